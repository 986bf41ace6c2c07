"""Parameters in bfloat16/float16 (not autocast): an update that rounds to nothing in the
parameter's dtype is "did not move", never an FSLR of 0 that a record keeps or FLeRM divides
by."""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator

import pytest
import torch

import fslr_func as ff
from fslr_func.training.flerm import FLeRM
from fslr_func.training.recorder import Recorder


def _model(dtype: torch.dtype) -> torch.nn.Module:
    """A linear layer whose bias sits at 1024 (float16 spacing 1, bfloat16 spacing 8): an SGD
    step at rate 1e-4 moves the small weights but rounds the bias's update to nothing."""
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 2)
    with torch.no_grad():
        m.weight.mul_(0.1)
        m.bias.fill_(1024.0)
    return m.to(dtype)


def _probes(dtype: torch.dtype) -> Iterator[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    while True:
        yield torch.randn(8, 4, generator=g).to(dtype)


def _train(fm: ff.FSLRModule, opt: torch.optim.Optimizer, step: object, steps: int) -> None:
    g = torch.Generator().manual_seed(2)
    for _ in range(steps):
        x = torch.randn(16, 4, generator=g).to(fm.module.weight.dtype)
        opt.zero_grad()
        fm(x).float().square().mean().backward()
        with step():  # type: ignore[operator]
            opt.step()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_rounded_away_update_is_unknown_not_zero(dtype: torch.dtype) -> None:
    fm = ff.with_fslr(_model(dtype), samples=2, seed=0)
    opt = torch.optim.SGD(fm.parameters(), lr=1e-4)
    recorder = Recorder(fm, _probes(dtype), optimizer=opt, every=2, warmup_samples=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train(fm, opt, recorder.step, 3)
    record = recorder.record
    assert record.steps == [0, 2]
    assert record.fslr["bias"] == [None, None]  # was [0.0, 0.0]: a silent zero
    assert all(v is not None and v > 0 for v in record.fslr["weight"])
    assert any("did not change in their 16-bit dtype" in str(w.message) for w in caught)

    scaled = ff.with_fslr(_model(dtype), samples=2, seed=0)
    opt = torch.optim.SGD(scaled.parameters(), lr=1e-4)
    flerm = FLeRM(scaled, opt, record, probe_batches=_probes(dtype), unknown="hold")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train(scaled, opt, flerm.step, 2)
    assert "bias" in flerm.history[0].held
    assert all(math.isfinite(lr) and lr > 0 for lr in flerm.lrs().values())


def test_every_update_rounded_away_says_so() -> None:
    fm = ff.with_fslr(_model(torch.bfloat16), samples=2, seed=0)
    opt = torch.optim.SGD(fm.parameters(), lr=1e-9)
    recorder = Recorder(fm, _probes(torch.bfloat16), optimizer=opt, every=2, warmup_samples=2)
    with pytest.warns(RuntimeWarning, match="rounded to nothing in their 16-bit dtype"):
        _train(fm, opt, recorder.step, 2)
    assert recorder.record.steps == []


def test_zero_gradient_in_low_precision_is_still_a_measured_zero() -> None:
    """A zero gradient (LoRA A while B = 0) is no rounding: its FSLR is 0, as in float32."""
    fm = ff.with_fslr(_model(torch.bfloat16), samples=2, seed=0)
    fm.module.bias.requires_grad_(True)
    opt = torch.optim.SGD(fm.parameters(), lr=1e-2)
    recorder = Recorder(fm, _probes(torch.bfloat16), optimizer=opt, every=None, warmup_samples=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt.zero_grad()
        fm(torch.ones(2, 4, dtype=torch.bfloat16)).float().sum().mul(0).backward()
        fm.module.weight.grad = torch.ones_like(fm.module.weight)
        with recorder.step():
            opt.step()
    assert recorder.record.fslr["bias"] == [0.0]
