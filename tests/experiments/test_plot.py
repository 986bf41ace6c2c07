"""Figures: written, non-empty PNGs from records, summaries, FLeRM runs and sweep folders."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from test_sweep import tiny_config, tiny_task

from fslr_func.experiments import plot
from fslr_func.experiments.configs import SweepConfig
from fslr_func.experiments.sweep import run_sweep
from fslr_func.io.record import FSLRRecord

pytest.importorskip("matplotlib")

PNG = b"\x89PNG\r\n\x1a\n"


def _is_png(path: Path) -> bool:
    return path.exists() and path.stat().st_size > 1000 and path.read_bytes()[:8] == PNG


def _record() -> FSLRRecord:
    names = ["input.weight", "input.bias", "blocks.0.linear.weight", "readout.weight"]
    rec = FSLRRecord(meta={"base_lr": 0.01, "model": "ResMLP"})
    for i, step in enumerate((0, 25, 50, 75)):
        rec.append(
            step,
            {n: 0.5 / (1 + i) * (k + 1) for k, n in enumerate(names)},
            lrs=dict.fromkeys(names, 0.01),
        )
    return rec


def test_tensor_kinds() -> None:
    kinds = {
        "input.weight": "input",
        "embed.weight": "input",
        "pos.weight": "input",
        "blocks.2.linear.weight": "hidden",
        "blocks.2.linear.bias": "bias",
        "blocks.0.attn.k.weight": "QK weights",
        "blocks.0.attn.v.weight": "VO weights",
        "blocks.0.ff.up.weight": "FF up",
        "blocks.0.ff.down.weight": "FF down",
        "readout.weight": "readout",
        "lm_head.weight": "readout",
        "blocks.0.norm1.weight": "norm",
    }
    assert {n: plot.tensor_kind(n) for n in kinds} == kinds
    assert set(kinds.values()) <= set(plot.KIND_COLOURS)


def test_fslr_time_and_record(tmp_path: Path) -> None:
    out = plot.plot_fslr_time(_record(), tmp_path / "a" / "fslr.png", per_step=False)
    assert _is_png(out)
    path = tmp_path / "rec.json"
    _record().save(path)
    assert plot.plot_record(path) == [tmp_path / "rec.png"] and _is_png(tmp_path / "rec.png")
    assert plot.plot_record(path, tmp_path / "figs") == [tmp_path / "figs" / "rec.png"]
    with pytest.raises(ValueError, match="empty"):
        plot.plot_fslr_time(FSLRRecord(), tmp_path / "empty.png")


def test_transfer_with_diverged_points(tmp_path: Path) -> None:
    summary: dict[str, Any] = {
        "axis": "width",
        "scales": [1.0, 4.0],
        "lrs": [0.001, 0.01, 0.1],
        "config": SweepConfig(scales=(1, 4)).to_dict(),
        "modes": {
            mode: {
                "best_lr": {"1": 0.01, "4": 0.001 if mode == "standard" else 0.01},
                "best_loss": {"1": 1.0, "4": 0.8},
                "shift_octaves": -3.32 if mode == "standard" else 0.0,
                "loss": {"1": [1.5, 1.0, 2.0], "4": [0.8, 1.1, None]},
            }
            for mode in ("standard", "flerm")
        },
    }
    assert _is_png(plot.plot_transfer(summary, tmp_path / "t.png"))


def test_flerm_lrs(tmp_path: Path) -> None:
    runs = [
        {"scale": s, "flerm": {"lrs": {"input.weight": 0.01, "blocks.0.linear.weight": 0.01 / s}}}
        for s in (1.0, 2.0, 4.0)
    ]
    assert _is_png(plot.plot_flerm_lrs(runs, 0.01, tmp_path / "f.png"))
    with pytest.raises(ValueError, match="no FLeRM run"):
        plot.plot_flerm_lrs([{"scale": 1.0}], 0.01, tmp_path / "g.png")


def test_sweep_folder(tmp_path: Path) -> None:
    cfg = tiny_config(seeds=1)
    run_sweep(cfg, tmp_path, task=tiny_task(), quiet=True)
    written = plot.plot_sweep(tmp_path, tmp_path / "figs")
    assert [p.name for p in written] == ["transfer.png", "fslr_time.png", "flerm_lrs.png"]
    assert all(_is_png(p) for p in written)


def test_missing_matplotlib_names_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match=r"pip install 'fslr_func\[plot\]'"):
        plot.plot_fslr_time(_record(), tmp_path / "x.png")


def test_a_record_plots_with_rates_for_some_tensors_and_names_its_optimiser(tmp_path: Path) -> None:
    # a KeyError when lrs covered some tensors only; the title always said "Adam"
    record = FSLRRecord(
        steps=[0, 1], fslr={"input.weight": [1.0, 2.0], "readout.weight": [0.5, 0.25]},
        lrs={"input.weight": [0.1, 0.1]}, sched=[1.0, 0.5],
        meta={"base_lr": 0.05, "optimizer": "SGD", "model": "MLP"},
    )  # fmt: skip
    path = plot.plot_fslr_time(record, tmp_path / "fslr.png")
    assert path.stat().st_size > 0
    assert plot.KIND_COLOURS["FF down"] != plot.KIND_COLOURS["hidden"]
