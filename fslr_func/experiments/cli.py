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
import importlib
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..io.atomic import write_json
from ..io.record_meta import library_version
from .cli_args import (
    FLOAT_RANGES,
    INT_RANGES,
    LR_RANGE,
    MAX_DEPTH,
    MAX_WIDTH,
    SWEEP_OPTIONS,
    check_modes_type,
    integer_type,
    parse_lrs,
    real_type,
    value_range,
)
from .configs import (
    DEMO,
    DEPTH_AXES,
    WIDTH_AXES,
    ConfigError,
    SweepConfig,
)
from .train import OPTIMIZERS

if TYPE_CHECKING:
    from .task import Task

__all__ = ["build_parser", "main", "parse_lrs"]  # parse_lrs: its home is cli_args

_FLAG = {field: flag for field, (flag, _) in SWEEP_OPTIONS.items()}


def _add_config_options(
    p: argparse.ArgumentParser, defaults: SweepConfig, fields: Sequence[str] = tuple(SWEEP_OPTIONS)
) -> None:
    """The options of a sweep's configuration, each with its range and its default."""
    for field in fields:
        flag, kwargs = SWEEP_OPTIONS[field]
        default = getattr(defaults, field)
        shown = (
            ",".join(f"{v:g}" if isinstance(v, float) else str(v) for v in default)
            if (isinstance(default, tuple))
            else default
        )
        bounds = INT_RANGES.get(field) or FLOAT_RANGES.get(field)
        notes = [f"in {value_range(*bounds)}"] if bounds else []
        notes += [] if default is None else [f"default: {shown}"]
        help_text = f"{kwargs['help']} ({'; '.join(notes)})" if notes else kwargs["help"]
        p.add_argument(flag, dest=field, default=None, **{**kwargs, "help": help_text})


def _add_sweep_options(p: argparse.ArgumentParser, defaults: SweepConfig, out: str) -> None:
    _add_config_options(p, defaults)
    p.add_argument("--out", type=Path, default=None, help=f"output folder (default: {out})")
    p.add_argument(
        "--jobs",
        type=integer_type("jobs"),
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
        "check.png. The defaults shown are the ResMLP's; with --model the data, width, depth "
        "and batch size default to that model's, as in fslr sweep.",
    )
    fields = ("model", "axis", "scales", "data", "width", "depth", "batch_size")
    _add_config_options(check, SweepConfig(), fields)
    check.add_argument("--optimizer", choices=OPTIMIZERS, default="adam", help="(default: adam)")
    check.add_argument(
        "--lr",
        type=real_type("lr"),
        default=2.0**-6,
        help=f"in {value_range(*LR_RANGE)} (default: 2^-6)",
    )
    check.add_argument(
        "--steps", type=integer_type("steps"), default=10, help="steps per run, >= 2 (default: 10)"
    )
    check.add_argument(
        "--seed",
        type=integer_type("seed"),
        default=0,
        help=f"seed of every run (in {value_range(*INT_RANGES['seed'])}; default: 0)",
    )
    check.add_argument(
        "--modes",
        type=check_modes_type,
        default=("standard", "flerm"),
        help="standard, mup, flerm and/or features (FLeRM with match='features'), "
        "comma-separated (default: standard,flerm)",
    )
    check.add_argument(
        "--every",
        type=integer_type("every"),
        default=1,
        help="probe every EVERY steps (in [1, --steps - 1]; default: 1)",
    )
    check.add_argument(
        "--threshold",
        type=real_type("threshold"),
        default=2.0,
        help="flag tensors whose movement changes by more than this factor (in "
        f"({value_range(*FLOAT_RANGES['threshold'])[1:]}; default: 2)",
    )
    check.add_argument(
        "--task",
        default=None,
        metavar="MODULE:NAME",
        help="your own model family: a Task (fslr_func.experiments.task.Task), or a function "
        "of no arguments returning one, importable as MODULE:NAME (instead of --model, --data, "
        "--width, --depth, --batch-size, --axis; --scales default 1,2,4,8)",
    )
    check.add_argument("--out", type=Path, default=None, help="default: fslr_runs/check")
    check.add_argument("--no-plots", action="store_true", help="write check.json only")
    return parser, {"demo": demo, "sweep": sweep, "plot": plot, "check": check}


