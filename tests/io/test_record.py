"""FSLRRecord: JSON round trip, atomic save, load errors, seed averaging, lookup, append."""

from __future__ import annotations

import json
import math
import os
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fslr_func as ff
from fslr_func.io.atomic import _machine_tag, write_json
from fslr_func.io.record import FORMAT, META_KEYS, VERSION, FSLRRecord, optimizer_meta

SETTINGS = settings(max_examples=50, deadline=None)

finite = st.floats(min_value=0.0, max_value=1e6, allow_nan=False, allow_infinity=False)


@st.composite
def records(draw: st.DrawFn) -> FSLRRecord:
    names = draw(st.lists(st.text(min_size=1, max_size=12), min_size=1, max_size=5, unique=True))
    steps = sorted(draw(st.lists(st.integers(0, 10**6), min_size=0, max_size=6, unique=True)))
    n = len(steps)
    fslr = {k: draw(st.lists(finite | st.none(), min_size=n, max_size=n)) for k in names}
    lrs = (
        {k: draw(st.lists(finite, min_size=n, max_size=n)) for k in names}
        if draw(st.booleans())
        else {}
    )
    sched = draw(st.lists(finite, min_size=n, max_size=n))
    meta = {
        "base_lr": draw(st.none() | st.floats(1e-8, 10.0)),
        "seed": draw(st.integers(0, 100)),
        "shapes": {k: draw(st.lists(st.integers(1, 64), max_size=4)) for k in names},
        "extra": draw(st.dictionaries(st.text(max_size=5), st.integers(), max_size=3)),
    }
    return FSLRRecord(steps=steps, fslr=fslr, lrs=lrs, sched=sched, meta=meta)


def simple(values: list[float], seed: int = 0, steps: list[int] | None = None) -> FSLRRecord:
    steps = steps if steps is not None else list(range(0, 100 * len(values), 100))
    return FSLRRecord(
        steps=steps,
        fslr={"a": list(values), "b": [2 * v for v in values]},
        lrs={"a": [0.1] * len(values), "b": [0.2] * len(values)},
        sched=[1.0] * len(values),
        meta={"base_lr": 0.1, "seed": seed, "shapes": {"a": [3, 4], "b": [4]}},
    )


# ---------------------------------------------------------------------------------- construction


def test_defaults_fill_meta_and_sched() -> None:
    rec = FSLRRecord(steps=[0, 1], fslr={"w": [1.0, 2.0]})
    assert rec.sched == [1.0, 1.0]
    assert set(META_KEYS) <= set(rec.meta)
    # the running code's version, not an editable install's (possibly stale) metadata
    assert rec.meta["library_version"] == ff.__version__
    assert rec.names == ["w"] and len(rec) == 2 and rec.lrs == {}


