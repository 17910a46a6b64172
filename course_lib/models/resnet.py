"""The lesson's ResNet-18 for 28x28 inputs (Fashion-MNIST), as a plain ``nn.Module``.

PyTorch counterpart: ``torchvision.models.resnet18`` (made for 224x224 images: a 7x7 stride-2
stem and a max-pool that would shrink a 28x28 image to 7x7 before the first block). This one
follows d2l's ``resnet18`` of the "Concise Implementation for Multiple GPUs" chapter: a 3x3
stride-1 stem, no max-pool. Read more: He et al., "Deep Residual Learning for Image Recognition"
(2016), and d2l.ai, chapter "Residual Networks (ResNet) and ResNeXt".

Shapes for a (B, 1, 28, 28) input:
stem 3x3 conv 64 + BN + ReLU      -> (B, 64, 28, 28)
stage 1: 2 blocks of 64           -> (B, 64, 28, 28)
stage 2: 2 blocks of 128, stride 2 -> (B, 128, 14, 14)
stage 3: 2 blocks of 256, stride 2 -> (B, 256, 7, 7)
stage 4: 2 blocks of 512, stride 2 -> (B, 512, 4, 4)
global average pool, flatten      -> (B, 512) -> linear -> (B, num_classes) logits.
``resnet18(width=w)`` scales every channel count by w/64 (the lessons train width 16 on CPUs:
about 16 times fewer multiply-adds per image, the same depth and shapes otherwise).

The layers are built eagerly (not lazily as in d2l), so the parameters exist, and can be
counted or replicated, before the first forward pass; the names match d2l's ``state_dict`` keys.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Residual", "resnet18", "resnet_stage"]


class Residual(nn.Module):
    """Two 3x3 conv + batch-norm layers with a skip connection: ``relu(F(X) + X)``.

    Args:
        in_channels, out_channels: channels of the input and the output.
        use_1x1conv: pass the skip connection through a 1x1 convolution (needed when the
            channels or the resolution change).
        strides: stride of the first 3x3 conv (and of the 1x1 conv): 2 halves height and width.
    """

    def __init__(self, in_channels: int, out_channels: int, use_1x1conv: bool = False,
                 strides: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, kernel_size=3, padding=1,
                               stride=strides)
        self.conv2 = nn.Conv2d(out_channels, out_channels, kernel_size=3, padding=1)
        self.conv3 = (nn.Conv2d(in_channels, out_channels, kernel_size=1, stride=strides)
                      if use_1x1conv else None)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.bn2 = nn.BatchNorm2d(out_channels)

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        Y = F.relu(self.bn1(self.conv1(X)))  # (B, C_out, H/s, W/s)
        Y = self.bn2(self.conv2(Y))          # (B, C_out, H/s, W/s)
        if self.conv3 is not None:
            X = self.conv3(X)                # (B, C_out, H/s, W/s): the projected skip
        return F.relu(Y + X)


def resnet_stage(in_channels: int, out_channels: int, num_residuals: int,
                 first_block: bool = False) -> nn.Sequential:
    """``num_residuals`` residual blocks; the first halves the resolution unless ``first_block``."""
    blocks = []
    for i in range(num_residuals):
        if i == 0 and not first_block:
            blocks.append(Residual(in_channels, out_channels, use_1x1conv=True, strides=2))
        else:
            blocks.append(Residual(out_channels, out_channels))
    return nn.Sequential(*blocks)


def resnet18(num_classes: int = 10, in_channels: int = 1, width: int = 64) -> nn.Sequential:
    """ResNet-18 for small images: 3x3 stem, no max-pool, 4 stages of 2 blocks, average pool.

    Args:
        num_classes: outputs of the final linear layer.
        in_channels: channels of the input images (1 for Fashion-MNIST).
        width: channels of the stem and of stage 1; stages 2-4 double it each (64: the
            standard network, stages of 64, 128, 256, 512). The work per image grows as
            ``width**2``: width 16 costs about 16 times fewer multiply-adds than 64.

    Returns:
        An ``nn.Sequential`` mapping (B, in_channels, H, W) to (B, num_classes) logits;
        11,175,818 parameters for the defaults, like ``d2l.resnet18(10, 1)``.
    """
    if not isinstance(width, int) or isinstance(width, bool) or width < 1:
        raise ValueError(f"resnet18 needs width to be a positive int (channels of stage 1, "
                         f"64 for the standard network), got {width!r}.")
    w = width
    net = nn.Sequential(
        nn.Conv2d(in_channels, w, kernel_size=3, stride=1, padding=1),  # (B, w, H, W)
        nn.BatchNorm2d(w),
        nn.ReLU(),
    )
    net.add_module("resnet_block1", resnet_stage(w, w, 2, first_block=True))  # (B, w, H, W)
    net.add_module("resnet_block2", resnet_stage(w, 2 * w, 2))      # (B, 2w, H/2, W/2)
    net.add_module("resnet_block3", resnet_stage(2 * w, 4 * w, 2))  # (B, 4w, H/4, W/4)
    net.add_module("resnet_block4", resnet_stage(4 * w, 8 * w, 2))  # (B, 8w, H/8, W/8)
    net.add_module("global_avg_pool", nn.AdaptiveAvgPool2d((1, 1)))  # (B, 8w, 1, 1)
    net.add_module("fc", nn.Sequential(nn.Flatten(), nn.Linear(8 * w, num_classes)))
    return net
