"""The one place that knows what an :class:`~fslr_func.io.record.FSLRRecord` may hold.

A record is checked here when it is built, loaded, saved and averaged, and FLeRM and the
``fslr`` command read it through here: every field has a type, a range and a length, and a
value that breaks them is refused with a message that names the field, the row (and its
training step) and the fix. Nothing wrong loads.

Fields of a record with ``n`` rows (``docs/records.md`` has the full table):

- ``steps``: ``n`` ints ``>= 0``, strictly increasing.
- ``fslr``: tensor name -> ``n`` values, each a finite number ``>= 0`` or *unknown*
  (:data:`UNKNOWN`: ``None`` in memory, ``null`` in JSON). Unknown means the run could not
  measure that tensor at that row (it never had a finite probe: its warm-up probes were all
  NaN, or it never moved because its rate was 0); it is never written as 0.
- ``lrs``: tensor name (a subset of ``fslr``'s) -> ``n`` finite rates ``>= 0``; may be empty.
- ``sched``: ``n`` finite ratios ``>= 0``.
- ``meta``: a dict; the keys of :data:`META_SCHEMA` are checked (``base_lr`` a finite
  number ``> 0``, ``estimator`` one of the estimators, ``sched_per_step`` finite ratios
  ``>= 0``...), any other key is the user's.

On disk a record is JSON, ``{"format": FORMAT, "version": VERSION, "steps": ..., "fslr": ...,
"lrs": ..., "sched": ..., "meta": ...}``: ``NaN`` and ``Infinity`` are refused wherever they
are, naming the field (an unknown value is ``null``), and so is a key given twice. Version 1
(before unknown values existed) is read as is and written back as version 2; other versions are
refused, naming theirs.

Examples:
    >>> check_fslr({"w": [0.5, None]}, [0, 10])
    {'w': [0.5, None]}
    >>> check_fslr({"w": [0.5, -1.0]}, [0, 10])  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: fslr['w'] row 1 (step 10) is -1.0: an FSLR is a finite number >= 0 (null where ...
"""

from __future__ import annotations

import copy
import json
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from ..probe.names import short_list
from ..stats.estimator import ESTIMATORS

__all__ = [
    "FIELDS",
    "FORMAT",
    "META_SCHEMA",
    "SAME_META",
    "UNKNOWN",
    "VERSION",
    "Series",
    "check_compatible",
    "check_document",
    "check_fslr",
    "check_lrs",
    "check_meta",
    "check_number",
    "check_sched",
    "check_steps",
    "check_value",
    "parse_json",
    "plain",
]

FORMAT = "fslr_func.FSLRRecord"
"""Value of the ``"format"`` key of a saved record."""

VERSION = 2
"""Newest file format version this module reads and the one it writes (2: unknown FSLRs are
``null``; 1: every FSLR a number)."""

FIELDS = ("steps", "fslr", "lrs", "sched", "meta")
"""The fields of a saved record besides ``format`` and ``version``."""

UNKNOWN = None
"""How a record marks an FSLR the run could not measure (``null`` in JSON)."""

_FIX = "re-record the run or correct that entry"


