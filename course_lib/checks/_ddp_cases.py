"""The small models ``check_ddp`` trains: each one catches a mistake the others let through.

Parameter sizes no world size divides; float32, a few examples per rank. Importable by the
checker's worker processes (they build the models themselves).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["CASES"]


class MLP(nn.Module):
    """Linear 7 -> 5 -> 3: registration order is execution order."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(7, 5), nn.Linear(5, 3)

    def forward(self, X):                         # (B, 7)
        return self.fc2(torch.tanh(self.fc1(X)))  # (B, 3)


class Reordered(nn.Module):
    """Registered head, out, body; run body, out, head: gradients do not arrive in reverse
    registration order (a bucket's last parameter by position is not its last to arrive)."""

    def __init__(self):
        super().__init__()
        self.head, self.out, self.body = nn.Linear(6, 3), nn.Linear(6, 6), nn.Linear(7, 6)

    def forward(self, X):                                          # (B, 7)
        return self.head(torch.tanh(self.out(torch.tanh(self.body(X)))))  # (B, 3)


class Tied(nn.Module):
    """One weight reached from two modules (``b.weight is a.weight``), used twice per forward."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(7, 5)
        self.a, self.b = nn.Linear(5, 5), nn.Linear(5, 5)
        self.b.weight = self.a.weight              # tied: one parameter, one gradient
        self.out = nn.Linear(5, 3)

    def forward(self, X):                           # (B, 7)
        h = torch.tanh(self.inp(X))
        h = torch.tanh(self.b(torch.tanh(self.a(h))))
        return self.out(h)                          # (B, 3)


class Frozen(MLP):
    """The MLP with fc1 frozen (``requires_grad=False``): no gradient, no hook, no all-reduce."""

    def __init__(self):
        super().__init__()
        self.fc1.requires_grad_(False)


class Branches(nn.Module):
    """Two branches whose order in forward depends on the rank: gradients arrive in a different
    order on different ranks, as with data-dependent control flow."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(7, 4), nn.Linear(7, 6)
        self.out = nn.Linear(10, 3)

    def forward(self, X):                               # (B, 7)
        if dist.is_initialized() and dist.get_rank() % 2:
            hb = torch.tanh(self.b(X))                  # odd ranks: b first, so a's grads first
            ha = torch.tanh(self.a(X))
        else:
            ha = torch.tanh(self.a(X))
            hb = torch.tanh(self.b(X))
        return self.out(torch.cat([ha, hb], dim=1))     # (B, 10) -> (B, 3)


#: case name -> model builder (every model takes (B, 7) and returns (B, 3))
CASES: dict[str, Callable[[], nn.Module]] = {
    "mlp": MLP,
    "registered out of order": Reordered,
    "tied weight": Tied,
    "frozen fc1": Frozen,
    "branch order depends on the rank": Branches,
}
