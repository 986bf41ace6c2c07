"""FLeRM: identity, matching, optimisers, schedulers, depth policy, edge cases, resume, docs."""

from __future__ import annotations

import contextlib
import functools
import io
import math
import re
import runpy
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import fslr_func as ff
from fslr_func.experiments import ResMLP, train
from fslr_func.io.record import FSLRRecord
from fslr_func.training.flerm import FLeRM
from fslr_func.training.recorder import Recorder, grouping_meta

D_IN, CLASSES, BATCH = 16, 4, 32
LR0 = 1e-2
Controller = Recorder | FLeRM


class SignSGD(torch.optim.Optimizer):
    """Sign-SGD with momentum (Signum): ``W -= lr * sign(m)``, ``m = mu m + (1 - mu) g``."""

    def __init__(self, params: Any, lr: float = 1e-3, momentum: float = 0.9) -> None:
        super().__init__(params, {"lr": lr, "momentum": momentum})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                buf = state["momentum_buffer"]
                buf.mul_(group["momentum"]).add_(p.grad, alpha=1 - group["momentum"])
                p.add_(buf.sign(), alpha=-group["lr"])


def stream(seed: int, dtype: torch.dtype = torch.float32) -> Iterator[Tensor]:
    """Endless probe batches."""
    g = torch.Generator().manual_seed(seed)
    while True:
        yield torch.randn(BATCH, D_IN, generator=g).to(dtype)


def data(seed: int, steps: int, dtype: torch.dtype = torch.float32) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(BATCH, D_IN, generator=g).to(dtype),
            torch.randint(0, CLASSES, (BATCH,), generator=g),
        )
        for _ in range(steps)
    ]


def build(
    width: int = 16, depth: int = 2, *, seed: int = 0, dtype: torch.dtype = torch.float32, **kw: Any
) -> ff.FSLRModule:
    torch.manual_seed(seed)
    return ff.with_fslr(ResMLP(D_IN, CLASSES, width=width, depth=depth).to(dtype), seed=1, **kw)


def loop(
    fm: ff.FSLRModule,
    opt: torch.optim.Optimizer,
    ctl: Controller,
    batches: list[tuple[Tensor, Tensor]],
    sched: torch.optim.lr_scheduler.LRScheduler | None = None,
) -> None:
    for x, y in batches:
        opt.zero_grad()
        nn.functional.cross_entropy(fm(x), y).backward()
        with ctl.step(opt) if isinstance(ctl, Recorder) else ctl.step():
            opt.step()
        if sched is not None:
            sched.step()


def record(width: int = 16, depth: int = 2, steps: int = 1, **kw: Any) -> FSLRRecord:
    fm = build(width, depth)
    opt = torch.optim.Adam(fm.parameters(), lr=LR0)
    rec = Recorder(fm, stream(3), **kw)
    loop(fm, opt, rec, data(2, steps))
    return rec.record


@pytest.fixture(scope="module")
def base() -> FSLRRecord:
    """Base ResMLP (width 16, depth 2), probed at steps 0 (warm-up), 2 and 4."""
    return record(steps=5, every=2)


def test_identity_record_of_same_model_sets_base_lr(base: FSLRRecord) -> None:
    fm = build()
    opt = torch.optim.Adam(fm.parameters(), lr=LR0)
    flerm = FLeRM(fm, opt, base, probe_batches=stream(3), mode="periodic", every=2)
    loop(fm, opt, flerm, data(2, 5))
    assert [p.step for p in flerm.history] == [0, 2, 4]
    for point in flerm.history:
        assert point.held == ()
        for name, lr in point.lrs.items():
            assert lr == pytest.approx(LR0, rel=1e-6), name


def two_rates(fm: ff.FSLRModule, blocks: float = LR0 / 10) -> list[dict[str, Any]]:
    """Param groups: tensors outside the blocks at ``LR0`` (first: ``base_lr``), blocks slower."""
    named = list(fm.module.named_parameters())
    return [
        {"params": [p for n, p in named if not n.startswith("blocks.")], "lr": LR0},
        {"params": [p for n, p in named if n.startswith("blocks.")], "lr": blocks},
    ]


def per_tensor_record(
    depth: int = 2, *, dtype: torch.dtype = torch.float32, sched: bool = False, **kw: Any
) -> FSLRRecord:
    """A base run with blocks at ``LR0 / 10``, the rest at ``LR0`` (StepLR halving if ``sched``)."""
    fm = build(depth=depth, dtype=dtype, samples=4)
    opt = torch.optim.Adam(two_rates(fm))
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5) if sched else None
    rec = Recorder(fm, stream(3, dtype), warmup_samples=8, scheduler=scheduler, **kw)
    loop(fm, opt, rec, data(2, 5, dtype), scheduler)
    return rec.record


