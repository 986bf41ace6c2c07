"""Steps that cannot be measured, warm-up from 0, continuous base schedules, tensors frozen
mid-run, param groups added later, optimisers over a subset, and options checked on resume."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from _device import DEVICE, grad_scaler
from _tiny import backward, model, stream
from torch import nn

import fslr_func as ff
from fslr_func.io.record import FSLRRecord
from fslr_func.training.recorder import Recorder


def record(steps: int = 4, **kw: object) -> FSLRRecord:
    fm = model()
    opt = torch.optim.Adam(fm.parameters(), lr=1e-2)
    rec = Recorder(fm, stream(), optimizer=opt, warmup_samples=8, every=2, **kw)  # type: ignore[arg-type]
    with rec.attach():
        for t in range(steps):
            opt.zero_grad()
            backward(fm, t)
            opt.step()
    return rec.record


def test_skipped_step_is_not_folded_in_and_waits_for_the_next() -> None:
    fm = model()
    opt = torch.optim.Adam(fm.parameters(), lr=1e-2)
    rec = Recorder(fm, stream(), optimizer=opt, warmup_samples=8, every=10)
    opt.zero_grad(set_to_none=True)  # no gradient at all: the step changes nothing
    with pytest.warns(RuntimeWarning, match="no parameter changed"), rec.step():
        opt.step()
    assert len(rec.record) == 0 and fm.fslr() == {}
    backward(fm, 1)
    with rec.step():
        opt.step()
    assert rec.record.steps == [1]
    assert all(v > 0 for v in rec.record.at(1).values())  # not dragged to 0 (or halved)
    counts = dict(fm.ema.counts)
    # a later probe where one tensor has no gradient: its EMA is untouched, the others move on
    for t in range(2, 12):
        opt.zero_grad()
        backward(fm, t)
        fm.module[2].bias.grad = None
        with rec.step():
            opt.step()
    assert fm.ema.counts["2.bias"] == counts["2.bias"]
    assert fm.ema.counts["0.weight"] == counts["0.weight"] + 1
    assert rec.record.at(11)["2.bias"] == rec.record.at(1)["2.bias"]


def test_tensor_that_moves_but_not_the_function_reads_zero() -> None:
    torch.manual_seed(0)
    a, b = nn.Linear(6, 2, bias=False), nn.Linear(2, 3, bias=False)
    nn.init.zeros_(b.weight)  # LoRA: B = 0, so A moves (weight decay) but f does not
    fm = ff.with_fslr(
        nn.Sequential(a, b).to(DEVICE, torch.float64), samples=4, seed=0, strategy="loop"
    )
    opt = torch.optim.SGD(fm.parameters(), lr=0.1, weight_decay=0.1)
    (fm(next(stream(1))) - 1).square().mean().backward()
    with fm.measure(opt, next(stream())) as m:
        opt.step()
    assert "0.weight" in m.moved and float(m.fslr["0.weight"]) == 0.0
    assert float(m.fslr["1.weight"]) > 0


def test_an_empty_list_of_probe_batches_is_refused_before_the_step() -> None:
    # it measured nothing and said nothing: fm.fslr() read {} after the step
    fm = model()
    opt = torch.optim.SGD(fm.parameters(), lr=0.1)
    backward(fm, 0)
    before = [p.detach().clone() for p in fm.parameters()]
    with pytest.raises(ValueError, match="empty list"), fm.measure(opt, []):
        opt.step()
    assert all(torch.equal(a, p) for a, p in zip(before, fm.parameters(), strict=True))
    with pytest.raises(ValueError, match="empty list"):
        fm.fold([], {n: torch.ones_like(p) for n, p in fm.module.named_parameters()})


def test_one_tensor_as_probe_batches_is_refused_not_split_into_rows() -> None:
    fm = model()
    opt = torch.optim.SGD(fm.parameters(), lr=0.1)
    with pytest.raises(TypeError, match=r"one tensor.*\[x\]"):
        Recorder(fm, next(stream()), optimizer=opt)
    # one batch of keyword arguments iterates as its keys: refused at construction, not at the
    # first probe (after optimizer.step) with "inputs must be a Tensor ..., got str"
    with pytest.raises(TypeError, match=r"one dict .*yields its keys.*\[batch\]"):
        Recorder(fm, {"input": next(stream())}, optimizer=opt)
    with pytest.raises(TypeError, match=r"one dict"):
        ff.FLeRM(fm, opt, ff.FSLRRecord(), probe_batches={"input": next(stream())})


def test_warmup_from_zero_measures_at_the_first_nonzero_rate() -> None:
    fm = model()
    opt = torch.optim.AdamW(fm.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: min(t / 3, 1.0))
    rec = Recorder(fm, stream(), optimizer=opt, scheduler=sched, warmup_samples=8, every=2)
    with pytest.warns(RuntimeWarning, match="every learning rate is 0"), rec.attach():
        for t in range(5):
            opt.zero_grad()
            backward(fm, t)
            opt.step()
            sched.step()
    assert rec.record.steps == [1, 2, 4] and rec.record.meta["base_lr"] == 1e-2
    assert rec.record.meta["sched_per_step"][:3] == [0.0, 1 / 3, 2 / 3]
    # FLeRM over a warm-up from 0 waits for the first non-zero rate too
    fm2 = model(width=20)
    opt2 = torch.optim.AdamW(fm2.parameters(), lr=1e-2)
    sched2 = torch.optim.lr_scheduler.LambdaLR(opt2, lambda t: min(t / 3, 1.0))
    flerm = ff.FLeRM(fm2, opt2, rec.record, probe_batches=stream(2), scheduler=sched2)
    with pytest.warns(RuntimeWarning, match="waits"), flerm.attach():
        for t in range(3):
            opt2.zero_grad()
            backward(fm2, t)
            opt2.step()
            sched2.step()
    assert [p.step for p in flerm.history] == [1]
    assert all(v > 0 for v in flerm.history[0].lrs.values())


def test_base_schedule_is_followed_continuously_not_as_a_staircase() -> None:
    steps = 40
    fm = model()
    opt = torch.optim.SGD(fm.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=steps)
    rec = Recorder(fm, stream(), optimizer=opt, scheduler=sched, warmup_samples=4, every=None)
    true = []
    with rec.attach():
        for t in range(steps):
            true.append(sched.get_last_lr()[0] / sched.base_lrs[0])
            opt.zero_grad()
            backward(fm, t)
            opt.step()
            sched.step()
    fm2 = model(width=20)
    opt2 = torch.optim.SGD(fm2.parameters(), lr=0.05)
    flerm = ff.FLeRM(fm2, opt2, rec.record, probe_batches=stream(2), warmup_samples=4)
    with flerm.attach():
        for t in range(steps):
            opt2.zero_grad()
            backward(fm2, t)
            opt2.step()
    ratios = flerm.ratios
    for t in (5, 10, 17, 30):
        lrs = {n: rate for n, (_, rate) in flerm._rates_at(t).items()}  # FLeRM's rates at t
        for n, r in ratios.items():
            assert math.isclose(lrs[n], flerm.lr0 * true[t] * r, rel_tol=1e-12)
    # a record without per-step ratios (older files) is interpolated between its rows
    old = FSLRRecord(steps=[0, 10], fslr={"w": [1.0, 1.0]}, sched=[1.0, 3.0])
    assert old.schedule_at(5) == 2.0 and old.sched_at(5) == 1.0


def test_tensor_frozen_or_group_zeroed_mid_run_drops_out_with_a_note() -> None:
    fm = model()
    layers = fm.module
    opt = torch.optim.SGD(
        [{"params": layers[0].parameters()}, {"params": layers[2].parameters()}], lr=0.05
    )
    rec = Recorder(fm, stream(), optimizer=opt, warmup_samples=4, every=1)
    with rec.attach():
        for t in range(6):
            if t == 2:
                layers[0].bias.requires_grad_(False)
            if t == 4:
                opt.param_groups[1]["lr"] = 0.0
            opt.zero_grad()
            backward(fm, t)
            if t == 2:
                with pytest.warns(RuntimeWarning, match="did not move"):
                    opt.step()
            else:
                opt.step()
    assert rec.record.steps == list(range(6))
    assert rec.record.at(5)["0.bias"] == rec.record.at(1)["0.bias"]
    assert rec.record.lrs_at(5)["2.weight"] == 0.0 and rec.record.lrs_at(5)["0.bias"] == 0.0
    assert rec.record.at(5)["2.weight"] == rec.record.at(3)["2.weight"]


def test_a_plateau_cutting_a_tensor_rate_in_place_is_recorded() -> None:
    # ReduceLROnPlateau sets no initial_lr and cuts a tensor rate in place: the Recorder's
    # initial_lr was the same tensor, so the record said sched 1 at every cut
    def recorded(lr: float | torch.Tensor) -> FSLRRecord:
        fm = model()
        opt = torch.optim.Adam(fm.parameters(), lr=lr)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.1)
        rec = Recorder(fm, stream(1), optimizer=opt, warmup_samples=4, every=2, scheduler=plateau)
        for t in range(5):
            opt.zero_grad()
            backward(fm, t)
            with rec.step():
                opt.step()
            plateau.step(1.0)  # no improvement: a cut after every step
        return rec.record

    as_tensor = recorded(torch.tensor(1e-2, dtype=torch.float64))
    assert as_tensor.sched == pytest.approx(recorded(1e-2).sched) and as_tensor.sched[-1] < 0.01


def test_add_param_group_after_flerm_is_adopted() -> None:
    base = record()
    fm = model(width=20)
    layers = fm.module
    opt = torch.optim.Adam(layers[0].parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 10)
    flerm = ff.FLeRM(
        fm, opt, base, probe_batches=stream(1), scheduler=sched, mode="periodic", every=1
    )
    assert flerm.names == ["0.weight", "0.bias"]
    opt.add_param_group({"params": list(layers[2].parameters()), "lr": 1e-2})
    for t in range(2):
        opt.zero_grad()
        backward(fm, t)
        with flerm.step():
            opt.step()
        sched.step()
    assert flerm.names == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert sorted(flerm.history[-1].lrs) == sorted(flerm.names)


def test_static_flerm_matches_a_tensor_that_joins_after_its_set_point() -> None:
    # was: static mode had no set point after its first, so a tensor unfrozen later trained
    # at its group's rate (28x its matched rate in the report), with no note
    base = record()
    fm = model(width=20)
    hidden = fm.module[0].weight
    hidden.requires_grad_(False)  # unfrozen at step 2 (gradual unfreezing)
    opt = torch.optim.Adam(fm.parameters(), lr=1e-2)
    flerm = ff.FLeRM(fm, opt, base, probe_batches=stream(1), warmup_samples=8)
    for t in range(4):
        if t == 2:
            hidden.requires_grad_(True)
        opt.zero_grad()
        backward(fm, t)
        with flerm.step():
            opt.step()
        if t == 0:
            first = dict(flerm.ratios)
    assert [p.step for p in flerm.history] == [0, 2] and "0.weight" not in first
    assert flerm.ratios == {**first, "0.weight": flerm.ratios["0.weight"]}  # others kept
    assert flerm.lrs()["0.weight"] != 1e-2


def test_optimiser_over_a_subset_of_the_model() -> None:
    base = record()
    fm = model(width=20)
    opt = torch.optim.Adam(fm.module[2].parameters(), lr=1e-2)
    flerm = ff.FLeRM(fm, opt, base, probe_batches=stream(1))
    backward(fm, 0)
    with flerm.step():
        opt.step()
    assert sorted(flerm.history[0].lrs) == ["2.bias", "2.weight"]


@pytest.mark.parametrize(
    ("option", "value"),
    [("mode", "periodic"), ("every", 7), ("start_step", 1), ("warmup_samples", 4),
     ("policy", "equal"), ("min_fslr", 1e-3)],
)  # fmt: skip
def test_flerm_state_of_other_options_is_refused_unless_not_strict(
    option: str, value: object
) -> None:
    base = record()
    fm = model(width=20)
    opt = torch.optim.Adam(fm.parameters(), lr=1e-2)
    state = ff.FLeRM(fm, opt, base, probe_batches=stream()).state_dict()
    other = ff.FLeRM(fm, opt, base, probe_batches=stream(), **{option: value})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=f"saved with {option}="):
        other.load_state_dict(state)
    other.load_state_dict(state, strict=False)
    other_base = record(steps=2)
    with pytest.raises(ValueError, match="saved with base="):
        ff.FLeRM(fm, opt, other_base, probe_batches=stream()).load_state_dict(state)


def test_recorder_state_of_other_options_is_refused_and_options_checked_early() -> None:
    fm = model()
    opt = torch.optim.Adam(fm.parameters(), lr=1e-2)
    state = Recorder(fm, stream(), optimizer=opt).state_dict()
    with pytest.raises(ValueError, match="saved with every=100, but this Recorder has every=5"):
        Recorder(fm, stream(), optimizer=opt, every=5).load_state_dict(state)
    # a state is its model's and optimiser's: another width or optimiser loaded silently
    # (the record mixed rows of two models, FLeRM trained at the other width's rates)
    wide = model(width=24)
    with pytest.raises(ValueError, match=r"another model's tensors: '0\.weight': \[10, 6\] there"):
        Recorder(wide, stream(), optimizer=torch.optim.Adam(wide.parameters())).load_state_dict(
            state
        )
    with pytest.raises(ValueError, match=r"optimizers=\['Adam'\], but this Recorder has .*'SGD'"):
        sgd = torch.optim.SGD(fm.parameters(), lr=0.1)
        Recorder(fm, stream(), optimizer=sgd).load_state_dict(state)
    Recorder(wide, stream(), optimizer=torch.optim.SGD(wide.parameters(), lr=0.1)).load_state_dict(
        state, strict=False
    )  # the override
    with pytest.raises(TypeError, match="log_fn"):
        Recorder(fm, stream(), optimizer=opt, log_fn=3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="optimizer must be"):
        Recorder(fm, stream(), optimizer="adam")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="probe_batches"):
        Recorder(fm, 3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="every must be"):
        ff.FLeRM(fm, opt, record(), probe_batches=stream(), every=0)
    other = torch.optim.SGD(fm.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="scheduler must be a scheduler of this optimizer"):
        Recorder(fm, stream(), optimizer=opt, scheduler=torch.optim.lr_scheduler.StepLR(other, 1))


def _stall_warnings(
    ctl: object,
    fm: ff.FSLRModule,
    opt: torch.optim.Optimizer,
    steps: range,
    spike: int | None = None,
    frozen: range = range(0),
) -> list[tuple[int, str]]:
    """Run ``steps`` through ``ctl``; the steps at which a stall warned, with the message."""
    out = []
    for t in steps:
        opt.zero_grad()
        g = torch.Generator().manual_seed(100 + t)
        x = torch.randn(8, 6, generator=g, dtype=torch.float64).to(DEVICE)
        (fm(x).square().mean() * (1e200 if t == spike else 1.0)).backward()
        if t in frozen:
            opt.zero_grad(set_to_none=True)  # no gradient: the step changes nothing
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            with ctl.step():  # type: ignore[attr-defined]
                opt.step()
        out += [(t, str(w.message)) for w in seen if "no step has been measured" in str(w.message)]
    return out


def test_a_stalled_run_warns_once_per_stall_and_again_after_recovering() -> None:
    # a 1e200 loss spike makes Adam's v infinite (float64): no weight moves again, every probe
    # is deferred, and the record silently ended at the spike (the deferral note is given once)
    fm = model()
    opt = torch.optim.Adam(fm.parameters(), lr=1e-2)
    rec = Recorder(fm, stream(), optimizer=opt, warmup_samples=4, every=2)
    assert rec.stall_after == 50
    warned = _stall_warnings(rec, fm, opt, range(80), spike=10)
    assert rec.record.steps[-1] == 8
    assert [t for t, _ in warned] == [59]  # the 50th step owing probes, once
    assert "50 steps (since step 10" in warned[0][1] and "overflowed" in warned[0][1]
    opt.state.clear()  # the run recovers ...
    assert _stall_warnings(rec, fm, opt, range(80, 90)) == []
    assert rec.record.steps[-5:] == [80, 82, 84, 86, 88]
    # ... and a new stall (steps without gradients) warns again, counted from its own start
    warned = _stall_warnings(rec, fm, opt, range(90, 160), frozen=range(95, 200))
    assert [t for t, _ in warned] == [145]  # owed from step 96, the first probed one
    state = rec.state_dict()
    assert state["stalled_since"] == 96 and state["stall_noted"] is True


def test_flerm_stall_waits_for_five_probe_intervals() -> None:
    base = record(steps=4)
    fm = model(width=20)
    opt = torch.optim.Adam(fm.parameters(), lr=1e-2)
    flerm = ff.FLeRM(fm, opt, base, probe_batches=stream(2), mode="periodic", every=20)
    assert flerm.stall_after == 100  # 5 x every=20 > 50
    warned = _stall_warnings(flerm, fm, opt, range(130), frozen=range(5, 200))
    assert [t for t, _ in warned] == [119]  # owed from the set point at 20


def test_blocks_a_scaler_skips_are_no_steps_but_a_stall_of_them_warns() -> None:
    """``with rec.step(): scaler.step(opt)`` with gradients that are never finite: ``t`` stays
    at 0, and the 50th skipped block in a row warns; the stall's length survives a resume."""
    fm = model()
    opt = torch.optim.Adam(fm.parameters(), lr=1e-2)
    rec = Recorder(fm, stream(), optimizer=opt, warmup_samples=4, every=2)
    scaler = grad_scaler()
    warned = []
    for block in range(60):
        opt.zero_grad()
        scaler.scale(fm(next(stream())).sum() * torch.inf).backward()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            with rec.step():
                scaler.step(opt)
        scaler.update()
        warned += [block for w in seen if "no step has been measured" in str(w.message)]
    assert rec.t == 0 and rec.record.steps == [] and warned == [49]
    state = rec.state_dict()
    assert state["stall_steps"] == 60 and state["stalled_since"] == 0
    assert rec.probes_used == 0  # each skipped block gave its probe batch back
    again = Recorder(model(), stream(), optimizer=opt, warmup_samples=4, every=2)
    again.load_state_dict(state)
    assert again.state_dict()["stall_steps"] == 60
    del state["stall_steps"]  # a state saved before it was kept: counted from the steps
    again.load_state_dict(state)
    assert again.state_dict()["stall_steps"] == 0


