"""Property tests of the record schema (issue 21): any record that loads round-trips exactly,
and any mutation of a valid record's fields either loads to the same meaning or is refused
with a message naming the field."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fslr_func.io.record import FSLRRecord
from fslr_func.io.record_meta import default_meta
from fslr_func.io.record_schema import FIELDS, VERSION
from fslr_func.stats.estimator import ESTIMATORS

finite = st.floats(min_value=0.0, max_value=1e300, allow_nan=False, allow_infinity=False)
json_scalars = st.none() | st.booleans() | st.integers(-(10**6), 10**6) | st.text(max_size=4)


def _nested(inner: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3)


json_values = st.recursive(json_scalars | finite, _nested, max_leaves=6)
# what a hand edit can leave: anything JSON-like, NaN, Infinity and huge integers included
hostile = st.one_of(
    st.none(),
    st.floats(),
    json_scalars,
    st.integers(-(10**400), 10**400),
    st.recursive(json_scalars | st.floats(), _nested, max_leaves=4),
)


@st.composite
def records(draw: st.DrawFn, min_steps: int = 0) -> FSLRRecord:
    names = draw(st.lists(st.text(min_size=1, max_size=6), min_size=1, max_size=4, unique=True))
    steps = sorted(
        draw(st.lists(st.integers(0, 10**9), min_size=min_steps, max_size=5, unique=True))
    )
    n = len(steps)
    column = st.lists(finite | st.none(), min_size=n, max_size=n)
    rates = st.lists(finite, min_size=n, max_size=n)
    meta = {
        "base_lr": draw(st.none() | st.floats(1e-12, 1e3)),
        "estimator": draw(st.none() | st.sampled_from(ESTIMATORS)),
        "grouping": draw(st.none() | st.sampled_from(["auto", "callable:mine"])),
        "samples": draw(st.none() | st.integers(1, 64)),
        "seed": draw(st.none() | st.integers(0, 99) | st.lists(st.integers(0, 99), max_size=3)),
        "shapes": {k: draw(st.lists(st.integers(0, 9), max_size=3)) for k in names},
        "sched_per_step": draw(st.lists(finite, max_size=4)),
        "every": draw(st.none() | st.integers(1, 100)),
        "user": draw(json_values),
    }
    return FSLRRecord(
        steps=steps,
        fslr={k: draw(column) for k in names},
        lrs={k: draw(rates) for k in names} if draw(st.booleans()) else {},
        sched=draw(rates),
        meta=meta,
    )


@given(rec=records())
def test_any_record_that_loads_round_trips_exactly(
    tmp_path_factory: pytest.TempPathFactory, rec: FSLRRecord
) -> None:
    path = tmp_path_factory.getbasetemp() / "round_trip.json"
    rec.save(path)
    text = path.read_bytes()
    back = FSLRRecord.load(path)
    assert back == rec and back.names == rec.names
    back.save(path)
    assert path.read_bytes() == text  # byte for byte


def _paths(doc: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every place in a document: keys of objects, indices of lists, recursively."""
    out: list[tuple[Any, ...]] = [prefix] if prefix else []
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += _paths(v, (*prefix, i))
    return out


def _same(a: Any, b: Any) -> bool:
    """Same meaning: numbers by value (1 == 1.0, never True == 1), the rest structurally."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return float(a) == float(b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


def _meaning(doc: dict[str, Any]) -> dict[str, Any]:
    """What a document says, with the documented defaults: ``sched`` [] or null is 1 at every
    step; missing meta keys take their defaults; ``shapes`` null is {}."""
    out = {k: doc[k] for k in FIELDS}
    if out["sched"] in (None, []):
        out["sched"] = [1.0] * len(out["steps"])
    meta = default_meta()
    meta.update(out["meta"])
    if meta["shapes"] is None:
        meta["shapes"] = {}
    out["meta"] = meta
    return out


def _assert_usable(rec: FSLRRecord) -> None:
    """What FLeRM and the plots rely on, checked independently of the schema's code."""

    def number(x: object) -> bool:
        return type(x) is float and math.isfinite(x) and x >= 0

    n = len(rec.steps)
    assert all(type(s) is int and s >= 0 for s in rec.steps)
    assert all(a < b for a, b in zip(rec.steps, rec.steps[1:], strict=False))
    assert all(len(v) == n and all(x is None or number(x) for x in v) for v in rec.fslr.values())
    assert all(len(v) == n and all(number(x) for x in v) for v in rec.lrs.values())
    assert set(rec.lrs) <= set(rec.fslr) and len(rec.sched) == n
    assert all(number(x) for x in [*rec.sched, *rec.meta.get("sched_per_step", [])])
    lr = rec.meta["base_lr"]
    assert lr is None or (type(lr) in (int, float) and math.isfinite(lr) and lr > 0)
    assert json.loads(json.dumps(rec.to_dict(), allow_nan=False)) is not None  # saveable