def test_recorder_and_flerm_take_a_compiled_wrapper() -> None:
    # `fm = torch.compile(ff.with_fslr(model))`: fm.measure worked through the compiled
    # module, but Recorder and FLeRM refused it ("fm must be a with_fslr(model) wrapper, got
    # OptimizedModule"). They look through it, and give what the plain wrapper gives.
    def run(compiled: bool) -> tuple[FSLRRecord, dict[str, float]]:
        fm = build()
        driven = torch.compile(fm, backend="eager") if compiled else fm
        opt = torch.optim.Adam(fm.parameters(), lr=LR0)
        rec = Recorder(driven, stream(3), warmup_samples=2, every=None)  # type: ignore[arg-type]
        loop(fm, opt, rec, data(2, 2))
        wide = build(width=32)
        driven = torch.compile(wide, backend="eager") if compiled else wide
        opt = torch.optim.Adam(wide.parameters(), lr=LR0)
        flerm = FLeRM(driven, opt, rec.record, probe_batches=stream(4), warmup_samples=2)  # type: ignore[arg-type]
        loop(wide, opt, flerm, data(5, 2))
        return rec.record, flerm.lrs()

    (rec, lrs), (rec_plain, lrs_plain) = run(compiled=True), run(compiled=False)
    assert rec.to_dict() == rec_plain.to_dict()
    assert lrs == lrs_plain and len(set(lrs.values())) > 1


def test_per_tensor_base_rates_are_set_back_on_the_same_model() -> None:
    """Base: two groups (1e-2, 1e-3) under StepLR; FLeRM with one group restores each rate."""
    base = per_tensor_record(dtype=torch.float64, sched=True, every=2)
    assert base.sched == [1.0, 0.5, 0.25] and base.meta["base_lr"] == LR0
    assert base.lrs["blocks.0.linear.weight"] == pytest.approx([LR0 / 10, LR0 / 20, LR0 / 40])
    fm = build(dtype=torch.float64, samples=4)
    opt = torch.optim.Adam(fm.parameters(), lr=LR0)
    flerm = FLeRM(
        fm,
        opt,
        base,
        probe_batches=stream(3, torch.float64),
        mode="periodic",
        every=2,
        warmup_samples=8,
    )
    loop(fm, opt, flerm, data(2, 5, torch.float64))
    assert [p.step for p in flerm.history] == [0, 2, 4]
    for point in flerm.history:
        assert point.held == ()
        want = base.lrs_at(point.step)
        for name, lr in point.lrs.items():
            assert lr == pytest.approx(want[name], rel=1e-6), (point.step, name)


def test_depth_with_per_tensor_base_rates_conserves_movement() -> None:
    """Scaled tensors answering to base tensor b move the function by lr_b * FSLR_b in all."""
    base = per_tensor_record(every=None)
    fm = build(16, depth=8, samples=4)
    opt = torch.optim.Adam(fm.parameters(), lr=LR0)
    flerm = FLeRM(fm, opt, base, probe_batches=stream(3), policy="share_blocks", warmup_samples=8)
    loop(fm, opt, flerm, data(2, 1))
    point = flerm.history[0]
    assert point.held == ()
    moved: dict[str, float] = dict.fromkeys(base.names, 0.0)
    for name, lr in point.lrs.items():
        m = re.match(r"blocks\.(\d+)\.(.*)", name)
        b = name if m is None else f"blocks.{int(m.group(1)) // 4}.{m.group(2)}"
        moved[b] += lr * point.fslr[name]
    rates, fslr = base.lrs_at(0), base.at(0)
    assert min(rates.values()) == LR0 / 10 and max(rates.values()) == LR0
    for b, value in moved.items():
        assert value == pytest.approx(rates[b] * fslr[b], rel=1e-9), b