class _Flaky:
    """Endless probe batches (``stream``'s) whose ``raise_at``-th draw raises once."""

    def __init__(self, raise_at: int | None) -> None:
        self.inner, self.draws, self.raise_at = stream(1), 0, raise_at

    def __iter__(self) -> _Flaky:
        return self

    def __next__(self) -> torch.Tensor:
        self.draws += 1
        if self.draws == self.raise_at:
            raise OSError("a transient read error")
        return next(self.inner)


def test_an_interrupted_probed_step_or_a_failing_draw_spends_no_probe_batch() -> None:
    # Ctrl-C inside a probed step, or a probe source that raised in the middle of a warm-up's
    # draw, used up the batches drawn: the retried step, and every later probe, ran on other
    # batches than an uninterrupted run's, and a checkpoint saved then resumed elsewhere
    def run(interrupt_at: int | None, raise_at: int | None) -> Recorder:
        fm = model()
        opt = torch.optim.Adam(fm.parameters(), lr=1e-2)
        rec = Recorder(fm, _Flaky(raise_at), optimizer=opt, warmup_samples=8, every=2)
        t = 0
        while t < 5:
            opt.zero_grad()
            backward(fm, t)
            try:
                with rec.step():
                    if t == interrupt_at:
                        interrupt_at = None
                        raise KeyboardInterrupt
                    opt.step()
            except (KeyboardInterrupt, OSError):
                continue  # the same step again
            t += 1
        return rec

    plain = run(None, None)
    for interrupted in (run(2, None), run(None, 2)):
        assert interrupted.probes_used == plain.probes_used
        assert interrupted.record == plain.record