def _named(path: tuple[Any, ...], deleted: bool) -> list[str]:
    """What a refusal of a mutation at ``path`` must name: the field, and the tensor or meta
    key whose value changed (a deleted tensor is gone: the field is named)."""
    top = str(path[0])
    if top in ("fslr", "lrs", "meta") and len(path) >= 2 and not (deleted and len(path) == 2):
        return [top, repr(path[1])]
    return [top]


@given(rec=records(min_steps=1), data=st.data())
def test_any_mutation_loads_to_the_same_meaning_or_is_refused_naming_the_field(
    tmp_path_factory: pytest.TempPathFactory, rec: FSLRRecord, data: st.DataObject
) -> None:
    path = tmp_path_factory.getbasetemp() / "mutated.json"
    original = json.loads(json.dumps(rec.to_dict()))
    # format and version: test_older_and_newer_versions; half the edits hit a value of a series
    paths = [p for p in _paths(original) if p[0] not in ("format", "version")]
    values = [p for p in paths if isinstance(p[-1], int) and p[0] != "meta"]
    places = st.sampled_from(paths) | (st.sampled_from(values) if values else st.nothing())
    for _ in range(16):  # sixteen hand edits of each record
        where = data.draw(places)
        delete = data.draw(st.booleans())
        value = None if delete else data.draw(hostile)
        doc = json.loads(json.dumps(original))
        parent = doc
        for key in where[:-1]:
            parent = parent[key]
        if delete:
            del parent[where[-1]]
        else:
            parent[where[-1]] = value
        path.write_text(json.dumps(doc))  # NaN and Infinity written as a careless tool would
        try:
            back = FSLRRecord.load(path)
        except ValueError as err:
            message = str(err)
            assert all(name in message for name in _named(where, delete)), (where, message)
            assert "Traceback" not in message and "\n" not in message
            continue
        _assert_usable(back)
        got = back.to_dict()
        assert got["version"] == VERSION
        assert _same({k: got[k] for k in FIELDS}, _meaning(doc)), (where, value)


