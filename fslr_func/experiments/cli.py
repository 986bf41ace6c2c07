"""The ``fslr`` console script: ``fslr demo``, ``fslr sweep`` and ``fslr plot``.

- ``fslr demo``: the README's main job. ResMLP width transfer (32 to 256 units) on procedural
  MNIST-1D, standard Adam against muP and FLeRM, 9 learning rates an octave apart, 3 seeds
  (:data:`fslr_func.experiments.configs.DEMO`). Writes ``summary.json``, ``transfer.png``,
  ``fslr_time.png`` and ``flerm_lrs.png`` to ``fslr_runs/demo`` (``--out``) and prints the
  best learning rate per width for each mode and its shift in octaves.
- ``fslr sweep``: the same for any built-in model, axis, scales and learning rates.
- ``fslr plot``: re-draw the figures of a sweep folder, or plot a saved FSLR record.
- ``fslr check``: muP's coordinate check in function space: each tensor's movement per step
  against scale for a built-in model, standard and FLeRM, drifting tensors flagged
  (:mod:`fslr_func.experiments.check`; a model of your own goes in through a ``Task``).

Runs are cached in the output folder: an interrupted command resumes where it stopped when run
again, and a finished one re-plots instantly.

Examples:
    >>> main(["sweep", "--scales", "1,two"])  # doctest: +SKIP
    usage: fslr sweep [-h] ...
    fslr sweep: error: argument --scales: 'two' is not a number
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..io.atomic import write_json
from ..io.record_meta import library_version
from ..training.policies import POLICIES
from .configs import (
    AXES,
    DATA,
    DEMO,
    DEPTH_AXES,
    FLERM_INITS,
    MODELS,
    MODES,
    NORMS,
    WIDTH_AXES,
    ConfigError,
    SweepConfig,
)
from .train import OPTIMIZERS, SCHEDULES

__all__ = ["build_parser", "main", "parse_lrs"]

_NUMBER = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?"


def _number(text: str) -> float:
    """A float, or ``2^k`` / ``2**k``."""
    t = text.strip()
    m = re.fullmatch(rf"2\s*(?:\^|\*\*)\s*({_NUMBER})", t)
    try:
        value = 2.0 ** float(m.group(1)) if m else float(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text.strip()!r} is not a number") from None
    except OverflowError:  # 2^2000
        raise argparse.ArgumentTypeError(f"{text.strip()!r} is not a finite number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text.strip()!r} is not a finite number")
    return value


def parse_lrs(text: str) -> tuple[float, ...]:
    """Learning rates from the command line: a comma list of numbers or ``2^k`` and ranges.

    ``LO..HI`` is one learning rate per octave from ``LO`` up to ``HI``; ``LO..HI/N`` has ``N``
    per octave.

    Examples:
        >>> parse_lrs("1e-3, 2^-4")
        (0.001, 0.0625)
        >>> [f"{x:g}" for x in parse_lrs("2^-4..2^-2")]
        ['0.0625', '0.125', '0.25']
        >>> len(parse_lrs("2^-4..2^-2/2"))
        5
    """
    out: list[float] = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            raise argparse.ArgumentTypeError(f"empty item in {text!r}")
        if ".." in item:
            span, _, per = item.partition("/")
            lo_text, _, hi_text = span.partition("..")
            lo, hi = _number(lo_text), _number(hi_text)
            try:
                n = int(per) if per else 1
            except ValueError:
                raise argparse.ArgumentTypeError(
                    f"{per!r} in {item!r} is not a whole number of learning rates per octave"
                ) from None
            if lo <= 0 or hi < lo or n < 1:
                raise argparse.ArgumentTypeError(
                    f"range {item!r} needs 0 < LO <= HI and a positive count per octave"
                )
            k = 0
            while lo * 2.0 ** (k / n) <= hi * (1 + 1e-9):
                out.append(lo * 2.0 ** (k / n))
                k += 1
                if k > 10_000:
                    raise argparse.ArgumentTypeError(f"range {item!r} is too long")
        else:
            out.append(_number(item))
    bad = [x for x in out if x <= 0]
    if bad:
        raise argparse.ArgumentTypeError(f"learning rates must be > 0, got {bad[0]:g}")
    return tuple(out)


LR_RANGE = (2.0**-40, 2.0**10)
"""Learning rates the command accepts (every sweep rate, ``fslr check --lr``)."""

SCALE_RANGE = (2.0**-6, 2.0**10)
"""Scale multipliers the command accepts."""

MAX_WIDTH = 2**13
"""Largest width (base width times scale) of a built-in model."""

MAX_DEPTH = 2**9
"""Largest number of blocks (base depth times scale) of a built-in model."""

MAX_VALUES = 256
"""Most learning rates or scales one sweep takes."""

INT_RANGES: dict[str, tuple[int, int]] = {
    "steps": (1, 10**6),
    "seeds": (1, 100),
    "width": (1, MAX_WIDTH),
    "depth": (1, MAX_DEPTH),
    "batch_size": (1, 2**16),
    "num_samples": (100, 10**6),
    "seq_len": (2, 2**12),
    "last": (1, 10**6),
    "samples": (1, 2**12),
    "warmup_samples": (1, 2**16),
    "every": (1, 10**6),
    "jobs": (1, 256),
    "seed": (0, 2**32 - 1),
}
"""Accepted range of every whole-number option, both ends included."""

FLOAT_RANGES: dict[str, tuple[float, float]] = {
    "lr": LR_RANGE,
    "init_scale": (2.0**-20, 2.0**20),
    "weight_decay": (0.0, 10.0),
    "threshold": (1.0, 2.0**20),
}
"""Accepted range of every number option, both ends included (``threshold`` excludes 1)."""


def _range(lo: float, hi: float) -> str:
    """``[lo, hi]`` as the messages show it (``2^k`` for powers of two).

    Example:
        >>> _range(2.0**-40, 1024.0), _range(1, 100), _range(0.0, 10.0), _range(2.0**-6, 0.5)
        ('[2^-40, 2^10]', '[1, 100]', '[0, 10]', '[2^-6, 2^-1]')
    """

    def show(x: float) -> str:
        k = math.log2(x) if x > 0 else 0.5
        if k.is_integer() and (k < 0 or k >= 10):
            return f"2^{int(k)}"
        return str(int(x)) if float(x).is_integer() else f"{x:g}"

    return f"[{show(lo)}, {show(hi)}]"


def _in_range(value: float, lo: float, hi: float, what: str, text: str) -> None:
    if not lo <= value <= hi:
        raise argparse.ArgumentTypeError(f"{what} in {_range(lo, hi)}, got {text!r}")


def _accepted(parse: Any, what: str, lo: float, hi: float) -> Any:
    """``parse`` whose errors end with the accepted range."""

    def checked(text: str) -> Any:
        try:
            return parse(text)
        except argparse.ArgumentTypeError as err:
            if " in [" in str(err):
                raise
            raise argparse.ArgumentTypeError(
                f"{err}; accepted: {what} in {_range(lo, hi)}"
            ) from None

    checked.__name__ = getattr(parse, "__name__", what)
    return checked


def _values(text: str, what: str, lo: float, hi: float) -> tuple[float, ...]:
    """A comma list of numbers, each in ``[lo, hi]``, at most :data:`MAX_VALUES`."""
    values = tuple(_number(item) for item in text.split(","))
    if len(values) > MAX_VALUES:
        raise argparse.ArgumentTypeError(f"at most {MAX_VALUES} {what}, got {len(values)}")
    for v in values:
        _in_range(v, lo, hi, f"{what} must be", f"{v:g}")
    return values


_scales = _accepted(lambda text: _values(text, "scales", *SCALE_RANGE), "scales", *SCALE_RANGE)
_lrs = _accepted(
    lambda text: _values(",".join(repr(v) for v in parse_lrs(text)), "learning rates", *LR_RANGE),
    "learning rates",
    *LR_RANGE,
)


def _integer(field: str) -> Any:
    """argparse type: a whole number in ``INT_RANGES[field]``."""
    lo, hi = INT_RANGES[field]

    def parse(text: str) -> int:
        try:
            value = int(text.strip(), 10)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text.strip()[:40]!r} is not a whole number"
            ) from None
        _in_range(value, lo, hi, "must be a whole number", text.strip())
        return value

    parse.__name__ = field  # argparse names the type in its own messages
    return _accepted(parse, "a whole number", lo, hi)


def _real(field: str) -> Any:
    """argparse type: a number (or ``2^k``) in ``FLOAT_RANGES[field]``."""
    lo, hi = FLOAT_RANGES[field]

    def parse(text: str) -> float:
        value = _number(text)
        _in_range(value, lo, hi, "must be a number", text.strip())
        if field == "threshold" and value == 1.0:
            raise argparse.ArgumentTypeError("the factor must be > 1, got 1")
        return value

    parse.__name__ = field
    return _accepted(parse, "a number", lo, hi)


def _modes(text: str) -> tuple[str, ...]:
    modes = tuple(m.strip() for m in text.split(",") if m.strip())
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise argparse.ArgumentTypeError(
            f"choose from {', '.join(MODES)} (comma-separated), got {text!r}"
        )
    return modes


def _check_modes(text: str) -> tuple[str, ...]:
    from .check import CHECK_MODES

    modes = tuple(m.strip() for m in text.split(",") if m.strip())
    if not modes or any(m not in CHECK_MODES for m in modes):
        raise argparse.ArgumentTypeError(
            f"choose from {', '.join(CHECK_MODES)} (comma-separated), got {text!r}"
        )
    return modes


# config field -> (flag, argparse kwargs)
_OPTIONS: dict[str, tuple[str, dict[str, Any]]] = {
    "model": ("--model", {"choices": MODELS, "help": "model family"}),
    "axis": ("--axis", {"choices": AXES, "help": "what to scale (the smallest scale is the base)"}),
    "scales": (
        "--scales",
        {
            "type": _scales,
            "metavar": "S,S,...",
            "help": f"scale multipliers in {_range(*SCALE_RANGE)}, e.g. 1,2,4,8",
        },
    ),
    "lrs": (
        "--lrs",
        {
            "type": _lrs,
            "metavar": "LRS",
            "help": "learning rates: comma list of numbers or 2^k, or LO..HI (one per octave), "
            f"LO..HI/N (N per octave), e.g. 2^-13..2^-5; each in {_range(*LR_RANGE)}",
        },
    ),
    "steps": ("--steps", {"type": _integer("steps"), "help": "optimiser steps per run"}),
    "seeds": (
        "--seeds",
        {"type": _integer("seeds"), "help": "seeds per run (base records averaged)"},
    ),
    "data": (
        "--data",
        {
            "choices": sorted({d for ds in DATA.values() for d in ds}),
            "help": "mnist1d or digits (resmlp), text (transformer)",
        },
    ),
    "width": ("--width", {"type": _integer("width"), "help": "base width (ResMLP units, d_model)"}),
    "depth": ("--depth", {"type": _integer("depth"), "help": "base number of residual blocks"}),
    "init_scale": (
        "--init-scale",
        {"type": _real("init_scale"), "help": "base init scale of the block weights"},
    ),
    "batch_size": ("--batch-size", {"type": _integer("batch_size"), "help": "training batch size"}),
    "num_samples": (
        "--num-samples",
        {"type": _integer("num_samples"), "help": "MNIST-1D samples generated (train + test)"},
    ),
    "seq_len": ("--seq-len", {"type": _integer("seq_len"), "help": "transformer context length"}),
    "norm": (
        "--norm",
        {
            "choices": NORMS,
            "help": "transformer norm placement: x + f(Norm(x)) (prenorm), Norm(x + f(x)) "
            "(postnorm) or x + Norm(f(x)) (prenormpostmod)",
        },
    ),
    "last": (
        "--last",
        {"type": _integer("last"), "help": "a run's loss is the mean over its last LAST batches"},
    ),
    "samples": ("--samples", {"type": _integer("samples"), "help": "omega samples per FSLR probe"}),
    "warmup_samples": (
        "--warmup-samples",
        {
            "type": _integer("warmup_samples"),
            "help": "omega samples of the EMA warm-up (paper: 40)",
        },
    ),
    "every": (
        "--every",
        {"type": _integer("every"), "help": "base runs record FSLRs every EVERY steps"},
    ),
    "modes": ("--modes", {"type": _modes, "help": "which modes to run, comma-separated"}),
    "strategy": (
        "--strategy",
        {
            "choices": ("vmap", "loop", "autograd", "auto"),
            "help": "probe strategy (pinned for reproducible sweeps; auto decides by timing)",
        },
    ),
    "optimizer": (
        "--optimizer",
        {"choices": OPTIMIZERS, "help": "optimiser of every mode (sgd: momentum 0.9)"},
    ),
    "weight_decay": (
        "--weight-decay",
        {"type": _real("weight_decay"), "help": "weight decay (decoupled for adamw)"},
    ),
    "schedule": (
        "--schedule",
        {"choices": SCHEDULES, "help": "learning-rate schedule (warmup_cosine: 10%% warm-up)"},
    ),
    "flerm_policy": (
        "--policy",
        {
            "choices": tuple(POLICIES),
            "help": "FLeRM's policy (default: share_blocks where the depth changes, else "
            "identity; equal and equal_all are the paper's ablations)",
        },
    ),
    "flerm_init": (
        "--flerm-init",
        {
            "choices": FLERM_INITS,
            "help": "FLeRM's models: the standard initialisation, or muP's initialisation and "
            "readout multiplier (FLeRM still sets every rate)",
        },
    ),
    "flerm_mode": (
        "--flerm-mode",
        {
            "choices": ("static", "periodic"),
            "help": "FLeRM sets the rates once after the warm-up (static, the paper's main "
            "results) or also every EVERY steps (periodic)",
        },
    ),
}
_FLAG = {field: flag for field, (flag, _) in _OPTIONS.items()}


def _add_sweep_options(p: argparse.ArgumentParser, defaults: SweepConfig, out: str) -> None:
    for field, (flag, kwargs) in _OPTIONS.items():
        default = getattr(defaults, field)
        shown = (
            ",".join(f"{v:g}" if isinstance(v, float) else str(v) for v in default)
            if (isinstance(default, tuple))
            else default
        )
        bounds = INT_RANGES.get(field) or FLOAT_RANGES.get(field)
        notes = [f"in {_range(*bounds)}"] if bounds else []
        notes += [] if default is None else [f"default: {shown}"]
        help_text = f"{kwargs['help']} ({'; '.join(notes)})" if notes else kwargs["help"]
        p.add_argument(flag, dest=field, default=None, **{**kwargs, "help": help_text})
    p.add_argument("--out", type=Path, default=None, help=f"output folder (default: {out})")
    p.add_argument(
        "--jobs",
        type=_integer("jobs"),
        default=None,
        help="worker processes, one single-threaded run each (default: the CPU cores, at most 8)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--no-plots", action="store_true", help="write summary.json only")


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The ``fslr`` parser and its subcommand parsers (by name)."""
    parser = argparse.ArgumentParser(
        prog="fslr",
        description="Function-space learning rates and FLeRM learning-rate transfer: run the "
        "demo, run a learning-rate transfer sweep, or plot results.",
    )
    parser.add_argument("--version", action="version", version=f"fslr_func {library_version()}")
    sub = parser.add_subparsers(dest="command", metavar="{demo,sweep,plot,check}")
    sub.required = True
    demo = sub.add_parser(
        "demo",
        help="ResMLP width transfer on bundled data, standard vs muP vs FLeRM (a few minutes)",
        description="ResMLP width transfer (32 to 256 units) on procedural MNIST-1D: standard "
        "Adam vs muP vs FLeRM over 9 learning rates. Writes summary.json and PNGs and prints the "
        "best learning rate per width. Every option defaults to the demo's configuration.",
    )
    _add_sweep_options(demo, DEMO, "fslr_runs/demo")
    sweep = sub.add_parser(
        "sweep",
        help="learning rates x scales x {standard, muP, FLeRM} for a built-in model",
        description="Learning-rate transfer sweep: every learning rate x scale x seed, with "
        "the plain optimiser, in muP and with FLeRM (base = the smallest scale). Runs are "
        "cached in the output folder; run the same command again to resume. The defaults shown "
        "are the ResMLP's; with --model transformer the data, width, depth, batch size and "
        "learning rates default to the transformer's (text, 32, 2, 16, 2^-12..2^-4).",
    )
    _add_sweep_options(sweep, SweepConfig(), "fslr_runs/<model>_<axis>")
    plot = sub.add_parser(
        "plot",
        help="draw the figures of a sweep folder or of a saved FSLR record",
        description="Re-draw transfer.png, fslr_time.png and flerm_lrs.png of a sweep folder "
        "(and print its table), or plot a record JSON (FSLR over time).",
    )
    plot.add_argument("path", type=Path, help="a sweep folder or an FSLRRecord JSON file")
    plot.add_argument(
        "--out", type=Path, default=None, help="where to write (default: beside the input)"
    )
    check = sub.add_parser(
        "check",
        help="coordinate check in function space: each tensor's FSLR against scale",
        description="Train a built-in model at each scale for a few steps at one learning "
        "rate, with the plain optimiser and with FLeRM (base = the smallest scale), and show "
        "how each tensor's function-space movement per step (lr x FSLR) moves with scale; "
        "tensors drifting by more than --threshold are flagged. Writes check.json and "
        "check.png.",
    )
    for field in ("model", "axis", "scales", "data", "width", "depth", "batch_size"):
        flag, kwargs = _OPTIONS[field]
        check.add_argument(flag, dest=field, default=None, **kwargs)
    check.add_argument("--optimizer", choices=OPTIMIZERS, default="adam", help="(default: adam)")
    check.add_argument(
        "--lr", type=_real("lr"), default=2.0**-6, help=f"in {_range(*LR_RANGE)} (default: 2^-6)"
    )
    check.add_argument(
        "--steps", type=_integer("steps"), default=10, help="steps per run, >= 2 (default: 10)"
    )
    check.add_argument(
        "--seed", type=_integer("seed"), default=0, help="seed of every run (default: 0)"
    )
    check.add_argument(
        "--modes",
        type=_check_modes,
        default=("standard", "flerm"),
        help="standard, mup and/or flerm, comma-separated (default: standard,flerm)",
    )
    check.add_argument(
        "--every", type=_integer("every"), default=1, help="probe every EVERY steps (default: 1)"
    )
    check.add_argument(
        "--threshold",
        type=_real("threshold"),
        default=2.0,
        help="flag tensors whose movement changes by more than this factor (default: 2)",
    )
    check.add_argument("--out", type=Path, default=None, help="default: fslr_runs/check")
    check.add_argument("--no-plots", action="store_true", help="write check.json only")
    return parser, {"demo": demo, "sweep": sweep, "plot": plot, "check": check}