def _is_int(x: object) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _number(x: object) -> float | None:
    """``float(x)`` for an int or float that is finite (bool, str, NaN, Inf: ``None``)."""
    if isinstance(x, bool) or not isinstance(x, (numbers.Real)):
        return None
    try:
        value = float(x)
    except (OverflowError, TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def _at(field: str, i: int, steps: Sequence[int] | None) -> str:
    """``field row i (step s)``: where a value sits, for messages."""
    step = f" (step {steps[i]})" if steps is not None and i < len(steps) else ""
    return f"{field} row {i}{step}"


def check_steps(steps: object) -> list[int]:
    """``steps`` as a list of ints ``>= 0``, strictly increasing.

    Examples:
        >>> check_steps([0, 10, 5])  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: steps row 2 is 5 after 10: steps must be strictly increasing; re-record the ...
    """
    if not isinstance(steps, (list, tuple)):
        raise ValueError(
            f"steps must be a list of training steps (ints), got {type(steps).__name__}"
        )
    out: list[int] = []
    for i, s in enumerate(steps):
        if not _is_int(s) or int(s) < 0:
            raise ValueError(f"steps row {i} is {s!r}: a step is an int >= 0; {_FIX}")
        if out and int(s) <= out[-1]:
            raise ValueError(
                f"steps row {i} is {s!r} after {out[-1]}: steps must be strictly increasing; {_FIX}"
            )
        out.append(int(s))
    return out


def check_number(value: object, where: str, what: str) -> float:
    """A finite number ``>= 0`` (a one-element tensor too); ``where`` and ``what`` name it in
    the error.

    Examples:
        >>> check_number("0.5", "sched at step 3", "a schedule ratio")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: sched at step 3 is '0.5': a schedule ratio is a finite number >= 0; ...
    """
    x = _as_number(value)
    if x is None or x < 0:
        raise ValueError(f"{where} is {value!r}: {what} is a finite number >= 0; {_FIX}")
    return x


def check_value(value: object, where: str, what: str) -> float | None:
    """An FSLR: :func:`check_number`, or ``None`` (unknown).

    Examples:
        >>> check_value(None, "fslr['w'] at step 0", "an FSLR") is None
        True
    """
    if value is None:
        return None
    x = _as_number(value)
    if x is None or x < 0:
        raise ValueError(
            f"{where} is {value!r}: {what} is a finite number >= 0 (null where the run could "
            f"not measure it); {_FIX}"
        )
    return x


def _values(
    values: object, field: str, steps: Sequence[int], what: str, *, unknown: bool
) -> list[float | None]:
    if not isinstance(values, (list, tuple)):
        raise ValueError(
            f"{field} must be a list with one value per step, got {type(values).__name__}"
        )
    if len(values) != len(steps):
        raise ValueError(
            f"{field} has {len(values)} values but the record has {len(steps)} steps: every "
            f"series has one value per step; {_FIX}"
        )
    check = check_value if unknown else check_number
    return [check(v, _at(field, i, steps), what) for i, v in enumerate(values)]


def _as_number(v: object) -> float | None:
    """A finite float from a number or a one-element tensor (``None`` if it is neither)."""
    x = _number(v)
    if x is None and not isinstance(v, (str, bytes, bool, type(None), numbers.Number)):
        item = getattr(v, "item", None)  # torch / numpy scalars
        if callable(item):
            try:
                x = _number(item())
            except (RuntimeError, ValueError):  # a tensor of more than one element
                return None
    return x


def _table(
    table: object, field: str, steps: Sequence[int], what: str, *, unknown: bool
) -> dict[str, list[float | None]]:
    if not isinstance(table, Mapping):
        raise ValueError(
            f"{field} must map tensor names to lists of values, got {type(table).__name__}"
        )
    out: dict[str, list[float | None]] = {}
    for name, values in table.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"{field} has the key {name!r}: keys are tensor names (str)")
        out[name] = _values(values, f"{field}[{name!r}]", steps, what, unknown=unknown)
    return out


def check_fslr(fslr: object, steps: Sequence[int]) -> dict[str, list[float | None]]:
    """``fslr`` validated: tensor name -> one value per step, finite ``>= 0`` or ``None``."""
    out = _table(fslr, "fslr", steps, "an FSLR", unknown=True)
    if steps and not out:
        raise ValueError(
            f"fslr is empty but the record has {len(steps)} steps: give the FSLRs of every "
            "trainable tensor"
        )
    return out


def check_lrs(lrs: object, steps: Sequence[int], names: Sequence[str]) -> dict[str, list[float]]:
    """``lrs`` validated: tensor name (one of ``names``) -> one finite rate ``>= 0`` per step.

    Examples:
        >>> check_lrs({"v": [0.1]}, [0], ["w"])  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: lrs has tensors ['v'] that fslr lacks: lrs holds the rates of recorded ...
    """
    out = _table(lrs, "lrs", steps, "a learning rate", unknown=False)
    extra = [n for n in out if n not in set(names)]
    if extra:
        raise ValueError(
            f"lrs has tensors {short_list(extra)} that fslr lacks: lrs holds the rates of "
            f"recorded tensors only; {_FIX}"
        )
    return {n: [float(v) for v in vs if v is not None] for n, vs in out.items()}


def check_sched(sched: object, steps: Sequence[int]) -> list[float]:
    """``sched`` validated (``None`` or ``[]``: ``1.0`` at every step)."""
    if sched is None or (isinstance(sched, (list, tuple)) and not sched):
        return [1.0] * len(steps)
    values = _values(sched, "sched", steps, "a schedule ratio lr(t) / lr(0)", unknown=False)
    return [float(v) for v in values if v is not None]


# ---------------------------------------------------------------------- meta


