"""A sweep's summary: the best learning rate per mode and scale, its shift, the table.

A (mode, scale, lr) cell scores the mean over seeds of its runs' losses (infinite when a seed
diverged or is missing); the best learning rate of a scale is the grid point with the lowest
score, and its *shift* from the base to the largest scale is measured in octaves,
``log2(best_lr[largest] / best_lr[base])``. A best learning rate on the edge of the grid (its
smallest or largest rate) may not be the optimum: the scales where that happens are listed in
``edge``, and a shift involving one is only a bound (``shift_bound``: ``"lower"`` on its size).

Examples:
    >>> from fslr_func.experiments.configs import SweepConfig
    >>> config = SweepConfig(scales=(1, 2), lrs=(0.25, 0.5), seeds=1, modes=("standard",))
    >>> runs = {RunSpec("standard", s, lr, 0).key: {"loss": loss}
    ...         for s, lr, loss in [(1, 0.25, 2.0), (1, 0.5, 1.0), (2, 0.25, 1.0), (2, 0.5, 3.0)]}
    >>> summarise(config, runs)["modes"]["standard"]["shift_octaves"]
    -1.0
"""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Mapping
from typing import Any

from .configs import MODES, SweepConfig, scale_key
from .run import RunSpec, finite_or_none

__all__ = ["bound_sign", "format_table", "shift_text", "summarise", "transferred"]


def _seed_mean(cell: list[Mapping[str, Any] | None], field: str) -> float | None:
    """The mean of ``field`` over the seeds' runs; ``None`` if a run or its value is missing.

    Each value is divided by the count before the sum, so losses near the float maximum
    average to a finite number (``math.fsum`` of them raises ``OverflowError``).

    Examples:
        >>> _seed_mean([{"loss": 1.0}, {"loss": 2.0}], "loss"), _seed_mean([None], "loss")
        (1.5, None)
        >>> _seed_mean([{"loss": 1.5e308}, {"loss": 1.7e308}], "loss")
        1.6e+308
    """
    values = [c.get(field) for c in cell if c]
    present = [v for v in values if v is not None]
    n = len(present)
    return math.fsum(v / n for v in present) if n == len(cell) else None


def summarise(
    config: SweepConfig,
    runs: Mapping[str, Mapping[str, Any]],
    *,
    out: str | os.PathLike[str] | None = None,
) -> dict[str, Any]:
    """The sweep's results: best learning rate, its loss and shift per mode and scale.

    A (mode, scale, lr) cell scores the mean over seeds of the runs' losses (infinite when a
    seed diverged or is missing).

    Returns:
        ``{"axis", "scales", "lrs", "modes": {mode: {"best_lr": {scale: lr}, "best_loss":
        {scale: loss}, "shift_octaves": log2(best_lr[largest] / best_lr[base]), "loss":
        {scale: [score per lr, None if infinite]}, "test_loss": {scale: test loss at the best
        lr}, "edge": [scales whose best lr is the grid's smallest or largest], "shift_bound":
        "lower" when the base or largest scale is one of them, else None}}, "identity_check":
        {...}, "config": {...}, "runs": n}``; scales are keys like
        ``"8"``, learning rates floats; ``None`` where nothing converged.
    """
    modes: dict[str, Any] = {}
    for mode in config.modes:
        best_lr: dict[str, float | None] = {}
        best_loss: dict[str, float | None] = {}
        test: dict[str, float | None] = {}
        table: dict[str, list[float | None]] = {}
        for scale in config.scales:
            scores: list[float] = []
            tests: list[float | None] = []
            for lr in config.lrs:
                cell = [runs.get(RunSpec(mode, scale, lr, s).key) for s in range(config.seeds)]
                loss = _seed_mean(cell, "loss")
                scores.append(math.inf if loss is None else loss)
                tests.append(_seed_mean(cell, "test_loss"))
            sk = scale_key(scale)
            table[sk] = [finite_or_none(v) for v in scores]
            i = min(range(len(scores)), key=scores.__getitem__)
            found = math.isfinite(scores[i])
            best_lr[sk] = config.lrs[i] if found else None
            best_loss[sk] = scores[i] if found else None
            test[sk] = tests[i] if found else None
        lo, hi = best_lr[scale_key(config.scales[0])], best_lr[scale_key(config.scales[-1])]
        edge = [k for k, v in best_lr.items() if v in (config.lrs[0], config.lrs[-1])]
        ends = {scale_key(config.scales[0]), scale_key(config.scales[-1])}
        modes[mode] = {
            "best_lr": best_lr,
            "shift_octaves": None if lo is None or hi is None else round(math.log2(hi / lo), 6),
            "edge": edge,
            "shift_bound": "lower" if ends & set(edge) and len(config.lrs) > 1 else None,
            "best_loss": best_loss,
            "test_loss": test,
            "loss": table,
        }
    summary: dict[str, Any] = {
        "axis": config.axis,
        "scales": list(config.scales),
        "lrs": list(config.lrs),
        "modes": modes,
        "identity_check": _identity_check(config, runs),
        "config": config.to_dict(),
        "runs": len(runs),
    }
    if out is not None:
        summary["out"] = str(out)
    return summary


