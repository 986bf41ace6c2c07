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

    {"format": "fslr_func.FSLRRecord", "version": 2,
     "steps": [...], "fslr": {name: [...]}, "lrs": {name: [...]}, "sched": [...], "meta": {...}}

Every field is checked when a record is built, loaded, saved or averaged
(:mod:`fslr_func.io.record_schema`, the one place that knows the schema). An FSLR the run could not
measure (no finite probe yet, or a tensor that never moved) is *unknown*: ``None`` in memory,
``null`` in JSON, never 0; lookups refuse it unless the caller picks a fallback.

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

import json
import numbers
import os
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..probe.names import short_list
from . import record_schema as schema
from .atomic import atomic_write_text
from .record_lookup import Fallback, Lookups
from .record_mean import seed_mean
from .record_meta import META_KEYS, default_meta, grouping_meta, library_version, optimizer_meta
from .record_schema import FORMAT, UNKNOWN, VERSION, plain
from .record_tables import csv_text, data_frame, table_rows

__all__ = [
    "FORMAT",
    "META_KEYS",
    "UNKNOWN",
    "VERSION",
    "FSLRRecord",
    "Fallback",
    "grouping_meta",
    "optimizer_meta",
]


@dataclass
class FSLRRecord(Lookups):
    """FSLR time series of one training run, or the mean over seeds.

    Row ``i`` holds the estimates taken at training step ``steps[i]``: ``fslr[name][i]`` is
    ``||Delta_W f||_RMS`` of tensor ``name`` for a unit learning rate (``None``: unknown, the
    run could not measure it), ``lrs[name][i]`` the learning rate in force (optional),
    ``sched[i] = lr(t) / lr(0)`` of the base run.

    Construction validates and copies everything (:mod:`fslr_func.io.record_schema`): ``steps``
    strictly increasing ints ``>= 0``; every series as long as ``steps``; FSLRs finite and
    ``>= 0`` or ``None``; learning rates and ratios finite and ``>= 0``; ``lrs`` names among
    ``fslr``'s; the known ``meta`` keys of their type. A missing ``sched`` defaults to ``1.0``
    at every step; missing :data:`META_KEYS` are filled with defaults (``library_version``
    from the installed package). ``meta`` must be JSON-able to be saved and round-trips as
    JSON (tuples come back as lists; ``shapes`` are stored as lists).

    Attributes:
        steps: training steps at which estimates were taken, strictly increasing.
        fslr: tensor name -> FSLR at each step, or ``None`` where unknown (names in
            ``named_parameters()`` order).
        lrs: tensor name -> learning rate in force at each step; may be empty.
        sched: scheduler ratio ``current_lr / initial_lr`` of the base run at each step.
        meta: ``base_lr``, ``optimizer``, ``optimizer_hparams``, ``estimator``, ``beta``,
            ``samples``, ``seed`` (int, or list of ints for a mean), ``shapes``
            (name -> list[int]), ``model``, ``library_version``, ``schedule`` and any other
            JSON-able entries.

    Raises:
        ValueError: a field breaks the schema; the message names the field, the row and its
            step, and the fix.

    Examples:
        >>> rec = FSLRRecord(steps=[0, 10], fslr={"w": [1.0, 2.0]}, meta={"seed": 3})
        >>> len(rec), rec.names, rec.sched, rec.meta["seed"]
        (2, ['w'], [1.0, 1.0], 3)
        >>> FSLRRecord(steps=[0], fslr={"w": [float("nan")]})  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: fslr['w'] row 0 (step 0) is nan: an FSLR is a finite number >= 0 (null ...
    """

    steps: list[int] = field(default_factory=list)
    fslr: dict[str, list[float | None]] = field(default_factory=dict)
    lrs: dict[str, list[float]] = field(default_factory=dict)
    sched: list[float] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        steps = schema.check_steps(self.steps)
        fslr = schema.check_fslr(self.fslr, steps)
        lrs = schema.check_lrs(self.lrs, steps, list(fslr))
        sched = schema.check_sched(self.sched, steps)
        given = self.meta
        if isinstance(given, Mapping) and "shapes" in given and given["shapes"] is None:
            given = {**given, "shapes": {}}  # None: not recorded, as {}
        meta = default_meta()
        meta.update(schema.check_meta(given))
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

    # ------------------------------------------------------------------ building

    def append(
        self,
        step: int,
        fslr: Mapping[str, object],
        lrs: Mapping[str, object] | None = None,
        sched: object = 1.0,
    ) -> None:
        """Add the estimates of one training step.

        Args:
            step: training step; must be greater than the last recorded one.
            fslr: tensor name -> FSLR (float or one-element tensor, finite, ``>= 0``), or
                ``None`` where the run could not measure it (unknown). Once the record has
                tensor names, exactly those names must be given.
            lrs: tensor name -> learning rate in force; give it on every row or on none.
            sched: scheduler ratio ``lr(t) / lr(0)`` of the run at this step.

        Raises:
            ValueError: on a non-increasing step, different tensor names, or a non-finite or
                negative value. The record is left unchanged.

        Examples:
            >>> rec = FSLRRecord()
            >>> rec.append(0, {"w": 0.5, "lora_A": None})
            >>> rec.fslr
            {'w': [0.5], 'lora_A': [None]}
        """
        if not (isinstance(step, numbers.Integral) and not isinstance(step, bool)) or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        step = int(step)
        if self.steps and step <= self.steps[-1]:
            raise ValueError(
                f"steps must increase: step {step} comes after recorded step {self.steps[-1]}"
            )
        if not fslr:
            raise ValueError("fslr is empty: give the FSLR of every trainable tensor")
        bad = [k for k in [*fslr, *(lrs or {})] if not isinstance(k, str) or not k]
        if bad:
            raise ValueError(f"the key {bad[0]!r} is no tensor name: names are non-empty str")
        if self.fslr:
            _check_names(self.fslr, fslr, "fslr")
        row = {
            str(k): schema.check_value(v, f"fslr[{k!r}] at step {step}", "an FSLR")
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
            extra = [str(k) for k in lrs if str(k) not in row]
            if extra:
                raise ValueError(f"lrs has tensors {short_list(extra)} that fslr lacks")
            lr_row = {
                str(k): schema.check_number(v, f"lrs[{k!r}] at step {step}", "a learning rate")
                for k, v in lrs.items()
            }
        elif self.lrs:
            raise ValueError("earlier rows have lrs: give lrs on every row or none")
        s = schema.check_number(sched, f"sched at step {step}", "a schedule ratio")

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
        ``FSLR_W(t) = (1/S) sum_s FSLR_W^(s)(t)``, so that the mean of any finite values is
        finite (:mod:`fslr_func.io.record_mean`). An FSLR unknown in some seeds is the mean
        of the seeds that know it (each estimates the same quantity); unknown in all, it
        stays unknown. ``meta`` is the first record's, with ``seed`` the list of all seeds
        (lists of seeds of earlier means are flattened).

        Raises:
            ValueError: if there are no records, or they differ in tensor names, steps,
                shapes, lrs names, estimator, grouping (but for ``exact`` records), optimiser,
                ``base_lr``, model or schedule
                (:func:`~fslr_func.io.record_schema.check_compatible`: the message names what
                differs).

        Examples:
            >>> a = FSLRRecord(steps=[0], fslr={"w": [1.0], "b": [None]}, meta={"seed": 0})
            >>> b = FSLRRecord(steps=[0], fslr={"w": [3.0], "b": [2.0]}, meta={"seed": 1})
            >>> m = FSLRRecord.mean([a, b])
            >>> m.fslr, m.meta["seed"]
            ({'w': [2.0], 'b': [2.0]}, [0, 1])
        """
        return cls(**seed_mean(list(records)))

    # ------------------------------------------------------------------ (de)serialisation

    def to_dict(self) -> dict[str, Any]:
        """The JSON document :meth:`save` writes (``format`` and ``version`` first): a copy,
        whose edits leave the record as it is."""
        return {
            "format": FORMAT,
            "version": VERSION,
            "steps": list(self.steps),
            "fslr": {k: list(v) for k, v in self.fslr.items()},
            "lrs": {k: list(v) for k, v in self.lrs.items()},
            "sched": list(self.sched),
            "meta": plain(self.meta),  # a NumPy number set after construction too
        }

    @classmethod
    def from_dict(cls, data: Any, *, source: str = "the data") -> FSLRRecord:
        """Inverse of :meth:`to_dict`; ``source`` names the origin in error messages.

        Version-1 documents are migrated (:func:`~fslr_func.io.record_schema.check_document`).

        Raises:
            ValueError: wrong ``format``, unsupported ``version``, missing or invalid fields
                (the field, the row and the fix named).
        """
        fields = schema.check_document(data, source, library_version())
        try:
            return cls(**fields)
        except ValueError as err:
            raise ValueError(f"{source} is damaged: {err}") from err

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the record as versioned JSON, atomically.

        The record is checked again (a field changed after construction, e.g. a ``meta``
        entry, is refused here) and serialised first (so a non-JSON-able ``meta`` raises
        before the file is touched), then written by
        :func:`~fslr_func.io.atomic.atomic_write_text`: through a symbolic link to its target,
        with the target's permissions; a crash mid-write leaves either the old file or the
        new one, never a truncated file.

        Raises:
            ValueError: a field breaks the schema, or ``meta`` holds something JSON cannot
                represent.
            PermissionError: ``path`` is a read-only file.
        """
        document = self.to_dict()
        try:
            FSLRRecord(**{k: document[k] for k in schema.FIELDS})
        except ValueError as err:
            raise ValueError(f"cannot save the record: {err}") from err
        try:
            text = json.dumps(document, allow_nan=False)
        except (TypeError, ValueError) as err:
            raise ValueError(
                f"cannot save the record: meta must be JSON-able (str, numbers, bool, None, "
                f"lists, dicts with str keys): {err}"
            ) from err
        atomic_write_text(path, text + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> FSLRRecord:
        """Read a record written by :meth:`save` (version 1 or 2).

        Raises:
            FileNotFoundError: if there is no such file.
            ValueError: if the path is not a regular file (a directory, a device such as
                ``/dev/zero`` or a pipe: never read without end or waited on), the file is
                damaged or truncated (not valid JSON, missing or invalid fields: the field,
                the row and the fix named), is not an FSLRRecord, or was written by a newer
                fslr_func.
        """
        path = os.fspath(path)
        source = repr(path)
        # opened without blocking (a pipe with no writer), then checked on the open file
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise ValueError(
                f"{source} is not a regular file (a directory, a device or a pipe): pass the "
                "path of a record's JSON file"
            )
        with open(fd, "rb") as f:
            raw = f.read()
        return cls.from_dict(schema.parse_json(raw, source), source=source)

    # ------------------------------------------------------------------ export

    def to_rows(self) -> list[dict[str, float | None]]:
        """One flat dict per recorded step: ``step``, ``sched``, ``fslr/<name>`` (``None``
        where unknown), ``lr/<name>``.

        Examples:
            >>> FSLRRecord(steps=[0], fslr={"w": [0.5]}, lrs={"w": [0.1]}).to_rows()
            [{'step': 0, 'sched': 1.0, 'fslr/w': 0.5, 'lr/w': 0.1}]
        """
        return table_rows(self)

    def to_csv(self, path: str | os.PathLike[str]) -> None:
        """Write :meth:`to_rows` as CSV (a header row, then one row per step; an unknown FSLR
        is an empty cell), atomically.

        Examples:
            >>> import os, tempfile
            >>> with tempfile.TemporaryDirectory() as d:
            ...     FSLRRecord(steps=[0], fslr={"w": [0.5]}).to_csv(os.path.join(d, "r.csv"))
            ...     print(open(os.path.join(d, "r.csv")).read().split())
            ['step,sched,fslr/w', '0,1.0,0.5']
        """
        atomic_write_text(path, csv_text(self))

    def to_pandas(self) -> Any:
        """:meth:`to_rows` as a ``pandas.DataFrame`` indexed by ``step`` (unknown: NaN).

        Raises:
            ImportError: pandas is not installed (``pip install pandas``).
        """
        return data_frame(self)


def _check_names(have: Mapping[str, object], given: Mapping[str, object], what: str) -> None:
    missing = [n for n in have if n not in given]
    extra = [n for n in given if n not in have]
    if missing or extra:
        raise ValueError(
            f"{what} names differ from the recorded ones: missing {short_list(missing)}, "
            f"unexpected {short_list(extra)}"
        )