def test_a_probe_source_that_raises_during_a_resumes_skip_or_a_new_pass_loses_nothing() -> None:
    from fslr_func.training.probe_schedule import ProbeFeed

    class Source:
        """A re-iterable of numbered batches whose ``fail``-th draw (over all passes)
        raises once."""

        def __init__(self, fail: int) -> None:
            self.draws, self.fail, self.passes = 0, fail, 0

        def __iter__(self) -> Any:
            self.passes += 1
            for i in range(3):
                self.draws += 1
                if self.draws == self.fail:
                    raise OSError("a transient read error")
                yield (self.passes, i)

    feed = ProbeFeed(Source(fail=2))  # during the skip of a resumed run: redone, not kept
    feed.skip(2)
    with pytest.raises(OSError):
        feed.take(2)
    assert feed.take(2) == [(2, 2), (3, 0)]  # the skip's 2 batches passed over again
    feed = ProbeFeed(Source(fail=5))  # in a second pass: the batch drawn before it is kept
    with pytest.raises(OSError):
        feed.take(5)
    with pytest.warns(RuntimeWarning, match=r"ran out after one pass \(1 batches\)"):
        assert feed.take(5) == [(1, 0), (1, 1), (1, 2), (2, 0), (3, 0)]
    resumed = ProbeFeed([0])  # a pass of one batch, resumed after two: it said 3
    resumed.skip(2)
    with pytest.warns(RuntimeWarning, match=r"ran out after one pass \(1 batches\)"):
        assert resumed.take(1) == [0]


