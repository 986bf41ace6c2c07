r"""The transfer matrix: one *cell* is a model family, base width, budget and data at 1x and
8x width; this module runs a cell on an adaptive learning-rate grid and reads it out.

A cell answers what a user who tunes the small model gets at 8x width, against a user who
re-tunes the big one. It is run in phases, each a list of runs given to the sweep's
:class:`~fslr_func.experiments.schedule.Scheduler` and cached in the sweep's files
(:class:`~fslr_func.experiments.cache.SweepCache`: the fingerprint leaves out the grid, so the
phases of a cell share one folder and an interrupted cell resumes):

1. standard training at 1x on the config's grid, widened by an octave at an edge until the
   best rate :math:`b` (seed mean of the last-``last`` training loss) is interior; these are
   also the base recordings of FLeRM;
2. at 8x: standard training on :math:`b/8 .. b` (the standard parametrisation's optimum moves
   down with width), muP and FLeRM on :math:`b/2 .. 2b`;
3. every mode whose best rate at 8x is on the edge of the rates it was run at gets the next
   octave out, until it is interior (or the grid reaches ``2**-20`` or ``2**2``).

With ``refine=True`` the rates are resolved to half an octave: after phase 1 the base also
runs at :math:`b \cdot 2^{\pm 1/2}` and :math:`b` becomes the best of the three (phases 2
and 3 are then an octave grid through it), and after phase 3 every mode at 8x also runs at
the half-octave neighbours of its best rate. It asks how much of a transferred loss is the
octave grid quantising the base's optimum (docs/reproduction.md, "The base's rate at half an
octave", measures it: it moves single cells either way more than it moves the matrix).

:func:`two_width_cell` asks whether a second small width tells FLeRM's overall level at the
top one: FLeRM's best rate at, say, 2x (fitted between the half-octave rates,
:func:`fitted_best`) carried to 8x by :func:`width_extrapolated_shift`.

Read-out per mode at 8x (:func:`cell_summary`): the best rate and its shift in octaves from
:math:`b` (and the fitted one), the loss at :math:`b` (the *transferred* loss: mean, sample
standard deviation and each seed), and for FLeRM and muP the ratio of the transferred loss to
re-tuned standard training's best loss at 8x (1 = as good as re-tuning).

Examples:
    >>> phase2_rates(2.0**-6, "standard") == tuple(2.0**k for k in range(-9, -5))
    True
    >>> phase2_rates(2.0**-6, "flerm") == (2.0**-7, 2.0**-6, 2.0**-5)
    True
    >>> [round(math.log2(lr), 1) for lr in phase2_rates(2.0**-6.5, "mup")]
    [-7.5, -6.5, -5.5]
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from .cache import SweepCache
from .configs import SweepConfig
from .run import RunSpec
from .schedule import Scheduler
from .task import Task, builtin_task

__all__ = [
    "LR_RANGE",
    "adaptive_cell",
    "best_rate",
    "cell_summary",
    "fitted_best",
    "other_seeds_best",
    "phase2_rates",
    "run_specs",
    "two_width_cell",
    "width_extrapolated_shift",
]

LR_RANGE = (-20, 2)
"""Octaves (powers of two) the adaptive grid may reach."""


def phase2_rates(b: float, mode: str) -> tuple[float, ...]:
    """The 8x rates of phase 2 for ``mode``, around the base's best rate ``b``: standard
    training ``b/8 .. b``, muP and FLeRM (and its variants) ``b/2 .. 2b``, in octaves through
    ``b`` (a power of two or not)."""
    lo, hi = (-3, 0) if mode == "standard" else (-1, 1)
    return tuple(b * 2.0**j for j in range(lo, hi + 1))


def run_specs(
    config: SweepConfig,
    out: str | Path,
    specs: Iterable[RunSpec],
    *,
    task: Task | None = None,
    jobs: int = 1,
    threads: int | None = 1,
    log: Callable[[str], None] | None = None,
    train: bool = True,
) -> dict[str, dict[str, Any]]:
    """Train the runs ``specs`` of ``config`` that are not cached in ``out``; return them all.

    The cache and scheduling of :func:`~fslr_func.experiments.sweep.run_sweep` for a list of
    runs instead of a grid: FLeRM runs wait for the base recordings of their rate (made here
    when missing), every result is stored as it finishes. ``config.seeds`` must be the seeds
    FLeRM's base records are averaged over.

    Args:
        log: called with one line when runs are to be trained.
        train: ``False``: train nothing, return the cached runs only.

    Returns:
        run key -> result, for every spec (cached or trained now).
    """
    config.validate(builtin=task is None)
    task_name = config.task_name if task is None else task.name
    cache = SweepCache.create(Path(out), config, task_name)
    base = config.base_scale
    done, todo, pending = cache.plan(specs, base)
    keys = {s.key for s in todo}
    if not pending or not train:
        return done
    if log is not None:
        log(f"{out}: {len(pending)} runs to train")

    def finish(spec: RunSpec, result: dict[str, Any], record: Any) -> None:
        cache.store(spec, result, record, run=spec.key in keys)
        if spec.key in keys:
            done[spec.key] = result

    Scheduler(pending, base_scale=base, seeds=cache.seeds, base_for=cache.mean, finish=finish).run(
        task if task is not None else builtin_task(config), config, jobs=jobs, threads=threads
    )
    return done


def _losses(
    runs: Mapping[str, Mapping[str, Any]],
    mode: str,
    scale: float,
    lr: float,
    seeds: int,
    field: str = "loss",
) -> list[float] | None:
    """Per-seed losses of a (mode, scale, lr) cell; ``inf`` for a diverged seed (or one
    without ``field``: a task without a test split has no ``test_loss``); ``None`` if a seed
    has not run."""
    out = []
    for seed in range(seeds):
        data = runs.get(RunSpec(mode, scale, lr, seed).key)
        if data is None:
            return None
        out.append(math.inf if data.get(field) is None else float(data[field]))
    return out


def _score(losses: Sequence[float]) -> float:
    return statistics.fmean(losses) if all(math.isfinite(v) for v in losses) else math.inf


def best_rate(
    runs: Mapping[str, Mapping[str, Any]], mode: str, scale: float, seeds: int
) -> tuple[float | None, list[float]]:
    """The best rate of ``mode`` at ``scale`` among the rates run (all seeds present) and the
    sorted rates run; ``None`` if none converged.

    Examples:
        >>> runs = {RunSpec("standard", 1.0, lr, 0).key:
        ...         {"mode": "standard", "scale": 1.0, "lr": lr, "loss": loss}
        ...         for lr, loss in [(0.25, 2.0), (0.5, 1.0), (1.0, None)]}
        >>> best_rate(runs, "standard", 1.0, 1)
        (0.5, [0.25, 0.5, 1.0])
    """
    rates = sorted(
        {float(d["lr"]) for d in runs.values() if d.get("mode") == mode and d.get("scale") == scale}
    )
    scored = [(lr, _score(ls)) for lr in rates if (ls := _losses(runs, mode, scale, lr, seeds))]
    rates = [lr for lr, _ in scored]
    finite = [(s, lr) for lr, s in scored if math.isfinite(s)]
    return (min(finite)[1] if finite else None), rates


def fitted_best(
    runs: Mapping[str, Mapping[str, Any]], mode: str, scale: float, seeds: int
) -> float | None:
    r""":math:`\log_2` of ``mode``'s best rate at ``scale``, resolved between the rates run.

    The vertex of the parabola through the best rate and its two neighbours (seed-mean loss
    against :math:`\log_2` of the rate, any spacing), kept between the two neighbours; the
    best rate itself where it has no converged neighbour on a side (an edge, or the next
    rate diverged) or the three points do not curve up. ``None`` if no rate converged.

    Examples:
        >>> runs = {RunSpec("flerm", 2.0, 2.0**e, 0).key:
        ...         {"mode": "flerm", "scale": 2.0, "lr": 2.0**e, "loss": (e + 6.25) ** 2}
        ...         for e in (-7, -6.5, -6, -5)}
        >>> fitted_best(runs, "flerm", 2.0, 1)
        -6.25
    """
    return _fitted(runs, mode, scale, seeds, *best_rate(runs, mode, scale, seeds))


def _fitted(
    runs: Mapping[str, Mapping[str, Any]],
    mode: str,
    scale: float,
    seeds: int,
    best: float | None,
    rates: Sequence[float],
) -> float | None:
    """:func:`fitted_best` from :func:`best_rate`'s ``(best, rates)``, already at hand."""
    if best is None:
        return None
    i = rates.index(best)
    x1 = math.log2(best)
    if i == 0 or i == len(rates) - 1:
        return x1
    (x0, y0), (_, y1), (x2, y2) = (
        (math.log2(lr), _score(_losses(runs, mode, scale, lr, seeds) or []))
        for lr in rates[i - 1 : i + 2]
    )
    if not (math.isfinite(y0) and math.isfinite(y2)):
        return x1
    # the vertex of the parabola through three points (Numerical Recipes' parabolic step)
    p, q = (x1 - x0) * (y1 - y2), (x1 - x2) * (y1 - y0)
    den = p - q
    if den >= 0:  # flat or curving down: no interior minimum to trust
        return x1
    vertex = x1 - 0.5 * ((x1 - x0) * p - (x1 - x2) * q) / den
    return min(max(vertex, x0), x2)


