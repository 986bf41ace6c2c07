r"""The mean of records of one run over seeds (the paper averages 8 seeds).

``fslr``, ``lrs`` and ``sched`` are arithmetic means, step by step,
:math:`\mathrm{FSLR}_W(t) = \frac{1}{S} \sum_s \mathrm{FSLR}_W^{(s)}(t)`, computed so that the
mean of any finite values is finite (:func:`mean_of`). An FSLR unknown in some seeds is the
mean of the seeds that know it (each estimates the same quantity); unknown in all, it stays
unknown. ``meta`` is the first record's, with ``seed`` the list of all seeds; its
per-step schedule (``sched_per_step``, what FLeRM follows between rows) is the step-by-step
mean over the seeds whose runs reached each step (left out if a seed has none), and its
``feature_gain`` the geometric mean over the seeds that recorded gains, and
``sched_groups_differ_at`` the earliest of the seeds'. A record that is a
mean itself counts as its seeds (``len(meta["seed"])``), so that a mean of means is the mean
of all the seeds, exactly where every seed knew every value and ran as long; where some of
its seeds did not (an FSLR unknown in one, a shorter run), the mean of means weighs the
others' values as all of its seeds' (a record keeps no per-value count): average the
seeds' own records for the exact mean.

Seeds recorded on one probe schedule whose steps differ (a ``GradScaler`` skipped a probed
step in one seed, and the probe moved to the next step) are averaged on the union of their
steps, each seed's value at step ``t`` being its row in force there, as a record is read
(:meth:`~fslr_func.io.record_lookup.Lookups.at`: the latest row at or before ``t``, the first
row before the first step).

Examples:
    >>> from fslr_func.io.record import FSLRRecord
    >>> a = FSLRRecord(steps=[0], fslr={"w": [1.0]}, meta={"seed": 0})
    >>> b = FSLRRecord(steps=[0], fslr={"w": [3.0]}, meta={"seed": 1})
    >>> seed_mean([a, b])["fslr"]
    {'w': [2.0]}
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Sequence
from typing import Any, cast

from .record_lookup import row_in_force
from .record_schema import SAME_META, Series, check_compatible

__all__ = ["mean_of", "seed_mean"]


def mean_of(values: Sequence[float]) -> float:
    r"""Arithmetic mean of finite values ``>= 0`` that cannot overflow.

    The sum is taken in log space, ``log sum_i v_i = log m + log sum_i (v_i / m)`` with
    ``m = max_i v_i`` (log-sum-exp), and the mean is ``m * ((1/n) sum_i v_i / m)``: every term
    and partial sum is at most ``n``, so values near the float maximum average to a finite
    number where ``math.fsum`` raises ``OverflowError``. Equal values (typical for ``lrs`` and
    ``sched``) come back exactly.

    Examples:
        >>> mean_of([1.0, 3.0]), mean_of([0.1, 0.1, 0.1]), mean_of([0.0, 0.0])
        (2.0, 0.1, 0.0)
        >>> mean_of([1.7e308, 1.5e308])
        1.6e+308
    """
    if values.count(values[0]) == len(values):  # all zero included
        return values[0]
    m = max(values)
    return m * (math.fsum(v / m for v in values) / len(values))


def _column_means(
    columns: Sequence[Sequence[float | None]], weights: Sequence[int]
) -> list[float | None]:
    """Step by step, the mean of the known values, each counted ``weights`` times (its
    record's seeds); ``None`` where none is known."""
    out: list[float | None] = []
    for column in zip(*columns, strict=True):
        known = [v for v, w in zip(column, weights, strict=True) if v is not None for _ in range(w)]
        out.append(mean_of(known) if known else None)
    return out


def _ragged_means(series: list[list[float]], weights: Sequence[int]) -> list[float]:
    """Index by index, the mean over the series long enough to have that index, each
    counted ``weights`` times."""
    longest = max(len(s) for s in series)
    return [
        mean_of(
            [s[i] for s, w in zip(series, weights, strict=True) if i < len(s) for _ in range(w)]
        )
        for i in range(longest)
    ]


def _geometric_means(gains: list[dict[str, Any]], weights: Sequence[int]) -> dict[str, float]:
    """Per tensor, the geometric mean of the records' feature gains, each counted
    ``weights`` times (tensors with a gain that is not a finite number > 0 in some record are
    left out)."""

    def usable(g: Any) -> bool:
        return isinstance(g, (int, float)) and 0 < g < math.inf

    total = sum(weights)
    return {
        n: math.exp(sum(w * math.log(g[n]) for g, w in zip(gains, weights, strict=True)) / total)
        for n in gains[0]
        if all(usable(g.get(n)) for g in gains)
    }


def _seed_count(record: Series) -> int:
    """How many seeds ``record`` averages: the length of a mean's ``meta["seed"]`` list, 1
    for a record of one run."""
    seed = record.meta.get("seed")
    return len(seed) if isinstance(seed, list) and seed else 1


def _warn_if_runs_ended_apart(records: Sequence[Series]) -> None:
    """Warn where a seed has rows at steps another seed's run never took (their Recorders'
    per-step schedules tell how long each ran): past a short run's end, the mean holds its
    last row, which a diverged, killed or shorter seed did not measure there."""
    lengths = [len(p) for r in records if isinstance(p := r.meta.get("sched_per_step"), list)]
    if len(lengths) < len(records):
        return
    # a row at a step the shortest run never took (a GradScaler's skipped steps only shorten
    # a run by a few steps, with its rows where the others' are)
    if any(step >= min(lengths) for r in records for step in r.steps):
        warnings.warn(
            f"FSLRRecord.mean: the seeds' runs lasted {sorted(set(lengths))} steps; past a "
            "shorter run's end its last row stands in for the steps it did not measure: re-run "
            "the shorter seeds (a diverged or killed run), or leave them out",
            RuntimeWarning,
            stacklevel=4,
        )


def seed_mean(records: Sequence[Series]) -> dict[str, Any]:
    """The fields (``steps``, ``fslr``, ``lrs``, ``sched``, ``meta``) of the mean record.

    Raises:
        ValueError: no records, or records of different runs
            (:func:`~fslr_func.io.record_schema.check_compatible` names what differs).
    """
    check_compatible(records)
    _warn_if_runs_ended_apart(records)
    first = records[0]
    seeds: list[Any] = []
    for rec in records:
        seed = rec.meta.get("seed")
        seeds.extend(seed if isinstance(seed, list) else [seed])
    meta = copy.deepcopy(dict(first.meta))
    meta["seed"] = seeds
    for key in SAME_META:  # a key record 0 left null: the others' (check_compatible: one)
        if meta.get(key) is None:
            meta[key] = next((r.meta[key] for r in records if r.meta.get(key) is not None), None)
    weights = [_seed_count(r) for r in records]  # a mean of means: every seed counts once
    gained = [
        (r.meta["feature_gain"], w)
        for r, w in zip(records, weights, strict=True)
        if isinstance(r.meta.get("feature_gain"), dict)
    ]
    if gained:  # Recorder(feature_gains=True)
        meta["feature_gain"] = _geometric_means([g for g, _ in gained], [w for _, w in gained])
    differ = [t for r in records if (t := r.meta.get("sched_groups_differ_at")) is not None]
    if differ:  # FLeRM needs the run's scheduler from the first step any seed's groups split
        meta["sched_groups_differ_at"] = min(differ)
    per_step = [r.meta.get("sched_per_step") for r in records]
    if all(isinstance(p, list) for p in per_step):
        meta["sched_per_step"] = _ragged_means(cast(list[list[float]], per_step), weights)
    else:  # an older seed without it: FLeRM follows the mean's rows
        meta.pop("sched_per_step", None)
    steps = sorted({t for r in records for t in r.steps})
    rows = [[row_in_force(r.steps, t) for t in steps] for r in records]

    def columns(series: list[Sequence[Any]]) -> list[float | None]:
        picked = [[s[i] for i in idx] for s, idx in zip(series, rows, strict=True)]
        return _column_means(picked, weights)

    fslr = {n: columns([cast(Any, r.fslr)[n] for r in records]) for n in first.fslr}
    # no None among rates and ratios: their means are all numbers
    lrs = {n: columns([cast(Any, r.lrs)[n] for r in records]) for n in first.lrs}
    sched = columns([cast(Any, r).sched for r in records])
    return {"steps": steps, "fslr": fslr, "lrs": lrs, "sched": sched, "meta": meta}
