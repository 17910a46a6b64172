"""The lesson's LeNet, written functionally: the parameters are a plain list of 8 tensors.

PyTorch counterpart: an ``nn.Module`` (``LeNet`` below has the same math) and
``torch.func.functional_call``. Source: d2l's "Multiple GPUs" chapter.

Shapes for a (B, 1, 28, 28) input:
conv 20@3x3 -> (B, 20, 26, 26) -> avg-pool 2 -> (B, 20, 13, 13)
conv 50@5x5 -> (B, 50, 9, 9)   -> avg-pool 2 -> (B, 50, 4, 4) -> flatten (B, 800)
linear 800->128 -> linear 128->10 logits. ReLU after each conv and after the first linear layer.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["LENET_SHAPES", "LeNet", "init_lenet_params", "lenet", "sgd"]

#: Shapes of the 8 parameters, in order: W1, b1, W2, b2, W3, b3, W4, b4.
LENET_SHAPES = [(20, 1, 3, 3), (20,), (50, 20, 5, 5), (50,), (800, 128), (128,), (128, 10), (10,)]


def init_lenet_params(scale: float | None = None, seed: int | None = None,
                      device: torch.device | str | None = None, *,
                      init: str | None = None) -> list[torch.Tensor]:
    """The 8 LeNet parameters, leaves requiring grad.

    Three initialisations:

    - ``init="torch"`` (the default): what ``nn.Conv2d`` and ``nn.Linear`` do (``reset_parameters``:
      ``kaiming_uniform_(a=sqrt(5))`` for the weights), scaled by each layer's fan-in: weights and
      biases uniform in ``[-1/sqrt(fan_in), 1/sqrt(fan_in)]``, weight variance ``1/(3 fan_in)``
      (Torch7's bound, which PyTorch kept). Each layer's weights multiply the mean square of its
      input by about 1/3 and its bias adds ``1/(3 fan_in)`` (which counts where the input is
      small, as at the last layer); the ReLU and pooling after it keep part of the rest, so the
      signal shrinks layer by layer, far less than under d2l's.
    - ``init="d2l"`` (or any ``scale`` given): d2l's, weights normal times ``scale`` (0.01 unless
      given), biases zero. A layer multiplies the signal's root mean square by about
      ``scale * sqrt(fan_in)``: the logits start near zero, the loss near ln 10.
    - ``init="he"``: He et al. 2015 ("Delving deep into rectifiers"), weights normal with
      variance ``2/fan_in``, biases zero: a layer and its ReLU keep the mean square of the
      signal.

    Lesson 01 sets d2l's beside torch's default at the first step.

    Args:
        scale: standard deviation of the weights (implies ``init="d2l"``).
        seed: seed for a private generator (the same seed gives the same weights anywhere).
        device: where to create them (default CPU).
        init: ``"torch"``, ``"d2l"`` or ``"he"``.
    """
    if init is None:
        init = "torch" if scale is None else "d2l"
    if init not in ("torch", "d2l", "he"):
        raise ValueError(f"init_lenet_params: init must be 'torch' (fan-in scaled, the default), "
                         f"'d2l' (normal times scale) or 'he' (normal, variance 2/fan-in), "
                         f"got {init!r}.")
    if init != "d2l" and scale is not None:
        raise ValueError(f"init_lenet_params: scale={scale} applies to init='d2l' only; the "
                         f"{init!r} initialisation scales each layer by its fan-in.")
    scale = 0.01 if scale is None else scale
    gen = torch.Generator()
    if seed is not None:
        gen.manual_seed(seed)
    else:
        gen.seed()
    params = []
    fan_in = 1
    for shape in LENET_SHAPES:
        if len(shape) == 4:    # conv weight (out, in, kh, kw)
            fan_in = shape[1] * shape[2] * shape[3]
        elif len(shape) == 2:  # linear weight stored (in, out): X @ W
            fan_in = shape[0]
        if init == "torch":    # the bias uses its layer's fan-in, as nn.Linear/nn.Conv2d
            bound = 1.0 / math.sqrt(fan_in)
            p = (torch.rand(shape, generator=gen) * 2 - 1) * bound
        elif len(shape) == 1:  # d2l and he: biases zero
            p = torch.zeros(shape)
        elif init == "he":
            p = torch.randn(shape, generator=gen) * math.sqrt(2.0 / fan_in)
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