def width_extrapolated_shift(shift: float, second: float, top: float) -> float:
    r"""The shift of the best rate at width multiple ``top``, from its shift at ``second``.

    The model: a finite-width correction of the best rate that decays as one over the
    width, :math:`s(m) = s_\infty (1 - 1/m)` in octaves from the base's (:math:`s(1) = 0`),
    so :math:`s(\text{top}) = s(\text{second}) \cdot (1 - 1/\text{top}) /
    (1 - 1/\text{second})`: from 2x to 8x a factor of 1.75.

    Examples:
        >>> round(width_extrapolated_shift(0.4, 2, 8), 6)
        0.7
    """
    if not (math.isfinite(shift) and math.isfinite(second) and math.isfinite(top)):
        raise ValueError(f"shift and width multiples must be finite; got {shift}, {second}, {top}")
    if second <= 1 or top <= 1:
        raise ValueError(f"width multiples must exceed 1 (the base); got {second} and {top}")
    return shift * (1 - 1 / top) / (1 - 1 / second)


def other_seeds_best(
    runs: Mapping[str, Mapping[str, Any]], mode: str, scale: float, seeds: int
) -> float | None:
    """Re-tuning judged on a seed it was not chosen on: for each seed ``k``, the loss at ``k``
    of the rate whose mean over the *other* seeds is lowest; the mean of these (``inf`` if
    one diverged). ``None`` with fewer than two seeds or no rate run on all of them.

    The best seed mean over a grid is the lowest of noisy numbers, so it is biased low: it
    is what re-tuning looks like on the seeds it was tuned on. This is the loss a user who
    re-tunes on some seeds gets on a fresh one, the reference without that bias.

    Examples:
        >>> runs = {RunSpec("standard", 8.0, lr, k).key:
        ...         {"mode": "standard", "scale": 8.0, "lr": lr, "loss": loss}
        ...         for lr, losses in [(0.25, (1.0, 1.4)), (0.5, (1.3, 1.0))]
        ...         for k, loss in enumerate(losses)}
        >>> other_seeds_best(runs, "standard", 8.0, 2)  # seed 0 gets 0.5's, seed 1 0.25's
        1.35
    """
    _, rates = best_rate(runs, mode, scale, seeds)
    if seeds < 2 or not rates:
        return None
    table = {lr: _losses(runs, mode, scale, lr, seeds) or [] for lr in rates}
    picked = []
    for k in range(seeds):
        others = {lr: _score([v for j, v in enumerate(ls) if j != k]) for lr, ls in table.items()}
        picked.append(table[min(others, key=lambda lr: (others[lr], lr))][k])
    return _score(picked)


