"""Figures of FSLR records and learning-rate transfer sweeps (optional extra: matplotlib).

- :func:`plot_transfer`: training loss against learning rate, one line per scale, standard
  training on top and FLeRM below, the best learning rate of each scale starred (paper
  figure 2).
- :func:`plot_fslr_time`: the FSLR of every tensor of a recorded run over training, coloured
  by the tensor's kind (input, hidden, readout, bias, attention...; paper figure 1).
- :func:`plot_flerm_lrs`: the per-tensor learning rates FLeRM set at each scale, relative to
  the base learning rate.
- :func:`plot_check`: ``fslr check``'s function-space movement of every tensor against scale,
  one panel per mode, the tensors drifting by more than the threshold drawn thick.
- :func:`plot_sweep` and :func:`plot_record`: all figures of a sweep folder or of a saved
  :class:`~fslr_func.io.record.FSLRRecord`.

matplotlib is imported only when a figure is drawn, and only its object-oriented API is used
(``matplotlib.figure.Figure``, rendered by Agg): no global backend is switched and no window
opens. Install it with ``pip install 'fslr_func[plot]'``.

Examples:
    >>> tensor_kind("blocks.3.linear.weight"), tensor_kind("readout.bias")
    ('hidden', 'bias')
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..io.record import FSLRRecord
from .summary import shift_text

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = [
    "KIND_COLOURS",
    "plot_check",
    "plot_flerm_lrs",
    "plot_fslr_time",
    "plot_record",
    "plot_sweep",
    "plot_transfer",
    "tensor_kind",
]

KIND_COLOURS = {
    "input": "tab:blue",
    "hidden": "tab:orange",
    "QK weights": "tab:purple",
    "VO weights": "tab:pink",
    "FF up": "tab:olive",
    "FF down": "tab:brown",
    "norm": "tab:cyan",
    "readout": "tab:green",
    "bias": "tab:gray",
}
"""Colour of each tensor kind in :func:`plot_fslr_time` and :func:`plot_flerm_lrs`."""

_PATTERNS = (
    ("bias", r"(^|\.)bias$"),
    ("norm", r"(^|\.|_)(norm|ln|layernorm)[^.]*\.weight$"),
    ("readout", r"(^|\.)(readout|head|lm_head|classifier|fc_out|output)\."),
    ("input", r"(^|\.)(input|embed|embedding|embeddings|wte|wpe|pos|tok_emb|pos_emb)\."),
    ("QK weights", r"(^|\.)(q|k|q_proj|k_proj|query|key|wq|wk)\."),
    ("VO weights", r"(^|\.)(v|o|v_proj|o_proj|value|out_proj|wv|wo)\."),
    ("FF up", r"(^|\.)(up|fc1|up_proj|gate_proj|c_fc|w1|w3)\."),
    ("FF down", r"(^|\.)(down|fc2|down_proj|c_proj|w2)\."),
)


def tensor_kind(name: str) -> str:
    """The kind of a parameter tensor, guessed from its name (for colours and legends).

    One of :data:`KIND_COLOURS`'s keys; ``"hidden"`` when nothing else matches.

    Examples:
        >>> [tensor_kind(n) for n in ("input.weight", "blocks.0.attn.q.weight",
        ...  "blocks.0.attn.o.weight", "blocks.1.ff.down.weight", "embed.weight")]
        ['input', 'QK weights', 'VO weights', 'FF down', 'input']
    """
    for kind, pattern in _PATTERNS:
        if re.search(pattern, name):
            return kind
    return "hidden"


def _figure(width: float, height: float) -> Figure:
    try:
        from matplotlib.figure import Figure
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(
            "plotting needs matplotlib, which is not installed: pip install 'fslr_func[plot]'"
        ) from err
    return Figure(figsize=(width, height), layout="constrained")


def _save(fig: Figure, path: str | os.PathLike[str]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def _colours(n: int) -> list[Any]:
    from matplotlib import colormaps

    cmap = colormaps["viridis"]
    return [cmap(0.9 * i / max(n - 1, 1)) for i in range(n)]


# ---------------------------------------------------------------------------------- figure 2


def _scale_label(summary: Mapping[str, Any], scale: float) -> str:
    from .configs import DEPTH_AXES, WIDTH_AXES, SweepConfig

    labels = summary.get("scale_labels")
    if isinstance(labels, Mapping) and f"{scale:g}" in labels:
        return str(labels[f"{scale:g}"])
    axis = summary.get("axis", "scale")
    config = summary.get("config")
    if isinstance(config, Mapping) and axis in (*WIDTH_AXES, *DEPTH_AXES):
        try:
            cfg = SweepConfig.from_dict(config)
            if summary.get("task", cfg.task_name) == cfg.task_name:  # a built-in model
                kw = cfg.model_kwargs(scale)
                sizes = [f"width {kw['width']}"] if axis in WIDTH_AXES else []
                sizes += [f"depth {kw['depth']}"] if axis in DEPTH_AXES else []
                return f"{', '.join(sizes)} ({scale:g}x)"
        except (TypeError, ValueError, KeyError):
            pass
    return f"{axis} {scale:g}x"


_OPTIMIZER_NAMES = {
    "adam": "Adam",
    "adamw": "AdamW",
    "sgd": "SGD",
    "signsgd": "sign-SGD",
    "adagrad": "Adagrad",
    "adamax": "Adamax",
}


def _optimizer_name(summary: Mapping[str, Any]) -> str:
    """The sweep's optimiser as a figure names it (``"sgd"`` -> ``"SGD"``)."""
    optimizer = str(summary.get("config", {}).get("optimizer", "adam"))
    return _OPTIMIZER_NAMES.get(optimizer, optimizer)


