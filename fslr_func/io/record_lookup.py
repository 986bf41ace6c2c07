"""Looking a record up by training step: the FSLRs, rates and schedule in force at any step,
where its values are unknown, and where it ends (:class:`Lookups`, the part of
:class:`~fslr_func.io.record.FSLRRecord` that reads it by step).

A record's row ``i`` holds the estimates taken at step ``steps[i]``; the row in force at step
``t`` is the latest at or before ``t`` (the first row before the first step: the estimates of
step 0 are the best guess for the very start of training).

Examples:
    >>> from fslr_func.io.record import FSLRRecord
    >>> rec = FSLRRecord(steps=[0, 10], fslr={"w": [1.0, 2.0]}, sched=[1.0, 0.5])
    >>> rec.at(9), rec.sched_at(10), rec.schedule_at(5)
    ({'w': 1.0}, 0.5, 0.75)
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any, Literal

from ..probe.names import short_list
from ..stats.checks import is_integer

__all__ = ["Fallback", "Lookups", "row_in_force"]

Fallback = Literal["error", "nearest", "omit"]
"""What a lookup does with an unknown FSLR: raise naming it, use the tensor's nearest known
value (the latest earlier row, else the earliest later one), or leave the tensor out."""


def row_in_force(steps: Sequence[int], step: int) -> int:
    """Index of the row of ``steps`` (sorted, not empty) in force at ``step``: the latest
    recorded step ``<= step``, the first row before the first step. How every lookup by step
    reads a record, and how seeds recorded at different steps are averaged.

    Examples:
        >>> [row_in_force([1, 3, 6], t) for t in (0, 1, 3, 4, 6)]
        [0, 0, 1, 1, 2]
    """
    return max(bisect.bisect_right(steps, step) - 1, 0)


def _check_step(step: object) -> None:
    """Refuse a step that is not an integer (a NaN read as the last row, ``None`` raised a
    comparison error).

    Examples:
        >>> _check_step(float("nan"))
        Traceback (most recent call last):
        ...
        TypeError: a step is an int (a training step's index), got nan
    """
    if not is_integer(step):
        raise TypeError(f"a step is an int (a training step's index), got {step!r}")


class Lookups:
    """The lookups by step of a record (a base of :class:`~fslr_func.io.record.FSLRRecord`,
    whose fields they read)."""

    steps: list[int]
    fslr: dict[str, list[float | None]]
    lrs: dict[str, list[float]]
    sched: list[float]
    meta: dict[str, Any]

    def __len__(self) -> int:
        """The number of rows."""
        return len(self.steps)

    def _row(self, step: int) -> int:
        """Index of the latest recorded step ``<= step`` (0 before the first one)."""
        _check_step(step)
        if not self.steps:
            raise ValueError("the record is empty: nothing was recorded yet")
        return row_in_force(self.steps, step)

    @property
    def last_step(self) -> int:
        """The last training step the record speaks for: its last row, or the last step of
        the per-step schedule (``meta["sched_per_step"]``) a Recorder stores, if later.

        Examples:
            >>> from fslr_func.io.record import FSLRRecord
            >>> FSLRRecord(steps=[0, 10], fslr={"w": [1.0, 1.0]}).last_step
            10
            >>> meta = {"sched_per_step": [1.0] * 50}  # a Recorder's run of 50 steps
            >>> FSLRRecord(steps=[0], fslr={"w": [1.0]}, meta=meta).last_step
            49
        """
        self._row(0)
        return max(self.steps[-1], len(self.meta.get("sched_per_step") or []) - 1)

    def past_end(self, step: int, what: str = "step") -> str | None:
        """``None`` if the record covers ``step`` (``step <= last_step``), else what to tell
        the user: the step and the record's length. FLeRM calls it at every set point and
        schedule lookup; past the end the last row (and the last schedule ratio) is reused.

        Examples:
            >>> from fslr_func.io.record import FSLRRecord
            >>> rec = FSLRRecord(steps=[0, 10], fslr={"w": [1.0, 1.0]})
            >>> rec.past_end(10) is None
            True
            >>> print(rec.past_end(25, "set point"))  # doctest: +NORMALIZE_WHITESPACE
            set point 25 is past the end of the base record (2 rows, steps 0 to 10; it covers
            steps up to 10): its last values are reused
        """
        _check_step(step)
        last = self.last_step
        if step <= last:
            return None
        return (
            f"{what} {step} is past the end of the base record ({len(self)} rows, steps "
            f"{self.steps[0]} to {self.steps[-1]}; it covers steps up to {last}): its last "
            "values are reused"
        )

    def before_start(self, step: int, what: str = "step") -> str | None:
        """``None`` unless ``step`` comes before the step the base run started probing at
        (``meta["start_step"]``, which a Recorder stores) and before the record's first row:
        then what to tell the user. Lookups there read the first row, measured later in
        training than ``step``; a first row after an unprobed warm-up from rate 0 (start
        step 0, first row at step 1) is the best guess for step 0 and gets ``None``.

        Examples:
            >>> from fslr_func.io.record import FSLRRecord
            >>> rec = FSLRRecord(steps=[500], fslr={"w": [1.0]}, meta={"start_step": 500})
            >>> print(rec.before_start(0, "set point"))  # doctest: +NORMALIZE_WHITESPACE
            set point 0 is before the base run's first probed step (its start_step 500): the
            first row's values (step 500) are used
            >>> rec.before_start(500) is None
            True
        """
        self._row(0)
        start = self.meta.get("start_step")
        if not isinstance(start, int) or step >= min(start, self.steps[0]):
            return None
        return (
            f"{what} {step} is before the base run's first probed step (its start_step "
            f"{start}): the first row's values (step {self.steps[0]}) are used"
        )

    def at(self, step: int, *, unknown: Fallback = "error") -> dict[str, float]:
        """FSLRs in force at ``step``: those of the latest recorded step ``<= step``.

        A step before the first recorded step gets the first record (the estimates of step 0
        are the best guess for the very start of training).

        Args:
            step: a training step.
            unknown: what to do with a tensor whose FSLR is unknown in that row: ``"error"``
                (raise, naming it), ``"nearest"`` (its nearest known value: the latest earlier
                row, else the earliest later one; left out if it is unknown at every row) or
                ``"omit"`` (leave it out).

        Raises:
            ValueError: the record is empty, or an unknown FSLR with ``unknown="error"``.

        Examples:
            >>> from fslr_func.io.record import FSLRRecord
            >>> rec = FSLRRecord(steps=[10, 20], fslr={"w": [1.0, 2.0], "b": [None, 3.0]})
            >>> rec.at(0, unknown="omit"), rec.at(19, unknown="nearest"), rec.at(10**9)
            ({'w': 1.0}, {'w': 1.0, 'b': 3.0}, {'w': 2.0, 'b': 3.0})
            >>> rec.at(10)  # doctest: +ELLIPSIS
            Traceback (most recent call last):
            ...
            ValueError: the record's FSLR of ['b'] is unknown at step 10 (row 0, step 10): ...
        """
        if unknown not in ("error", "nearest", "omit"):
            raise ValueError(f"unknown must be 'error', 'nearest' or 'omit', got {unknown!r}")
        i = self._row(step)
        out: dict[str, float] = {}
        for name, values in self.fslr.items():
            value = _nearest(values, i) if unknown == "nearest" else values[i]
            if value is not None:
                out[name] = value
        missing = [n for n in self.fslr if n not in out]
        if missing and unknown == "error":
            raise ValueError(
                f"the record's FSLR of {short_list(missing)} is unknown at step {step} (row {i}, "
                f"step {self.steps[i]}): the base run could not measure it (no finite probe, or "
                "the tensor never moved); choose a fallback (FLeRM(..., unknown='nearest' or "
                "'hold'); record.at(step, unknown='nearest' or 'omit')) or re-record the base run"
            )
        return out

    def unknown_steps(
        self, first: int | None = None, last: int | None = None
    ) -> dict[str, list[int]]:
        """Tensor name -> the recorded steps at which its FSLR is unknown, for the rows in
        force over ``[first, last]`` (default: all rows); tensors always known are left out.

        Examples:
            >>> from fslr_func.io.record import FSLRRecord
            >>> rec = FSLRRecord(steps=[0, 5, 10], fslr={"w": [None, 1.0, None], "b": [1.0] * 3})
            >>> rec.unknown_steps(), rec.unknown_steps(first=6, last=9)
            ({'w': [0, 10]}, {})
        """
        if not self.steps:
            return {}
        lo = 0 if first is None else self._row(first)
        hi = len(self.steps) - 1 if last is None else self._row(last)
        out: dict[str, list[int]] = {}
        for name, values in self.fslr.items():
            steps = [self.steps[i] for i in range(lo, hi + 1) if values[i] is None]
            if steps:
                out[name] = steps
        return out

    def sched_at(self, step: int) -> float:
        """Scheduler ratio ``lr(t) / lr(0)`` in force at ``step`` (same lookup as :meth:`at`).

        Examples:
            >>> from fslr_func.io.record import FSLRRecord
            >>> FSLRRecord(steps=[0, 5], fslr={"w": [1.0, 1.0]}, sched=[1.0, 0.1]).sched_at(7)
            0.1
        """
        return self.sched[self._row(step)]

    def lrs_at(self, step: int) -> dict[str, float]:
        """Learning rates in force at ``step`` (same lookup as :meth:`at`); empty without ``lrs``.

        Examples:
            >>> from fslr_func.io.record import FSLRRecord
            >>> rec = FSLRRecord(steps=[0, 5], fslr={"w": [1.0, 1.0]}, lrs={"w": [0.1, 0.01]})
            >>> rec.lrs_at(3), rec.lrs_at(5), FSLRRecord(steps=[0], fslr={"w": [1.0]}).lrs_at(0)
            ({'w': 0.1}, {'w': 0.01}, {})
        """
        i = self._row(step)
        return {name: values[i] for name, values in self.lrs.items()}

    def schedule_at(self, step: int) -> float:
        """The base run's schedule ratio at any ``step``, continuous (never a staircase).

        A :class:`~fslr_func.training.recorder.Recorder` stores the ratio at every training step in
        ``meta["sched_per_step"]`` (index = step): that value, exactly. Between and beyond
        what is stored, ``sched`` is interpolated linearly between recorded rows; past the
        end (:meth:`past_end`) the last value is held: the per-step one if it goes further
        than the rows.

        Examples:
            >>> from fslr_func.io.record import FSLRRecord
            >>> rec = FSLRRecord(steps=[0, 10], fslr={"w": [1.0, 1.0]}, sched=[1.0, 0.5])
            >>> rec.schedule_at(4), rec.schedule_at(20)
            (0.8, 0.5)
            >>> rec.meta["sched_per_step"] = [1.0] * 11 + [0.25] * 9
            >>> rec.schedule_at(12), rec.schedule_at(10**6)
            (0.25, 0.25)
        """
        per_step = self.meta.get("sched_per_step") or []
        if 0 <= step < len(per_step):
            return float(per_step[step])
        if per_step and self.steps and step >= len(per_step) > self.steps[-1]:
            return float(per_step[-1])
        i = self._row(step)
        if step <= self.steps[i] or i + 1 == len(self.steps):
            return self.sched[i]
        t0, t1 = self.steps[i], self.steps[i + 1]
        w = (step - t0) / (t1 - t0)
        return (1 - w) * self.sched[i] + w * self.sched[i + 1]


def _nearest(values: Sequence[float | None], i: int) -> float | None:
    """The known value nearest row ``i``: the latest at or before it, else the earliest after.

    Examples:
        >>> from fslr_func.io.record import FSLRRecord
        >>> _nearest([None, 2.0, None, 4.0], 2), _nearest([None, 2.0], 0), _nearest([None], 0)
        (2.0, 2.0, None)
    """
    order = [*range(i, -1, -1), *range(i + 1, len(values))]
    return next((v for j in order if (v := values[j]) is not None), None)
