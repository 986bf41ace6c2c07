"""fslr check: the coordinate check in function space (experiments/check.py, cli check)."""

from __future__ import annotations

import functools
import json
import math
import sys
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

from fslr_func.experiments.check import coord_check, format_check
from fslr_func.experiments.cli import main
from fslr_func.experiments.prediction import predict
from fslr_func.experiments.task import Task
from tests.experiments.test_sweep import _batches, tiny_task


def test_custom_task_standard_drifts_flerm_holds() -> None:
    modes = ("standard", "mup", "flerm")
    result = coord_check(tiny_task(), (1, 8), 0.01, steps=5, warmup_samples=8, modes=modes)
    assert result["names"][:2] == ["input.weight", "input.bias"]
    std, flerm = result["modes"]["standard"], result["modes"]["flerm"]
    # Adam moves a hidden matrix's function-space contribution ~ with its fan-in
    assert "blocks.0.weight" in std["flagged"] and std["drift"]["blocks.0.weight"] > 4
    assert flerm["drift"]["blocks.0.weight"] < 2 and "blocks.0.weight" not in flerm["flagged"]
    assert all(len(v) == 2 for v in flerm["movement"].values())
    # at 1x FLeRM sets every rate to the base's: the same run, so the same column (the
    # standard run's EMAs warmed up at step 0 entered its movement, 5-20% apart)
    for name, moved in std["movement"].items():
        assert flerm["movement"][name][0] == pytest.approx(moved[0], rel=1e-9)
    mup = result["modes"]["mup"]  # muP: the same model at 1x, the hidden drift mostly removed
    assert mup["movement"]["blocks.0.weight"][0] == std["movement"]["blocks.0.weight"][0]
    assert mup["drift"]["blocks.0.weight"] < std["drift"]["blocks.0.weight"] / 2
    table = format_check(result)
    assert table.startswith("standard:") and "flerm:" in table and "blocks.0.weight" in table
    json.dumps(result, allow_nan=False)


def test_check_measures_feature_gains_and_says_what_the_matrix_predicts() -> None:
    modes = ("standard", "flerm", "features")
    result = coord_check(tiny_task(), (1, 8), 0.01, steps=4, warmup_samples=8, modes=modes)
    (name, gains), *_ = result["gains"].items()  # the one hidden tensor: both dims grow
    assert list(result["gains"]) == ["blocks.0.weight"] and len(gains) == 2
    prediction = result["prediction"]
    assert prediction["factor"] == pytest.approx(gains[1] / gains[0])
    assert prediction["exponent"] == pytest.approx(math.log(gains[1] / gains[0]) / math.log(8))
    assert prediction["kind"] == "grows" and prediction["factor"] > 1.5
    # match="features" raises the hidden tensor's rate by the factor at the set point: its
    # output movement at 8x is FLeRM's times about that (the runs part after step 0)
    moved = result["modes"]["features"]["movement"][name][1]
    assert moved / result["modes"]["flerm"]["movement"][name][1] > 0.6 * prediction["factor"]
    table = format_check(result)
    assert "feature gain G_W" in table and "prediction: gain exponent e =" in table
    assert "match='features'" in table
    json.dumps(result, allow_nan=False)


