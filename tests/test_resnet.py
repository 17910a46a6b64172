import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

from course_lib.models.resnet import Residual, resnet18


@pytest.fixture(scope="module")
def d2l_net():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # d2l and lazy modules warn at import / first call
        d2l = pytest.importorskip("d2l.torch")
        net = d2l.resnet18(10, 1)
        net(torch.zeros(2, 1, 28, 28))  # d2l's layers are lazy: one call creates the weights
    return net


def test_same_parameter_count_and_output_shape_as_d2l(d2l_net):
    ours, theirs = resnet18(10, 1), d2l_net
    n_ours = sum(p.numel() for p in ours.parameters())
    n_theirs = sum(p.numel() for p in theirs.parameters())
    assert n_ours == n_theirs == 11_175_818
    X = torch.rand(3, 1, 28, 28)
    assert ours(X).shape == theirs(X).shape == (3, 10)


def test_same_state_dict_and_outputs_as_d2l(d2l_net):
    """Oracle: with d2l's weights loaded, our network computes the same logits."""
    torch.manual_seed(0)
    ours, theirs = resnet18(10, 1), d2l_net
    assert {k: v.shape for k, v in ours.state_dict().items()} == \
           {k: v.shape for k, v in theirs.state_dict().items()}
    ours.load_state_dict(theirs.state_dict())
    X = torch.rand(4, 1, 28, 28)
    ours.eval(), theirs.eval()
    assert_close(ours(X), theirs(X))
    ours.train(), theirs.train()
    assert_close(ours(X), theirs(X))


@settings(max_examples=4, deadline=None)
@given(batch=st.integers(1, 3), num_classes=st.integers(2, 12), in_channels=st.integers(1, 3),
       side=st.sampled_from([8, 28, 32]))
def test_output_shape(batch, num_classes, in_channels, side):
    net = resnet18(num_classes, in_channels).eval()
    with torch.no_grad():
        assert net(torch.rand(batch, in_channels, side, side)).shape == (batch, num_classes)


def test_downsampling_block_shapes():
    blk = Residual(64, 128, use_1x1conv=True, strides=2)
    assert blk(torch.rand(2, 64, 28, 28)).shape == (2, 128, 14, 14)
    assert Residual(8, 8)(torch.rand(2, 8, 7, 7)).shape == (2, 8, 7, 7)


def test_width_scales_every_stage_and_64_is_the_default():
    """width=64 is the standard network (same state dict); width=16 has stages 16..128."""
    assert {k: v.shape for k, v in resnet18(10, 1, width=64).state_dict().items()} == \
           {k: v.shape for k, v in resnet18(10, 1).state_dict().items()}
    narrow = resnet18(10, 1, width=16)
    X = torch.rand(2, 1, 28, 28)
    channels = []
    with torch.no_grad():
        for name, layer in narrow.named_children():
            X = layer(X)
            if name.startswith("resnet_block"):
                channels.append(X.shape[1])
    assert channels == [16, 32, 64, 128] and X.shape == (2, 10)
    n_narrow = sum(p.numel() for p in narrow.parameters())
    n_full = sum(p.numel() for p in resnet18(10, 1).parameters())
    assert 14 < n_full / n_narrow < 17  # conv weights scale as width**2


@pytest.mark.parametrize("width", [0, -4, 2.5, True])
def test_bad_width_is_refused_with_what_to_pass(width):
    with pytest.raises(ValueError, match="positive int"):
        resnet18(width=width)
