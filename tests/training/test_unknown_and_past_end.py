"""Runs that cannot record the truth say so, and FLeRM says when it goes past its record
(issue 21, items 2 and 4): unknown FSLRs are ``None`` (``null`` in JSON), never 0; a frozen
first param group is not the run's schedule; FLeRM refuses to drive a tensor from an unknown
base value unless told how; set points and schedule lookups past the record warn once or
raise."""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from _tiny import backward, model, stream
from torch import Tensor

import fslr_func as ff
from fslr_func.io.record import FSLRRecord
from fslr_func.training.flerm import FLeRM
from fslr_func.training.recorder import Recorder

LR = 0.05


def _frozen_first(fm: ff.FSLRModule) -> torch.optim.Optimizer:
    """SGD with the first layer in a group at rate 0 (a frozen embedding), the rest at LR."""
    first = [p for n, p in fm.module.named_parameters() if n.startswith("0.")]
    rest = [p for n, p in fm.module.named_parameters() if not n.startswith("0.")]
    return torch.optim.SGD([{"params": first, "lr": 0.0}, {"params": rest, "lr": LR}], lr=LR)


def _train(fm: ff.FSLRModule, opt: torch.optim.Optimizer, ctl: object, steps: int) -> None:
    for t in range(steps):
        opt.zero_grad()
        backward(fm, t)
        with ctl.step():  # type: ignore[attr-defined]
            opt.step()


def _frozen_first_base(steps: int = 6, base_lr: float | None = None) -> FSLRRecord:
    fm = model(0)
    opt = _frozen_first(fm)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the "did not move" note
        recorder = Recorder(
            fm, stream(1), optimizer=opt, warmup_samples=8, every=2, base_lr=base_lr
        )
        _train(fm, opt, recorder, steps)
    return recorder.record


def test_a_frozen_first_group_is_unknown_and_not_the_runs_schedule(tmp_path: Path) -> None:
    rec = _frozen_first_base()
    assert rec.steps == [0, 2, 4]
    assert rec.fslr["0.weight"] == [None] * 3 and rec.fslr["0.bias"] == [None] * 3
    assert all(v is not None and v > 0 for v in rec.fslr["2.weight"])
    # the schedule is the training group's, not the frozen group's 0
    assert rec.meta["base_lr"] == LR and rec.sched == [1.0] * 3
    assert rec.meta["sched_per_step"] == [1.0] * 6
    assert _frozen_first_base(base_lr=LR).sched == [1.0] * 3  # it was 0 at every step
    rec.save(tmp_path / "base.json")
    assert json.loads((tmp_path / "base.json").read_text())["fslr"]["0.weight"] == [None] * 3
    assert FSLRRecord.load(tmp_path / "base.json") == rec


def _nan_then(seed: int, nan_batches: int) -> Iterator[Tensor]:
    for k, x in enumerate(stream(seed)):
        yield torch.full_like(x, math.nan) if k < nan_batches else x


def test_warm_up_probes_all_non_finite_record_unknown_not_zero() -> None:
    fm = model(0)
    opt = torch.optim.SGD(fm.parameters(), lr=LR)
    recorder = Recorder(fm, _nan_then(1, nan_batches=2), optimizer=opt, warmup_samples=8, every=2)
    with pytest.warns(RuntimeWarning, match="not finite"):
        _train(fm, opt, recorder, 3)
    rec = recorder.record
    assert rec.steps == [0, 2]
    # the NaN reached every gradient but the readout bias's (d phi / d b does not see the
    # input): those rows are unknown, never 0 as they were
    assert [n for n, v in rec.fslr.items() if v[0] is None] == ["0.weight", "0.bias", "2.weight"]
    assert all(v[1] is not None and v[1] > 0 for v in rec.fslr.values())
    with pytest.raises(
        ValueError, match=r"\['0\.weight', '0\.bias', '2\.weight'\] is unknown at step 0"
    ):
        rec.at(0)
    nearest = {n: v[0] if v[0] is not None else v[1] for n, v in rec.fslr.items()}
    assert rec.at(0, unknown="nearest") == nearest


def _scaled(base: FSLRRecord, frozen: bool = False, **kwargs: object) -> tuple[FLeRM, object]:
    fm = model(3, width=24)
    if frozen:  # the scaled run freezes the first layer too
        for n, p in fm.module.named_parameters():
            p.requires_grad_(not n.startswith("0."))
    opt = torch.optim.SGD([p for p in fm.parameters() if p.requires_grad], lr=LR)
    flerm = FLeRM(fm, opt, base, probe_batches=stream(2), warmup_samples=8, **kwargs)  # type: ignore[arg-type]
    return flerm, (fm, opt)