def test_one_base_rate_or_no_lrs_is_the_single_lr0_rule() -> None:
    """Bit for bit: targets are the base FSLRs, rates lr_0 * sched * target / FSLR."""
    fm0 = build(samples=4)
    opt0 = torch.optim.Adam(fm0.parameters(), lr=LR0)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(opt0, T_max=7)
    rec = Recorder(fm0, stream(3), warmup_samples=8, every=2, scheduler=cosine)
    loop(fm0, opt0, rec, data(2, 5), cosine)
    scheduled = rec.record  # one rate: lrs = lr_0 * sched up to rounding
    assert scheduled.lrs and all(0 < s < 1 for s in scheduled.sched[1:])
    two = per_tensor_record(every=2)
    no_lrs = FSLRRecord(steps=two.steps, fslr=two.fslr, sched=two.sched, meta=two.meta)
    for base in (scheduled, no_lrs):
        fm = build(32, samples=4)
        opt = torch.optim.Adam(fm.parameters(), lr=LR0)
        flerm = FLeRM(
            fm, opt, base, probe_batches=stream(3), mode="periodic", every=2, warmup_samples=8
        )
        loop(fm, opt, flerm, data(2, 5))
        assert [p.step for p in flerm.history] == [0, 2, 4]
        for point in flerm.history:
            assert point.targets == base.at(point.step)
            s = base.sched_at(point.step)
            for n, lr in point.lrs.items():
                assert lr == LR0 * s * (point.targets[n] / point.fslr[n]), n


def test_matching_4x_wider_moves_function_as_base() -> None:
    """exact(scaled update) = base FSLR * lr_0, up to the scaled estimator's error.

    The error is log(estimate / exact) of the 4x wider model's FSLRs, at 40 Gaussian samples
    (kron, Adam step 0, these ResMLPs). Measured over 12 seeds x 8 tensors: mean -0.006,
    standard deviation 0.10 per tensor; the mean over a model's 8 tensors has standard
    deviation 0.058 (max 0.12). Bounds: 0.45 per tensor (4.5 sd), 0.25 for the mean (4.3 sd).
    """
    rec = record()
    fm = build(64, seed=7)
    opt = torch.optim.Adam(fm.parameters(), lr=LR0)
    flerm = FLeRM(fm, opt, rec, probe_batches=stream(5))
    before = {n: p.detach().clone() for n, p in fm.module.named_parameters()}
    loop(fm, opt, flerm, data(9, 1))
    applied = {n: p.detach() - before[n] for n, p in fm.module.named_parameters()}
    probes = stream(5)
    x = torch.cat([next(probes) for _ in range(5)])  # the 5 warm-up probe batches
    moved = ff.exact(fm.module, x, applied, params=before)
    target = rec.at(0)
    errors = {n: math.log(float(moved[n]) / (target[n] * LR0)) for n in flerm.names}
    assert max(abs(e) for e in errors.values()) < 0.45, errors
    assert abs(sum(errors.values()) / len(errors)) < 0.25, errors
    # the rates really differ from lr_0: FLeRM did something
    assert min(flerm.lrs().values()) < 0.5 * LR0


def test_set_point_step_is_one_step_at_the_new_rates() -> None:
    rec = record()
    fm = build(32, dtype=torch.float64)
    opt = torch.optim.Adam(fm.parameters(), lr=LR0)
    flerm = FLeRM(fm, opt, rec, probe_batches=stream(5, torch.float64))
    before = {n: p.detach().clone() for n, p in fm.module.named_parameters()}
    (x, y), *_ = data(9, 1, torch.float64)
    nn.functional.cross_entropy(fm(x), y).backward()
    grads = {n: p.grad.clone() for n, p in fm.module.named_parameters() if p.grad is not None}
    with flerm.step():
        opt.step()
    lrs = flerm.lrs()
    for n, p in fm.module.named_parameters():
        assert int(opt.state[p]["step"]) == 1  # one optimiser step, its update scaled
        adam_first_step = grads[n] / (grads[n].abs() + 1e-8)
        torch.testing.assert_close(p.detach(), before[n] - lrs[n] * adam_first_step)


OPTIMISERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "Adam": lambda p: torch.optim.Adam(p, lr=LR0),
    "AdamW": lambda p: torch.optim.AdamW(p, lr=LR0, weight_decay=0.1),
    "SGD-momentum": lambda p: torch.optim.SGD(p, lr=LR0, momentum=0.9),
    "Adagrad": lambda p: torch.optim.Adagrad(p, lr=LR0),
    "Adamax": lambda p: torch.optim.Adamax(p, lr=LR0),
    "RMSprop": lambda p: torch.optim.RMSprop(p, lr=LR0),
    "SignSGD": lambda p: SignSGD(p, lr=LR0),
}


