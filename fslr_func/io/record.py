"""FSLR time series of a training run: :class:`FSLRRecord`.

A record holds, for every trainable tensor ``W`` of a (base) model, its function-space learning
rate ``FSLR_W(t) = ||Delta_W f||_RMS`` measured at training steps ``t_0 < t_1 < ...`` with a
unit learning rate (see ``DESIGN.md``), together with the learning rates in force, the
scheduler's ratio ``sched(t) = lr(t) / lr(0)`` and the metadata needed to reuse it (base learning
rate ``lr_0``, optimiser, estimator, shapes...). FLeRM reads it back to set the learning rates of
a scaled model::

    lr_W(t) = lr_0 * sched(t) * FSLR_base_W(t) / FSLR_W(t)

The paper averages the base FSLRs over 8 seeds: :meth:`FSLRRecord.mean` does that.

On disk a record is one versioned JSON document, written atomically::

    {"format": "fslr_func.FSLRRecord", "version": 1,
     "steps": [...], "fslr": {name: [...]}, "lrs": {name: [...]}, "sched": [...], "meta": {...}}

Examples:
    >>> import os, tempfile
    >>> rec = FSLRRecord(meta={"base_lr": 1e-3, "seed": 0})
    >>> rec.append(0, {"w": 0.5, "b": 0.25})
    >>> rec.append(100, {"w": 0.4, "b": 0.2}, sched=0.5)
    >>> rec.at(50), rec.sched_at(150)
    ({'w': 0.5, 'b': 0.25}, 0.5)
    >>> with tempfile.TemporaryDirectory() as d:
    ...     rec.save(os.path.join(d, "base.json"))
    ...     FSLRRecord.load(os.path.join(d, "base.json")) == rec
    True
"""

from __future__ import annotations

import bisect
import copy
import csv
import io
import json
import math
import numbers
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, SupportsFloat

from ..probe.names import short_list
from .atomic import atomic_write_text
from .record_meta import META_KEYS, default_meta, grouping_meta, library_version, optimizer_meta

__all__ = ["FORMAT", "META_KEYS", "VERSION", "FSLRRecord", "grouping_meta", "optimizer_meta"]

FORMAT = "fslr_func.FSLRRecord"
"""Value of the ``"format"`` key of a saved record."""

VERSION = 1
"""Newest file format version this module reads and the one it writes."""

_FIELDS = ("steps", "fslr", "lrs", "sched", "meta")


def _is_int(x: object) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _as_float(value: object, what: str, *, nonneg: bool) -> float:
    """``float(value)`` for a number or one-element tensor; ValueError if not finite (or < 0)."""
    if isinstance(value, (str, bytes, bool)) or value is None:
        raise ValueError(f"{what} must be a number, got {value!r}")
    try:
        x = float(value)  # type: ignore[arg-type]  # anything float() takes; the rest raises below
    except (TypeError, ValueError, RuntimeError) as err:
        raise ValueError(f"{what} must be a number or a one-element tensor, got {value!r}") from err
    if not math.isfinite(x):
        raise ValueError(f"{what} is {x}: only finite values can be recorded")
    if nonneg and x < 0:
        raise ValueError(f"{what} is {x}: it must be >= 0")
    return x


def _float_list(values: object, what: str, n: int, *, nonneg: bool) -> list[float]:
    if not isinstance(values, (list, tuple)):
        raise ValueError(f"{what} must be a list of numbers, got {type(values).__name__}")
    if len(values) != n:
        raise ValueError(f"{what} has {len(values)} values but there are {n} steps")
    return [_as_float(v, f"{what}[{i}]", nonneg=nonneg) for i, v in enumerate(values)]


def _series(table: object, what: str, n: int, *, nonneg: bool) -> dict[str, list[float]]:
    if not isinstance(table, Mapping):
        raise ValueError(f"{what} must map tensor names to lists, got {type(table).__name__}")
    out: dict[str, list[float]] = {}
    for name, values in table.items():
        if not isinstance(name, str):
            raise ValueError(f"{what} keys must be tensor names (str), got {name!r}")
        out[name] = _float_list(values, f"{what}[{name!r}]", n, nonneg=nonneg)
    return out


