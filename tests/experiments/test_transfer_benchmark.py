"""benchmarks/transfer.py, issue 12's target printer, on tiny sweeps (its own are CPU-minutes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _scripts import load_script

from fslr_func.experiments.configs import SweepConfig


def test_norm_flag_runs_the_transformer_sweep_with_that_norm_in_its_own_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    bench = load_script("benchmarks/transfer.py")
    tiny = SweepConfig.for_model(
        "transformer", width=16, scales=(1, 2), lrs=(2.0**-6, 2.0**-4), steps=4, last=2,
        seq_len=8, batch_size=2, samples=2, warmup_samples=2,
    )  # fmt: skip
    monkeypatch.setattr(bench, "SWEEPS", {"transformer": tiny})
    assert bench.main(["--norm", "postnorm", "--out", str(tmp_path), "--seeds", "3"]) == 0
    out = capsys.readouterr().out
    assert "transformer-postnorm" in out and "targets met" in out
    saved = json.loads((tmp_path / "transformer-postnorm" / "sweep.json").read_text())
    assert saved["config"]["norm"] == "postnorm" and saved["task"] == "transformer-postnorm/text"