@pytest.mark.filterwarnings("ignore:FLeRM's base record was made")  # an Adam record, on purpose
@pytest.mark.parametrize("name", list(OPTIMISERS))
def test_every_optimiser_gets_finite_rates(base: FSLRRecord, name: str) -> None:
    fm = build(32, samples=4)
    opt = OPTIMISERS[name](fm.parameters())
    flerm = FLeRM(
        fm, opt, base, probe_batches=stream(3), mode="periodic", every=2, warmup_samples=8
    )
    loop(fm, opt, flerm, data(2, 5))
    assert [p.step for p in flerm.history] == [0, 2, 4]
    for point in flerm.history:
        assert point.held == ()
        assert all(math.isfinite(v) and v > 0 for v in point.lrs.values()), point.lrs
    assert all(torch.isfinite(p).all() for p in fm.parameters())


@pytest.mark.filterwarnings("ignore:FLeRM's base record was made")  # AdamW on an Adam record
def test_own_cosine_scheduler_scales_the_matched_rates(base: FSLRRecord) -> None:
    fm = build(32, samples=4)
    groups = [  # two groups with their own hyperparameters
        {"params": [p for n, p in fm.module.named_parameters() if "blocks" in n]},
        {"params": [p for n, p in fm.module.named_parameters() if "blocks" not in n]},
    ]
    opt = torch.optim.AdamW(groups, lr=LR0, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=6)
    flerm = FLeRM(fm, opt, base, probe_batches=stream(3), warmup_samples=8, scheduler=sched)
    own = opt.param_groups
    loop(fm, opt, flerm, data(2, 4), sched)
    assert opt.param_groups is own and len(own) == 2  # your groups, untouched by FLeRM
    ratio = sched.get_last_lr()[0] / LR0
    assert opt.param_groups[0]["lr"] == pytest.approx(LR0 * ratio)  # the scheduler's value
    assert 0.0 < ratio < 1.0
    set_lrs = flerm.history[0].lrs
    for name, lr in flerm.lrs().items():
        assert lr == pytest.approx(set_lrs[name] * ratio, rel=1e-12), name
    assert set(opt.state_dict()["param_groups"][0]) >= {"weight_decay", "initial_lr"}


def test_base_record_schedule_multiplies_rates_without_own_scheduler() -> None:
    fm0 = build(samples=4)
    opt0 = torch.optim.Adam(fm0.parameters(), lr=LR0)
    sched0 = torch.optim.lr_scheduler.StepLR(opt0, step_size=2, gamma=0.5)
    rec = Recorder(fm0, stream(3), warmup_samples=8, every=2, scheduler=sched0)
    loop(fm0, opt0, rec, data(2, 5), sched0)
    assert rec.record.sched == [1.0, 0.5, 0.25]
    fm = build(32, samples=4)
    opt = torch.optim.Adam(fm.parameters(), lr=LR0)
    flerm = FLeRM(fm, opt, rec.record, probe_batches=stream(3), warmup_samples=8)
    loop(fm, opt, flerm, data(2, 4))
    first = flerm.history[0].lrs
    for name, lr in flerm.lrs().items():  # step 4: base ratio 0.25
        assert lr == pytest.approx(first[name] * 0.25, rel=1e-12), name


def test_share_blocks_4x_deeper_targets_base_over_4(base: FSLRRecord) -> None:
    fm = build(16, depth=8, samples=4)
    opt = torch.optim.Adam(fm.parameters(), lr=LR0)
    flerm = FLeRM(fm, opt, base, probe_batches=stream(3), policy="share_blocks", warmup_samples=8)
    loop(fm, opt, flerm, data(2, 1))
    targets, b = flerm.history[0].targets, base.at(0)
    for name, value in targets.items():
        m = re.match(r"blocks\.(\d+)\.(.*)", name)
        if m is None:
            assert value == b[name], name
        else:
            expected = b[f"blocks.{int(m.group(1)) // 4}.{m.group(2)}"] / 4
            assert value == pytest.approx(expected, rel=1e-12), name
    with pytest.raises(ValueError, match=r"blocks\.2\.linear\.weight"):
        FLeRM(fm, opt, base, probe_batches=stream(3))  # identity: names differ