def plot_transfer(
    summary: Mapping[str, Any],
    path: str | os.PathLike[str],
    *,
    title: str | None = None,
    xlabel: str = "learning rate (base model's, for muP and FLeRM)",
) -> Path:
    """Loss against learning rate per scale, one panel per mode (standard, muP, FLeRM; paper
    figure 2). A panel whose shift is only a lower bound (a best learning rate on the edge of
    the grid) says so in its title.

    Args:
        summary: a sweep summary (:func:`fslr_func.experiments.sweep.summarise`); an optional
            ``"scale_labels"`` entry (``{scale key: label}``) names the lines.
        path: the PNG to write.
        title: figure title; default: the model and axis.
        xlabel: the x axis's label.

    Returns:
        ``path``. Diverged learning rates are left out (their line ends); the best learning
        rate of each scale is starred.
    """
    from .configs import MODES

    modes = [m for m in MODES if m in summary["modes"]]
    scales = [float(s) for s in summary["scales"]]
    lrs = [float(lr) for lr in summary["lrs"]]
    fig = _figure(6.4, 3.0 * len(modes) + 0.6)
    axes = fig.subplots(len(modes), 1, sharex=True, squeeze=False)[:, 0]
    colours = _colours(len(scales))
    finite = [
        v
        for m in modes
        for row in summary["modes"][m]["loss"].values()
        for v in row
        if v is not None and math.isfinite(v)
    ]
    # the least-trained runs (smallest lr) sit near the loss at initialisation: a sensible top
    starts = [
        next((v for v in summary["modes"][m]["loss"][k] if v is not None), None)
        for m in modes
        for k in summary["modes"][m]["loss"]
    ]
    top = max((v for v in starts if v is not None), default=None)
    optimizer = _optimizer_name(summary)
    names = {"standard": f"standard ({optimizer})", "mup": "muP", "flerm": "FLeRM"}
    for ax, mode in zip(axes, modes, strict=True):
        data = summary["modes"][mode]
        for colour, scale in zip(colours, scales, strict=True):
            key = f"{scale:g}"
            row = data["loss"].get(key, [])
            xs = [lr for lr, v in zip(lrs, row, strict=False) if v is not None]
            ys = [v for v in row if v is not None]
            ax.plot(xs, ys, "o-", color=colour, ms=3.5, lw=1.5, label=_scale_label(summary, scale))
            best = data["best_lr"].get(key)
            if best is not None:
                ax.plot(
                    [best],
                    [data["best_loss"][key]],
                    marker="*",
                    ms=14,
                    color=colour,
                    markeredgecolor="black",
                    zorder=5,
                )
        shift = shift_text(data.get("shift_octaves"), bool(data.get("shift_bound")))
        note = f": optimum shift {shift}" if shift else ""
        if data.get("edge"):
            note += " (best lr on the grid's edge)"
        ax.set_title(f"{names.get(mode, mode)}{note}", fontsize=10)
        ax.set_xscale("log", base=2)
        ax.set_ylabel("train loss (last batches)")
        ax.grid(alpha=0.3)
        if finite and top is not None:
            lo = min(finite)
            ax.set_ylim(lo - 0.05 * (top - lo), top + 0.05 * (top - lo))
    axes[-1].set_xlabel(xlabel)
    axes[0].legend(fontsize=8, loc="best")
    config = summary.get("config", {})
    fig.suptitle(
        title
        or f"{summary.get('task') or config.get('model', 'model')}: learning-rate transfer "
        f"across {summary['axis']}",
        fontsize=11,
    )
    return _save(fig, path)


# ---------------------------------------------------------------------------------- figure 1