def _config(args: argparse.Namespace, demo: bool) -> SweepConfig:
    given = {f: getattr(args, f) for f in SWEEP_OPTIONS if getattr(args, f) is not None}
    if demo:
        config = DEMO.replace(**given)
    else:
        model = given.pop("model", "resmlp")
        config = SweepConfig.for_model(model, **given)
    if "last" not in given and config.last > config.steps:
        # `--steps 20` alone: the default --last (30) would refuse a run the user never asked
        # about; average over every step instead (a --last given is checked as given)
        config = config.replace(last=config.steps)
    return config


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
    out = _out_folder(args.out or Path("fslr_runs") / name, parser)
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
    config: SweepConfig | None = None
    if args.task is not None:
        chosen = [f for f in ("model", *given) if f != "scales" and getattr(args, f) is not None]
        clash = [_FLAG[f] for f in chosen]
        if clash:
            parser.error(f"argument --task: the task is the model and its data: drop {clash}")
        task = _user_task(args.task, parser)
        scales = tuple(args.scales or (1, 2, 4, 8))
        if len(set(scales)) != len(scales):  # as a built-in model's scales are checked
            parser.error(f"argument --scales: must be distinct, got {list(scales)}")
        what = task.name
    else:
        try:
            config = SweepConfig.for_model(
                args.model or "resmlp", lrs=(args.lr,), steps=args.steps, last=1, **given
            ).validate()
        except ConfigError as err:
            parser.error(f"argument {_FLAG.get(err.field, err.field)}: {err.message}")
        _check_size(config, parser)
        task, scales = builtin_task(config), config.scales
        what = f"{config.model} on {config.data}, {config.axis}"
    if args.every > args.steps - 1:  # a probe after the set point is what is measured
        parser.error(
            f"argument --every: must be in [1, --steps - 1 = {args.steps - 1}], got {args.every}"
        )
    out = _out_folder(args.out or Path("fslr_runs") / "check", parser)
    _note(
        f"fslr check: {what} x {','.join(f'{s:g}' for s in scales)}, lr {args.lr:g}, "
        f"{args.steps} steps -> {out}"
    )
    result = coord_check(
        task,
        scales,
        args.lr,
        steps=args.steps,
        seed=args.seed,
        every=args.every,
        optimizer=args.optimizer,
        modes=args.modes,
        threshold=args.threshold,
    )
    result["task"] = task.name if config is None else config.task_name
    if config is not None:
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


def _out_folder(out: Path, parser: argparse.ArgumentParser) -> Path:
    """``--out``, created and checked writable before anything is trained."""
    if out.exists() and not out.is_dir():
        parser.error(f"argument --out: {str(out)!r} exists and is not a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        parser.error(f"argument --out: cannot create {str(out)!r}: {err.strerror or err}")
    if not os.access(out, os.W_OK | os.X_OK):
        parser.error(f"argument --out: {str(out)!r} is not writable")
    return out


def _user_task(spec: str, parser: argparse.ArgumentParser) -> Task:
    """The :class:`~fslr_func.experiments.task.Task` named by ``--task MODULE:NAME`` (a task,
    or a function of no arguments returning one)."""
    from .task import Task

    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        parser.error(f"argument --task: expected MODULE:NAME (e.g. mypkg.tasks:mlp), got {spec!r}")
    if os.getcwd() not in sys.path:  # as `python -m`: modules of the current directory
        sys.path.insert(0, os.getcwd())
    try:
        found = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, TypeError, ValueError) as err:
        # TypeError: a relative name ("./tasks.py", ".tasks"); ValueError: an empty part
        parser.error(
            f"argument --task: cannot import {spec!r}: {err} (MODULE is a module name, as "
            "for `python -m`: tasks for ./tasks.py, run from its folder)"
        )
    task = found() if callable(found) and not isinstance(found, Task) else found
    if not isinstance(task, Task):
        parser.error(
            f"argument --task: {spec!r} gives {type(task).__name__}, not a "
            "fslr_func.experiments.task.Task (name a task or a function returning one)"
        )
    return task


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``fslr`` console script; returns the exit status.

    Bad arguments exit with status 2 and a last line naming the argument and its accepted
    range. Nothing ends in a traceback: an unexpected error is one line and status 1
    (``FSLR_TRACEBACK=1`` in the environment shows the traceback).
    """
    parser, subs = build_parser()
    args: argparse.Namespace | None = None
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
        where = (
            "run again with FSLR_TRACEBACK=1 to see where: in your --task's code, fix it "
            "there; in fslr_func, report it"
            if getattr(args, "task", None)
            else "unexpected: run again with FSLR_TRACEBACK=1 to see where, and report it"
        )
        print(f"fslr: error: {type(err).__name__}: {reason} ({where})", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
