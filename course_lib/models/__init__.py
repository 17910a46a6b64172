"""The course's models: ``course_lib.models`` plays the part of ``torchvision.models``.

- ``lenet``: the functional LeNet of lessons 01-04 (parameters as a plain list of tensors, with
  the from-scratch ``sgd``) and the same network as an ``nn.Module``.
- ``resnet``: ResNet-18 for 28x28 inputs (lesson 05 on).
- ``gpt``: a small decoder-only transformer, ``GPT`` and its ``GPTConfig`` (lesson 14 on).
"""
from .gpt import GPT, GPTConfig
from .lenet import LENET_SHAPES, LeNet, init_lenet_params, lenet, sgd
from .resnet import Residual, resnet18, resnet_stage

__all__ = ["GPT", "LENET_SHAPES", "GPTConfig", "LeNet", "Residual", "init_lenet_params", "lenet",
           "resnet18", "resnet_stage", "sgd"]