def plot_fslr_time(
    record: FSLRRecord,
    path: str | os.PathLike[str],
    *,
    kind: Callable[[str], str] = tensor_kind,
    per_step: bool = True,
    title: str | None = None,
) -> Path:
    """FSLR of every tensor over training, coloured by kind (paper figure 1).

    Args:
        record: a recorded run.
        path: the PNG to write.
        kind: tensor name -> kind (legend entry and colour; unknown kinds get default colours).
        per_step: plot ``lr_W * FSLR_W``, the RMS change of the outputs per step caused by
            each tensor, when the record has learning rates (a tensor without them runs at
            ``base_lr`` times the schedule ratio, as FLeRM reads it); ``False``: the
            unit-learning-rate FSLR.
        title: figure title.

    Returns:
        ``path``.
    """
    if not len(record):
        raise ValueError("the record is empty: nothing to plot")
    fig = _figure(6.4, 4.0)
    ax = fig.subplots()
    meta = record.meta
    lr = meta.get("base_lr")
    rated = isinstance(lr, (int, float)) or all(n in record.lrs for n in record.fslr)
    scaled = per_step and bool(record.lrs) and rated
    seen: dict[str, str] = {}
    extra = iter(f"C{i}" for i in range(10, 100))
    for name, values in record.fslr.items():
        k = kind(name)
        colour = KIND_COLOURS.get(k) or seen.get(k) or next(extra)
        lrs = (
            (record.lrs.get(name) or [float(lr) * r for r in record.sched])  # type: ignore[arg-type]
            if scaled
            else [1.0] * len(values)
        )
        # unknown FSLRs (None) are not drawn, nor zeros (log scale)
        pts = [(s, v * lr) for s, v, lr in zip(record.steps, values, lrs, strict=True) if v]
        if not pts:
            continue
        ax.plot(
            [p[0] for p in pts],
            [p[1] for p in pts],
            "-o" if len(pts) < 30 else "-",
            ms=2.5,
            lw=1.2,
            color=colour,
            alpha=0.85,
            label=None if k in seen else k,
        )
        seen[k] = colour
    ax.set_yscale("log")
    ax.set_xlabel("training step")
    ax.set_ylabel("FSLR per step (lr x FSLR at lr 1)" if scaled else "FSLR at learning rate 1")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, loc="best")
    optimizer = meta.get("optimizer")
    run = ", ".join(
        [
            *([str(optimizer)] if optimizer else []),
            *([f"lr {lr:.3g}"] if isinstance(lr, (int, float)) else []),
        ]
    )
    default = f"{meta.get('model') or 'model'} FSLRs over time" + (f" ({run})" if run else "")
    ax.set_title(title or default, fontsize=10)
    return _save(fig, path)


def plot_flerm_lrs(
    runs: Sequence[Mapping[str, Any]],
    base_lr: float,
    path: str | os.PathLike[str],
    *,
    labels: Mapping[float, str] | None = None,
    kind: Callable[[str], str] = tensor_kind,
    title: str | None = None,
) -> Path:
    """Per-tensor learning rates FLeRM set, divided by the base learning rate, per scale.

    Args:
        runs: FLeRM run results (with a ``"flerm"`` entry), one per scale, of one base
            learning rate.
        base_lr: that base learning rate ``lr_0``.
        path: the PNG to write.
        labels: scale -> legend label.
        kind: tensor name -> kind (tick label colours).
        title: figure title.

    Returns:
        ``path``.
    """
    runs = [r for r in runs if r.get("flerm")]
    if not runs:
        raise ValueError("no FLeRM run with recorded learning rates to plot")
    runs = sorted(runs, key=lambda r: float(r["scale"]))
    names: list[str] = []
    for r in runs:
        names.extend(n for n in r["flerm"]["lrs"] if n not in names)
    fig = _figure(max(6.4, 0.16 * len(names) + 2.0), 4.2)
    ax = fig.subplots()
    colours = _colours(len(runs))
    for colour, r in zip(colours, runs, strict=True):
        rates = r["flerm"]["lrs"]
        xs = [i for i, n in enumerate(names) if n in rates]
        ys = [rates[names[i]] / base_lr for i in xs]
        scale = float(r["scale"])
        label = (labels or {}).get(scale, f"{scale:g}x")
        ax.plot(xs, ys, "o", color=colour, ms=5, label=label, alpha=0.9)
    ax.axhline(1.0, color="black", lw=0.8, ls="--")
    ax.set_yscale("log", base=2)
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names, rotation=90, fontsize=7 if len(names) < 40 else 5)
    for tick, name in zip(ax.get_xticklabels(), names, strict=True):
        tick.set_color(KIND_COLOURS.get(kind(name), "black"))
    ax.set_ylabel("FLeRM learning rate / base lr")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8, loc="best")
    ax.set_title(title or f"learning rates FLeRM set (base lr {base_lr:.3g})", fontsize=10)
    return _save(fig, path)


# ---------------------------------------------------------------------------------- folders