def test_shapes_property_and_normalisation() -> None:
    rec = FSLRRecord(meta={"shapes": {"w": (3, 4), "b": torch.Size([4])}})
    assert rec.meta["shapes"] == {"w": [3, 4], "b": [4]}
    assert rec.shapes == {"w": (3, 4), "b": (4,)}


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"steps": [0, 0], "fslr": {"w": [1.0, 1.0]}}, "strictly increasing"),
        ({"steps": [1, 0], "fslr": {"w": [1.0, 1.0]}}, "strictly increasing"),
        ({"steps": [0, 1], "fslr": {"w": [1.0]}}, r"fslr\['w'\] has 1 values but the record has 2"),
        ({"steps": [0], "fslr": {"w": [math.nan]}}, "finite"),
        ({"steps": [0], "fslr": {"w": [-1.0]}}, ">= 0"),
        ({"steps": [0], "fslr": {"w": [1.0]}, "sched": [1.0, 1.0]}, "sched has 2 values"),
        ({"steps": [0], "fslr": {"w": [1.0]}, "lrs": {"w": [math.inf]}}, "finite"),
        ({"steps": [0.5], "fslr": {"w": [1.0]}}, r"steps row 0 is 0\.5: a step is an int"),
        ({"steps": [0], "fslr": {}}, "fslr is empty"),
    ],
)
def test_constructor_validation(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        FSLRRecord(**kwargs)


# ---------------------------------------------------------------------------------- save / load


@SETTINGS
@given(rec=records())
def test_save_load_round_trip(rec: FSLRRecord, tmp_path_factory: pytest.TempPathFactory) -> None:
    path = tmp_path_factory.mktemp("rt") / "rec.json"
    rec.save(path)
    back = FSLRRecord.load(path)
    assert back == rec
    assert back.names == rec.names  # order preserved
    data = json.loads(path.read_text())
    assert data["format"] == FORMAT and data["version"] == VERSION
    assert list(data)[:2] == ["format", "version"]


def test_save_overwrites_and_leaves_no_temp(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    simple([1.0]).save(path)
    simple([1.0, 2.0]).save(str(path))
    assert len(FSLRRecord.load(str(path))) == 2
    assert os.listdir(tmp_path) == ["r.json"]


@pytest.mark.parametrize("fail", ["replace", "fsync", "write"])
def test_atomic_save_crash_keeps_old_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fail: str
) -> None:
    path = tmp_path / "r.json"
    old = simple([1.0, 2.0])
    old.save(path)
    before = path.read_bytes()

    class Crash(RuntimeError):
        pass

    def boom(*args: object, **kwargs: object) -> None:
        raise Crash("simulated crash")

    if fail == "replace":
        monkeypatch.setattr(os, "replace", boom)
    elif fail == "fsync":
        monkeypatch.setattr(os, "fsync", boom)
    else:  # crash after part of the text went out
        real_fdopen = os.fdopen

        def fdopen(fd: int, *args: object, **kwargs: object):  # type: ignore[no-untyped-def]
            f = real_fdopen(fd, *args, **kwargs)  # type: ignore[call-overload]
            real_write = f.write

            def write(text: str) -> int:
                real_write(text[: len(text) // 2])
                f.flush()
                raise Crash("simulated crash mid-write")

            f.write = write
            return f

        monkeypatch.setattr(os, "fdopen", fdopen)

    with pytest.raises(Crash):
        simple([5.0, 6.0, 7.0]).save(path)
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert FSLRRecord.load(path) == old
    assert os.listdir(tmp_path) == ["r.json"]


@pytest.mark.parametrize("where", ["missing folder", "target is a folder", "parent is a file"])
def test_save_error_names_the_target_not_the_temp_file(tmp_path: Path, where: str) -> None:
    # issue 10: os.replace onto a folder reported ".r.json.k3j2.tmp -> r.json"
    if where == "missing folder":
        path = tmp_path / "nope" / "r.json"
    elif where == "target is a folder":
        path = tmp_path / "r.json"
        path.mkdir()
    else:
        (tmp_path / "file").write_text("x")
        path = tmp_path / "file" / "r.json"
    with pytest.raises(OSError) as info:
        simple([1.0]).save(path)
    assert str(info.value).count(str(path)) == 1 and ".tmp" not in str(info.value)
    if where != "missing folder":  # which parents=True would create
        with pytest.raises(OSError, match=f"cannot write '{path}'"):
            write_json(path, {}, parents=True)
    assert not list(tmp_path.rglob("*.tmp"))


def test_next_save_removes_temp_files_of_killed_writers(tmp_path: Path) -> None:
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    path = tmp_path / "r.json"
    killed = tmp_path / f".r.json.{dead}.a1b2.tmp"  # what a kill -9 mid-write leaves
    live = tmp_path / f".r.json.{os.getppid()}.c3d4.tmp"  # a concurrent writer's, in flight
    other = tmp_path / f".q.json.{dead}.e5f6.tmp"  # another target's: its own next save
    # a writer of "r.json.<digits>" (a numbered copy), in flight: its temporary name starts
    # with r.json's prefix, and the digits are not a pid
    extended = tmp_path / f".r.json.{dead}.{os.getppid()}.g7h8.tmp"
    # another machine's writers on a shared filesystem (NFS; another PID namespace): their
    # pids mean nothing here, so theirs are kept until they are an hour old
    foreign = "0" * 6 if _machine_tag() != "0" * 6 else "1" * 6
    elsewhere = tmp_path / f".r.json.{dead}.{foreign}12345678.tmp"
    stale = tmp_path / f".r.json.{dead}.{foreign}87654321.tmp"
    own = tmp_path / f".r.json.{dead}.{_machine_tag()}12345678.tmp"  # this machine's, dead
    for f in (killed, live, other, extended, elsewhere, stale, own):
        f.write_text("partial")
    two_hours_ago = time.time() - 7200
    os.utime(stale, (two_hours_ago, two_hours_ago))
    simple([1.0]).save(path)
    kept = [live.name, other.name, extended.name, elsewhere.name, "r.json"]
    assert sorted(os.listdir(tmp_path)) == sorted(kept)


def test_save_rejects_non_json_meta_without_touching_file(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    simple([1.0]).save(path)
    before = path.read_bytes()
    rec = simple([1.0])
    rec.meta["bad"] = object()
    with pytest.raises(ValueError, match=r"cannot save the record: meta\['bad'\].*must be JSON"):
        rec.save(path)
    # checked at construction too (it was accepted there and refused at the first save)
    for bad in (torch.tensor(1.0), {1, 2}, {3: "int key"}, [math.inf]):
        with pytest.raises(ValueError, match=r"meta\['bad'\] is .*must be JSON"):
            FSLRRecord(steps=[0], fslr={"a": [1.0]}, meta={"bad": bad})
    rec.meta["bad"] = math.nan
    with pytest.raises(ValueError, match=r"cannot save the record: meta\['bad'\] is nan"):
        rec.save(path)
    del rec.meta["bad"]
    rec.fslr["a"][0] = -1.0  # changed after construction
    with pytest.raises(ValueError, match=r"cannot save the record: fslr\['a'\] row 0"):
        rec.save(path)
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["r.json"]


def test_load_truncated(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    simple([1.0, 2.0, 3.0]).save(path)
    text = path.read_text()
    for cut in (0, 1, len(text) // 2, len(text) - 3):
        path.write_text(text[:cut])
        with pytest.raises(ValueError, match="damaged or truncated") as info:
            FSLRRecord.load(path)
        assert "r.json" in str(info.value) and "re-record" in str(info.value)
    path.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ValueError, match="not valid JSON"):
        FSLRRecord.load(path)


def _write(path: Path, data: object) -> Path:
    path.write_text(json.dumps(data))
    return path


def test_load_wrong_format(tmp_path: Path) -> None:
    data = simple([1.0]).to_dict()
    data["format"] = "something.else"
    with pytest.raises(ValueError, match=r"not an FSLRRecord.*'something.else'.*FSLRRecord.save"):
        FSLRRecord.load(_write(tmp_path / "a.json", data))
    with pytest.raises(ValueError, match=r"not an FSLRRecord.*expected a JSON object"):
        FSLRRecord.load(_write(tmp_path / "b.json", [1, 2, 3]))
    del data["format"]
    with pytest.raises(ValueError, match="not an FSLRRecord"):
        FSLRRecord.load(_write(tmp_path / "c.json", data))


def test_load_newer_or_bad_version(tmp_path: Path) -> None:
    data = simple([1.0]).to_dict()
    data["version"] = VERSION + 1
    with pytest.raises(ValueError, match=rf"version {VERSION + 1}.*upgrade fslr_func"):
        FSLRRecord.load(_write(tmp_path / "a.json", data))
    data["version"] = "1"
    with pytest.raises(ValueError, match="'version' must be an int"):
        FSLRRecord.load(_write(tmp_path / "b.json", data))
    data["version"] = 0
    with pytest.raises(ValueError, match="unknown FSLRRecord format version 0"):
        FSLRRecord.load(_write(tmp_path / "c.json", data))


def test_load_missing_or_invalid_fields(tmp_path: Path) -> None:
    data = simple([1.0, 2.0]).to_dict()
    del data["sched"], data["meta"]
    with pytest.raises(ValueError, match=r"damaged: missing fields \['sched', 'meta'\]"):
        FSLRRecord.load(_write(tmp_path / "a.json", data))
    data = simple([1.0, 2.0]).to_dict()
    data["fslr"]["a"] = [1.0]
    with pytest.raises(ValueError, match=r"damaged: fslr\['a'\] has 1 values"):
        FSLRRecord.load(_write(tmp_path / "b.json", data))


def test_load_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        FSLRRecord.load(tmp_path / "nope.json")


def test_load_refuses_what_is_not_a_regular_file_without_reading_or_waiting(
    tmp_path: Path,
) -> None:
    # a device would be read without end (/dev/zero) and a pipe with no writer waited on
    # for ever: both refused on the open file, before any read
    fifo = tmp_path / "record.json"
    os.mkfifo(fifo)
    for path in (tmp_path, fifo, Path("/dev/zero")):
        with pytest.raises(ValueError, match="not a regular file"):
            FSLRRecord.load(path)


# ---------------------------------------------------------------------------------- mean


@SETTINGS
@given(
    n_seeds=st.integers(1, 5),
    n_steps=st.integers(1, 5),
    data=st.data(),
)
def test_mean_is_elementwise_mean(n_seeds: int, n_steps: int, data: st.DataObject) -> None:
    recs = []
    for seed in range(n_seeds):
        values = data.draw(st.lists(finite, min_size=n_steps, max_size=n_steps))
        sched = data.draw(st.lists(finite, min_size=n_steps, max_size=n_steps))
        rec = simple(values, seed=seed)
        rec.sched = sched
        recs.append(rec)
    m = FSLRRecord.mean(iter(recs))  # any iterable
    assert m.steps == recs[0].steps
    assert m.names == ["a", "b"]
    for name in m.names:
        for i in range(n_steps):
            expect = sum(r.fslr[name][i] for r in recs) / n_seeds
            assert math.isclose(m.fslr[name][i], expect, rel_tol=1e-12, abs_tol=1e-300)
    for i in range(n_steps):
        expect = sum(r.sched[i] for r in recs) / n_seeds
        assert math.isclose(m.sched[i], expect, rel_tol=1e-12, abs_tol=1e-300)
    assert m.lrs == {"a": [0.1] * n_steps, "b": [0.2] * n_steps}
    assert m.meta["seed"] == list(range(n_seeds))
    assert m.meta["base_lr"] == 0.1 and m.shapes == recs[0].shapes


def test_mean_near_float_max_does_not_overflow() -> None:
    # issue 10: math.fsum raised OverflowError ("intermediate overflow in fsum")
    big = [1.7e308, 1.5e308, 1e-300, 1.79e308]
    recs = [FSLRRecord(steps=[0, 1], fslr={"w": [v, v / 2]}, sched=[v, 1.0]) for v in big]
    m = FSLRRecord.mean(recs)
    expect = sum(v / 4 for v in big)
    assert m.fslr["w"] == [pytest.approx(expect, rel=1e-15), pytest.approx(expect / 2, rel=1e-15)]
    assert m.sched == [pytest.approx(expect, rel=1e-15), 1.0]
    assert FSLRRecord.mean([simple([0.0]), simple([0.0])]).fslr["a"] == [0.0]


def _train_on(base_of: Callable[[list[str]], FSLRRecord], steps: int) -> tuple[Any, Any]:
    """FLeRM on a tiny MLP with Adam at 0.01 from ``base_of(tensor names)``, ``steps`` steps."""
    import fslr_func as ff

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    fm = ff.with_fslr(net, samples=4, seed=0)
    opt = torch.optim.Adam(fm.parameters(), lr=0.01)
    base = base_of([n for n, _ in net.named_parameters()])
    flerm = ff.FLeRM(fm, opt, base, probe_batches=[torch.randn(16, 4)], warmup_samples=4)
    x = torch.randn(16, 4)
    for _ in range(steps):
        opt.zero_grad()
        fm(x).square().mean().backward()
        with flerm.step():
            opt.step()
    return flerm, net


def test_flerm_with_absurd_base_fslr_holds_instead_of_overflowing_adam() -> None:
    # issue 10: a base FSLR of 1e300 gave a rate of ~1e298; Adam raised "value cannot be
    # converted to type float without overflow" (or wrote inf into the weights)
    def base(names: list[str]) -> FSLRRecord:
        fslr = {n: [1e300 if n == "0.weight" else 0.1] for n in names}
        return FSLRRecord(steps=[0], fslr=fslr, meta={"base_lr": 0.01, "sched_per_step": [1.0] * 2})

    with pytest.warns(RuntimeWarning, match=r"too large.*'0\.weight'"):
        flerm, net = _train_on(base, 2)
    assert flerm.history[0].held == ("0.weight",) and flerm.lrs()["0.weight"] == 0.01
    assert all(torch.isfinite(p).all() for p in net.parameters())


@pytest.mark.parametrize("field", ["sched", "sched_per_step"])
def test_flerm_with_absurd_schedule_ratio_holds_instead_of_overflowing(field: str) -> None:
    # A schedule ratio of 1e300 (valid in the schema) multiplied the matched ratio after the
    # overflow check: Adam raised "value cannot be converted to type float without overflow"
    # inside torch._foreach_lerp_ (1e30: inf and NaN in the weights, no warning)
    def base(names: list[str]) -> FSLRRecord:
        fslr = {n: [0.1] for n in names}
        if field == "sched":
            return FSLRRecord(steps=[0], fslr=fslr, sched=[1e300], meta={"base_lr": 0.01})
        meta = {"base_lr": 0.01, "sched_per_step": [1.0, 1e300, 1.0]}
        return FSLRRecord(steps=[0], fslr=fslr, meta=meta)

    with pytest.warns(RuntimeWarning, match=r"schedule ratio.*past the square root.*'0\.weight'"):
        _, net = _train_on(base, 3)
    assert all(torch.isfinite(p).all() for p in net.parameters())


def test_mean_refuses_a_seed_without_rows_and_averages_the_per_step_schedule() -> None:
    plan = {"every": 10, "warmup_samples": 8, "start_step": 0}
    a = FSLRRecord(steps=[0, 10], fslr={"w": [1.0, 2.0]}, meta={**plan, "seed": 0})
    empty = FSLRRecord(steps=[], fslr={"w": []}, meta={**plan, "seed": 1})
    for records in ([a, empty], [empty, a]):  # was: IndexError from the row lookup
        with pytest.raises(ValueError, match=r"has no rows and record \d has some: leave out"):
            FSLRRecord.mean(records)

    # the per-step schedule FLeRM follows was record 0's alone while sched was averaged;
    # feature gains were record 0's alone (or none) where another seed had none
    def rec(seed: int, per_step: list[float], **meta: Any) -> FSLRRecord:
        return FSLRRecord(
            steps=[0, 2], fslr={"w": [1.0, 1.0]}, sched=[per_step[0], per_step[2]],
            meta={"seed": seed, "schedule": "LambdaLR", "sched_per_step": per_step, **meta},
        )  # fmt: skip

    m = FSLRRecord.mean([rec(0, [1.0, 1.0, 1.0], feature_gain={"w": 4.0}), rec(1, [1.0, 0.5, 0.0])])
    assert m.sched == [1.0, 0.5] and m.meta["sched_per_step"] == [1.0, 0.75, 0.5]
    assert m.schedule_at(2) == m.sched[1]
    assert m.meta["feature_gain"] == {"w": 4.0}  # the mean of the seeds that recorded one
    m = FSLRRecord.mean([rec(0, [1.0, 0.5, 0.25]), rec(1, [1.0, 0.5, 0.25, 0.125, 0.0])])
    assert m.meta["sched_per_step"] == [1.0, 0.5, 0.25, 0.125, 0.0]  # a longer run's steps
    older = rec(1, [1.0, 0.5, 0.0])
    del older.meta["sched_per_step"]
    assert "sched_per_step" not in FSLRRecord.mean([rec(0, [1.0, 1.0, 1.0]), older]).meta


def test_mean_of_means_flattens_seeds_and_copies_meta() -> None:
    a = FSLRRecord.mean([simple([1.0], 0), simple([3.0], 1)])
    b = FSLRRecord.mean([a, simple([5.0], 2)])
    assert b.meta["seed"] == [0, 1, 2]
    a.meta["shapes"]["a"].append(9)
    assert b.meta["shapes"]["a"] == [3, 4]


def test_mean_of_seeds_whose_skipped_steps_moved_a_probe_is_taken_step_by_step() -> None:
    # Under a GradScaler each seed skips its own steps, and a Recorder moves a probe of a
    # skipped step to the next one: seeds of one run recorded different steps, and mean()
    # refused them ("different steps"). Records of one probe schedule are averaged on the
    # union of their steps, each seed read as FLeRM reads it (the row in force).
    plan = {"every": 3, "warmup_samples": 8, "start_step": 0}
    a = simple([1.0, 2.0, 3.0], 0, steps=[1, 3, 6])
    b = simple([10.0, 20.0, 30.0], 1, steps=[0, 4, 6])
    a.meta.update(plan)
    b.meta.update(plan)
    m = FSLRRecord.mean([a, b])
    assert m.steps == [0, 1, 3, 4, 6]
    assert m.fslr["a"] == [5.5, 5.5, 6.0, 11.0, 16.5]
    for t in range(8):
        assert m.at(t)["b"] == pytest.approx((a.at(t)["b"] + b.at(t)["b"]) / 2, rel=1e-12)
    assert m.lrs["b"] == [0.2] * 5 and m.meta["seed"] == [0, 1]
    b.meta["every"] = 2  # another probe schedule: different runs, still refused
    with pytest.raises(ValueError, match=r"different steps.*probe schedule"):
        FSLRRecord.mean([a, b])


def test_seeds_recorded_under_a_grad_scaler_that_skipped_different_steps_average() -> None:
    def record(seed: int, skipped: int) -> FSLRRecord:
        torch.manual_seed(seed)
        net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
        fm = ff.with_fslr(net, samples=4, seed=seed, strategy="loop")
        opt = torch.optim.Adam(fm.parameters(), lr=1e-2)
        scaler = torch.amp.GradScaler("cpu")
        probes = iter(torch.randn(20, 16, 4, generator=torch.Generator().manual_seed(seed)))
        rec = ff.Recorder(fm, probes, optimizer=opt, warmup_samples=8, every=3, meta={"seed": seed})
        for t in range(7):
            opt.zero_grad()
            x = torch.randn(16, 4)
            if t == skipped:
                x[0, 0] = math.inf
            scaler.scale(fm(x).square().mean()).backward()
            with rec.step():  # a skipped probed step warns that its probes move
                scaler.step(opt)
            scaler.update()
        return rec.record

    # a skipped step is no step, also in the with form: both seeds take 6 steps, probed at
    # the same ones (before, the skipped step was counted and their rows fell apart)
    a, b = record(0, skipped=0), record(1, skipped=3)
    assert a.steps == b.steps == [0, 3]
    m = FSLRRecord.mean([a, b])
    assert m.steps == [0, 3]
    for t in m.steps:
        for n in m.names:
            assert m.at(t)[n] == pytest.approx((a.at(t)[n] + b.at(t)[n]) / 2, rel=1e-12)


def test_mean_rejects_mismatches() -> None:
    base = simple([1.0, 2.0])
    other = simple([1.0, 2.0])
    other.fslr["c"] = other.fslr.pop("b")
    with pytest.raises(ValueError, match=r"different tensors.*\['b'\].*\['c'\]"):
        FSLRRecord.mean([base, other])
    with pytest.raises(ValueError, match=r"different steps.*\[100\].*\[50\]"):
        FSLRRecord.mean([base, simple([1.0, 2.0], steps=[0, 50])])
    other = simple([1.0, 2.0])
    other.meta["shapes"]["b"] = [5]
    with pytest.raises(ValueError, match=r"different shapes for tensors \['b'\]"):
        FSLRRecord.mean([base, other])
    other = simple([1.0, 2.0])
    other.lrs = {}
    with pytest.raises(ValueError, match="different lrs tensors"):
        FSLRRecord.mean([base, other])
    other = simple([1.0, 2.0])
    other.meta["base_lr"] = 0.2
    with pytest.raises(ValueError, match=r"different meta\['base_lr'\] \(0\.1 vs 0\.2\)"):
        FSLRRecord.mean([base, other])
    with pytest.raises(ValueError, match="at least one"):
        FSLRRecord.mean([])


# ---------------------------------------------------------------------------------- at


def test_at_lookup_semantics() -> None:
    rec = FSLRRecord(steps=[10, 20, 40], fslr={"w": [1.0, 2.0, 3.0]}, sched=[1.0, 0.5, 0.25])
    expect = {0: 1.0, 9: 1.0, 10: 1.0, 19: 1.0, 20: 2.0, 39: 2.0, 40: 3.0, 10**9: 3.0, -5: 1.0}
    for step, value in expect.items():
        assert rec.at(step) == {"w": value}
    assert [rec.sched_at(s) for s in (0, 20, 39, 41)] == [1.0, 0.5, 0.5, 0.25]
    out = rec.at(20)
    out["w"] = 99.0
    assert rec.fslr["w"][1] == 2.0  # a copy
    with pytest.raises(ValueError, match="empty"):
        FSLRRecord().at(0)
    with pytest.raises(ValueError, match="empty"):
        FSLRRecord().sched_at(0)


# ---------------------------------------------------------------------------------- append


def test_append_builds_record_and_accepts_tensors() -> None:
    rec = FSLRRecord()
    rec.append(0, {"w": torch.tensor(0.5), "b": 0.25}, lrs={"w": 1e-3, "b": 1e-3})
    rec.append(5, {"b": torch.tensor([0.2]), "w": 0.4}, lrs={"w": 1e-3, "b": 1e-3}, sched=0.5)
    assert rec.steps == [0, 5]
    assert rec.names == ["w", "b"]
    assert rec.fslr == {"w": [0.5, pytest.approx(0.4)], "b": [0.25, pytest.approx(0.2)]}
    assert all(type(v) is float for vs in rec.fslr.values() for v in vs)
    assert rec.sched == [1.0, 0.5]
    assert FSLRRecord(steps=rec.steps, fslr=rec.fslr, lrs=rec.lrs, sched=rec.sched) == FSLRRecord(
        steps=[0, 5], fslr=rec.fslr, lrs=rec.lrs, sched=[1.0, 0.5]
    )


def test_append_validation_leaves_record_unchanged() -> None:
    rec = FSLRRecord()
    rec.append(3, {"w": 1.0, "b": 2.0})
    snapshot = FSLRRecord(**{k: getattr(rec, k) for k in ("steps", "fslr", "lrs", "sched", "meta")})
    bad = [
        ((3, {"w": 1.0, "b": 2.0}), {}, "steps must increase"),
        ((2, {"w": 1.0, "b": 2.0}), {}, "steps must increase"),
        ((4, {"w": 1.0}), {}, r"missing \['b'\]"),
        ((4, {"w": 1.0, "b": 2.0, "c": 3.0}), {}, r"unexpected \['c'\]"),
        ((4, {"w": math.nan, "b": 2.0}), {}, r"fslr\['w'\] at step 4 is nan"),
        ((4, {"w": 1.0, "b": math.inf}), {}, r"fslr\['b'\] at step 4 is inf"),
        ((4, {"w": torch.tensor(float("nan")), "b": 1.0}), {}, "finite"),
        ((4, {"w": -1.0, "b": 1.0}), {}, ">= 0"),
        ((4, {"w": torch.ones(2), "b": 1.0}), {}, r"fslr\['w'\] at step 4 is tensor"),
        ((4, {"w": 1.0, "b": 1.0}), {"sched": math.nan}, "sched at step 4"),
        ((4, {"w": 1.0, "b": 1.0}), {"lrs": {"w": 1.0, "b": 1.0}}, "every row or none"),
        ((4, {}), {}, "empty"),
        ((4.0, {"w": 1.0, "b": 1.0}), {}, "step must be an int"),
    ]
    for args, kwargs, match in bad:
        with pytest.raises(ValueError, match=match):
            rec.append(*args, **kwargs)  # type: ignore[arg-type]
        assert rec == snapshot


def test_append_lrs_consistency() -> None:
    rec = FSLRRecord()
    rec.append(0, {"w": 1.0}, lrs={"w": 0.1})
    with pytest.raises(ValueError, match="earlier rows have lrs"):
        rec.append(1, {"w": 1.0})
    with pytest.raises(ValueError, match=r"lrs names differ.*missing \['w'\]"):
        rec.append(1, {"w": 1.0}, lrs={"v": 0.1})
    with pytest.raises(ValueError, match=r"lrs\['w'\] at step 1"):
        rec.append(1, {"w": 1.0}, lrs={"w": -0.1})
    assert len(rec) == 1


def test_append_respects_declared_names() -> None:
    rec = FSLRRecord(fslr={"w": [], "b": []})
    with pytest.raises(ValueError, match=r"missing \['b'\]"):
        rec.append(0, {"w": 1.0})
    rec.append(0, {"b": 1.0, "w": 2.0})
    assert rec.names == ["w", "b"] and rec.at(0) == {"w": 2.0, "b": 1.0}


def test_optimizer_meta_is_json_able() -> None:
    p = torch.zeros(3, requires_grad=True)
    opt = torch.optim.AdamW([p], lr=3e-4, betas=(0.8, 0.9), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 0.5)
    m = optimizer_meta(opt)
    assert m["optimizer"] == "AdamW"
    assert m["base_lr"] == pytest.approx(3e-4)  # initial_lr, not the scheduled 1.5e-4
    assert m["optimizer_hparams"]["betas"] == [0.8, 0.9]
    assert m["optimizer_hparams"]["weight_decay"] == 0.1
    json.dumps(m, allow_nan=False)
    rec = FSLRRecord(meta=m)
    assert rec.meta["optimizer"] == "AdamW"
    del sched


def test_what_a_user_analysing_records_met() -> None:
    # append took names the schema refuses ("" failed at the first save; 1 and "1" kept one)
    rec = FSLRRecord()
    for row in ({"": 0.5}, {1: 0.5, "1": 0.7}):
        with pytest.raises(ValueError, match="is no tensor name"):
            rec.append(0, row)  # type: ignore[dict-item]
    assert len(rec) == 0
    # a record without rows kept no tensor columns in its CSV
    from fslr_func.io.record_tables import csv_text

    empty = FSLRRecord(fslr={"w": [], "b": []}, lrs={"w": []})
    assert csv_text(empty).split() == ["step,sched,fslr/w,fslr/b,lr/w"]

    # record 0 leaving estimator null hid the conflict of the others
    def of(estimator: str | None, value: float, seed: int) -> FSLRRecord:
        meta = {"seed": seed, **({"estimator": estimator} if estimator else {})}
        return FSLRRecord(steps=[0], fslr={"w": [value]}, meta=meta)

    with pytest.raises(ValueError, match=r"record 2 vs record 1: different meta\['estimator'\]"):
        FSLRRecord.mean([of(None, 1.0, 0), of("kron", 3.0, 1), of("full", 8.0, 2)])
    # a mean of means counts every seed once (it weighted each record once: 5.0, not 4.0),
    # and takes the estimator record 0 left null from the others
    pair = FSLRRecord.mean([of(None, 1.0, 0), of("kron", 3.0, 1)])
    three = FSLRRecord.mean([pair, of("kron", 8.0, 2)])
    assert three.fslr["w"] == [4.0] and three.meta["seed"] == [0, 1, 2]
    assert pair.meta["estimator"] == "kron"
    # records built from one meta dict shared its nested dicts
    shared = {"cfg": {"width": 64}}
    a, b = (FSLRRecord(steps=[0], fslr={"w": [1.0]}, meta=shared) for _ in range(2))
    a.meta["cfg"]["width"] = 256
    assert b.meta["cfg"] == {"width": 64} and shared["cfg"] == {"width": 64}


@pytest.mark.parametrize("step", [math.nan, None, 2.0, "3", True])
def test_a_lookup_by_a_step_that_is_not_an_int_is_refused(step: Any) -> None:
    """A NaN step read as the last row (``bisect`` compares False), ``None`` raised a raw
    comparison error."""
    rec = FSLRRecord(steps=[0, 5], fslr={"w": [1.0, 2.0]}, sched=[1.0, 0.5])
    for lookup in (rec.at, rec.sched_at, rec.lrs_at, rec.past_end):
        with pytest.raises(TypeError, match="a step is an int"):
            lookup(step)


PLAN = {"every": 3, "warmup_samples": 8, "start_step": 0}  # one probe schedule


def test_the_mean_of_runs_that_ended_apart_warns() -> None:
    """A seed that stopped early (diverged, killed) had its last row carried to the longer
    seeds' later steps without a word."""
    long = FSLRRecord(steps=[0, 3, 6, 9], fslr={"w": [1.0, 2.0, 3.0, 4.0]},
                      meta={"seed": 0, "sched_per_step": [1.0] * 12, **PLAN})  # fmt: skip
    short = FSLRRecord(steps=[0, 3], fslr={"w": [1.0, 2.0]},
                       meta={"seed": 1, "sched_per_step": [1.0] * 6, **PLAN})  # fmt: skip
    with pytest.warns(RuntimeWarning, match=r"lasted \[6, 12\] steps"):
        FSLRRecord.mean([long, short])
    same = FSLRRecord(steps=[0, 3, 6, 9], fslr={"w": [2.0] * 4},
                      meta={"seed": 2, "sched_per_step": [1.0] * 12, **PLAN})  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert FSLRRecord.mean([long, same]).fslr["w"] == [1.5, 2.0, 2.5, 3.0]


def test_to_dict_is_a_copy_whose_edits_leave_the_record_alone() -> None:
    rec = FSLRRecord(steps=[0], fslr={"w": [1.0]}, meta={"seed": 0, "mine": {"a": [1]}})
    data = rec.to_dict()
    data["meta"]["seed"] = 9
    data["meta"]["mine"]["a"].append(2)
    data["fslr"]["w"][0] = 5.0
    assert rec.meta["seed"] == 0 and rec.meta["mine"] == {"a": [1]} and rec.fslr["w"] == [1.0]


def test_the_mean_of_seeds_a_scaler_shortened_by_a_few_steps_is_quiet() -> None:
    """A ``GradScaler``'s skipped steps do not advance a run: a seed with more skips has a
    shorter per-step schedule, but its rows are where the others' are."""
    one = FSLRRecord(steps=[0, 2, 4], fslr={"w": [1.0, 2.0, 3.0]},
                     meta={"seed": 0, "sched_per_step": [1.0] * 6, **PLAN})  # fmt: skip
    other = FSLRRecord(steps=[0, 2, 4], fslr={"w": [1.0, 2.0, 3.0]},
                       meta={"seed": 1, "sched_per_step": [1.0] * 5, **PLAN})  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        FSLRRecord.mean([one, other])


def test_numpy_numbers_set_in_meta_after_construction_save() -> None:
    np = pytest.importorskip("numpy")
    rec = FSLRRecord(steps=[0], fslr={"w": [1.0]}, meta={"seed": 0})
    rec.meta["seed"] = np.int64(4)
    rec.meta["mine"] = {"ratio": np.float32(0.5)}
    assert json.loads(json.dumps(rec.to_dict()))["meta"]["seed"] == 4