def _next_out(best: float | None, rates: Sequence[float]) -> float | None:
    """The rate an octave beyond the edge ``best`` is on (a diverged top counts as interior),
    or ``None`` when ``best`` is interior or the range is exhausted."""
    if not rates:
        return None
    if best is None or best == rates[0]:  # nothing converged: go down
        nxt = rates[0] / 2
    elif best == rates[-1]:
        nxt = rates[-1] * 2
    else:
        return None
    return nxt if LR_RANGE[0] <= round(math.log2(nxt), 6) <= LR_RANGE[1] else None


def _half_octaves(lr: float, rates: Sequence[float]) -> list[float]:
    """The rates half an octave either side of ``lr`` that are not among ``rates``; on the
    half-octave grid ``2**(k/2)`` exactly (the same floats as ``2.0 ** (k / 2)``, so a run
    cached at one of them is found again)."""
    e = math.log2(lr)
    on_grid = abs(2 * e - round(2 * e)) < 1e-9
    near = [2.0 ** (round(2 * e) / 2 + d) if on_grid else lr * 2.0**d for d in (-0.5, 0.5)]
    run = {round(math.log2(r), 6) for r in rates}
    return [x for x in near if round(math.log2(x), 6) not in run]


def adaptive_cell(
    config: SweepConfig,
    out: str | Path,
    *,
    modes: Sequence[str] = ("standard", "mup", "flerm"),
    tuned: float | None = None,
    task: Task | None = None,
    jobs: int = 1,
    log: Callable[[str], None] | None = None,
    train: bool = True,
    refine: bool = False,
) -> dict[str, Any]:
    """Run (or resume) one cell of the matrix on the adaptive grid; return :func:`cell_summary`.

    Args:
        config: the cell; its largest scale is the scaled model (8x), its smallest the base.
        out: the cell's folder.
        modes: the modes to run at the largest scale (``"standard"`` is always run at 1x).
        tuned: the base's best rate when known (a variant's folder: the main folder's
            :math:`b`); ``None``: found here by phase 1.
        task: the model family; default :func:`builtin_task` of ``config``.
        jobs: worker processes.
        log: called with a line per phase.
        train: ``False``: read what is cached, train nothing (a cell not run reads as empty).
        refine: resolve the base's best rate (when found here) and each mode's best rate at
            8x to half an octave (the module docstring). The runs share the cell's folder
            with the octave grid's: ``refine=False`` on the same folder still reads the
            octave grid alone.
    """
    say = log or (lambda line: None)
    base, top, seeds = config.base_scale, config.scales[-1], config.seeds
    ks = range(seeds)

    def run(specs: list[RunSpec]) -> dict[str, dict[str, Any]]:
        return run_specs(config, out, specs, task=task, jobs=jobs, log=say, train=train)

    runs: dict[str, dict[str, Any]] = {}
    if tuned is None:
        grid = list(config.lrs)
        while True:
            specs = [RunSpec("standard", base, lr, k) for lr in grid for k in ks]
            got = run(specs)
            runs.update(got)
            b, rates = best_rate(runs, "standard", base, seeds)
            nxt = _next_out(b, rates)
            if nxt is None or not (train or any(s.key in got for s in specs)):
                break
            grid = [nxt]
        if b is None:
            assert not train, "every base run diverged"
            return {"tuned": None, "base_loss": None, "modes": {}}
        if refine:
            runs.update(
                run(
                    [RunSpec("standard", base, lr, k) for lr in _half_octaves(b, rates) for k in ks]
                )
            )
            b = best_rate(runs, "standard", base, seeds)[0] or b
        tuned = b
    else:
        # the base runs at b give FLeRM its records (and the read-out its base loss)
        runs.update(run([RunSpec("standard", base, tuned, k) for k in ks]))
    specs = [RunSpec(m, top, lr, k) for m in modes for lr in phase2_rates(tuned, m) for k in ks]
    while specs:
        got = run(specs)
        runs.update(got)
        if not (train or any(s.key in got for s in specs)):
            break
        specs = []
        for m in modes:
            nxt = _next_out(*best_rate(runs, m, top, seeds))
            if nxt is not None:
                specs += [RunSpec(m, top, nxt, k) for k in ks]
    if refine:
        specs = []
        for m in modes:
            best, rates = best_rate(runs, m, top, seeds)
            if best is not None:
                specs += [RunSpec(m, top, lr, k) for lr in _half_octaves(best, rates) for k in ks]
        runs.update(run(specs))
    return cell_summary(config, runs, tuned, modes)