def _config(args: argparse.Namespace, demo: bool) -> SweepConfig:
    given = {f: getattr(args, f) for f in _OPTIONS if getattr(args, f) is not None}
    if demo:
        return DEMO.replace(**given)
    model = given.pop("model", "resmlp")
    return SweepConfig.for_model(model, **given)


def _check_size(config: SweepConfig, parser: argparse.ArgumentParser) -> None:
    """Refuse a sweep whose largest model exceeds :data:`MAX_WIDTH` or :data:`MAX_DEPTH`."""
    top = max(config.scales)
    sizes = [
        ("width", "--width", config.width, MAX_WIDTH, WIDTH_AXES),
        ("depth", "--depth", config.depth, MAX_DEPTH, DEPTH_AXES),
    ]
    for what, flag, base, limit, axes in sizes:
        largest = base * top if config.axis in axes else base
        if largest > limit:
            where = "--scales" if config.axis in axes and base <= limit else flag
            parser.error(
                f"argument {where}: the largest model would have {what} {largest:g}; accepted: "
                f"{flag} x the largest scale in [1, {limit}]"
            )


def _note(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _run(args: argparse.Namespace, parser: argparse.ArgumentParser, demo: bool) -> int:
    from .sweep import default_jobs, format_table, run_sweep

    try:
        config = _config(args, demo).validate()
    except ConfigError as err:
        parser.error(f"argument {_FLAG.get(err.field, err.field)}: {err.message}")
    _check_size(config, parser)
    norm = "" if config.norm == "prenorm" else f"-{config.norm}"
    policy = "" if config.flerm_policy is None else f"-{config.flerm_policy}"
    init = "" if config.flerm_init == "standard" else f"-{config.flerm_init}init"
    name = "demo" if demo else f"{config.model}{norm}_{config.axis}{policy}{init}"
    out: Path = args.out or Path("fslr_runs") / name
    if out.exists() and not out.is_dir():
        parser.error(f"argument --out: {str(out)!r} exists and is not a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        parser.error(f"argument --out: cannot create {str(out)!r}: {err.strerror or err}")
    if not os.access(out, os.W_OK | os.X_OK):
        parser.error(f"argument --out: {str(out)!r} is not writable")
    jobs = args.jobs or default_jobs()
    start = time.perf_counter()
    try:
        old = json.loads((out / "sweep.json").read_text())
        if old.get("fingerprint") != config.fingerprint({"task": config.task_name}):
            _note(
                f"note: {out} holds runs of another configuration; they are re-run "
                "(use another --out to keep them)"
            )
    except (OSError, ValueError, AttributeError):
        pass
    _note(
        f"fslr {'demo' if demo else 'sweep'}: {config.task_name}, {config.axis} x "
        f"{','.join(f'{s:g}' for s in config.scales)}, {len(config.lrs)} learning rates, "
        f"{config.seeds} seed(s), {config.steps} steps, {jobs} job(s) -> {out}"
    )
    try:
        result = run_sweep(config, out, jobs=jobs, quiet=args.quiet)
        summary = result.summary
        written = [out / "summary.json"]
        if not args.no_plots:
            try:
                from .plot import plot_sweep

                written += plot_sweep(out)
            except ImportError as err:
                _note(f"note: no plots ({err})")
        summary["wall_seconds"] = round(time.perf_counter() - start, 2)
        _write_summary(out / "summary.json", summary)
    except KeyboardInterrupt:
        _note(f"\ninterrupted: finished runs are cached in {out}; run the same command to resume")
        return 130
    except OSError as err:  # every file the command writes is in --out (disk full, read-only)
        parser.error(f"argument --out: {err}")
    print(
        f"\nBest learning rate per {config.axis} (train loss averaged over the last "
        f"{config.last} of {config.steps} batches, mean of {config.seeds} seed(s)):\n"
    )
    print(format_table(summary))
    check = summary.get("identity_check") or {}
    if check:
        print(
            f"\nidentity check (FLeRM at the base scale): rates / lr in "
            f"[{check['lr_ratio_min']:.3f}, {check['lr_ratio_max']:.3f}]"
        )
    cached = len(set(result.runs) - set(result.executed))
    print(
        f"\n{len(result.executed)} run(s) trained, {cached} cached; {summary['wall_seconds']:.0f} s"
    )
    print("wrote " + ", ".join(str(p) for p in written))
    return 0


def _write_summary(path: Path, summary: dict[str, Any]) -> None:
    write_json(path, summary, parents=True)


def _plot(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from .plot import plot_record, plot_sweep
    from .sweep import format_table, load_runs, summarise

    path: Path = args.path
    if not path.exists():
        parser.error(f"argument path: {str(path)!r} does not exist")
    if path.is_dir() and not (path / "sweep.json").exists():
        parser.error(f"argument path: {str(path)!r} is not a sweep folder (no sweep.json)")
    if not path.is_dir() and not path.is_file():  # a device, a pipe: never read forever
        parser.error(f"argument path: {str(path)!r} is not a file: pass a record JSON file")
    try:
        if path.is_dir():
            written = plot_sweep(path, args.out)
            config, runs = load_runs(path)
            print(format_table(summarise(config, runs)))
        else:
            written = plot_record(path, args.out)
    except (OSError, ValueError) as err:  # a damaged file, an unwritable --out
        where = "--out" if args.out is not None and str(args.out) in str(err) else "path"
        parser.error(f"argument {where}: {err}")
    print("wrote " + ", ".join(str(p) for p in written))
    return 0


def _check(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from .check import coord_check, format_check
    from .task import builtin_task

    given = {
        f: getattr(args, f)
        for f in ("axis", "scales", "data", "width", "depth", "batch_size")
        if getattr(args, f) is not None
    }
    if args.steps < 2:
        parser.error(
            f"argument --steps: must be in [2, {INT_RANGES['steps'][1]}] (step 0 is FLeRM's "
            f"set point), got {args.steps}"
        )
    try:
        config = SweepConfig.for_model(
            args.model or "resmlp", lrs=(args.lr,), steps=args.steps, last=1, **given
        ).validate()
    except ConfigError as err:
        parser.error(f"argument {_FLAG.get(err.field, err.field)}: {err.message}")
    _check_size(config, parser)
    if args.every > args.steps:
        parser.error(f"argument --every: must be in [1, --steps={args.steps}], got {args.every}")
    out: Path = args.out or Path("fslr_runs") / "check"
    if out.exists() and not out.is_dir():
        parser.error(f"argument --out: {str(out)!r} exists and is not a folder")
    _note(
        f"fslr check: {config.model} on {config.data}, {config.axis} x "
        f"{','.join(f'{s:g}' for s in config.scales)}, lr {args.lr:g}, {args.steps} steps -> {out}"
    )
    task = builtin_task(config)
    result = coord_check(
        task,
        config.scales,
        args.lr,
        steps=args.steps,
        seed=args.seed,
        every=args.every,
        optimizer=args.optimizer,
        modes=args.modes,
        threshold=args.threshold,
    )
    result["task"] = config.task_name
    result["config"] = config.to_dict()
    written = [out / "check.json"]
    write_json(written[0], result, parents=True)
    if not args.no_plots:
        try:
            from .plot import plot_check

            written.append(plot_check(result, out / "check.png"))
        except ImportError as err:
            _note(f"note: no plots ({err})")
    print(format_check(result))
    print("wrote " + ", ".join(str(p) for p in written))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``fslr`` console script; returns the exit status.

    Bad arguments exit with status 2 and a last line naming the argument and its accepted
    range. Nothing ends in a traceback: an unexpected error is one line and status 1
    (``FSLR_TRACEBACK=1`` in the environment shows the traceback).
    """
    parser, subs = build_parser()
    try:
        args = parser.parse_args(argv)
        if args.command == "plot":
            return _plot(args, subs["plot"])
        if args.command == "check":
            return _check(args, subs["check"])
        return _run(args, subs[args.command], demo=args.command == "demo")
    except ImportError as err:
        print(f"fslr: error: {err}", file=sys.stderr)
        return 1
    except Exception as err:  # never a traceback; FSLR_TRACEBACK=1 shows it (a bug: report it)
        if os.environ.get("FSLR_TRACEBACK"):
            raise
        reason = str(err).strip().splitlines()[0] if str(err).strip() else ""
        print(
            f"fslr: error: {type(err).__name__}: {reason} (unexpected: run again with "
            "FSLR_TRACEBACK=1 to see where, and report it)",
            file=sys.stderr,
        )
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