@dataclass
class FSLRRecord:
    """FSLR time series of one training run, or the mean over seeds.

    Row ``i`` holds the estimates taken at training step ``steps[i]``: ``fslr[name][i]`` is
    ``||Delta_W f||_RMS`` of tensor ``name`` for a unit learning rate, ``lrs[name][i]`` the
    learning rate in force (optional), ``sched[i] = lr(t) / lr(0)`` of the base run.

    Construction validates and copies everything: ``steps`` strictly increasing integers; every
    series as long as ``steps``; all values finite, FSLRs and learning rates ``>= 0``. A missing
    ``sched`` defaults to ``1.0`` at every step; missing :data:`META_KEYS` are filled with
    defaults (``library_version`` from the installed package). ``meta`` must be JSON-able to be
    saved and round-trips as JSON (tuples come back as lists; ``shapes`` are stored as lists).

    Attributes:
        steps: training steps at which estimates were taken, strictly increasing.
        fslr: tensor name -> FSLR at each step (names in ``named_parameters()`` order).
        lrs: tensor name -> learning rate in force at each step; may be empty.
        sched: scheduler ratio ``current_lr / initial_lr`` of the base run at each step.
        meta: ``base_lr``, ``optimizer``, ``optimizer_hparams``, ``estimator``, ``beta``,
            ``samples``, ``seed`` (int, or list of ints for a mean), ``shapes``
            (name -> list[int]), ``model``, ``library_version``, ``schedule`` and any other
            JSON-able entries.

    Examples:
        >>> rec = FSLRRecord(steps=[0, 10], fslr={"w": [1.0, 2.0]}, meta={"seed": 3})
        >>> len(rec), rec.names, rec.sched, rec.meta["seed"]
        (2, ['w'], [1.0, 1.0], 3)
    """

    steps: list[int] = field(default_factory=list)
    fslr: dict[str, list[float]] = field(default_factory=dict)
    lrs: dict[str, list[float]] = field(default_factory=dict)
    sched: list[float] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.steps, (list, tuple)):
            raise ValueError(f"steps must be a list of ints, got {type(self.steps).__name__}")
        for i, s in enumerate(self.steps):
            if not _is_int(s):
                raise ValueError(f"steps[{i}] must be an int, got {s!r}")
        steps = [int(s) for s in self.steps]
        for i in range(1, len(steps)):
            if steps[i] <= steps[i - 1]:
                raise ValueError(
                    f"steps must be strictly increasing, but steps[{i - 1}] = {steps[i - 1]} "
                    f"and steps[{i}] = {steps[i]}"
                )
        n = len(steps)
        fslr = _series(self.fslr, "fslr", n, nonneg=True)
        if n and not fslr:
            raise ValueError(f"the record has {n} steps but no tensors in fslr")
        lrs = _series(self.lrs, "lrs", n, nonneg=True)
        if self.sched is None or (isinstance(self.sched, (list, tuple)) and not self.sched):
            sched = [1.0] * n
        else:
            sched = _float_list(self.sched, "sched", n, nonneg=True)
        if not isinstance(self.meta, Mapping):
            raise ValueError(f"meta must be a dict, got {type(self.meta).__name__}")
        meta = default_meta()
        meta.update(self.meta)
        shapes = meta["shapes"] if meta["shapes"] is not None else {}
        if not isinstance(shapes, Mapping):
            raise ValueError(f"meta['shapes'] must map names to shapes, got {shapes!r}")
        try:
            meta["shapes"] = {str(k): [int(d) for d in v] for k, v in shapes.items()}
        except (TypeError, ValueError) as err:
            raise ValueError(f"meta['shapes'] must map names to lists of ints: {err}") from err
        self.steps, self.fslr, self.lrs, self.sched, self.meta = steps, fslr, lrs, sched, meta

    # ------------------------------------------------------------------ accessors

    @property
    def names(self) -> list[str]:
        """Tensor names, in recording (``named_parameters()``) order."""
        return list(self.fslr)

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Tensor name -> shape, from ``meta["shapes"]`` (empty if not recorded)."""
        return {k: tuple(v) for k, v in self.meta["shapes"].items()}

    def __len__(self) -> int:
        return len(self.steps)

    def _row(self, step: int) -> int:
        """Index of the latest recorded step ``<= step`` (0 before the first one)."""
        if not self.steps:
            raise ValueError("the record is empty: nothing was recorded yet")
        return max(bisect.bisect_right(self.steps, step) - 1, 0)

    def at(self, step: int) -> dict[str, float]:
        """FSLRs in force at ``step``: those of the latest recorded step ``<= step``.

        A step before the first recorded step gets the first record (the estimates of step 0
        are the best guess for the very start of training). Raises ValueError if the record is
        empty.

        Examples:
            >>> rec = FSLRRecord(steps=[10, 20], fslr={"w": [1.0, 2.0]})
            >>> rec.at(0), rec.at(19), rec.at(20), rec.at(10**9)
            ({'w': 1.0}, {'w': 1.0}, {'w': 2.0}, {'w': 2.0})
        """
        i = self._row(step)
        return {name: values[i] for name, values in self.fslr.items()}

    def sched_at(self, step: int) -> float:
        """Scheduler ratio ``lr(t) / lr(0)`` in force at ``step`` (same lookup as :meth:`at`).

        Examples:
            >>> FSLRRecord(steps=[0, 5], fslr={"w": [1.0, 1.0]}, sched=[1.0, 0.1]).sched_at(7)
            0.1
        """
        return self.sched[self._row(step)]

    def lrs_at(self, step: int) -> dict[str, float]:
        """Learning rates in force at ``step`` (same lookup as :meth:`at`); empty without ``lrs``.

        Examples:
            >>> rec = FSLRRecord(steps=[0, 5], fslr={"w": [1.0, 1.0]}, lrs={"w": [0.1, 0.01]})
            >>> rec.lrs_at(3), rec.lrs_at(5), FSLRRecord(steps=[0], fslr={"w": [1.0]}).lrs_at(0)
            ({'w': 0.1}, {'w': 0.01}, {})
        """
        i = self._row(step)
        return {name: values[i] for name, values in self.lrs.items()}

    # ------------------------------------------------------------------ building

    def append(
        self,
        step: int,
        fslr: Mapping[str, SupportsFloat],
        lrs: Mapping[str, SupportsFloat] | None = None,
        sched: SupportsFloat = 1.0,
    ) -> None:
        """Add the estimates of one training step.

        Args:
            step: training step; must be greater than the last recorded one.
            fslr: tensor name -> FSLR (float or one-element tensor, finite, ``>= 0``). Once the
                record has tensor names, exactly those names must be given.
            lrs: tensor name -> learning rate in force; give it on every row or on none.
            sched: scheduler ratio ``lr(t) / lr(0)`` of the run at this step.

        Raises:
            ValueError: on a non-increasing step, different tensor names, or a non-finite or
                negative value. The record is left unchanged.
        """
        if not _is_int(step):
            raise ValueError(f"step must be an int, got {step!r}")
        step = int(step)
        if self.steps and step <= self.steps[-1]:
            raise ValueError(
                f"steps must increase: step {step} comes after recorded step {self.steps[-1]}"
            )
        if not fslr:
            raise ValueError("fslr is empty: give the FSLR of every trainable tensor")
        if self.fslr:
            _check_names(self.fslr, fslr, "fslr")
        row = {
            str(k): _as_float(v, f"fslr[{k!r}] at step {step}", nonneg=True)
            for k, v in fslr.items()
        }
        lr_row: dict[str, float] = {}
        if lrs is not None:
            if self.steps and not self.lrs:
                raise ValueError(
                    "earlier rows were appended without lrs: give lrs on every row or none"
                )
            if self.lrs:
                _check_names(self.lrs, lrs, "lrs")
            lr_row = {
                str(k): _as_float(v, f"lrs[{k!r}] at step {step}", nonneg=True)
                for k, v in lrs.items()
            }
        elif self.lrs:
            raise ValueError("earlier rows have lrs: give lrs on every row or none")
        s = _as_float(sched, f"sched at step {step}", nonneg=True)

        self.steps.append(step)
        for name in self.fslr if self.fslr else row:
            self.fslr.setdefault(name, []).append(row[name])
        for name in self.lrs if self.lrs else lr_row:
            self.lrs.setdefault(name, []).append(lr_row[name])
        self.sched.append(s)

    @classmethod
    def mean(cls, records: Iterable[FSLRRecord]) -> FSLRRecord:
        """Average records of the same run over seeds (the paper averages 8 seeds).

        ``fslr``, ``lrs`` and ``sched`` are arithmetic means, step by step:
        ``FSLR_W(t) = (1/S) sum_s FSLR_W^(s)(t)``, computed in log space (:func:`_mean`), so
        the mean of any finite values is finite. ``meta`` is the first record's, with ``seed``
        the list of all seeds (lists of seeds of earlier means are flattened).

        Raises:
            ValueError: if there are no records, or they differ in tensor names, steps, shapes,
                lrs names or ``base_lr`` (the message names what differs).

        Examples:
            >>> a = FSLRRecord(steps=[0], fslr={"w": [1.0]}, meta={"seed": 0})
            >>> b = FSLRRecord(steps=[0], fslr={"w": [3.0]}, meta={"seed": 1})
            >>> m = FSLRRecord.mean([a, b])
            >>> m.fslr, m.meta["seed"]
            ({'w': [2.0]}, [0, 1])
        """
        recs = list(records)
        if not recs:
            raise ValueError("FSLRRecord.mean needs at least one record")
        first = recs[0]
        for k, rec in enumerate(recs[1:], start=1):
            where = f"record {k} vs record 0"
            if set(rec.fslr) != set(first.fslr):
                raise ValueError(
                    f"{where}: different tensors: only in record 0: "
                    f"{short_list(n for n in first.fslr if n not in rec.fslr)}; "
                    f"only in record {k}: {short_list(n for n in rec.fslr if n not in first.fslr)}"
                )
            if rec.steps != first.steps:
                only0 = sorted(set(first.steps) - set(rec.steps))
                onlyk = sorted(set(rec.steps) - set(first.steps))
                raise ValueError(
                    f"{where}: different steps: only in record 0: {only0[:10]}; only in "
                    f"record {k}: {onlyk[:10]} (record 0 has {len(first.steps)} steps, "
                    f"record {k} has {len(rec.steps)})"
                )
            if rec.shapes != first.shapes:
                diff = sorted(
                    n
                    for n in set(rec.shapes) | set(first.shapes)
                    if rec.shapes.get(n) != first.shapes.get(n)
                )
                raise ValueError(f"{where}: different shapes for tensors {short_list(diff)}")
            if set(rec.lrs) != set(first.lrs):
                raise ValueError(
                    f"{where}: different lrs tensors: only in record 0: "
                    f"{short_list(n for n in first.lrs if n not in rec.lrs)}; "
                    f"only in record {k}: {short_list(n for n in rec.lrs if n not in first.lrs)}"
                )
            lr0, lrk = first.meta.get("base_lr"), rec.meta.get("base_lr")
            if lr0 is not None and lrk is not None and lr0 != lrk:
                raise ValueError(
                    f"{where}: different base_lr ({lr0} vs {lrk}): average seeds of one "
                    "learning rate only"
                )

        def avg(columns: list[list[float]]) -> list[float]:
            return [_mean(vals) for vals in zip(*columns, strict=True)]

        seeds: list[Any] = []
        for rec in recs:
            seed = rec.meta.get("seed")
            seeds.extend(seed if isinstance(seed, list) else [seed])
        meta = copy.deepcopy(first.meta)
        meta["seed"] = seeds
        return cls(
            steps=list(first.steps),
            fslr={name: avg([r.fslr[name] for r in recs]) for name in first.fslr},
            lrs={name: avg([r.lrs[name] for r in recs]) for name in first.lrs},
            sched=avg([r.sched for r in recs]),
            meta=meta,
        )

    # ------------------------------------------------------------------ (de)serialisation

    def to_dict(self) -> dict[str, Any]:
        """The JSON document :meth:`save` writes (``format`` and ``version`` first)."""
        return {
            "format": FORMAT,
            "version": VERSION,
            "steps": list(self.steps),
            "fslr": {k: list(v) for k, v in self.fslr.items()},
            "lrs": {k: list(v) for k, v in self.lrs.items()},
            "sched": list(self.sched),
            "meta": self.meta,
        }

    @classmethod
    def from_dict(cls, data: Any, *, source: str = "the data") -> FSLRRecord:
        """Inverse of :meth:`to_dict`; ``source`` names the origin in error messages.

        Raises:
            ValueError: wrong ``format``, unsupported ``version``, missing or invalid fields.
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
                f"{source} has FSLRRecord format version {version}, but this fslr_func "
                f"({library_version()}) reads versions up to {VERSION}: upgrade fslr_func"
            )
        if version < 1:
            raise ValueError(f"{source} has an unknown FSLRRecord format version {version}")
        missing = [k for k in _FIELDS if k not in data]
        if missing:
            raise ValueError(
                f"{source} is damaged: missing fields {missing}; a version-{VERSION} record has "
                f"{list(_FIELDS)}: re-record it or restore it from a backup"
            )
        try:
            return cls(**{k: data[k] for k in _FIELDS})
        except ValueError as err:
            raise ValueError(f"{source} is damaged: {err}") from err

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the record as versioned JSON, atomically.

        The document is serialised first (so a non-JSON-able ``meta`` raises before the file
        is touched), written to a temporary file in the same directory, flushed and fsynced,
        then moved over ``path`` with :func:`os.replace`. A crash mid-write leaves either the
        old file or the new one, never a truncated file.

        Raises:
            ValueError: if ``meta`` holds something JSON cannot represent.
        """
        try:
            text = json.dumps(self.to_dict(), allow_nan=False)
        except (TypeError, ValueError) as err:
            raise ValueError(
                f"cannot save the record: meta must be JSON-able (str, numbers, bool, None, "
                f"lists, dicts with str keys): {err}"
            ) from err
        atomic_write_text(path, text + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> FSLRRecord:
        """Read a record written by :meth:`save`.

        Raises:
            FileNotFoundError: if there is no such file.
            ValueError: if the file is damaged or truncated (not valid JSON, missing or invalid
                fields), is not an FSLRRecord, or was written by a newer fslr_func.
        """
        path = os.fspath(path)
        with open(path, "rb") as f:
            raw = f.read()
        try:
            data = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ValueError(
                f"{path!r} is damaged or truncated: it is not valid JSON ({err}); it may have "
                "been cut short or copied incompletely: re-record it or restore it from a backup"
            ) from err
        return cls.from_dict(data, source=repr(path))

    # ------------------------------------------------------------------ schedule and export

    def schedule_at(self, step: int) -> float:
        """The base run's schedule ratio at any ``step``, continuous (never a staircase).

        A :class:`~fslr_func.training.recorder.Recorder` stores the ratio at every training step in
        ``meta["sched_per_step"]`` (index = step): that value, exactly. Between and beyond
        what is stored, ``sched`` is interpolated linearly between recorded rows and held
        after the last one.

        Examples:
            >>> rec = FSLRRecord(steps=[0, 10], fslr={"w": [1.0, 1.0]}, sched=[1.0, 0.5])
            >>> rec.schedule_at(4), rec.schedule_at(20)
            (0.8, 0.5)
            >>> rec.meta["sched_per_step"] = [0.0, 0.25]
            >>> rec.schedule_at(1)
            0.25
        """
        per_step = self.meta.get("sched_per_step") or []
        if 0 <= step < len(per_step):
            return float(per_step[step])
        i = self._row(step)
        if step <= self.steps[i] or i + 1 == len(self.steps):
            return self.sched[i]
        t0, t1 = self.steps[i], self.steps[i + 1]
        w = (step - t0) / (t1 - t0)
        return (1 - w) * self.sched[i] + w * self.sched[i + 1]

    def to_rows(self) -> list[dict[str, float]]:
        """One flat dict per recorded step: ``step``, ``sched``, ``fslr/<name>``, ``lr/<name>``.

        Examples:
            >>> FSLRRecord(steps=[0], fslr={"w": [0.5]}, lrs={"w": [0.1]}).to_rows()
            [{'step': 0, 'sched': 1.0, 'fslr/w': 0.5, 'lr/w': 0.1}]
        """
        return [
            {
                "step": step,
                "sched": self.sched[i],
                **{f"fslr/{n}": v[i] for n, v in self.fslr.items()},
                **{f"lr/{n}": v[i] for n, v in self.lrs.items()},
            }
            for i, step in enumerate(self.steps)
        ]

    def to_csv(self, path: str | os.PathLike[str]) -> None:
        """Write :meth:`to_rows` as CSV (a header row, then one row per step), atomically.

        Examples:
            >>> import os, tempfile
            >>> with tempfile.TemporaryDirectory() as d:
            ...     FSLRRecord(steps=[0], fslr={"w": [0.5]}).to_csv(os.path.join(d, "r.csv"))
            ...     print(open(os.path.join(d, "r.csv")).read().split())
            ['step,sched,fslr/w', '0,1.0,0.5']
        """
        rows = self.to_rows()
        out = io.StringIO()
        writer = csv.DictWriter(out, fieldnames=list(rows[0]) if rows else ["step", "sched"])
        writer.writeheader()
        writer.writerows(rows)
        atomic_write_text(path, out.getvalue())

    def to_pandas(self) -> Any:
        """:meth:`to_rows` as a ``pandas.DataFrame`` indexed by ``step``.

        Raises:
            ImportError: pandas is not installed (``pip install pandas``).
        """
        try:
            import pandas as pd
        except ImportError as err:
            raise ImportError(
                "FSLRRecord.to_pandas needs pandas: pip install pandas (or use to_rows/to_csv)"
            ) from err
        return pd.DataFrame(self.to_rows()).set_index("step")


def _mean(values: Sequence[float]) -> float:
    r"""Arithmetic mean of finite values ``>= 0`` that cannot overflow.

    The sum is taken in log space, ``log sum_i v_i = log m + log sum_i (v_i / m)`` with
    ``m = max_i v_i`` (log-sum-exp), and the mean is ``m * ((1/n) sum_i v_i / m)``: every term
    and partial sum is at most ``n``, so values near the float maximum average to a finite
    number where ``math.fsum`` raises ``OverflowError``. Equal values (typical for ``lrs`` and
    ``sched``) come back exactly.

    Examples:
        >>> _mean([1.0, 3.0]), _mean([0.1, 0.1, 0.1]), _mean([0.0, 0.0])
        (2.0, 0.1, 0.0)
        >>> _mean([1.7e308, 1.5e308])
        1.6e+308
    """
    if values.count(values[0]) == len(values):  # all zero included
        return values[0]
    m = max(values)
    return m * (math.fsum(v / m for v in values) / len(values))


def _check_names(have: Mapping[str, object], given: Mapping[str, object], what: str) -> None:
    missing = [n for n in have if n not in given]
    extra = [n for n in given if n not in have]
    if missing or extra:
        raise ValueError(
            f"{what} names differ from the recorded ones: missing {short_list(missing)}, "
            f"unexpected {short_list(extra)}"
        )