def _optional(check: Callable[[object], bool]) -> Callable[[object], bool]:
    return lambda v: v is None or check(v)


def _positive_number(v: object) -> bool:
    x = _number(v)
    return x is not None and x > 0


def _int_at_least(low: int) -> Callable[[object], bool]:
    return lambda v: _is_int(v) and int(v) >= low  # type: ignore[call-overload]


def _seed(v: object) -> bool:
    return v is None or _is_int(v) or (isinstance(v, list) and all(_seed(s) for s in v))


def _shapes(v: object) -> bool:
    return isinstance(v, Mapping) and all(
        isinstance(k, str)
        and isinstance(s, (list, tuple))
        and all(_is_int(d) and int(d) >= 0 for d in s)
        for k, s in v.items()
    )


def _ratios(v: object) -> bool:
    return isinstance(v, (list, tuple)) and all((x := _number(r)) is not None and x >= 0 for r in v)


def _beta(v: object) -> bool:
    x = _number(v)
    return x is not None and 0 <= x < 1


def _str(v: object) -> bool:
    return isinstance(v, str)


def _json_value(v: object) -> bool:
    """``v`` is JSON: ``None``, a bool, an int, a finite float (JSON has no NaN or infinity),
    a str, or lists (tuples) and str-keyed dicts of those: a user's meta entry, checked at
    construction rather than at the first save."""
    if v is None or isinstance(v, (bool, str)) or _is_int(v):
        return True
    if isinstance(v, numbers.Real):  # a float, a NumPy float
        return math.isfinite(float(v))
    if isinstance(v, Mapping):
        return all(isinstance(k, str) and _json_value(x) for k, x in v.items())
    if isinstance(v, (list, tuple)):
        return all(_json_value(x) for x in v)
    return False


META_SCHEMA: dict[str, tuple[Callable[[object], bool], str]] = {
    "base_lr": (_optional(_positive_number), "a finite number > 0 (lr_0), or null"),
    "optimizer": (_optional(_str), "the optimiser's class name, or null"),
    "optimizer_hparams": (
        lambda v: isinstance(v, Mapping) and _json_value(v),
        "a dict of JSON values (finite numbers: no NaN or Infinity)",
    ),
    "estimator": (_optional(lambda v: v in ESTIMATORS), f"one of {list(ESTIMATORS)}, or null"),
    "grouping": (_optional(_str), "a grouping name or 'callable:<name>', or null"),
    "beta": (_optional(_beta), "a number in [0, 1), or null"),
    "samples": (_optional(_int_at_least(1)), "an int >= 1, or null"),
    "seed": (_seed, "an int, a list of ints (a mean), or null"),
    "shapes": (_shapes, "a dict of tensor name -> list of ints >= 0"),
    "model": (_optional(_str), "a class name, or null"),
    "library_version": (_str, "a version string"),
    "schedule": (_optional(_str), "a scheduler's class name, or null"),
    "sched_per_step": (_ratios, "a list of finite ratios >= 0, one per training step"),
    "sched_groups_differ_at": (
        _optional(_int_at_least(0)),
        "the first step at which the param groups' schedules differed (an int >= 0), or null",
    ),
    "every": (_optional(_int_at_least(1)), "an int >= 1, or null"),
    "warmup_samples": (_optional(_int_at_least(1)), "an int >= 1, or null"),
    "start_step": (_optional(_int_at_least(0)), "an int >= 0, or null"),
}
"""Meta key -> (check, what it must be). Other keys are the user's and pass as they are."""


def check_meta(meta: object) -> dict[str, Any]:
    """A copy of ``meta`` whose :data:`META_SCHEMA` keys are checked (``shapes`` as lists).

    Examples:
        >>> check_meta({"base_lr": float("nan")})  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: meta['base_lr'] is nan: it must be a finite number > 0 (lr_0), or null; ...
    """
    if not isinstance(meta, Mapping):
        raise ValueError(f"meta must be a dict, got {type(meta).__name__}")
    out = copy.deepcopy(dict(meta))  # a record owns its meta: nested dicts are not shared
    for key, value in out.items():
        check, what = META_SCHEMA.get(
            key,
            (
                _json_value,
                "JSON: str, finite numbers (not NaN or Infinity), bool, null, lists, dicts "
                "with str keys",
            ),
        )
        if not check(value):
            raise ValueError(f"meta[{key!r}] is {value!r}: it must be {what}; {_FIX}")
    # plain Python values: a NumPy number passes the checks but not json.dumps or
    # torch.load(weights_only=True); sched_per_step's ratios are floats, an int among them too
    out = {k: plain(v) for k, v in out.items()}
    if "sched_per_step" in out:
        out["sched_per_step"] = [float(r) for r in out["sched_per_step"]]
    return out


