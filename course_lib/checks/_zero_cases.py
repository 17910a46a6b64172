"""The small models ``check_zero`` shards an optimizer over; tests/test_zero.py uses them too.

Parameter sizes 91, 13, 65, 5, 15 and 3: no world size from 2 to 4 splits them evenly by count
and by size at once. Importable by the checker's worker processes (they build the models).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

__all__ = ["MODELS"]


class MLP(nn.Module):
    """Linear 7 -> 13 -> 5 -> 3: parameter sizes 91, 13, 65, 5, 15, 3."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(7, 13), nn.Linear(13, 5), nn.Linear(5, 3)

    def forward(self, X):                                       # (B, 7)
        return self.fc3(torch.tanh(self.fc2(torch.tanh(self.fc1(X)))))  # (B, 3)


class Tied(MLP):
    """One weight used by two layers (``parameters()`` lists it once)."""

    def __init__(self):
        super().__init__()
        self.again = nn.Linear(7, 13)
        self.again.weight = self.fc1.weight

    def forward(self, X):                                       # (B, 7)
        h = torch.tanh(self.fc1(X)) + torch.tanh(self.again(X))  # (B, 13)
        return self.fc3(torch.tanh(self.fc2(h)))                # (B, 3)


def frozen() -> nn.Module:
    """The MLP with fc2 frozen (``requires_grad=False``): no gradient, no optimizer state."""
    net = MLP()
    net.fc2.requires_grad_(False)
    return net


#: case name -> model builder (every model takes (B, 7) and returns (B, 3))
MODELS: dict[str, Callable[[], nn.Module]] = {"mlp": MLP, "tied": Tied, "frozen fc2": frozen}