def test_an_edited_or_damaged_state_is_refused_naming_what() -> None:
    # a negative ratio loaded (that tensor then trained by gradient ascent), a NaN one too,
    # a negative step count, and a version-2 state without its config skipped every check
    def built() -> ff.FLeRM:
        fm = model(width=20)
        opt = torch.optim.Adam(fm.parameters(), lr=1e-2)
        return ff.FLeRM(fm, opt, base, probe_batches=stream(1), warmup_samples=8)

    base = record()
    flerm = built()
    backward(flerm.fm, 0)
    with flerm.step():
        flerm.optimizer.step()
    saved = flerm.state_dict()
    for edit, says in [
        ({"ratios": {**saved["ratios"], "0.weight": -1.0}}, r"ratios\['0\.weight'\] is -1\.0"),
        ({"ratios": {**saved["ratios"], "0.bias": math.nan}}, r"ratios\['0\.bias'\] is nan"),
        ({"t": -3}, "'t' is -3, not a count"),
        ({"probes_used": "2"}, "'probes_used' is '2', not a count"),
        ({"config": None}, "has no 'config'"),
    ]:
        with pytest.raises(ValueError, match=says):
            built().load_state_dict({**saved, **edit})
    fresh = built()
    fresh.load_state_dict(saved)  # the state as saved still loads
    assert fresh.ratios == flerm.ratios and fresh.t == 1


