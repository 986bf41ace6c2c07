"""Recorder: probe schedule, cost on other steps, metadata, schedule ratio, resume."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import fslr_func as ff
from fslr_func.io.record import FSLRRecord, grouping_meta
from fslr_func.training.probe_schedule import ProbeFeed, ProbePlan
from fslr_func.training.recorder import Recorder
from fslr_func.training.wrapper import Measurement


def model(seed: int = 0) -> ff.FSLRModule:
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 3)).double()
    # A pinned strategy: records are compared bit for bit, and "auto" decides by timing.
    return ff.with_fslr(net, samples=4, seed=1, strategy="loop")


def stream(seed: int) -> Iterator[Tensor]:
    g = torch.Generator().manual_seed(seed)
    while True:
        yield torch.randn(8, 6, generator=g, dtype=torch.float64)


def run(
    fm: ff.FSLRModule,
    opt: torch.optim.Optimizer,
    rec: Recorder,
    steps: range,
    sched: torch.optim.lr_scheduler.LRScheduler | None = None,
) -> list[Measurement | None]:
    yielded = []
    for t in steps:
        g = torch.Generator().manual_seed(100 + t)
        x = torch.randn(8, 6, generator=g, dtype=torch.float64)
        opt.zero_grad()
        fm(x).square().mean().backward()
        with rec.step(opt) as m:
            opt.step()
        yielded.append(m)
        if sched is not None:
            sched.step()
    return yielded


def test_warmup_then_every_k_steps_on_fresh_batches() -> None:
    fm = model()
    opt = torch.optim.SGD(fm.parameters(), lr=0.1, momentum=0.9)
    rec = Recorder(fm, stream(0), warmup_samples=10, every=3, start_step=1)
    calls: list[int] = []
    fold = fm.fold

    def counting(inputs: Any, delta: Any, **kw: Any) -> None:
        calls.append(len(inputs))
        fold(inputs, delta, **kw)

    fm.fold = counting  # type: ignore[method-assign]
    yielded = run(fm, opt, rec, range(9))
    assert rec.record.steps == [1, 4, 7]
    assert calls == [3, 1, 1]  # ceil(10 / 4) warm-up probes, then one per probe step
    assert rec.probes_used == 5 and rec.t == 9
    assert [m is not None for m in yielded] == [t in (1, 4, 7) for t in range(9)]
    assert all(
        isinstance(m, Measurement) and set(m.delta) == set(rec.record.names)
        for m in yielded
        if m is not None
    )


def test_other_steps_take_no_snapshot(monkeypatch: pytest.MonkeyPatch) -> None:
    fm = model()
    opt = torch.optim.Adam(fm.parameters(), lr=1e-2)
    rec = Recorder(fm, stream(0), warmup_samples=4, every=100)
    run(fm, opt, rec, range(1))
    clones: list[int] = []
    clone = Tensor.clone

    def counting(self: Tensor, *args: Any, **kw: Any) -> Tensor:
        clones.append(1)
        return clone(self, *args, **kw)

    monkeypatch.setattr(Tensor, "clone", counting)
    measured: list[int] = []
    monkeypatch.setattr(fm, "measure", lambda *a, **k: measured.append(1))
    with rec.step(opt) as m:
        opt.step()
    assert m is None and clones == [] and measured == []


def test_record_rows_metadata_and_schedule_ratio() -> None:
    fm = model()
    opt = torch.optim.Adam(fm.parameters(), lr=0.02)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.1)
    rec = Recorder(fm, stream(0), warmup_samples=4, every=2, scheduler=sched, meta={"seed": 3})
    run(fm, opt, rec, range(5), sched)
    r = rec.record
    assert r.steps == [0, 2, 4]
    assert r.sched == pytest.approx([1.0, 0.1, 0.01])
    assert r.lrs["0.weight"] == pytest.approx([0.02, 0.002, 0.0002])
    assert r.meta["base_lr"] == 0.02 and r.meta["optimizer"] == "Adam"
    assert r.meta["estimator"] == "kron" and r.meta["samples"] == 4 and r.meta["seed"] == 3
    assert r.meta["schedule"] == "StepLR" and r.shapes["0.weight"] == (10, 6)
    assert r.meta["grouping"] == "auto"
    assert all(v > 0 and math.isfinite(v) for vals in r.fslr.values() for v in vals)


def test_grouping_is_recorded_by_name(tmp_path: Path) -> None:
    def by_kernel(name: str, shape: tuple[int, ...]) -> None:
        return None

    net = nn.Sequential(nn.Conv1d(2, 3, 3), nn.Flatten(), nn.Linear(3 * 4, 2)).double()
    for grouping, stored in [
        ("dims", "dims"),
        (by_kernel, "callable:test_grouping_is_recorded_by_name.<locals>.by_kernel"),
    ]:
        assert grouping_meta(grouping) == stored
        fm = ff.with_fslr(net, samples=2, seed=1, grouping=grouping)
        rec = Recorder(fm, iter([torch.randn(4, 2, 6, dtype=torch.float64)]), warmup_samples=2)
        opt = torch.optim.SGD(fm.parameters(), lr=0.1)
        fm(torch.randn(4, 2, 6, dtype=torch.float64)).square().mean().backward()
        with rec.step(opt):
            opt.step()
        assert rec.record.meta["grouping"] == stored
        rec.record.save(tmp_path / "rec.json")  # stays JSON-able
        assert FSLRRecord.load(tmp_path / "rec.json").meta["grouping"] == stored


def test_ratio_without_scheduler_is_relative_to_base_lr() -> None:
    fm = model()
    opt = torch.optim.SGD(fm.parameters(), lr=0.1)
    rec = Recorder(fm, stream(0), warmup_samples=4, every=1)
    run(fm, opt, rec, range(1))
    opt.param_groups[0]["lr"] = 0.05  # a hand-made schedule
    run(fm, opt, rec, range(1, 2))
    assert rec.record.sched == [1.0, 0.5] and rec.record.meta["base_lr"] == 0.1


def test_resume_gives_the_uninterrupted_record() -> None:
    fm = model()
    opt = torch.optim.Adam(fm.parameters(), lr=1e-2)
    rec = Recorder(fm, stream(0), warmup_samples=8, every=2)
    run(fm, opt, rec, range(7))
    reference = rec.record

    fm = model()
    opt = torch.optim.Adam(fm.parameters(), lr=1e-2)
    rec = Recorder(fm, stream(0), warmup_samples=8, every=2)
    run(fm, opt, rec, range(3))
    saved = {"fm": fm.state_dict(), "opt": opt.state_dict(), "rec": rec.state_dict()}
    fm = model(seed=5)
    opt = torch.optim.Adam(fm.parameters(), lr=1e-2)
    rec = Recorder(fm, stream(0), warmup_samples=8, every=2)
    fm.load_state_dict(saved["fm"])
    opt.load_state_dict(saved["opt"])
    rec.load_state_dict(saved["rec"])
    run(fm, opt, rec, range(3, 7))
    assert rec.record == reference
    with pytest.raises(ValueError, match="version"):
        rec.load_state_dict({**saved["rec"], "version": 0})


def test_a_non_finite_probe_batch_is_left_out_and_the_record_goes_on() -> None:
    fm = model()
    opt = torch.optim.SGD(fm.parameters(), lr=0.1)
    rec = Recorder(fm, stream(0), warmup_samples=4, every=1)
    run(fm, opt, rec, range(1))
    fold = fm.fold

    def nan_batches(inputs: Any, delta: Any, **kw: Any) -> None:
        fold([torch.full_like(b, math.nan) for b in inputs], delta, **kw)

    fm.fold = nan_batches  # type: ignore[method-assign]
    with pytest.warns(RuntimeWarning, match=r"not finite.*step 1"):
        run(fm, opt, rec, range(1, 2))
    fm.fold = fold  # type: ignore[method-assign]
    run(fm, opt, rec, range(2, 3))
    assert rec.record.steps == [0, 1, 2]
    # The averages of every tensor the NaN reaches kept their values; the readout bias's
    # gradient does not depend on the inputs, so its probe stayed finite and was folded in.
    reached = ["0.weight", "0.bias", "2.weight"]
    assert [rec.record.at(1)[n] for n in reached] == [rec.record.at(0)[n] for n in reached]
    assert rec.record.at(1)["2.bias"] != rec.record.at(0)["2.bias"]
    assert rec.record.at(2) != rec.record.at(1)


def test_probe_batches_running_out_and_bad_options() -> None:
    fm = model()
    opt = torch.optim.SGD(fm.parameters(), lr=0.1)
    rec = Recorder(fm, iter([torch.randn(8, 6, dtype=torch.float64)]), warmup_samples=8)
    with pytest.raises(ValueError, match="ran out after 1 batches"):
        run(fm, opt, rec, range(1))
    bad: list[dict[str, Any]] = [{"warmup_samples": 0}, {"every": 0}, {"start_step": -1}]
    for kw in bad:
        with pytest.raises(ValueError, match=next(iter(kw))):
            Recorder(fm, stream(0), **kw)


def test_reiterable_probe_batches_are_cycled_with_a_note() -> None:
    """A DataLoader (or any re-iterable) is started again when it runs out, as curvlinops
    re-iterates its data; the batches then repeat, in the same order."""
    data = torch.utils.data.TensorDataset(torch.arange(3.0).reshape(3, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=1)
    feed = ProbeFeed(loader)
    with pytest.warns(RuntimeWarning, match="ran out after one pass"):
        drawn = feed.take(2) + feed.take(3)
    assert [float(b[0]) for b in drawn] == [0.0, 1.0, 2.0, 0.0, 1.0]
    resumed = ProbeFeed(loader)
    resumed.skip(4)
    with pytest.warns(RuntimeWarning, match="ran out"):
        assert float(resumed.take(1)[0][0]) == 1.0
    with pytest.raises(ValueError, match="empty"):
        ProbeFeed([]).take(1)


def test_a_dataloader_over_a_tensor_dataset_probes_like_its_tensors() -> None:
    """A DataLoader over ``TensorDataset(x)`` yields ``[x_batch]`` lists (default_collate turns
    tuples into lists): they are positional arguments, as the tensors themselves would be,
    not an error at the first probe."""
    probes = torch.randn(16, 6, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(probes), batch_size=8)
    records = []
    for source in (loader, [probes[:8], probes[8:]]):
        fm = model()
        opt = torch.optim.SGD(fm.parameters(), lr=0.1)
        rec = Recorder(fm, source, optimizer=opt, warmup_samples=8, every=1)
        run(fm, opt, rec, range(2))
        records.append(rec.record)
    assert records[0].steps == [0, 1]
    assert records[0].fslr == records[1].fslr


@pytest.mark.parametrize("loader", [False, True])
def test_an_empty_probe_source_is_refused_at_construction(loader: bool) -> None:
    empty: Any = []
    if loader:
        empty = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(0, 6)))
    fm = model()
    opt = torch.optim.SGD(fm.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="probe_batches is empty"):
        Recorder(fm, empty, optimizer=opt)


def test_drawing_probe_batches_leaves_the_global_rng_alone() -> None:
    """Each pass of a DataLoader draws a seed from the global RNG (a shuffling one its order
    too): drawn by the feed, that changed the training run's later dropout masks and shuffles,
    and a resumed run's differed from the uninterrupted one's (Trainer + GPT-2 dropout)."""
    data = torch.utils.data.TensorDataset(torch.arange(4.0).reshape(4, 1))
    for shuffle in (False, True):
        feed = ProbeFeed(torch.utils.data.DataLoader(data, batch_size=2, shuffle=shuffle))
        torch.manual_seed(0)
        before = torch.random.get_rng_state()
        with pytest.warns(RuntimeWarning, match="ran out"):
            feed.take(3)
        assert torch.equal(torch.random.get_rng_state(), before)


def test_recorder_and_flerm_take_the_optimizer_the_same_way() -> None:
    fm = model()
    opt = torch.optim.SGD(fm.parameters(), lr=0.1)
    other = torch.optim.SGD(fm.parameters(), lr=0.1)
    rec = Recorder(fm, stream(0), optimizer=opt, warmup_samples=8)
    with pytest.raises(ValueError, match="another optimiser"), rec.step(other):
        pass
    with pytest.raises(ValueError, match="needs the optimiser"), Recorder(fm, stream(0)).step():
        pass


def test_plan_and_feed() -> None:
    plan = ProbePlan.of(warmup_samples=40, samples=8, every=None, start_step=0)
    assert [plan.probes_at(t) for t in (0, 1, 100)] == [5, 0, 0]
    batches = [torch.full((1,), float(i)) for i in range(4)]
    feed = ProbeFeed(iter(batches))
    assert feed.take(4) == batches
    with pytest.raises(ValueError, match="ran out after 4"):
        feed.take(1)


def test_wrapping_without_a_seed_leaves_the_runs_own_random_draws_as_they_were() -> None:
    """``with_fslr`` without ``seed=`` drew its omega seed from the global RNG and advanced
    it: a Trainer callback that wraps the model after ``set_seed`` changed every dropout mask
    of the run it only meant to record, ``forward_seed`` or not."""
    net = nn.Linear(3, 2)
    torch.manual_seed(0)
    want = torch.rand(3)
    torch.manual_seed(0)
    first = ff.with_fslr(net, samples=2)
    assert torch.equal(torch.rand(3), want)
    torch.manual_seed(0)
    assert ff.with_fslr(net, samples=2).seed == first.seed  # still reproducible
    torch.set_default_device("meta")  # the CPU generator's draw, whatever the default device
    try:
        assert ff.with_fslr(net, samples=2).seed == first.seed
    finally:
        torch.set_default_device(None)