def two_width_cell(
    config: SweepConfig,
    out: str | Path,
    out_second: str | Path,
    tuned: float,
    second: float,
    *,
    mode: str = "flerm",
    task: Task | None = None,
    jobs: int = 1,
    log: Callable[[str], None] | None = None,
    train: bool = True,
) -> dict[str, Any]:
    """``mode`` at the top width at a rate read from a second, small width.

    ``mode`` (FLeRM with ``config``'s variant, or muP) runs at ``second`` times the base
    width around the base's best rate ``tuned`` on the refined adaptive grid
    (:func:`adaptive_cell`, folder ``out_second``); its fitted best rate there
    (:func:`fitted_best`) is ``s`` octaves from ``tuned``. At the top width (folder ``out``,
    beside the cell's other runs of ``mode``) it then runs at ``tuned`` shifted by each model
    of how ``s`` grows with width: ``"inverse_width"``, :func:`width_extrapolated_shift`;
    ``"constant"``, ``s`` as it is. What a user gets who tunes the overall level at two
    small widths instead of one.

    Returns:
        ``{"second_fit_shift": s, "rates": {model: rate}, "at": {model: {"mean", "sd",
        "losses"}}}``; ``"rates"`` and ``"at"`` are empty when the second width has no
        converged rate (or, with ``train=False``, has not run).
    """
    base, top, seeds = config.base_scale, config.scales[-1], config.seeds
    if not (math.isfinite(tuned) and tuned > 0):
        raise ValueError(f"the base's rate must be a positive finite number; got {tuned}")
    if not 1 < second < top / base:
        raise ValueError(
            f"the second width multiple must lie between the base's (1) and the top one "
            f"({top / base:g}); got {second}"
        )
    small = config.replace(scales=(base, base * second))
    summary = adaptive_cell(
        small,
        out_second,
        modes=(mode,),
        tuned=tuned,
        task=task,
        jobs=jobs,
        log=log,
        train=train,
        refine=True,
    )
    s = summary["modes"].get(mode, {}).get("fit_shift")
    doc: dict[str, Any] = {"second_fit_shift": s, "rates": {}, "at": {}}
    if s is None:
        return doc
    shifts = {"inverse_width": width_extrapolated_shift(s, second, top / base), "constant": s}
    # exponents to 1/100 of an octave: the same float, so the same cached run, on a re-read
    rates = {k: 2.0 ** round(math.log2(tuned) + v, 2) for k, v in shifts.items()}
    specs = [RunSpec(mode, top, lr, k) for lr in rates.values() for k in range(seeds)]
    runs = run_specs(config, out, specs, task=task, jobs=jobs, log=log, train=train)
    doc["rates"] = rates
    for model, lr in rates.items():
        losses = _losses(runs, mode, top, lr, seeds)
        if losses is not None:
            doc["at"][model] = _spread(losses)
    return doc