def _identity_check(config: SweepConfig, runs: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """FLeRM at the base scale against the standard run: the rates it set over ``lr`` and the
    largest loss difference (exactly 1 and 0 with one seed; seed noise of the mean with more)."""
    if "flerm" not in config.modes or "standard" not in config.modes:
        return {}
    ratios: list[float] = []
    diffs: list[float] = []
    for lr in config.lrs:
        for s in range(config.seeds):
            f = runs.get(RunSpec("flerm", config.base_scale, lr, s).key)
            st = runs.get(RunSpec("standard", config.base_scale, lr, s).key)
            if f and "flerm" in f:
                ratios.extend(v / lr for v in f["flerm"]["lrs"].values())
            if f and st and f.get("loss") is not None and st.get("loss") is not None:
                diffs.append(abs(f["loss"] - st["loss"]))
    if not ratios:
        return {}
    return {
        "lr_ratio_min": min(ratios),
        "lr_ratio_max": max(ratios),
        "max_abs_loss_diff": max(diffs) if diffs else None,
    }


def _fmt_lr(lr: float | None) -> str:
    if lr is None:
        return "-"
    k = math.log2(lr)
    return f"{lr:.3g} (2^{k:.0f})" if abs(k - round(k)) < 1e-9 else f"{lr:.3g}"


def format_table(summary: Mapping[str, Any]) -> str:
    """The best learning rate and loss per scale for each mode, and the shifts in octaves.

    A best learning rate on the edge of the grid is marked ``!`` and a shift that is only a
    lower bound ``>=``, explained in a last line. Rows are named ``<scale>x``, or by the
    summary's optional ``"scale_labels"`` (``{scale key: label}``).

    Examples:
        >>> s = {"axis": "width", "scales": [1.0, 8.0], "modes": {
        ...     "standard": {"best_lr": {"1": 0.0625, "8": 0.0078125}, "shift_octaves": -3.0,
        ...                  "best_loss": {"1": 0.9, "8": 0.5}},
        ...     "flerm": {"best_lr": {"1": 0.0625, "8": 0.0625}, "shift_octaves": 0.0,
        ...               "best_loss": {"1": 0.9, "8": 0.4}}}}
        >>> print(format_table(s))
        width    standard best lr   loss     flerm best lr      loss
        1x       0.0625 (2^-4)      0.9000   0.0625 (2^-4)      0.9000
        8x       0.00781 (2^-7)     0.5000   0.0625 (2^-4)      0.4000
        shift    -3 octaves                  +0 octaves
    """
    modes = [m for m in MODES if m in summary["modes"]]
    keys = [scale_key(float(scale)) for scale in summary["scales"]]
    labels = {k: summary.get("scale_labels", {}).get(k, k + "x") for k in keys}
    w = max(8, len(summary["axis"]), *(len(v) for v in labels.values()))  # first column
    head = f"{summary['axis']:<{w}} " + " ".join(f"{m + ' best lr':<18} {'loss':<8}" for m in modes)
    lines = [head]
    for sk in keys:
        cells = []
        for m in modes:
            loss = summary["modes"][m]["best_loss"].get(sk)
            lr = _fmt_lr(summary["modes"][m]["best_lr"].get(sk))
            lr += "!" if sk in summary["modes"][m].get("edge", ()) else ""
            cells.append(f"{lr:<18} {'-' if loss is None else f'{loss:.4f}':<8}")
        lines.append(f"{labels[sk]:<{w}} " + " ".join(cells))
    shifts = []
    for m in modes:
        data = summary["modes"][m]
        text = shift_text(data["shift_octaves"], bool(data.get("shift_bound")))
        shifts.append(f"{text or '-':<27}")
    lines.append(f"{'shift':<{w}} " + " ".join(shifts))
    if any(summary["modes"][m].get("edge") for m in modes):
        lines.append(
            "! best learning rate on the edge of the grid: widen --lrs (a shift >= or <= is "
            "a bound)"
        )
    return "\n".join(line.rstrip() for line in lines)


def shift_text(shift: float | None, bound: bool) -> str:
    """A shift as the table and the figures print it; ``bound``: a best rate on the grid's
    edge, so the shift is at least this far from 0, in its direction (``>=+2``, ``<=-1``).

    Examples:
        >>> shift_text(-1.0, True), shift_text(2.0, True), shift_text(0.0, False)
        ('<=-1 octaves', '>=+2 octaves', '+0 octaves')
    """
    return "" if shift is None else f"{bound_sign(shift, bound)}{shift:+.3g} octaves"


def bound_sign(shift: float, bound: bool) -> str:
    """``">="`` or ``"<="`` before a shift that is a bound (its true value is at least this
    far from 0: a best rate on the grid's edge), else ``""``.

    Examples:
        >>> bound_sign(-1.0, True), bound_sign(1.0, True), bound_sign(1.0, False)
        ('<=', '>=', '')
    """
    return (">=" if shift > 0 else "<=" if shift < 0 else "") if bound else ""


def transferred(
    config: SweepConfig, summary: Mapping[str, Any], runs: Mapping[str, Any], mode: str, lr: float
) -> dict[str, Any]:
    """The largest model's losses at ``lr`` over the seeds (the *transferred loss* when ``lr``
    is the base model's best), and the shift from ``lr`` to its own best learning rate there.

    Args:
        config: the sweep's config (scales and seeds).
        summary: its :func:`summarise` document.
        runs: run key -> result (``{"loss": ...}``, ``None`` for a diverged run).
        mode: the mode to read.
        lr: the learning rate to read the largest scale at.

    Returns:
        ``{"lr", "mean", "sd", "losses", "shift", "bound"}``; ``mean`` is ``inf`` if a seed
        diverged or is missing; ``bound`` when the largest scale's best rate is on the grid's
        edge (the shift is then a lower bound on its size).

    Examples:
        >>> config = SweepConfig(scales=(1, 2), lrs=(0.25, 0.5), seeds=2, modes=("standard",))
        >>> runs = {RunSpec("standard", s, lr, k).key: {"loss": s * lr + k}
        ...         for s in (1, 2) for lr in (0.25, 0.5) for k in (0, 1)}
        >>> t = transferred(config, summarise(config, runs), runs, "standard", 0.5)
        >>> t["losses"], t["mean"], t["shift"]
        ([1.0, 2.0], 1.5, -1.0)
    """
    data = summary["modes"][mode]
    top = scale_key(config.scales[-1])
    losses = []
    for seed in range(config.seeds):
        loss = (runs.get(RunSpec(mode, config.scales[-1], lr, seed).key) or {}).get("loss")
        losses.append(math.inf if loss is None else float(loss))
    finite = all(math.isfinite(v) for v in losses)
    best = data["best_lr"][top]
    return {
        "lr": lr,
        "mean": statistics.fmean(losses) if finite else math.inf,
        "sd": statistics.stdev(losses) if finite and len(losses) > 1 else 0.0,
        "losses": losses,
        "shift": None if best is None else round(math.log2(best / lr), 6),
        "bound": top in data.get("edge", ()),
    }