class _TiedHead(nn.Module):
    """The output reads the input layer's weight again: the probe finds no readout."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.embed = nn.Linear(3, width, bias=False)
        self.block = nn.Linear(width, width)

    def forward(self, x: Tensor) -> Tensor:
        h = self.embed(x[:, :3])
        return (h + torch.relu(self.block(h))) @ self.embed.weight


def _tied_task() -> Task:
    def build(scale: float, seed: int) -> nn.Module:
        return _TiedHead(round(8 * scale))

    return Task("tied", build, _batches, functools.partial(_batches, probe=True))


def test_a_run_that_diverges_is_named_in_the_table() -> None:
    """At a rate where the runs diverge the table printed movements of 1e13 without a word."""
    result = coord_check(tiny_task(), (1, 2), 2.0**10, steps=4, warmup_samples=8)
    assert result["modes"]["standard"]["diverged"] == [1.0, 2.0]
    assert "! diverged at 1x, 2x" in format_check(result)
    calm = coord_check(tiny_task(), (1, 2), 0.01, steps=3, warmup_samples=8, modes=("standard",))
    assert calm["modes"]["standard"]["diverged"] == []
    assert "diverged" not in format_check(calm)


def test_check_without_a_readout_predicts_nothing_and_refuses_the_features_mode() -> None:
    result = coord_check(_tied_task(), (1, 2), 0.01, steps=3, warmup_samples=8)
    assert result["gains"] is None and result["prediction"]["kind"] == "not measured"
    assert "no readout" in format_check(result)
    with pytest.raises(ValueError, match="mode 'features' measures the features"):
        coord_check(_tied_task(), (1, 2), 0.01, steps=3, modes=("standard", "features"))


@pytest.mark.parametrize(
    ("gains", "kind"),
    [
        ({"a": [1.0, 2.8], "b": [2.0, 5.7]}, "grows"),
        ({"a": [1.0, 1.1]}, "flat"),
        ({"a": [1.0, 0.3]}, "falls"),
        ({}, "no hidden tensor"),
        ({"a": [0.0, 1.0]}, "no hidden tensor"),  # a gain of 0 is no measurement
        (None, "not measured"),
    ],
)
def test_prediction_places_a_model_by_its_gain_exponent(
    gains: dict[str, list[float]] | None, kind: str
) -> None:
    got = predict({"scales": [1.0, 8.0], "gains": gains})
    assert got["kind"] == kind and got["text"]
    if kind in ("grows", "flat", "falls"):
        factor = math.exp(sum(math.log(g[1] / g[0]) for g in gains.values()) / len(gains))
        assert got["factor"] == pytest.approx(factor)
        assert got["exponent"] == pytest.approx(math.log(factor) / math.log(8.0))


def test_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="steps"):
        coord_check(tiny_task(), (1, 2), 0.01, steps=1)
    with pytest.raises(ValueError, match="modes"):
        coord_check(tiny_task(), (1, 2), 0.01, modes=("sideways",))


def test_cli_check_builtin(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "check"
    args = ["check", "--data", "digits", "--width", "8", "--scales", "1,2", "--steps", "3"]
    assert main([*args, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "readout.weight" in printed and "drifts by more than 2x" in printed
    result = json.loads((out / "check.json").read_text())
    assert result["scales"] == [1.0, 2.0] and set(result["modes"]) == {"standard", "flerm"}
    assert (out / "check.png").stat().st_size > 1000
    with pytest.raises(SystemExit) as err:
        main(["check", "--steps", "1", "--out", str(out)])
    assert err.value.code == 2


@pytest.mark.parametrize("axis", ["depth", "width_depth"])
def test_cli_check_along_depth_shares_blocks(
    axis: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # the built-in task carries its axis's policy: blocks with no base tensor are matched
    args = ["check", "--data", "digits", "--width", "8", "--depth", "2", "--axis", axis]
    assert main([*args, "--scales", "1,2", "--steps", "3", "--out", str(tmp_path)]) == 0
    capsys.readouterr()
    result = json.loads((tmp_path / "check.json").read_text())
    assert result["modes"]["flerm"]["movement"]["blocks.0.linear.weight"][1] > 0


_USER_TASKS = """
import functools
from tests.experiments.test_sweep import tiny_task

TASK = tiny_task()
NOT_A_TASK = 3


def make():
    return tiny_task()
"""


@pytest.mark.parametrize("name", ["TASK", "make"])
def test_cli_check_runs_a_task_of_your_own(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "my_tasks.py").write_text(_USER_TASKS)
    monkeypatch.chdir(tmp_path)  # the current directory's modules, as `python -m`
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    out = tmp_path / "check"
    args = ["check", "--task", f"my_tasks:{name}", "--scales", "1,4", "--steps", "3"]
    assert main([*args, "--no-plots", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "blocks.0.weight" in printed and "prediction: gain exponent" in printed
    result = json.loads((out / "check.json").read_text())
    assert result["task"] == "tiny-width" and result["scales"] == [1.0, 4.0]
    assert list(result["gains"]) == ["blocks.0.weight"] and "config" not in result


@pytest.mark.parametrize(
    ("task", "extra", "says"),
    [
        ("my_tasks", [], "expected MODULE:NAME"),
        ("my_tasks:missing", [], "cannot import"),
        ("no_such_module_here:x", [], "cannot import"),
        ("my_tasks:NOT_A_TASK", [], "gives int, not a"),
        ("my_tasks:TASK", ["--model", "resmlp"], "drop ['--model']"),
        ("./my_tasks.py:TASK", [], "MODULE is a module name"),  # was: TypeError, status 1
        ("my_tasks:TASK", ["--scales", "1,1,2"], "--scales: must be distinct"),
    ],
)
def test_cli_check_task_refuses_what_is_not_a_task(
    task: str,
    extra: list[str],
    says: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    (tmp_path / "my_tasks.py").write_text(_USER_TASKS)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(SystemExit) as err:
        main(["check", "--task", task, *extra, "--out", str(tmp_path / "out")])
    assert err.value.code == 2
    assert says in capsys.readouterr().err


def test_cli_check_an_error_in_your_tasks_code_points_to_it_not_to_a_bug_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    source = _USER_TASKS + "\n\ndef broken():\n    raise RuntimeError('my bug')\n"
    (tmp_path / "my_broken_tasks.py").write_text(source)  # a module name no other test imports
    monkeypatch.syspath_prepend(str(tmp_path))
    args = ["check", "--task", "my_broken_tasks:broken", "--scales", "1,4", "--steps", "3"]
    assert main([*args, "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "RuntimeError: my bug" in err and "in your --task's code, fix it there" in err