class LoRA(nn.Module):
    """Frozen linear layers with a LoRA adapter ``x A^T B^T`` (B = 0 at init) on the hidden one."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.inp, self.hidden, self.out = nn.Linear(D_IN, 12), nn.Linear(12, 12), nn.Linear(12, 4)
        self.requires_grad_(False)
        self.lora_A = nn.Parameter(torch.randn(rank, 12) / math.sqrt(12))
        self.lora_B = nn.Parameter(torch.zeros(12, rank))

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.inp(x))
        return self.out(torch.tanh(self.hidden(h) + h @ self.lora_A.T @ self.lora_B.T))


def lora_run(rank: int, ctl: Callable[[ff.FSLRModule, torch.optim.Optimizer], Controller]) -> Any:
    torch.manual_seed(0)
    fm = ff.with_fslr(LoRA(rank), samples=4, seed=1)
    opt = torch.optim.Adam([p for p in fm.parameters() if p.requires_grad], lr=LR0)
    c = ctl(fm, opt)
    loop(fm, opt, c, data(2, 5))
    return c


def test_lora_zero_fslr_is_held_with_one_warning_then_matched() -> None:
    rec = lora_run(2, lambda fm, opt: Recorder(fm, stream(3), warmup_samples=8, every=2)).record
    assert rec.at(0)["lora_A"] == 0.0  # A does not move the function while B == 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        flerm = lora_run(
            8,
            lambda fm, opt: FLeRM(
                fm, opt, rec, probe_batches=stream(3), warmup_samples=8, mode="periodic", every=2
            ),
        )
    held = [w for w in caught if "zero or below" in str(w.message)]
    assert len(held) == 1 and "lora_A" in str(held[0].message)
    first, second = flerm.history[0], flerm.history[1]
    assert first.held == ("lora_A",) and first.lrs["lora_A"] == LR0  # kept its rate
    assert second.held == () and second.lrs["lora_A"] != LR0  # matched once B moved


def test_lora_start_step_defers_flerm() -> None:
    rec = lora_run(
        2, lambda fm, opt: Recorder(fm, stream(3), warmup_samples=8, every=None, start_step=2)
    ).record
    assert rec.steps == [2] and rec.at(2)["lora_A"] > 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        flerm = lora_run(
            8,
            lambda fm, opt: FLeRM(
                fm, opt, rec, probe_batches=stream(3), warmup_samples=8, start_step=2
            ),
        )
    assert [p.step for p in flerm.history] == [2] and flerm.history[0].held == ()


def test_a_set_point_whose_probes_are_all_left_out_holds_the_rates(base: FSLRRecord) -> None:
    fm = build(32, samples=4)
    opt = torch.optim.Adam(fm.parameters(), lr=LR0)
    flerm = FLeRM(
        fm, opt, base, probe_batches=stream(3), mode="periodic", every=2, warmup_samples=8
    )
    fold = fm.fold

    def nan_at_second_set_point(inputs: Any, delta: Any, **kw: Any) -> None:
        if flerm.t == 2:
            inputs = [torch.full_like(b, math.nan) for b in inputs]
        fold(inputs, delta, **kw)

    fm.fold = nan_at_second_set_point  # type: ignore[method-assign]
    with pytest.warns(RuntimeWarning, match="every probe of this set point was left out"):
        loop(fm, opt, flerm, data(2, 3))
    first, second = flerm.history
    # A weight's gradient multiplies its (NaN) input; the biases' gradients came back
    # finite (ReLU's backward masks the NaN out), so only the weights lost their probes.
    held = tuple(n for n in flerm.names if n.endswith("weight"))
    assert second.held == held
    assert all(second.lrs[n] == first.lrs[n] for n in held)
    assert all(second.lrs[n] != first.lrs[n] for n in flerm.names if n not in held)


def test_record_of_another_architecture_or_estimator_is_an_error(base: FSLRRecord) -> None:
    class Other(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Linear(D_IN, 8)
            self.readout = nn.Linear(8, CLASSES)

        def forward(self, x: Tensor) -> Tensor:
            return self.readout(self.body(x))

    fm = ff.with_fslr(Other())
    opt = torch.optim.Adam(fm.parameters(), lr=LR0)
    with pytest.raises(ValueError, match=r"'body.weight'.*another architecture"):
        FLeRM(fm, opt, base, probe_batches=stream(3))
    fm = build()
    opt = torch.optim.Adam(fm.parameters(), lr=LR0)
    ranks = FSLRRecord.from_dict(base.to_dict())
    ranks.meta["shapes"]["input.bias"] = [1, 16]
    with pytest.raises(ValueError, match=r"different rank.*'input.bias'"):
        FLeRM(fm, opt, ranks, probe_batches=stream(3))
    fm = build(estimator="full")
    opt = torch.optim.Adam(fm.parameters(), lr=LR0)
    with pytest.raises(ValueError, match=r"estimator 'kron'.*'input.weight'"):
        FLeRM(fm, opt, base, probe_batches=stream(3))


def test_record_of_another_grouping_is_an_error(base: FSLRRecord) -> None:
    def by_kernel(name: str, shape: tuple[int, ...]) -> None:
        return None

    assert base.meta["grouping"] == "auto"
    fm = build(grouping="dims")
    opt = torch.optim.Adam(fm.parameters(), lr=LR0)
    with pytest.raises(ValueError, match=r"grouping 'auto'.*uses 'dims'.*'input.weight'"):
        FLeRM(fm, opt, base, probe_batches=stream(3))
    old = FSLRRecord.from_dict(base.to_dict())
    del old.meta["grouping"]  # a record from before groupings were recorded: accepted
    FLeRM(fm, opt, old, probe_batches=stream(3))
    custom = FSLRRecord.from_dict(base.to_dict())
    custom.meta["grouping"] = grouping_meta(by_kernel)
    with pytest.raises(ValueError, match=r"grouping 'callable:.*by_kernel' .*uses 'dims'"):
        FLeRM(fm, opt, custom, probe_batches=stream(3))
    fm = build(grouping=by_kernel)
    opt = torch.optim.Adam(fm.parameters(), lr=LR0)
    FLeRM(fm, opt, custom, probe_batches=stream(3))  # callables compare by qualified name


def test_a_record_of_another_optimiser_warns(base: FSLRRecord) -> None:
    """An Adam record driving SGD set rates that transfer nothing, without a word (FSLRs at
    learning rate 1 depend on the update rule): FLeRM warns, naming both."""
    assert base.meta["optimizer"] == "Adam"
    fm = build(32)
    sgd = torch.optim.SGD(fm.parameters(), lr=LR0)
    with pytest.warns(RuntimeWarning, match=r"made with Adam and this optimiser is SGD"):
        FLeRM(fm, sgd, base, probe_batches=stream(3))
    adam = torch.optim.Adam(fm.parameters(), lr=LR0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        FLeRM(fm, adam, base, probe_batches=stream(3))
        several = FSLRRecord.from_dict(base.to_dict())
        several.meta["optimizer"] = "SGD+Adam"  # a Recorder over two optimisers
        FLeRM(fm, adam, several, probe_batches=stream(3))
        unnamed = FSLRRecord.from_dict(base.to_dict())
        unnamed.meta["optimizer"] = None  # a hand-made record: nothing to check
        FLeRM(fm, sgd, unnamed, probe_batches=stream(3))


def test_invalid_setups_are_errors(base: FSLRRecord) -> None:
    fm = build()
    opt = torch.optim.Adam(fm.parameters(), lr=LR0)
    with pytest.raises(ValueError, match="mode"):
        FLeRM(fm, opt, base, probe_batches=stream(3), mode="sometimes")  # type: ignore[arg-type]
    foreign = torch.optim.Adam([*fm.parameters(), nn.Parameter(torch.zeros(2))], lr=LR0)
    with pytest.raises(ValueError, match="not the wrapped model's"):
        FLeRM(fm, foreign, base, probe_batches=stream(3))
    no_lr = FSLRRecord(steps=base.steps, fslr=base.fslr, meta={"estimator": "kron"})
    with pytest.raises(ValueError, match="base_lr"):
        FLeRM(fm, opt, no_lr, probe_batches=stream(3))
    with pytest.raises(ValueError, match="empty"):
        FLeRM(fm, opt, FSLRRecord(meta={"base_lr": LR0}), probe_batches=stream(3))
    for lr0 in (0.0, -LR0, "0.01", True):
        bad_lr = FSLRRecord.from_dict(base.to_dict())
        bad_lr.meta["base_lr"] = lr0
        with pytest.raises(ValueError, match=r"base_lr'\] must be a number > 0"):
            FLeRM(fm, opt, bad_lr, probe_batches=stream(3))
    stalled = FSLRRecord.from_dict(base.to_dict())
    stalled.sched[1] = 0.0
    with pytest.raises(ValueError, match=r"schedule ratio is 0 at steps \[2\]"):
        FLeRM(fm, opt, stalled, probe_batches=stream(3))
    stalled.lrs = {}  # without rates there is nothing to un-schedule: accepted
    FLeRM(fm, opt, stalled, probe_batches=stream(3))
    other = torch.optim.Adam(fm.parameters(), lr=LR0)
    sched = torch.optim.lr_scheduler.StepLR(other, 2)
    with pytest.raises(ValueError, match="scheduler"):
        FLeRM(fm, opt, base, probe_batches=stream(3), scheduler=sched)


def make_run(base: FSLRRecord, seed: int) -> tuple[Any, ...]:
    # A pinned strategy: "auto" decides by timing, and vmap and the loop differ in rounding.
    fm = build(24, seed=seed, dtype=torch.float64, samples=4, strategy="loop")
    opt = torch.optim.Adam(fm.parameters(), lr=LR0)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
    flerm = FLeRM(
        fm,
        opt,
        base,
        probe_batches=stream(3, torch.float64),
        mode="periodic",
        every=3,
        warmup_samples=8,
        scheduler=sched,
    )
    return fm, opt, sched, flerm


def test_resume_equals_uninterrupted_run(base: FSLRRecord, tmp_path: Path) -> None:
    batches = data(4, 10, torch.float64)
    fm, opt, sched, flerm = make_run(base, seed=0)
    loop(fm, opt, flerm, batches, sched)
    reference = {n: p.detach().clone() for n, p in fm.named_parameters()}

    fm, opt, sched, flerm = make_run(base, seed=0)
    loop(fm, opt, flerm, batches[:4], sched)
    path = tmp_path / "ckpt.pt"
    torch.save(
        {
            "fm": fm.state_dict(),
            "opt": opt.state_dict(),
            "sched": sched.state_dict(),
            "flerm": flerm.state_dict(),
        },
        path,
    )
    fm, opt, sched, flerm = make_run(base, seed=99)  # fresh objects, other weights
    ckpt = torch.load(path)
    fm.load_state_dict(ckpt["fm"])
    opt.load_state_dict(ckpt["opt"])
    sched.load_state_dict(ckpt["sched"])
    flerm.load_state_dict(ckpt["flerm"])
    assert flerm.t == 4 and [p.step for p in flerm.history] == [0, 3]
    loop(fm, opt, flerm, batches[4:], sched)
    assert [p.step for p in flerm.history] == [0, 3, 6, 9]
    for n, p in fm.named_parameters():
        assert torch.equal(p.detach(), reference[n]), n


def test_state_of_other_tensors_is_rejected(base: FSLRRecord) -> None:
    fm = build()
    flerm = FLeRM(fm, torch.optim.Adam(fm.parameters()), base, probe_batches=stream(3))
    state = flerm.state_dict()
    state["names"] = ["x", *state["names"][1:]]
    with pytest.raises(ValueError, match="other tensors"):
        flerm.load_state_dict(state)
    with pytest.raises(ValueError, match="version"):
        flerm.load_state_dict({**state, "version": 0})
    buf = io.BytesIO()
    torch.save(flerm.state_dict(), buf)  # plain data: loads with weights_only
    buf.seek(0)
    assert torch.load(buf, weights_only=True)["names"] == flerm.names


class _Doubled:
    """A callable-object policy: its default repr holds a memory address."""

    def __call__(self, base: Any, scaled: Any) -> dict[str, float]:
        return {n: 2.0 * base[n] for n in scaled}


def _times(base: Any, scaled: Any, k: float) -> dict[str, float]:
    return {n: k * base[n] for n in scaled}


@pytest.mark.parametrize("make", [_Doubled, lambda: functools.partial(_times, k=2.0)])
def test_a_state_with_a_callable_object_policy_loads_into_a_new_flerm(
    base: FSLRRecord, make: Callable[[], Any]
) -> None:
    """A policy object (or partial) built again, as a resumed process does, has another
    address: its saved name held that address, so load_state_dict refused the state with
    "saved with policy='<...Doubled object at 0x...>'"."""
    fm = build()
    opt = torch.optim.Adam(fm.parameters())
    state = FLeRM(fm, opt, base, probe_batches=stream(3), policy=make()).state_dict()
    again = FLeRM(fm, opt, base, probe_batches=stream(3), policy=make())
    again.load_state_dict(state)
    assert " at 0x" not in state["config"]["policy"]


def test_a_param_group_at_rate_0_is_named_as_such_not_as_a_zero_fslr(base: FSLRRecord) -> None:
    """Its tensors were reported as having "an FSLR or base target of zero ... (e.g. LoRA A
    while B is still zero)"; the cause is the group's rate of 0."""
    fm = build(32, samples=4)
    readout = [p for n, p in fm.module.named_parameters() if n.startswith("readout.")]
    others = [p for n, p in fm.module.named_parameters() if not n.startswith("readout.")]
    opt = torch.optim.Adam([{"params": others}, {"params": readout, "lr": 0.0}], lr=LR0)
    flerm = FLeRM(fm, opt, base, probe_batches=stream(3), warmup_samples=8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loop(fm, opt, flerm, data(2, 1))
    messages = [str(w.message) for w in caught]
    assert any("'readout.weight'" in m and "at learning rate 0" in m for m in messages)
    assert not any("readout.weight" in m and "zero or below min_fslr" in m for m in messages)
    assert flerm.lrs()["readout.weight"] == 0.0 and flerm.lrs()["readout.bias"] == 0.0


def test_works_in_the_experiments_training_loop(base: FSLRRecord) -> None:
    fm = build(32, samples=4)
    opt = torch.optim.Adam(fm.parameters(), lr=LR0)
    flerm = FLeRM(fm, opt, base, probe_batches=stream(3), warmup_samples=8)
    losses = train(fm, data(2, 3), opt, 3, around_step=lambda t: flerm.step())
    assert len(losses) == 3 and flerm.t == 3 and len(flerm.history) == 1


def test_docs_flerm_md_code_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    doc = Path(__file__).resolve().parents[2] / "docs" / "flerm.md"
    blocks = re.findall(r"```python\n(.*?)```", doc.read_text(), flags=re.S)
    assert len(blocks) >= 4
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, Any] = {"__name__": "flerm_docs"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the LoRA snippet's held tensor
        for block in blocks:
            exec(compile(block, str(doc), "exec"), namespace)


@pytest.mark.parametrize("name", ["flerm_width.py", "flerm_depth.py"])
def test_examples_run(name: str, monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    path = Path(__file__).resolve().parents[2] / "examples" / name
    argv = [str(path), "--steps", "30", "--lrs", "1e-3", "1e-2", "--seeds", "1"]
    monkeypatch.setattr("sys.argv", argv)
    runpy.run_path(str(path), run_name="__main__")
    out = capsys.readouterr().out
    assert "best lr" in out and "FLeRM" in out and "nan" not in out


def _recorded_under_flerm(order: str) -> tuple[FSLRRecord, list[dict[str, float]]]:
    """A FLeRM-driven run recorded by a Recorder on the same wrapper, FLeRM and the Recorder
    nested or attached in the order named; returns the record and FLeRM's rates per step."""
    torch.manual_seed(0)
    base_fm = ff.with_fslr(ResMLP(D_IN, CLASSES, width=8, depth=2), samples=4, seed=0)
    base_opt = torch.optim.Adam(base_fm.parameters(), lr=LR0)
    base = Recorder(base_fm, stream(1), optimizer=base_opt, warmup_samples=8)
    train(
        base_fm,
        data(0, 3),
        base_opt,
        3,
        nn.functional.cross_entropy,
        around_step=lambda t: base.step(),
    )
    torch.manual_seed(0)
    fm = ff.with_fslr(ResMLP(D_IN, CLASSES, width=32, depth=2), samples=4, seed=0)
    opt = torch.optim.Adam(fm.parameters(), lr=LR0)
    rates: list[dict[str, float]] = []
    flerm = FLeRM(
        fm, opt, base.record, probe_batches=stream(2), warmup_samples=8,
        log_fn=lambda t, s: rates.append({k[9:]: v for k, v in s.items() if "flerm_lr/" in k}),
    )  # fmt: skip
    rec = Recorder(fm, stream(3), optimizer=opt, warmup_samples=8, every=1, start_step=1)
    hooks = []
    if order.startswith("attach"):
        first, second = (flerm, rec) if order == "attach-flerm-first" else (rec, flerm)
        hooks = [first.attach(), second.attach()]
    for x, y in data(4, 5):
        opt.zero_grad()
        nn.functional.cross_entropy(fm(x), y).backward()
        with contextlib.ExitStack() as stack:
            if order == "flerm-outside":
                stack.enter_context(flerm.step())
                stack.enter_context(rec.step())
            elif order == "flerm-inside":
                stack.enter_context(rec.step())
                stack.enter_context(flerm.step())
            opt.step()
    for h in hooks:
        h.detach()
    return rec.record, rates


def test_a_recorder_of_a_flerm_run_records_flerms_rates_in_any_order() -> None:
    """The rates recorded are FLeRM's, as applied; the unit-rate FSLRs are those of the step's
    direction, whether the Recorder measured the update before or after FLeRM scaled it."""
    records = {}
    for order in ("flerm-outside", "flerm-inside", "attach-flerm-first", "attach-recorder-first"):
        record, rates = _recorded_under_flerm(order)
        assert record.steps == [1, 2, 3, 4]
        assert len(set(rates[1].values())) > 1  # per-tensor rates, not the group's
        for row, step in enumerate(record.steps):
            recorded = {n: record.lrs[n][row] for n in record.names}
            assert recorded == pytest.approx(rates[step], rel=1e-12), (order, step)
        records[order] = record
    first = records["flerm-outside"]
    for order, record in records.items():
        for n in first.names:
            assert record.fslr[n] == pytest.approx(first.fslr[n], rel=1e-4), (order, n)