def test_a_refused_state_leaves_the_controller_and_the_wrapper_as_they_were() -> None:
    """A damaged state was half loaded before its error: the Recorder had taken the saved
    step count and rows, FLeRM the saved ratios (then a raw ``KeyError``), the wrapper the
    saved averages (then a bad generator state raised)."""
    fm, small = model(width=20), model()
    opt = torch.optim.Adam(fm.parameters(), lr=1e-2)
    small_opt = torch.optim.Adam(small.parameters(), lr=1e-2)
    flerm = ff.FLeRM(fm, opt, record(), probe_batches=stream(1), warmup_samples=8)
    rec = Recorder(small, stream(2), optimizer=small_opt, warmup_samples=4, every=1)
    for t in range(2):
        for net, o, controller in ((fm, opt, flerm), (small, small_opt, rec)):
            o.zero_grad()
            backward(net, t)
            with controller.step():
                o.step()
    saved_flerm, saved_rec, saved_fm = flerm.state_dict(), rec.state_dict(), fm.state_dict()

    fresh = model(width=20)
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=1e-2)
    other = ff.FLeRM(fresh, fresh_opt, record(), probe_batches=stream(1), warmup_samples=8)
    before = other.lrs()
    history = [{k: v for k, v in p.items() if k != "held"} for p in saved_flerm["history"]]
    with pytest.raises(ValueError, match="history is damaged or edited"):
        other.load_state_dict({**saved_flerm, "history": history})
    assert other.lrs() == before and other.ratios == {} and other.t == 0

    fresh_small = model()
    small_opt = torch.optim.Adam(fresh_small.parameters(), lr=1e-2)
    recorder = Recorder(fresh_small, stream(2), optimizer=small_opt, warmup_samples=4, every=1)
    for edit, says in [
        ({"stalled_since": "abc"}, "'stalled_since' is 'abc'"),
        ({"stall_steps": None}, "'stall_steps' is None"),
        ({"record": None}, "Recorder state"),
    ]:
        with pytest.raises(ValueError, match=says):
            recorder.load_state_dict({**saved_rec, **edit})
        assert recorder.t == 0 and recorder.record.steps == [] and recorder.probes_used == 0
    without = dict(saved_rec)
    del without["record"]
    with pytest.raises(ValueError, match="lacks 'record'"):
        recorder.load_state_dict(without)

    extra = saved_fm._metadata[""]["fslr_state"]  # type: ignore[attr-defined]
    extra["generators"] = {"cpu": torch.zeros(3, dtype=torch.uint8)}  # not a generator state
    assert fresh.fslr() == {}
    with pytest.raises(ValueError, match="FSLRModule state is damaged or edited"):
        fresh.load_state_dict(saved_fm)
    assert fresh.fslr() == {} and fresh.probes == 0


