"""The lesson's LeNet, written functionally: the parameters are a plain list of 8 tensors.

PyTorch counterpart: an ``nn.Module`` (``LeNet`` below has the same math) and
``torch.func.functional_call``. Source: d2l's "Multiple GPUs" chapter.

Shapes for a (B, 1, 28, 28) input:
conv 20@3x3 -> (B, 20, 26, 26) -> avg-pool 2 -> (B, 20, 13, 13)
conv 50@5x5 -> (B, 50, 9, 9)   -> avg-pool 2 -> (B, 50, 4, 4) -> flatten (B, 800)
linear 800->128 -> linear 128->10 logits. ReLU after each conv and after the first linear layer.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["LENET_SHAPES", "LeNet", "init_lenet_params", "lenet", "sgd"]

#: Shapes of the 8 parameters, in order: W1, b1, W2, b2, W3, b3, W4, b4.
LENET_SHAPES = [(20, 1, 3, 3), (20,), (50, 20, 5, 5), (50,), (800, 128), (128,), (128, 10), (10,)]


def init_lenet_params(scale: float = 0.01, seed: int | None = None,
                      device: torch.device | str | None = None) -> list[torch.Tensor]:
    """The 8 LeNet parameters: weights normal times ``scale``, biases zero; leaves requiring grad.

    Args:
        scale: standard deviation of the weights.
        seed: seed for a private generator (the same seed gives the same weights anywhere).
        device: where to create them (default CPU).
    """
    gen = torch.Generator()
    if seed is not None:
        gen.manual_seed(seed)
    else:
        gen.seed()
    params = []
    for shape in LENET_SHAPES:
        if len(shape) == 1:  # a bias
            p = torch.zeros(shape)
        else:
            p = torch.randn(shape, generator=gen) * scale
        params.append(p.to(device).requires_grad_())
    return params


def lenet(X: torch.Tensor, params: list[torch.Tensor]) -> torch.Tensor:
    """Logits (B, 10) of LeNet for images X (B, 1, 28, 28) with the 8 tensors in ``params``."""
    if len(params) != 8:
        raise ValueError(f"lenet expects the 8 tensors of init_lenet_params(), got {len(params)}.")
    if X.dim() != 4 or tuple(X.shape[1:]) != (1, 28, 28):
        raise ValueError(f"lenet expects images of shape (B, 1, 28, 28), got {tuple(X.shape)}. "
                         "Load Fashion-MNIST without resize= (the network's 800 = 50 x 4 x 4 "
                         "inputs to the first linear layer fix the 28 x 28 size).")
    W1, b1, W2, b2, W3, b3, W4, b4 = params
    h = F.relu(F.conv2d(X, W1, b1))           # (B, 20, 26, 26)
    h = F.avg_pool2d(h, kernel_size=2)        # (B, 20, 13, 13)
    h = F.relu(F.conv2d(h, W2, b2))           # (B, 50, 9, 9)
    h = F.avg_pool2d(h, kernel_size=2)        # (B, 50, 4, 4)
    h = h.reshape(h.shape[0], -1)             # (B, 800)
    h = F.relu(h @ W3 + b3)                   # (B, 128)
    return h @ W4 + b4                        # (B, 10)


def sgd(params: list[torch.Tensor], lr: float) -> None:
    """One step of minibatch SGD in place, then zero the gradients.

    The loss is assumed to be a mean over the batch, so no division by the batch size here.
    """
    with torch.no_grad():
        for p in params:
            p -= lr * p.grad
            p.grad.zero_()


class LeNet(nn.Module):
    """The same network as ``lenet`` as an ``nn.Module``.

    Linear weights are stored as torch stores them, (out, in): ``fc1.weight == W3.T``.
    """

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 20, kernel_size=3)
        self.conv2 = nn.Conv2d(20, 50, kernel_size=5)
        self.fc1 = nn.Linear(800, 128)
        self.fc2 = nn.Linear(128, 10)

    @classmethod
    def from_params(cls, params: list[torch.Tensor]) -> LeNet:
        """A module holding copies of the functional parameters (same outputs as ``lenet``)."""
        net = cls().to(params[0].device)
        W1, b1, W2, b2, W3, b3, W4, b4 = [p.detach() for p in params]
        with torch.no_grad():
            for dst, src in [(net.conv1.weight, W1), (net.conv1.bias, b1),
                             (net.conv2.weight, W2), (net.conv2.bias, b2),
                             (net.fc1.weight, W3.T), (net.fc1.bias, b3),
                             (net.fc2.weight, W4.T), (net.fc2.bias, b4)]:
                dst.copy_(src)
        return net

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        h = F.avg_pool2d(F.relu(self.conv1(X)), 2)   # (B, 20, 13, 13)
        h = F.avg_pool2d(F.relu(self.conv2(h)), 2)   # (B, 50, 4, 4)
        h = F.relu(self.fc1(h.flatten(1)))           # (B, 128)
        return self.fc2(h)                           # (B, 10)
