"""The residual conv nets, the generated 2-D image set and their wiring into sweeps (issue 23)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from fslr_func.experiments.configs import ConfigError, SweepConfig
from fslr_func.experiments.data import digits, digits_aug
from fslr_func.experiments.models import ResConvNet
from fslr_func.experiments.mup import apply_mup, base_shapes, mup_groups
from fslr_func.experiments.sweep import run_sweep
from fslr_func.experiments.task import builtin_task


@pytest.mark.parametrize("shape", [(1, 40), (1, 8, 8)])
@pytest.mark.parametrize("batchnorm", [False, True])
def test_resconv_shapes_names_and_init(shape, batchnorm):
    torch.manual_seed(0)
    net = ResConvNet(shape, 10, width=64, depth=4, batchnorm=batchnorm, stride=1)
    x = torch.randn(6, math.prod(shape))
    assert net(x).shape == (6, 10)
    names = [n for n, _ in net.named_parameters()]
    assert names[0] == "input.weight" and names[-1] == "readout.bias"
    assert ("blocks.0.norm.weight" in names) == batchnorm
    # Kaiming over the true fan-in (channels times kernel), 1/depth on the block weights
    k = 3 ** (len(shape) - 1)
    w = net.blocks[1].conv.weight
    expected = 2.0 / (64 * k) / 4
    assert abs(w.var().item() / expected - 1) < 6 * math.sqrt(2 / w.numel())
    assert torch.all(net.blocks[1].conv.bias == 0)


def test_resconv_stride_halves_the_length_and_bad_arguments_are_refused():
    net = ResConvNet((1, 40), 3, width=4, depth=1, stride=2)
    assert net.input(torch.randn(2, 1, 40)).shape == (2, 4, 20)
    with pytest.raises(ValueError, match="in_shape"):
        ResConvNet((40,), 3)
    with pytest.raises(ValueError, match="kernel"):
        ResConvNet((1, 40), 3, kernel=4)
    with pytest.raises(ValueError, match="depth"):
        ResConvNet((1, 40), 3, depth=0)


def test_digits_aug_is_deterministic_standardised_and_held_out():
    a, b = digits_aug(num_samples=2000, seed=3), digits_aug(num_samples=2000, seed=4)
    assert a.x_train.shape == (1600, 64) and a.x_test.shape == (400, 64)
    assert not torch.equal(a.x_train, b.x_train)
    assert abs(a.x_train.mean().item()) < 1e-4
    assert torch.allclose(a.x_train.std(0), torch.ones(64), atol=1e-3)
    assert set(a.y_train.tolist()) == set(range(10))
    assert digits().x_train.shape[0] == 1438  # the plain set is unchanged


def test_conv_configs_keep_old_fingerprints_and_name_their_task():
    # the fingerprints of the existing families must not change (cached sweeps stay valid)
    assert SweepConfig().fingerprint() == "ccef073fba5859de"
    assert SweepConfig.for_model("transformer").fingerprint() == "c9bdc6946b510f53"
    c = SweepConfig.for_model("resconv_bn", data="digits_aug", data_seed=5)
    assert c.task_name == "resconv_bn/digits_aug-seed5"
    assert c.fingerprint() != c.replace(data_seed=None).fingerprint()
    assert c.train_size == 20000
    with pytest.raises(ConfigError, match="data_seed"):
        SweepConfig(data="digits", data_seed=1).validate()
    with pytest.raises(ConfigError, match="flerm_variant"):
        SweepConfig(flerm_variant="nope").validate()
    with pytest.raises(ConfigError, match="data"):
        SweepConfig.for_model("resconv", data="text").validate()


@pytest.mark.parametrize(("model", "data"), [("resconv", "mnist1d"), ("resconv_bn", "digits_aug")])
def test_builtin_conv_task_and_mup(model, data):
    config = SweepConfig.for_model(model, data=data, width=4, scales=(1, 4), num_samples=1000)
    task = builtin_task(config)
    net = task.build(4, 0)
    assert isinstance(net, ResConvNet) and net.width == 16
    assert net.in_shape == ((1, 40) if data == "mnist1d" else (1, 8, 8))
    shapes = base_shapes(task.build, 1, 0)
    torch.manual_seed(0)
    bias = {n: p.detach().clone() for n, p in net.named_parameters()}
    with torch.no_grad():
        for n, p in net.named_parameters():
            if n.endswith("conv.bias"):
                p.fill_(1.0)
    groups = {g["name"]: g["lr"] for g in apply_mup(net, shapes, 1.0)}
    # hidden convs: two infinite (channel) dims, the kernel finite: lr / m_in under Adam
    assert groups["blocks.0.conv.weight"] == 0.25
    assert groups["input.weight"] == 1.0 and groups["readout.weight"] == 1.0
    # conv biases times sqrt(m_in), the readout's weight times sqrt(m)
    assert torch.allclose(net.blocks[0].conv.bias, torch.full((16,), 2.0))
    assert torch.allclose(net.readout.weight, 2.0 * bias["readout.weight"])
    sgd = {g["name"]: g["lr"] for g in mup_groups(net, shapes, 1.0, optimizer="sgd")}
    assert sgd["blocks.0.conv.weight"] == 1.0 and sgd["input.weight"] == 4.0


def test_conv_bias_rescaling_matches_the_package():
    mup = pytest.importorskip("mup")
    torch.manual_seed(0)

    def make(width: int) -> nn.Module:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Conv1d(2, width, 3), nn.ReLU(), nn.Conv1d(width, width, 3))
        with torch.no_grad():
            for p in net.parameters():
                p.normal_()
        return net

    ours, theirs, base = make(16), make(16), make(4)
    apply_mup(ours, base, 1.0)
    mup.set_base_shapes(theirs, make(4))
    for (n, a), (_, b) in zip(ours.named_parameters(), theirs.named_parameters(), strict=True):
        assert torch.allclose(a, b), n


def test_tiny_conv_sweep_runs_every_mode(tmp_path):
    config = SweepConfig.for_model(
        "resconv_bn",
        data="digits_aug",
        width=2,
        scales=(1, 2),
        lrs=(0.01,),
        steps=4,
        last=2,
        seeds=1,
        num_samples=500,
        warmup_samples=8,
        every=2,
        batch_size=16,
    )
    result = run_sweep(config, tmp_path, quiet=True)
    assert len(result.executed) == 6
    flerm = result.runs["flerm_scale=2_lr=0.01_seed=0"]
    assert set(flerm["flerm"]["lrs"]) >= {"blocks.0.conv.weight", "blocks.0.norm.weight"}
    assert result.summary["identity_check"]["max_abs_loss_diff"] == 0.0