def test_flerm_refuses_an_unknown_base_value_naming_the_tensor() -> None:
    base = _frozen_first_base()
    refused = r"FLeRM drives: '0\.weight' at steps \[0\]; '0\.bias'.*'nearest'.*unknown='hold'"
    with pytest.raises(ValueError, match=refused):
        _scaled(base)
    with pytest.raises(ValueError, match=r"at steps \[0, 2, 4\]"):
        _scaled(base, mode="periodic", every=2)
    # frozen in the scaled run too: FLeRM does not drive it, nothing to refuse
    flerm, (fm, opt) = _scaled(base, frozen=True)
    _train(fm, opt, flerm, 2)  # type: ignore[arg-type]
    lrs = flerm.history[0].lrs
    assert set(lrs) == {"2.weight", "2.bias"} and all(lr > 0 for lr in lrs.values())


def test_hold_keeps_the_group_rate_and_matches_the_others_with_the_training_schedule() -> None:
    base = _frozen_first_base()
    with pytest.warns(
        RuntimeWarning, match=r"\['0\.weight', '0\.bias'\] answer to base tensors whose FSLR"
    ):
        flerm, (fm, opt) = _scaled(base, unknown="hold")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        _train(fm, opt, flerm, 2)  # type: ignore[arg-type]
    point = flerm.history[0]
    assert point.lrs["0.weight"] == LR and point.lrs["0.bias"] == LR  # held at the group's rate
    assert set(point.held) == {"0.weight", "0.bias"}
    # the others are matched at the base schedule 1 (it was 0 for every step: rates all 0)
    for n in ("2.weight", "2.bias"):
        want = LR * base.at(0, unknown="omit")[n] / point.fslr[n]
        assert point.lrs[n] == pytest.approx(want, rel=1e-12) and point.lrs[n] > 0


def test_nearest_uses_the_tensors_nearest_known_value() -> None:
    fm = model(0)
    opt = torch.optim.SGD(fm.parameters(), lr=LR)
    recorder = Recorder(fm, _nan_then(1, nan_batches=2), optimizer=opt, warmup_samples=8, every=2)
    with pytest.warns(RuntimeWarning):
        _train(fm, opt, recorder, 3)
    base = recorder.record  # row 0 unknown, row 2 known
    with pytest.raises(ValueError, match="unknown for tensors FLeRM drives"):
        _scaled(base)
    flerm, (fm, opt) = _scaled(base, unknown="nearest")
    _train(fm, opt, flerm, 1)  # type: ignore[arg-type]
    assert flerm.history[0].targets == base.at(0, unknown="nearest")
    assert flerm.history[0].targets["0.weight"] == base.fslr["0.weight"][1]


def test_set_points_and_schedule_past_the_record_warn_once_or_raise() -> None:
    base = _frozen_first_base(steps=4)  # rows 0 and 2, schedule of steps 0 to 3
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        flerm, (fm, opt) = _scaled(base, unknown="hold", mode="periodic", every=2)
        _train(fm, opt, flerm, 8)  # type: ignore[arg-type]
    past = [str(w.message) for w in caught if "past the end" in str(w.message)]
    assert len(past) == 2, past  # once for the schedule, once for the set points
    assert "the base schedule at step 4 is past the end of the base record (2 rows, steps 0 " \
        "to 2; it covers steps up to 3)" in past[0]  # fmt: skip
    assert "FLeRM: set point 4 is past the end" in past[1]
    with pytest.warns(RuntimeWarning, match="unknown"):
        flerm, (fm, opt) = _scaled(base, unknown="hold", past_end="error")
    with pytest.raises(ValueError, match=r"schedule at step 4 is past the end.*past_end='error'"):
        _train(fm, opt, flerm, 8)  # type: ignore[arg-type]
    assert flerm.t == 4  # steps 0 to 3 ran


def test_a_start_step_past_the_record_is_named_at_construction() -> None:
    base = _frozen_first_base(steps=4)
    with pytest.raises(ValueError, match="FLeRM: set point 10 is past the end"):
        _scaled(base, unknown="hold", start_step=10, past_end="error")


def test_set_points_before_the_base_runs_first_probed_step_warn_or_raise() -> None:
    # a base that started probing at step 3 (start_step=3) drove a scaled run's step-0 set
    # point from step 3's FSLRs without a word
    fm = model(0)
    opt = torch.optim.SGD(fm.parameters(), lr=LR)
    recorder = Recorder(fm, stream(1), optimizer=opt, warmup_samples=8, every=2, start_step=3)
    _train(fm, opt, recorder, 6)
    base = recorder.record
    assert base.steps == [3, 5]
    with pytest.warns(RuntimeWarning, match=r"set point 0 is before the base run's first probed"):
        flerm, (fm, opt) = _scaled(base)
    _train(fm, opt, flerm, 1)  # type: ignore[arg-type]
    assert flerm.history[0].targets == base.at(3)
    with pytest.raises(ValueError, match=r"set point 0 is before.*start FLeRM \(start_step\)"):
        _scaled(base, past_end="error")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # from the base's own start: nothing to say
        _scaled(base, start_step=3)


def test_nearest_with_a_tensor_unknown_at_every_row_points_to_hold_not_to_itself() -> None:
    base = _frozen_first_base()  # the first layer unknown at every row
    with pytest.raises(ValueError, match=r"unknown at every row.*unknown='hold'") as err:
        _scaled(base, unknown="nearest")
    assert "unknown='nearest' uses" not in str(err.value)