def test_older_and_newer_versions(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    doc = FSLRRecord(steps=[0, 5], fslr={"w": [0.5, 0.25]}).to_dict()
    path.write_text(json.dumps({**doc, "version": 1}))  # version 1 had no unknown values
    assert FSLRRecord.load(path) == FSLRRecord.from_dict(doc)
    for version in (0, -3, VERSION + 1):
        path.write_text(json.dumps({**doc, "version": version}))
        with pytest.raises(ValueError, match=rf"version {version}"):
            FSLRRecord.load(path)


def test_nan_and_duplicate_keys_are_refused_naming_where(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    doc = FSLRRecord(steps=[0, 5], fslr={"w": [0.5, 0.25]}, sched=[1.0, 0.5]).to_dict()
    for field, value, named in [
        ("sched", [1.0, math.nan], r"sched row 1 \(step 5\) is nan"),
        ("sched", [None, 1.0], r"sched row 0 \(step 0\) is None"),
        ("lrs", {"w": [0.1, None]}, r"lrs\['w'\] row 1 \(step 5\) is None"),
        ("steps", [0, 5.0], r"steps row 1 is 5\.0: a step is an int"),
        ("sched", [1.0, -0.5], r"sched row 1 \(step 5\) is -0\.5"),
        ("sched", [1.0, "0.5"], r"sched row 1 \(step 5\) is '0\.5'"),
        ("fslr", {"w": [math.inf, 1.0]}, r"fslr\['w'\] row 0 \(step 0\) is inf"),
        ("meta", {"sched_per_step": [1.0, math.nan]}, r"meta\['sched_per_step'\]"),
        ("meta", {"base_lr": -1}, r"meta\['base_lr'\] is -1"),
        ("meta", {"estimator": "kronecker"}, r"meta\['estimator'\] is 'kronecker'.*'kron'"),
        ("meta", {"mine": {"x": math.nan}}, r"meta\['mine'\].*not NaN"),
        ("meta", {"optimizer_hparams": {"eps": math.inf}}, r"meta\['optimizer_hparams'\].*NaN"),
    ]:
        path.write_text(json.dumps({**doc, field: value}))
        with pytest.raises(ValueError, match=named):
            FSLRRecord.load(path)
    path.write_text(json.dumps(doc).replace('"fslr": {"w"', '"fslr": {"w": [1, 1], "w"'))
    with pytest.raises(ValueError, match="the key 'w' appears twice"):
        FSLRRecord.load(path)


def test_mean_refuses_records_of_other_estimators_groupings_and_optimisers() -> None:
    def rec(**meta: Any) -> FSLRRecord:
        return FSLRRecord(steps=[0], fslr={"w": [1.0]}, meta={"base_lr": 0.1, **meta})

    for key, a, b in [
        ("estimator", "kron", "iid"),
        ("grouping", "auto", "matrix"),
        ("optimizer", "Adam", "SGD"),
        ("model", "ResMLP", "Transformer"),
        ("schedule", None, None),
    ]:
        if a is None:
            continue
        with pytest.raises(ValueError, match=rf"different meta\['{key}'\] \('{a}' vs '{b}'\)"):
            FSLRRecord.mean([rec(**{key: a}), rec(**{key: b})])
    mean = FSLRRecord.mean([rec(estimator="kron"), rec()])  # not recorded: matches anything
    assert mean.meta["estimator"] == "kron"


def test_numpy_numbers_in_meta_become_python_numbers(tmp_path: Path) -> None:
    """``Recorder(..., meta={"seed": seed})`` in a loop over ``np.arange`` passed the checks,
    then failed at the end of the run: ``save`` ("int64 is not JSON serializable"), FLeRM
    (which hashes the record as JSON) and ``torch.load(weights_only=True)`` of a state
    holding it."""
    np = pytest.importorskip("numpy")
    meta = {
        "seed": np.int64(3),
        "samples": np.int32(4),
        "every": np.int64(2),
        "base_lr": np.float32(0.5),
        "beta": np.float64(0.9),
        "mine": {"widths": (np.int64(32), np.int64(64)), "ratio": np.float32(0.25)},
    }
    rec = FSLRRecord(steps=[0], fslr={"w": [1.0]}, meta=meta)
    assert rec.meta["seed"] == 3 and type(rec.meta["seed"]) is int
    assert type(rec.meta["base_lr"]) is float and type(rec.meta["samples"]) is int
    assert rec.meta["mine"] == {"widths": [32, 64], "ratio": 0.25}
    path = tmp_path / "r.json"
    rec.save(path)
    assert FSLRRecord.load(path) == rec
    state = tmp_path / "state.pt"
    torch.save({"record": rec.to_dict()}, state)
    assert FSLRRecord.from_dict(torch.load(state, weights_only=True)["record"]) == rec


def test_a_record_saved_with_a_utf8_byte_order_mark_loads(tmp_path: Path) -> None:
    """An editor saving "UTF-8 with BOM" made a whole record read as damaged or truncated."""
    rec = FSLRRecord(steps=[0, 5], fslr={"w": [1.0, 2.0]}, meta={"base_lr": 0.1})
    path = tmp_path / "base.json"
    rec.save(path)
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    assert FSLRRecord.load(path) == rec