def plain(v: Any) -> Any:
    """``v`` with NumPy (or any ``numbers``) ints and floats as Python's, tuples as lists.

    Examples:
        >>> from fractions import Fraction  # a numbers.Real, as NumPy's floats are
        >>> plain({"seed": (3,), "lr": Fraction(1, 2), "on": True})
        {'seed': [3], 'lr': 0.5, 'on': True}
    """
    if isinstance(v, bool) or v is None or isinstance(v, str):
        return v
    if _is_int(v):
        return int(v)
    if isinstance(v, numbers.Real):
        return float(v)
    if isinstance(v, Mapping):
        return {k: plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [plain(x) for x in v]
    return v


# ---------------------------------------------------------------------- documents


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"the key {key!r} appears twice in one object; keep one of them")
        out[key] = value
    return out


def parse_json(raw: bytes, source: str) -> Any:
    """JSON with no key given twice; errors name ``source``.

    ``NaN`` and ``Infinity`` (not JSON, but what a careless writer leaves) are read as
    floats, so that the schema refuses them naming the field and the row.

    Examples:
        >>> parse_json(b'{"a": 1, "a": 2}', "'r.json'")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: 'r.json' is damaged: the key 'a' appears twice in one object; keep one ...
    """
    try:
        text = raw.decode("utf-8-sig")  # a byte-order mark, as some editors save, is no damage
    except UnicodeDecodeError as err:
        raise ValueError(
            f"{source} is damaged: it is not valid JSON (not UTF-8 text: {err}); pass a file "
            "written by FSLRRecord.save"
        ) from err
    try:
        return json.loads(text, object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as err:
        raise ValueError(
            f"{source} is damaged or truncated: it is not valid JSON ({err}); it may have been "
            "cut short or copied incompletely: re-record it or restore it from a backup"
        ) from err
    except (ValueError, RecursionError) as err:
        raise ValueError(f"{source} is damaged: {err}") from err


def _migrate(data: Mapping[str, Any], version: int) -> dict[str, Any]:
    """A document of ``version`` as the current version has it (1 -> 2: the same fields;
    version 1 had no unknown values)."""
    return {**data, "version": VERSION} if version == 1 else dict(data)


def check_document(data: Any, source: str, newest: str) -> dict[str, Any]:
    """The fields of a saved record (format and version checked, older versions migrated).

    Args:
        data: the parsed JSON document.
        source: the document's origin, for messages.
        newest: the installed library's version, named when a record is too new.

    Raises:
        ValueError: not an FSLRRecord, another version, a missing field.
    """
    if not isinstance(data, Mapping):
        raise ValueError(
            f"{source} is not an FSLRRecord: expected a JSON object, got {type(data).__name__}"
        )
    fmt = data.get("format")
    if fmt != FORMAT:
        raise ValueError(
            f"{source} is not an FSLRRecord: its 'format' is {fmt!r}, expected {FORMAT!r}; "
            "pass a file written by FSLRRecord.save"
        )
    version: Any = data.get("version")
    if not _is_int(version):
        raise ValueError(f"{source}: 'version' must be an int, got {version!r}")
    if version > VERSION:
        raise ValueError(
            f"{source} has FSLRRecord format version {version}, but this fslr_func ({newest}) "
            f"reads versions 1 to {VERSION}: upgrade fslr_func"
        )
    if version < 1:
        raise ValueError(
            f"{source} has an unknown FSLRRecord format version {version}: versions 1 to "
            f"{VERSION} exist; re-record it"
        )
    doc = _migrate(data, version)
    missing = [k for k in FIELDS if k not in doc]
    if missing:
        raise ValueError(
            f"{source} is damaged: missing fields {missing}; a version-{VERSION} record has "
            f"{list(FIELDS)}: re-record it or restore it from a backup"
        )
    extra = [k for k in doc if k not in (*FIELDS, "format", "version")]
    if extra:
        raise ValueError(
            f"{source} has fields {extra} that no FSLRRecord version has: put your own "
            "entries in 'meta'"
        )
    return {k: doc[k] for k in FIELDS}


# ---------------------------------------------------------------------- means

SAME_META = ("estimator", "grouping", "optimizer", "base_lr", "model", "schedule")
"""Meta keys records must share to be averaged (``None``: not recorded, matches anything)."""

PROBE_PLAN = ("every", "warmup_samples", "start_step")
"""Meta keys of a Recorder's probe schedule: records that share them planned the same probe
steps, and differ in steps only where a step that changed no weight (skipped by a
``GradScaler``) moved a probe to the next step."""


def same_probe_plan(a: Series, b: Series) -> bool:
    """Whether two records were probed on the same schedule (:data:`PROBE_PLAN`, recorded
    in both)."""
    return all(
        a.meta.get(key) is not None and a.meta.get(key) == b.meta.get(key) for key in PROBE_PLAN
    )


class Series(Protocol):
    """The parts of a record :func:`check_compatible` reads."""

    @property
    def steps(self) -> Sequence[int]: ...

    @property
    def fslr(self) -> Mapping[str, object]: ...

    @property
    def lrs(self) -> Mapping[str, object]: ...

    @property
    def meta(self) -> Mapping[str, Any]: ...


def check_compatible(records: Sequence[Series]) -> None:
    """Refuse to average records of different runs: the message names what differs.

    Records averaged over seeds must have the same tensors, shapes and lrs tensors, and the
    same ``estimator``, ``grouping`` (not for ``exact`` values, which it does not enter),
    ``optimizer``, ``base_lr``, ``model`` and ``schedule`` where both record them. Their steps
    must be the same too, unless both were recorded on the same probe schedule
    (:func:`same_probe_plan`): a skipped step moves a probe, and such records are averaged step
    by step (:func:`~fslr_func.io.record_mean.seed_mean`).

    Raises:
        ValueError: no records, or the first difference between record ``k`` and record 0.
    """
    if not records:
        raise ValueError("FSLRRecord.mean needs at least one record")
    first = records[0]
    for k, rec in enumerate(records[1:], start=1):
        where = f"record {k} vs record 0"
        for field in ("fslr", "lrs"):
            mine, theirs = getattr(first, field), getattr(rec, field)
            if set(mine) != set(theirs):
                what = "tensors" if field == "fslr" else "lrs tensors"
                raise ValueError(
                    f"{where}: different {what}: only in record 0: "
                    f"{short_list(n for n in mine if n not in theirs)}; only in record {k}: "
                    f"{short_list(n for n in theirs if n not in mine)}"
                )
        if not rec.steps or not first.steps:
            if rec.steps or first.steps:
                empty, full = (k, 0) if not rec.steps else (0, k)
                raise ValueError(
                    f"{where}: record {empty} has no rows and record {full} has some: leave "
                    "out the seeds that recorded nothing (a mean needs every seed's rows)"
                )
        elif rec.steps != first.steps and not same_probe_plan(first, rec):
            only0 = sorted(set(first.steps) - set(rec.steps))
            onlyk = sorted(set(rec.steps) - set(first.steps))
            raise ValueError(
                f"{where}: different steps: only in record 0: {only0[:10]}; only in record {k}: "
                f"{onlyk[:10]} (record 0 has {len(first.steps)} steps, record {k} has "
                f"{len(rec.steps)}), and they do not record one probe schedule "
                f"(meta {list(PROBE_PLAN)}), under which steps moved by a skipped step are "
                "averaged"
            )
        shapes0, shapesk = first.meta.get("shapes") or {}, rec.meta.get("shapes") or {}
        diff = sorted(n for n in {*shapes0, *shapesk} if shapes0.get(n) != shapesk.get(n))
        if diff:
            raise ValueError(f"{where}: different shapes for tensors {short_list(diff)}")
    exact = all(r.meta.get("estimator") == "exact" for r in records)
    for key in SAME_META:  # against the first record that gives one (null matches any)
        if key == "grouping" and exact:  # exact values do not depend on the grouping
            continue
        given = [(k, r.meta.get(key)) for k, r in enumerate(records) if r.meta.get(key) is not None]
        for k, b in given[1:]:
            j, a = given[0]
            if a != b:
                raise ValueError(
                    f"record {k} vs record {j}: different meta[{key!r}] ({a!r} vs {b!r}): "
                    "average the seeds of one configuration only (FSLRs of different "
                    "estimators, groupings, optimisers, learning rates, models or schedules are "
                    "different quantities)"
                )