def test_a_state_with_the_generator_of_a_device_this_machine_lacks_loads_with_a_warning() -> None:
    """A GPU run's checkpoint on a CPU machine: the wrapper's state holds a ``cuda:0`` omega
    generator, which cannot be made there, and the whole load raised (after replacing the
    averages). The averages load; that generator is left out, said once. Simulated with a
    device no test machine has (``xpu:0``)."""
    fm = model()
    opt = torch.optim.SGD(fm.parameters(), lr=0.1)
    backward(fm, 0)
    with fm.measure(opt, next(stream())):
        opt.step()
    state = fm.state_dict()
    extra = state._metadata[""]["fslr_state"]  # type: ignore[attr-defined]
    extra["generators"] = {**extra["generators"], "xpu:0": torch.zeros(16, dtype=torch.uint8)}
    restored = model(seed=1)
    with pytest.warns(RuntimeWarning, match="omega generator of xpu:0"):
        restored.load_state_dict(state)
    assert restored.fslr().keys() == fm.fslr().keys()
    assert all(torch.equal(restored.fslr()[n], v) for n, v in fm.fslr().items())
    assert list(restored.generators) == [str(next(fm.parameters()).device)]


def _runtime_warnings(
    controller: Recorder | ff.FLeRM,
    fm: ff.FSLRModule,
    opt: Any,
    steps: range,
    after: Callable[[int], None] = lambda t: None,
) -> list[str]:
    """Train ``steps`` through ``controller`` (``after(t)`` after each step); the messages of
    each ``RuntimeWarning`` given."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for t in steps:
            opt.zero_grad()
            backward(fm, t)
            with controller.step():
                opt.step()
            after(t)
    return [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


def test_a_diverged_run_warns_once_not_at_every_probe() -> None:
    # weights gone NaN: every probe is left out; the Recorder warned at every row and a
    # periodic FLeRM twice per set point, for the rest of the run
    def diverged(
        controller: Recorder | ff.FLeRM, fm: ff.FSLRModule, opt: Any, read_every_step: bool = False
    ) -> list[str]:
        def after(t: int) -> None:
            if read_every_step:
                fm.fslr()
            if t == 3:
                with torch.no_grad():
                    fm.module[0].weight.fill_(math.nan)

        return _runtime_warnings(controller, fm, opt, range(12), after)

    fm = model()
    opt = torch.optim.Adam(fm.parameters(), lr=1e-2)
    rec = Recorder(fm, stream(1), optimizer=opt, warmup_samples=4, every=1)
    left_out = [m for m in diverged(rec, fm, opt) if "were left out" in m]
    assert len(left_out) == 1
    # the FSLRs read between probes too (a log every step, a probe every other step): a
    # reading without a probe since the last re-armed the warning
    fm = model()
    opt = torch.optim.Adam(fm.parameters(), lr=1e-2)
    rec = Recorder(fm, stream(1), optimizer=opt, warmup_samples=4, every=2)
    left_out = [m for m in diverged(rec, fm, opt, read_every_step=True) if "were left out" in m]
    assert len(left_out) == 1
    fm = model(width=20)
    opt = torch.optim.Adam(fm.parameters(), lr=1e-2)
    flerm = ff.FLeRM(
        fm, opt, record(), probe_batches=stream(2), warmup_samples=4, mode="periodic", every=1
    )
    said = diverged(flerm, fm, opt)
    assert sum("were left out" in m for m in said) == 1
    assert sum("no finite FSLR estimate" in m for m in said) == 1


@pytest.mark.parametrize("passed", [False, True])
def test_a_plateau_not_passed_to_flerm_is_warned_of_once(passed: bool) -> None:
    """A ``ReduceLROnPlateau`` sets no ``initial_lr``: left out of ``scheduler=``, its cuts
    were undone by FLeRM's rates (the base's schedule) without a word. A group rate that
    moves without a scheduler passed now warns, once; passed, the cuts act and nothing warns."""
    base = record(steps=4)
    fm = model(width=20)
    opt = torch.optim.Adam(fm.parameters(), lr=1e-2)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.1, patience=0)
    flerm = ff.FLeRM(
        fm, opt, base, probe_batches=stream(2), warmup_samples=4, mode="periodic", every=2,
        scheduler=plateau if passed else None,
    )  # fmt: skip
    cut = lambda t: plateau.step(1.0)  # noqa: E731 (never improves: cut at every step)
    seen = _runtime_warnings(flerm, fm, opt, range(4), cut)
    changed = [m for m in seen if "no scheduler was passed" in m]
    assert len(changed) == (0 if passed else 1), changed
    if not passed:
        assert "param group 0's rate changed from 0.01 to 0.001" in changed[0]


def test_param_groups_on_different_schedules_need_the_scaled_runs_own_scheduler() -> None:
    """A record keeps one schedule ratio per step: where the base run's groups followed
    different schedules (a warm-up of one group only), FLeRM without a scheduler would give
    every tensor the first group's, silently; it is refused, and with the run's own scheduler
    every tensor follows its group's schedule (the same model gets its base rates back)."""

    def two_groups() -> tuple[ff.FSLRModule, torch.optim.Optimizer]:
        fm = model()
        params = list(fm.parameters())
        return fm, torch.optim.Adam([{"params": params[:2]}, {"params": params[2:]}], lr=1e-2)

    def steps(fm: ff.FSLRModule, opt: torch.optim.Optimizer, sched: Any, n: int) -> None:
        for t in range(n):
            opt.zero_grad()
            backward(fm, t)
            opt.step()
            sched.step()

    def run(schedules: list[Callable[[int], float]]) -> tuple[FSLRRecord, ff.FSLRModule]:
        fm, opt = two_groups()
        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedules)
        rec = Recorder(fm, stream(), optimizer=opt, scheduler=sched, warmup_samples=8, every=2)
        with rec.attach():
            steps(fm, opt, sched, 4)
        return rec.record, fm

    same, _ = run([lambda t: 1 / (1 + t)] * 2)
    assert same.meta.get("sched_groups_differ_at") is None
    split_schedules: list[Callable[[int], float]] = [lambda t: 1 / (1 + t), lambda t: 1.0]
    split, _ = run(split_schedules)
    assert split.meta["sched_groups_differ_at"] == 1
    loaded = FSLRRecord.from_dict(split.to_dict())
    assert FSLRRecord.mean([same, loaded]).meta["sched_groups_differ_at"] == 1
    fm, opt = two_groups()
    with pytest.raises(ValueError, match=r"different schedules from step 1.*scheduler="):
        ff.FLeRM(fm, opt, loaded, probe_batches=stream(2))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, split_schedules)
    flerm = ff.FLeRM(fm, opt, loaded, probe_batches=stream(2), scheduler=sched)
    with flerm.attach():
        steps(fm, opt, sched, 3)
    lrs = flerm.lrs()  # step 3: group 0 at 1/4 of its initial rate, group 1 at its rate
    schedule = {n: v / (1e-2 * flerm.ratios[n]) for n, v in lrs.items()}
    expected = {"0.weight": 0.25, "0.bias": 0.25, "2.weight": 1.0, "2.bias": 1.0}
    assert schedule == pytest.approx(expected, rel=1e-9)