def _task_name(out: Path, default: str) -> str:
    """The task name a sweep folder's ``sweep.json`` records (custom tasks have their own)."""
    import json

    try:
        return str(json.loads((out / "sweep.json").read_text())["task"])
    except (OSError, ValueError, KeyError, TypeError):
        return default


def plot_check(result: Mapping[str, Any], path: str | os.PathLike[str]) -> Path:
    """The figure of :func:`fslr_func.experiments.check.coord_check`: per mode, each tensor's
    movement per step against scale (log-log), coloured by kind, drifting tensors thick.

    Returns:
        ``path``.
    """
    modes = list(result["modes"])
    fig = _figure(5.2 * len(modes), 4.0)
    axes = fig.subplots(1, len(modes), sharey=True, squeeze=False)[0]
    scales = [float(s) for s in result["scales"]]
    for ax, mode in zip(axes, modes, strict=True):
        data = result["modes"][mode]
        seen: set[str] = set()
        for name in result["names"]:
            kind = tensor_kind(name)
            flagged = name in data["flagged"]
            ax.plot(
                scales,
                data["movement"][name],
                "o-",
                color=KIND_COLOURS.get(kind, "black"),
                lw=2.6 if flagged else 1.0,
                ms=3,
                alpha=1.0 if flagged else 0.6,
                label=None if kind in seen else kind,
            )
            seen.add(kind)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("scale")
        ax.set_title(
            f"{mode}: {len(data['flagged'])} of {len(result['names'])} tensors drift "
            f"> {result['threshold']:g}x",
            fontsize=10,
        )
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("||Δ_W f||_RMS per step")
    axes[0].legend(fontsize=8, loc="best")
    fig.suptitle(
        f"function-space coordinate check: lr {result['lr']:.3g}, {result['steps']} steps",
        fontsize=11,
    )
    return _save(fig, path)


def plot_record(
    path: str | os.PathLike[str], dest: str | os.PathLike[str] | None = None
) -> list[Path]:
    """Plot a saved :class:`~fslr_func.io.record.FSLRRecord` (FSLR over time).

    Args:
        path: the record's JSON file.
        dest: the PNG to write; default: beside the record, ``<name>.png``.

    Returns:
        The written file, in a list.
    """
    record = FSLRRecord.load(path)
    target = Path(dest) if dest is not None else Path(path).with_suffix(".png")
    if target.suffix.lower() != ".png":
        target = target / (Path(path).stem + ".png")
    return [plot_fslr_time(record, target)]


def plot_sweep(
    out: str | os.PathLike[str], dest: str | os.PathLike[str] | None = None
) -> list[Path]:
    """Draw ``transfer.png``, ``fslr_time.png`` and ``flerm_lrs.png`` of a sweep folder.

    ``fslr_time.png`` shows the base model's seed-0 record at its best standard learning rate;
    ``flerm_lrs.png`` the rates FLeRM set, at each scale, at the base scale's best FLeRM
    learning rate. Figures whose data are missing (e.g. a standard-only sweep) are skipped.

    Args:
        out: the sweep folder (re-summarised from its cached runs).
        dest: folder for the PNGs; default: ``out``.

    Returns:
        The written files.
    """
    from .configs import lr_key, scale_key
    from .sweep import RunSpec, load_runs, summarise

    out = Path(out)
    dest = Path(dest) if dest is not None else out
    config, runs = load_runs(out)
    summary = summarise(config, runs)
    summary["task"] = _task_name(out, config.task_name)
    builtin = summary["task"] == config.task_name
    written = [plot_transfer(summary, dest / "transfer.png")]
    base = scale_key(config.base_scale)
    modes = summary["modes"]
    lr = (modes.get("standard") or modes.get("flerm") or {}).get("best_lr", {}).get(base)
    if lr is not None:
        try:
            record = FSLRRecord.load(out / "records" / f"lr={lr_key(lr)}_seed=0.json")
        except (OSError, ValueError):
            record = None
        if record is not None and len(record):
            kw = config.model_kwargs(config.base_scale)
            what = (
                f"{config.model} (width {kw['width']}, depth {kw['depth']})"
                if builtin
                else summary["task"]
            )
            title = f"base {what}: FSLRs over time, {_optimizer_name(summary)} lr {lr:.3g}"
            written.append(plot_fslr_time(record, dest / "fslr_time.png", title=title))
    flr = modes.get("flerm", {}).get("best_lr", {}).get(base)
    if flr is not None:
        chosen = [runs.get(RunSpec("flerm", s, flr, 0).key) for s in config.scales]
        chosen_runs = [r for r in chosen if r]
        if any(r.get("flerm") for r in chosen_runs):
            labels = {float(s): _scale_label(summary, float(s)) for s in config.scales}
            written.append(plot_flerm_lrs(chosen_runs, flr, dest / "flerm_lrs.png", labels=labels))
    return written
