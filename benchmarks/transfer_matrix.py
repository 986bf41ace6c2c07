"""The transfer matrix (issue 23): FLeRM, muP and re-tuned standard training at 8x width, on
families x base widths x budgets x data, each cell on an adaptive learning-rate grid.

Every cell trains the base model (1x) and the 8x-wide model with Adam (constant rate, the
identity policy, static FLeRM: the way the demo trains), seeds 0..k-1, and reads out at 8x
(:mod:`fslr_func.experiments.matrix`): each mode's best rate and its shift in octaves from the
base's best rate ``b``, its loss at ``b`` (what a user who tunes the small model gets), and
the ratio of that loss to re-tuned standard training's best loss at 8x (1: as good as
re-tuning). Losses are training losses over the last fifth of the steps, one pass over fresh
data, seed means.

The full product (5 families x 2 base widths x 3 budgets x data) is too slow on 2 CPU cores;
the design covers each factor on at least two families:

- family: every family at 150 steps and its first base width (ResMLP, 1-D conv net with and
  without BatchNorm on MNIST-1D, 2-D conv net with and without BatchNorm on ``digits_aug``,
  PreNorm transformer);
- budget: 150, 300, 600 steps on the ResMLP, 150 and 300 on the 1-D conv net (600:
  ``--cells conv1d-w16-s600``, left out of the default run for its cost);
- base width: ResMLP 32 and 64, 1-D conv net 16 and 32 channels;
- data: the ResMLP on MNIST-1D (two generation seeds) and on ``digits_aug``.

Held-out cells (``HELD_OUT_CELLS``, run by name with ``--cells``): combinations of data,
budget, base width and norm placement no variant or option was chosen on, named before they
were run, to check that the matrix's findings hold off it.
``BUDGET_CELLS``: the held-out cells of the budget rule (the variant ``feature_budget``),
named before it was run on any of them. ``OPTIMIZER_CELLS``: AdamW and SGD cells, named
before ``readout_built_upstream`` ran on them. ``DEPTH_CELLS``: depth, and width and depth
together, named before any run of them; ``DEPTH_HELD_OUT_CELLS``: more of them, named after;
``DEPTH_OPTIMIZER_CELLS``: with AdamW, SGD and a cosine decay.
Each read-out also gives the test losses at the rates training loss chose (a second table;
``test_ratio`` in ``--json``): a cell whose wide model memorises its data can be read on
unseen data too. ``--top-scale K`` runs cells at K times the base width instead of 8. ``--refine``
resolves the base's best rate and every mode's best at the top width to half an octave
(:func:`~fslr_func.experiments.matrix.adaptive_cell`'s ``refine``), in the same folders.

``--variant NAME`` runs a FLeRM variant (:mod:`fslr_func.experiments.variants`) on the same
cells, each in its own folder, at the base rate ``b`` the main cell found and its adaptive
neighbours; its rows are read against the main cell's re-tuned standard training and muP.

``--two-widths K`` (with ``--variant``) also runs each variant at K times the base width
(folders ``CELL@Kx+VARIANT``) and at the top width at the rate its fitted best at K
extrapolates to (:func:`~fslr_func.experiments.matrix.two_width_cell`), and prints a table
of both models against re-tuning.

``--seeds N`` runs the cells with N seeds instead of their own, in a folder of its own
(``fslr_runs/matrix-seedsN``): FLeRM's runs read the seed mean of the base records, so they
differ with the number of seeds. Copy a cell's folders there first to reuse its standard and
muP runs (a run's fingerprint leaves the seeds out).

``--base-rate CELL=LR`` (repeatable, with ``--variant``) skips a cell's main runs and runs
the variants at ``b = LR`` (the main table's, docs/reproduction.md) and their adaptive
neighbours, printing each variant's shift, loss at ``b`` and best loss; the ratio to re-tuned
standard training is then read against the main table's.

Run: ``nice -n 15 python benchmarks/transfer_matrix.py --jobs 2`` (cached under
``fslr_runs/matrix``; a second call re-prints in seconds); ``--cells a,b`` for some cells,
``--list`` for their names.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fslr_func.experiments.cli_args import parse_lrs
from fslr_func.experiments.configs import SweepConfig, octaves
from fslr_func.experiments.matrix import adaptive_cell, two_width_cell
from fslr_func.experiments.summary import bound_sign


def _cell(model: str, steps: int, seeds: int, **overrides: Any) -> SweepConfig:
    return SweepConfig.for_model(
        model, scales=(1, 8), steps=steps, last=steps // 5, seeds=seeds, **overrides
    )


#: The cells, cheapest first within each group.
CELLS: dict[str, SweepConfig] = {
    "resmlp-w32-s150": _cell("resmlp", 150, 3),
    "resmlp-w64-s150": _cell("resmlp", 150, 3, width=64),
    "resmlp-w32-s300": _cell("resmlp", 300, 3),
    "resmlp-w32-s600": _cell("resmlp", 600, 3),
    "resmlp-aug-w32-s150": _cell("resmlp", 150, 3, data="digits_aug"),
    "resmlp-seed7-w64-s300": _cell("resmlp", 300, 3, width=64, data_seed=7),
    "conv1d-w16-s150": _cell("resconv", 150, 3),
    "conv1d-bn-w16-s150": _cell("resconv_bn", 150, 3),
    "transformer-d16-s150": _cell("transformer", 150, 2, width=16, lrs=octaves(-10, -3)),
    "conv2d-w8-s150": _cell("resconv", 150, 3, data="digits_aug", width=8),
    "conv2d-bn-w8-s150": _cell("resconv_bn", 150, 3, data="digits_aug", width=8),
    "conv1d-w16-s300": _cell("resconv", 300, 2),
    "conv1d-w32-s150": _cell("resconv", 150, 2, width=32),
}
#: Cells defined but left out of the default run for its cost on 2 cores (``--cells`` runs them).
EXTRA_CELLS: dict[str, SweepConfig] = {
    "conv1d-w16-s600": _cell("resconv", 600, 2),
    # the transformer cell with the 3 seeds of the PreNorm sweep above (benchmarks/transfer.py)
    "transformer-d16-s150-3seeds": _cell("transformer", 150, 3, width=16, lrs=octaves(-10, -3)),
    # data repetition against budget: the 600-step ResMLP on four times the data (about one
    # pass, as the 150-step cell), and the 150-step one on a quarter (about four passes, as
    # the 600-step cell)
    "resmlp-w32-s600-fresh": _cell("resmlp", 600, 3, num_samples=100_000),
    "resmlp-w32-s150-rep": _cell("resmlp", 150, 3, num_samples=6_000),
    # the budget under a cosine schedule, which removes a constant rate's late noise floor
    "resmlp-w32-s150-cos": _cell("resmlp", 150, 3, schedule="cosine"),
    "resmlp-w32-s600-cos": _cell("resmlp", 600, 3, schedule="cosine"),
    "resmlp-w32-s1200-cos": _cell("resmlp", 1200, 2, schedule="cosine"),
    "resmlp-aug-w32-s600-cos": _cell("resmlp", 600, 2, data="digits_aug", schedule="cosine"),
    # named after the four above ran, before these ran: does match="features" at power 1
    # transfer under a cosine schedule on the other families and cells too?
    "resmlp-aug-w32-s300-cos": _cell("resmlp", 300, 2, data="digits_aug", schedule="cosine"),
    "resmlp-w64-s600-cos": _cell("resmlp", 600, 2, width=64, schedule="cosine"),
    "conv1d-w16-s300-cos": _cell("resconv", 300, 2, schedule="cosine"),
    "conv2d-w8-s150-cos": _cell("resconv", 150, 2, data="digits_aug", width=8, schedule="cosine"),
    "transformer-d16-s150-cos": _cell(
        "transformer", 150, 2, width=16, lrs=octaves(-10, -3), schedule="cosine"
    ),
    # named after the nine above ran, before these ran: a BatchNorm conv net and a base width
    # of 64 on other data
    "conv1d-bn-w16-s150-cos": _cell("resconv_bn", 150, 2, schedule="cosine"),
    "resmlp-seed7-w64-s300-cos": _cell("resmlp", 300, 2, width=64, data_seed=7, schedule="cosine"),
}
#: Held-out cells: combinations of data, budget and base width that no variant or option was
#: chosen on (named before any of them was run), to check that the matrix's findings hold off it.
HELD_OUT_CELLS: dict[str, SweepConfig] = {
    "resmlp-aug-w32-s300": _cell("resmlp", 300, 3, data="digits_aug"),
    "resmlp-w64-s600": _cell("resmlp", 600, 2, width=64),
    "conv1d-bn-w16-s300": _cell("resconv_bn", 300, 2),
    "conv2d-w8-s300": _cell("resconv", 300, 2, data="digits_aug", width=8),
    # added after the four above were run, before it was: the family they lack
    "transformer-postnorm-d16-s150": _cell(
        "transformer", 150, 2, width=16, norm="postnorm", lrs=octaves(-10, -3)
    ),
}

#: Held-out cells of the budget rule (``feature_budget``, :func:`budget_power`: fitted on the
#: 150 and 600-step cells), named before any of them was run: budgets it was not fitted at,
#: on the data, families and base widths of the matrix.
BUDGET_CELLS: dict[str, SweepConfig] = {
    "resmlp-w32-s75": _cell("resmlp", 75, 3),
    "resmlp-w32-s1200": _cell("resmlp", 1200, 2),
    "resmlp-aug-w32-s600": _cell("resmlp", 600, 2, data="digits_aug"),
    "conv2d-bn-w8-s300": _cell("resconv_bn", 300, 2, data="digits_aug", width=8),
    "transformer-d16-s300": _cell("transformer", 300, 2, width=16, lrs=octaves(-10, -3)),
}

#: Other optimisers (the matrix's cells all train with Adam): AdamW with weight decay 0.1 and
#: SGD with momentum 0.9, on three families, named before any run of them, to check whether
#: ``scale_readout`` with ``match="features_all"`` (the variant ``readout_built_upstream``)
#: keeps its lead over muP off Adam.
OPTIMIZER_CELLS: dict[str, SweepConfig] = {
    "resmlp-w32-s300-adamw": _cell("resmlp", 300, 3, optimizer="adamw", weight_decay=0.1),
    "conv1d-bn-w16-s150-adamw": _cell("resconv_bn", 150, 2, optimizer="adamw", weight_decay=0.1),
    "transformer-d16-s150-adamw": _cell(
        "transformer", 150, 2, width=16, lrs=octaves(-10, -3), optimizer="adamw", weight_decay=0.1
    ),
    "resmlp-w32-s300-sgd": _cell("resmlp", 300, 3, optimizer="sgd", lrs=octaves(-9, 0)),
    "conv1d-bn-w16-s150-sgd": _cell("resconv_bn", 150, 2, optimizer="sgd", lrs=octaves(-9, 0)),
}

#: Depth, and width and depth together (``axis``; FLeRM's policy ``share_blocks``), named
#: before any run of them: does ``scale_readout`` with ``match="features_all"`` keep its lead
#: where the scaled model adds blocks the base lacks (each added block's feature gain against
#: the base block its FSLR target answers to)? muP scales width only. The conv net and the
#: transformer are run at 4x (``--top-scale 4``) for their cost on 2 cores.
DEPTH_CELLS: dict[str, SweepConfig] = {
    "resmlp-depth-s150": _cell("resmlp", 150, 3, axis="depth"),
    "resmlp-wd-s150": _cell("resmlp", 150, 3, axis="width_depth"),
    "resmlp-wd-s300": _cell("resmlp", 300, 2, axis="width_depth"),
    "resmlp-aug-wd-s150": _cell("resmlp", 150, 2, axis="width_depth", data="digits_aug"),
    "conv1d-bn-wd-w16-s150": _cell("resconv_bn", 150, 2, axis="width_depth"),
    "transformer-wd-d16-s150": _cell(
        "transformer", 150, 2, width=16, lrs=octaves(-10, -3), axis="width_depth"
    ),
}

#: Held-out cells of depth and width and depth, named after the six above ran and before
#: any of these did: a longer budget, another base width and data seed, the conv nets
#: without BatchNorm and in 2-D, the PostNorm transformer, depth alone at 300 steps. The
#: conv nets, the transformer and the base width of 64 are run at 4x (``--top-scale 4``).
DEPTH_HELD_OUT_CELLS: dict[str, SweepConfig] = {
    "resmlp-wd-s600": _cell("resmlp", 600, 2, axis="width_depth"),
    "resmlp-depth-s300": _cell("resmlp", 300, 2, axis="depth"),
    "resmlp-seed7-w64-wd-s150": _cell("resmlp", 150, 2, width=64, data_seed=7, axis="width_depth"),
    "conv1d-wd-w16-s150": _cell("resconv", 150, 2, axis="width_depth"),
    "conv2d-bn-wd-w8-s150": _cell(
        "resconv_bn", 150, 2, data="digits_aug", width=8, axis="width_depth"
    ),
    "transformer-postnorm-wd-d16-s150": _cell(
        "transformer", 150, 2, width=16, norm="postnorm", lrs=octaves(-10, -3), axis="width_depth"
    ),
}

#: Width and depth together off Adam at a constant rate, named after the twelve depth cells
#: above ran and before these did.
DEPTH_OPTIMIZER_CELLS: dict[str, SweepConfig] = {
    "resmlp-wd-s150-adamw": _cell(
        "resmlp", 150, 2, axis="width_depth", optimizer="adamw", weight_decay=0.1
    ),
    "resmlp-wd-s150-sgd": _cell(
        "resmlp", 150, 2, axis="width_depth", optimizer="sgd", lrs=octaves(-9, 0)
    ),
    "resmlp-wd-s300-cos": _cell("resmlp", 300, 2, axis="width_depth", schedule="cosine"),
    # named after the three above ran: is the 600-step cell's gap the constant rate's?
    "resmlp-wd-s600-cos": _cell("resmlp", 600, 2, axis="width_depth", schedule="cosine"),
}

#: Every cell by name, in the order ``--list`` prints them.
ALL_CELLS: dict[str, SweepConfig] = {
    **CELLS,
    **EXTRA_CELLS,
    **HELD_OUT_CELLS,
    **BUDGET_CELLS,
    **OPTIMIZER_CELLS,
    **DEPTH_CELLS,
    **DEPTH_HELD_OUT_CELLS,
    **DEPTH_OPTIMIZER_CELLS,
}


def _fmt(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None or not math.isfinite(x) else format(x, spec)


def _shift(entry: Mapping[str, Any]) -> str:
    s = entry.get("shift")
    return "-" if s is None else f"{bound_sign(s, bool(entry.get('edge')))}{s:+g}"


def row(name: str, main: Mapping[str, Any], variant: Mapping[str, Any] | None = None) -> str:
    """One table row: base rate; FLeRM (or the variant): shift, loss at b (sd), ratio to
    re-tuned standard; standard: shift, best loss; muP: shift, loss at b, ratio."""
    modes = main["modes"]
    std = modes.get("standard", {})
    std_best = std.get("best_loss")
    f = (variant or main)["modes"].get("flerm", {})
    m = modes.get("mup", {})

    def at(e: Mapping[str, Any]) -> str:
        a = e.get("at_tuned", {})
        return f"{_fmt(a.get('mean'))} ({_fmt(a.get('sd'))})"

    def ratio(e: Mapping[str, Any]) -> str:
        mean = e.get("at_tuned", {}).get("mean")
        return _fmt(mean / std_best if mean is not None and std_best else None)

    b = round(math.log2(main["tuned"]), 2)  # half an octave under --refine
    return (
        f"| {name} | 2^{b:g} | {_shift(f)} | {at(f)} | {ratio(f)} | "
        f"{_shift(std)} | {_fmt(std_best)} | {_shift(m)} | {at(m)} | {ratio(m)} |"
    )


HEADER = (
    "| cell | base best b | FLeRM shift | FLeRM at b (sd) | FLeRM / re-tuned | standard shift | "
    "re-tuned standard best | muP shift | muP at b (sd) | muP / re-tuned |\n"
    "|---|---|---|---|---|---|---|---|---|---|"
)


#: What :func:`compact` divides by: (the mode's loss at b, standard training's reference).
REFERENCES = {
    "train": ("mean", "best_loss"),  # re-tuning's best seed mean
    "test": ("test", "best_test"),  # the test losses at the same rates
    "other_seeds": ("mean", "other_seeds_best"),  # re-tuning judged on seeds not tuned on
}


def compact(doc: Mapping[str, Any], variants: Sequence[str], *, against: str = "train") -> str:
    """One table: per cell, FLeRM's, each variant's and muP's shift and ratio to re-tuned
    standard training (``shift; ratio``), lowest ratio of the row in bold. ``against``
    (:data:`REFERENCES`): ``"test"``, the ratio of the test losses at the same rates (those
    chosen by training loss); ``"other_seeds"``, the ratio to re-tuning whose rate is chosen
    on the other seeds (:func:`fslr_func.experiments.matrix.other_seeds_best`)."""
    mine, ref = REFERENCES[against]
    labels = ["FLeRM", *variants, "muP"]
    lines = [
        "| cell | " + " | ".join(labels) + " |",
        "|---|" + "---|" * len(labels),
    ]
    for name, d in doc.items():
        std_best = d["main"]["modes"]["standard"].get(ref)
        cells = []
        for label in labels:
            if label == "FLeRM":
                e = d["main"]["modes"].get("flerm", {})
            elif label == "muP":
                e = d["main"]["modes"].get("mup", {})
            else:
                e = (d["variants"].get(label) or {"modes": {}})["modes"].get("flerm", {})
            mean = e.get("at_tuned", {}).get(mine)
            r = (
                mean / std_best
                if mean is not None and std_best and math.isfinite(std_best)
                else None
            )
            cells.append((r, f"{_shift(e)}; {_fmt(r)}"))
        best = min((r for r, _ in cells if r is not None), default=None)
        shown = [f"**{t}**" if r is not None and r == best else t for r, t in cells]
        lines.append(f"| {name} | " + " | ".join(shown) + " |")
    return "\n".join(lines)


def plot(doc: Mapping[str, Any], variants: Sequence[str], path: Path, top: float = 8) -> None:
    """Bars per cell: loss at the top width (``top`` times the base's) at the base's best rate
    over re-tuned standard training's best loss there, for FLeRM, each variant and muP (1: as
    good as re-tuning)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(doc)
    series: list[tuple[str, list[float]]] = []

    def ratio(cell: Mapping[str, Any], mode: str) -> float:
        e = cell["modes"].get(mode, {})
        mean = e.get("at_tuned", {}).get("mean")
        return mean / std if mean is not None and (std := std_best) else math.nan

    for label, key, mode in [
        ("FLeRM", None, "flerm"),
        *[(f"FLeRM {v}", v, "flerm") for v in variants],
        ("muP", None, "mup"),
    ]:
        vals = []
        for n in names:
            std_best = doc[n]["main"]["modes"]["standard"].get("best_loss")
            cell = doc[n]["main"] if key is None else doc[n]["variants"].get(key)
            vals.append(ratio(cell, mode) if cell else math.nan)
        series.append((label, vals))
    fig, ax = plt.subplots(figsize=(8, 0.55 * len(names) + 1.5))
    h = 0.8 / len(series)
    for i, (label, vals) in enumerate(series):
        ax.barh([k + i * h for k in range(len(names))], vals, height=h, label=label)
    finite = [v for _, vals in series for v in vals if math.isfinite(v)]
    ax.set_xlim(left=max(0.0, min(finite, default=1.0) - 0.05))
    ax.axvline(1.0, color="k", lw=0.8)
    ax.axvline(1.02, color="k", lw=0.5, ls=":")
    ax.set_yticks([k + 0.4 - h / 2 for k in range(len(names))], names)
    ax.invert_yaxis()
    ax.set_xlabel(
        f"loss at {top:g}x at the base's best rate / re-tuned standard training's best at {top:g}x"
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


TWO_WIDTH_HEADER = (
    "| cell | base best b | FLeRM's fitted shift at the second width; at the top width | "
    "FLeRM at b / re-tuned | inverse-width model: shift; / re-tuned | constant model: shift; "
    "/ re-tuned | muP at b / re-tuned | muP, inverse-width model: shift; / re-tuned | muP, "
    "constant model: shift; / re-tuned |\n|---|---|---|---|---|---|---|---|---|"
)


def _two_width_columns(
    main: Mapping[str, Any], variant: Mapping[str, Any], mup: Mapping[str, Any]
) -> dict[str, tuple[float | None, float | None]]:
    """The two-width read-out's columns of one row, in order: label -> (the rate, ``None``
    at b or where a model did not run; the seed-mean loss at 8x) for FLeRM (the variant) and
    muP at b and at each model's rate; ``variant["two_widths"]`` and ``mup`` are
    :func:`~fslr_func.experiments.matrix.two_width_cell`'s read-outs."""
    two = variant.get("two_widths", {})

    def at_b(modes: Mapping[str, Any], mode: str) -> tuple[None, float | None]:
        return None, modes.get(mode, {}).get("at_tuned", {}).get("mean")

    def model(doc: Mapping[str, Any], key: str) -> tuple[float | None, float | None]:
        return doc.get("rates", {}).get(key), doc.get("at", {}).get(key, {}).get("mean")

    return {
        "FLeRM at b": at_b(variant["modes"], "flerm"),
        "inverse width": model(two, "inverse_width"),
        "constant": model(two, "constant"),
        "muP at b": at_b(main["modes"], "mup"),
        "muP, inverse width": model(mup, "inverse_width"),
        "muP, constant": model(mup, "constant"),
    }


def two_width_row(
    name: str, main: Mapping[str, Any], variant: Mapping[str, Any], mup: Mapping[str, Any]
) -> str:
    """One row of the two-width read-out: the variant's fitted shift at the second width and
    at the top one; then each of :func:`_two_width_columns` over re-tuned standard
    training's best (at a model's rate, its shift from b first)."""
    std_best = main["modes"]["standard"].get("best_loss")
    tuned = variant["tuned"]

    def cell(label: str, lr: float | None, mean: float | None) -> str:
        ratio = _fmt(mean / std_best if mean is not None and std_best else None)
        if label.endswith("at b"):
            return ratio
        return f"{'-' if lr is None else format(math.log2(lr / tuned), '+.2f')}; {ratio}"

    two = variant.get("two_widths", {})
    s2, s8 = two.get("second_fit_shift"), variant["modes"].get("flerm", {}).get("fit_shift")
    columns = _two_width_columns(main, variant, mup)
    cells = [cell(label, lr, mean) for label, (lr, mean) in columns.items()]
    return (
        f"| {name} | 2^{round(math.log2(tuned), 2):g} | {_fmt(s2, '+.2f')}; {_fmt(s8, '+.2f')} | "
        + " | ".join(cells)
        + " |"
    )


def two_width_counts(
    docs: Sequence[tuple[Mapping[str, Any], Mapping[str, Any], Mapping[str, Any]]],
) -> str:
    """How many rows of the two-width read-out are within 2% of re-tuning, per column of
    :func:`_two_width_columns`: against re-tuning's best seed mean, and against re-tuning
    judged on seeds it was not chosen on (``other_seeds_best``); ``docs`` holds (main
    read-out, variant read-out, muP's two-width read-out) per row."""
    columns: dict[str, list[tuple[float | None, Mapping[str, Any]]]] = {}
    for main, variant, mup in docs:
        std = main["modes"]["standard"]
        for label, (_, mean) in _two_width_columns(main, variant, mup).items():
            columns.setdefault(label, []).append((mean, std))

    def within(label: str, ref: str) -> int:
        return sum(
            1
            for mean, std in columns[label]
            if mean is not None and std.get(ref) and mean / std[ref] <= 1.02
        )

    return f"within 2% of re-tuning, of {len(docs)} (of re-tuning judged on other seeds): " + (
        "; ".join(
            f"{label} {within(label, 'best_loss')} ({within(label, 'other_seeds_best')})"
            for label in columns
        )
    )


def _base_rate(text: str, parser: argparse.ArgumentParser) -> tuple[str, float]:
    """``CELL=LR`` of ``--base-rate``."""
    cell, _, lr = text.partition("=")
    if cell not in ALL_CELLS:
        parser.error(f"--base-rate: unknown cell {cell!r}; --list names them")
    try:
        (rate,) = parse_lrs(lr)
    except (ValueError, argparse.ArgumentTypeError) as err:
        parser.error(f"--base-rate {text!r}: {err}")
    return cell, rate


def main(argv: Sequence[str] | None = None) -> int:
    """Run (or re-read) the cells and print the matrix; exit status 0."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cells", default=None, help="comma-separated cell names (default: all)")
    p.add_argument("--list", action="store_true", help="print the cell names and exit")
    p.add_argument("--out", type=Path, default=Path("fslr_runs/matrix"))
    p.add_argument("--jobs", type=int, default=1)
    p.add_argument(
        "--variant", action="append", default=[], help="a FLeRM variant to run (repeatable)"
    )
    p.add_argument("--json", type=Path, default=None, help="also write the read-outs here")
    p.add_argument("--plot", type=Path, default=None, help="also draw the ratios here")
    p.add_argument("--cached", action="store_true", help="train nothing: print what is cached")
    p.add_argument(
        "--base-rate",
        action="append",
        default=[],
        metavar="CELL=LR",
        help="with --variant: skip CELL's main runs, run the variants at b = LR (2^k allowed)",
    )
    p.add_argument(
        "--refine",
        action="store_true",
        help="resolve the base's best rate and each mode's at the top width to half an octave",
    )
    p.add_argument(
        "--top-scale",
        type=int,
        default=None,
        help="run the cells at this width multiple instead of 8 (folders CELL@Kx)",
    )
    p.add_argument(
        "--two-widths",
        type=int,
        default=None,
        metavar="K",
        help="with --variant: also run each variant at K times the base width and at the top "
        "width at the rate its fitted best there extrapolates to (two_width_cell)",
    )
    p.add_argument(
        "--seeds",
        type=int,
        default=None,
        help="run the cells with this many seeds instead of their own (folder OUT-seedsN)",
    )
    args = p.parse_args(argv)
    if args.seeds is not None and args.seeds < 1:
        p.error(f"--seeds must be a positive integer, got {args.seeds}")
    if args.list:
        print("\n".join(ALL_CELLS))
        return 0
    cells = dict(ALL_CELLS)
    if args.seeds is not None:
        # its own folder: FLeRM's runs read the seed mean of the base records, so another
        # number of seeds would replace the runs of the cells' own read-out
        cells = {n: c.replace(seeds=args.seeds) for n, c in cells.items()}
        args.out = args.out.with_name(f"{args.out.name}-seeds{args.seeds}")
    if args.top_scale is not None:
        k = args.top_scale
        cells = {n: c.replace(scales=(c.base_scale, c.base_scale * k)) for n, c in cells.items()}
        args.out = args.out.with_name(f"{args.out.name}@{k}x")
    top = 8 if args.top_scale is None else args.top_scale
    names = args.cells.split(",") if args.cells else list(CELLS)
    unknown = [n for n in names if n not in cells]
    if unknown:
        p.error(f"unknown cells {unknown}; --list names them")
    given = dict(_base_rate(text, p) for text in args.base_rate)
    if given and not args.variant:
        p.error("--base-rate runs variants only: give --variant")
    if args.two_widths is not None and not (args.variant and 1 < args.two_widths < top):
        p.error(f"--two-widths K needs --variant and 1 < K < {top:g} (the top width)")
    doc: dict[str, Any] = {}

    def variant_cell(name: str, variant: str, tuned: float) -> dict[str, Any]:
        """FLeRM with ``variant`` on cell ``name`` around the base rate ``tuned`` (and, with
        ``--two-widths``, at the rate the second width extrapolates to)."""
        config = cells[name].replace(flerm_variant=variant)
        out = adaptive_cell(
            config,
            args.out / f"{name}+{variant}",
            modes=("flerm",),
            tuned=tuned,
            jobs=args.jobs,
            log=lambda s: print(s, flush=True),
            train=not args.cached,
            refine=args.refine,
        )
        if args.two_widths is not None:
            out["two_widths"] = two_widths(name, variant, tuned)
        return out

    def two_widths(name: str, variant: str | None, tuned: float) -> dict[str, Any]:
        """:func:`two_width_cell` of FLeRM with ``variant``, or of muP (``None``)."""
        second = args.out.with_name(f"{args.out.name.split('@')[0]}@{args.two_widths}x")
        folder = name if variant is None else f"{name}+{variant}"
        return two_width_cell(
            cells[name].replace(flerm_variant=variant),
            args.out / folder,
            second / folder,
            tuned,
            args.two_widths,
            mode="flerm" if variant else "mup",
            jobs=args.jobs,
            log=lambda s: print(s, flush=True),
            train=not args.cached,
        )

    two_width_rows: list[str] = []
    two_width_docs: list[tuple[Mapping[str, Any], Mapping[str, Any], Mapping[str, Any]]] = []
    for name in [n for n in names if n in given]:
        main_cell, mup = None, {}
        if args.two_widths is not None:  # the reference: the main cell's re-tuning, read only
            main_cell = adaptive_cell(cells[name], args.out / name, train=False, refine=True)
            mup = two_widths(name, None, given[name])
        for variant in args.variant:
            done = variant_cell(name, variant, given[name])
            if main_cell is not None and main_cell["tuned"] is not None:
                two_width_rows.append(two_width_row(f"{name} {variant}", main_cell, done, mup))
                two_width_docs.append((main_cell, done, mup))
            flerm = done["modes"].get("flerm")
            if flerm is not None:
                at = flerm["at_tuned"]
                print(
                    f"{name} {variant}: shift {flerm['shift']:+g}; loss at b "
                    f"{at['mean']:.4f} (sd {at['sd']:.4f}); best {flerm['best_loss']:.4f}; "
                    f"test loss at b {_fmt(at.get('test'), '.4f')}",
                    flush=True,
                )
    for name in [n for n in names if n not in given]:
        config = cells[name]
        t0 = time.perf_counter()
        main_out = adaptive_cell(
            config,
            args.out / name,
            jobs=args.jobs,
            log=lambda s: print(s, flush=True),
            train=not args.cached,
            refine=args.refine,
        )
        if main_out["tuned"] is None:
            continue
        doc[name] = {"main": main_out, "variants": {}}
        mup = {} if args.two_widths is None else two_widths(name, None, main_out["tuned"])
        for variant in args.variant:
            doc[name]["variants"][variant] = variant_cell(name, variant, main_out["tuned"])
            if args.two_widths is not None:
                done = doc[name]["variants"][variant]
                two_width_rows.append(two_width_row(f"{name} {variant}", main_out, done, mup))
                two_width_docs.append((main_out, done, mup))
        print(f"{name}: {time.perf_counter() - t0:.0f} s", flush=True)
    for variant in [None, *args.variant] if doc else []:
        label = f" (FLeRM columns: variant {variant})" if variant else ""
        print(f"\ntransfer matrix{label}, 1x -> {top:g}x width, loss at {top:g}x:\n{HEADER}")
        for name, d in doc.items():
            print(row(name, d["main"], d["variants"][variant] if variant else None))
    if args.variant and doc:
        print(f"\n{compact(doc, args.variant)}")
        print(
            "\ntest losses at the same rates (chosen by training loss), over re-tuned standard "
            f"training's:\n{compact(doc, args.variant, against='test')}"
        )
        print(
            "\nover re-tuning judged on seeds it was not chosen on (each seed scored at the rate "
            "best on the others; re-tuning's best seed mean is biased low):\n"
            f"{compact(doc, args.variant, against='other_seeds')}"
        )
    if two_width_rows:
        print(
            f"\nFLeRM's best rate at {args.two_widths}x width carried to {top:g}x (fitted "
            f"shifts in octaves from b; losses at {top:g}x over re-tuned standard training's "
            f"best):\n{TWO_WIDTH_HEADER}"
        )
        print("\n".join(two_width_rows))
        print(f"\n{two_width_counts(two_width_docs)}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=1, default=str))
    if args.plot:
        plot(doc, args.variant, args.plot, top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