def test_a_groups_rate_cut_by_hand_after_a_resume_still_splits_the_schedules() -> None:
    """Without a scheduler, the first rate of each group is what a cut is measured against;
    it was not in the Recorder's state, so a run resumed before the cut took the cut rate as
    the first and lost ``sched_groups_differ_at``."""

    def run(resume_at: int | None) -> FSLRRecord:
        fm = model()
        params = list(fm.parameters())
        opt = torch.optim.Adam([{"params": params[:2]}, {"params": params[2:]}], lr=1e-2)
        rec = Recorder(fm, stream(), optimizer=opt, warmup_samples=8, every=2)
        for t in range(6):
            if t == resume_at:
                state = rec.state_dict()
                rec = Recorder(fm, stream(), optimizer=opt, warmup_samples=8, every=2)
                rec.load_state_dict(state)
            if t == 4:
                opt.param_groups[1]["lr"] = 1e-3  # by hand, no scheduler
            opt.zero_grad()
            backward(fm, t)
            with rec.step():
                opt.step()
        return rec.record

    assert run(None).meta["sched_groups_differ_at"] == 4
    assert run(4).meta["sched_groups_differ_at"] == 4  # resumed just before the cut


def test_a_recorder_given_its_optimisers_at_each_step_tells_them_apart() -> None:
    """Two optimisers at different constant rates, each stepped in its own block of a
    Recorder built without them: their groups' first rates must not be mixed up (a false
    ``sched_groups_differ_at`` makes FLeRM refuse the record)."""
    fm = model()
    first, second = list(fm.parameters())[:2], list(fm.parameters())[2:]
    a, b = torch.optim.SGD(first, lr=1e-2), torch.optim.SGD(second, lr=1e-3)
    rec = Recorder(fm, stream(), warmup_samples=8, every=2)
    for t in range(4):
        for opt in (a, b):
            opt.zero_grad()
            backward(fm, t)
            with rec.step(opt):
                opt.step()
    assert rec.record.meta.get("sched_groups_differ_at") is None