def _spread(losses: list[float] | None) -> dict[str, Any]:
    """``{"mean", "sd", "losses"}`` of per-seed losses; mean ``None`` (and sd 0) unless every
    seed ran and converged."""
    if not losses or not all(map(math.isfinite, losses)):
        return {"mean": None, "sd": 0.0, "losses": losses}
    sd = statistics.stdev(losses) if len(losses) > 1 else 0.0
    return {"mean": statistics.fmean(losses), "sd": sd, "losses": losses}


def cell_summary(
    config: SweepConfig,
    runs: Mapping[str, Mapping[str, Any]],
    tuned: float,
    modes: Sequence[str],
) -> dict[str, Any]:
    """A cell's read-out (see the module docstring).

    Returns:
        ``{"tuned": b, "base_loss": mean loss at b at 1x, "modes": {mode: {"best_lr",
        "shift" (octaves from b), "fit_shift" (:func:`fitted_best`'s, from b), "best_loss",
        "best_test" (the test loss at the best rate), "at_tuned": {"mean", "sd", "losses",
        "test"}, "ratio": transferred loss / standard's best loss at 8x, "test_ratio": the
        test losses of the same two, "other_seeds_ratio": the transferred loss over
        standard's ``"other_seeds_best"`` (:func:`other_seeds_best`: re-tuning judged on seeds
        it was not chosen on) (non-standard modes)}}}``; a test loss is ``None`` where a seed
        has none (the task has no test split, or the run diverged). The rates are chosen by
        training loss throughout.

    Examples:
        >>> cfg = SweepConfig(scales=(1, 8), seeds=1)
        >>> runs = {RunSpec(m, s, lr, 0).key: {"mode": m, "scale": s, "lr": lr, "loss": v}
        ...         for m, s, lr, v in [("standard", 1.0, 0.5, 1.0), ("standard", 8.0, 0.25, 0.8),
        ...                             ("standard", 8.0, 0.5, 0.9), ("flerm", 8.0, 0.5, 0.84)]}
        >>> s = cell_summary(cfg, runs, 0.5, ["standard", "flerm"])
        >>> s["modes"]["standard"]["shift"], s["modes"]["flerm"]["ratio"]
        (-1.0, 1.05)
    """
    top, seeds = config.scales[-1], config.seeds
    base_losses = _losses(runs, "standard", config.base_scale, tuned, seeds)
    out: dict[str, Any] = {
        "tuned": tuned,
        "base_loss": None if base_losses is None else _score(base_losses),
        "modes": {},
    }
    for m in modes:
        best, rates = best_rate(runs, m, top, seeds)
        at = _losses(runs, m, top, tuned, seeds)
        fit = _fitted(runs, m, top, seeds, best, rates)
        entry: dict[str, Any] = {
            "best_lr": best,
            "shift": None if best is None else round(math.log2(best / tuned), 6),
            "fit_shift": None if fit is None else round(fit - math.log2(tuned), 6),
            "best_loss": None if best is None else _score(_losses(runs, m, top, best, seeds) or []),
            "rates": rates,
            "edge": best is not None and best in (rates[0], rates[-1]) and len(rates) > 1,
            "at_tuned": _spread(at),
        }
        entry["at_tuned"]["test"] = _test(runs, m, top, tuned, seeds)
        entry["best_test"] = None if best is None else _test(runs, m, top, best, seeds)
        out["modes"][m] = entry
    std = out["modes"].get("standard", {})
    if std:
        std["other_seeds_best"] = other_seeds_best(runs, "standard", top, seeds)
    for m, entry in out["modes"].items():
        if m == "standard":
            continue
        for key, mine, ref in (
            ("ratio", entry["at_tuned"]["mean"], std.get("best_loss")),
            ("test_ratio", entry["at_tuned"]["test"], std.get("best_test")),
            ("other_seeds_ratio", entry["at_tuned"]["mean"], std.get("other_seeds_best")),
        ):
            if ref and math.isfinite(ref) and mine is not None:
                entry[key] = round(mine / ref, 6)
    return out


def _test(
    runs: Mapping[str, Mapping[str, Any]], mode: str, scale: float, lr: float, seeds: int
) -> float | None:
    """The seed-mean test loss of a (mode, scale, lr) cell, ``None`` unless every seed has
    a finite one."""
    tests = _losses(runs, mode, scale, lr, seeds, "test_loss")
    return None if tests is None or not all(map(math.isfinite, tests)) else statistics.fmean(tests)
