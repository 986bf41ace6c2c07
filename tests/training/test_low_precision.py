"""Parameters in bfloat16/float16 (not autocast): an update that rounds to nothing in the
parameter's dtype is "did not move", never an FSLR of 0 that a record keeps or FLeRM divides
by."""

from __future__ import annotations

import contextlib
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


class SparseEmbedding(torch.nn.Module):
    """A sparse embedding (``SparseAdam``'s kind of gradient) and a dense head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(20, 8, sparse=True)
        self.head = torch.nn.Linear(8, 3)

    def forward(self, i: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(i).mean(1))


def _tokens(seed: int) -> Iterator[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    while True:
        yield torch.randint(0, 20, (8, 5), generator=g)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_sparse_gradient_is_measured_in_16_bit_parameters_too(dtype: torch.dtype) -> None:
    """The rounded-away check read the largest gradient entry with ``amax``, which sparse
    gradients do not have: every measured step of a bf16 model with a sparse embedding
    raised ``NotImplementedError``."""
    fm = ff.with_fslr(SparseEmbedding().to(dtype), samples=2, seed=0)
    opt = torch.optim.SparseAdam(list(fm.module.emb.parameters()), lr=1e-2)
    x = next(_tokens(1))
    fm(x).float().square().mean().backward()
    with fm.measure(opt, next(_tokens(2))) as m:
        opt.step()
    assert m.moved == ("emb.weight",) and float(m.fslr["emb.weight"]) > 0


@pytest.mark.parametrize("form", ["with", "hooks"])
def test_a_scaler_skipped_step_with_sparse_gradients_is_no_step(form: str) -> None:
    """The ``with`` form tells a step the scaler skipped by the gradients' finiteness, tested
    elementwise on a sparse gradient, which torch refuses: it raised where the hooks form
    counted the step as skipped."""
    fm = ff.with_fslr(SparseEmbedding(), samples=2, seed=0)
    opt = torch.optim.SparseAdam(list(fm.module.emb.parameters()), lr=1e-2)
    rec = Recorder(fm, _tokens(1), optimizer=opt, warmup_samples=2, every=1)
    scaler = torch.amp.GradScaler("cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the skipped step's probes move: said elsewhere
        with rec.attach() if form == "hooks" else contextlib.nullcontext():
            for t, x in zip(range(4), _tokens(3), strict=False):
                opt.zero_grad()
                loss = fm(x).square().mean() * (math.inf if t == 1 else 1.0)
                scaler.scale(loss).backward()
                with rec.step() if form == "with" else contextlib.nullcontext():
                    scaler.step(opt)
                scaler.update()
    assert rec.t == 3 and rec.record.steps == [0, 1, 2]
