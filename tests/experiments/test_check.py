"""fslr check: the coordinate check in function space (experiments/check.py, cli check)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fslr_func.experiments.check import coord_check, format_check
from fslr_func.experiments.cli import main
from tests.experiments.test_sweep import tiny_task


def test_custom_task_standard_drifts_flerm_holds() -> None:
    modes = ("standard", "mup", "flerm")
    result = coord_check(tiny_task(), (1, 8), 0.01, steps=5, warmup_samples=8, modes=modes)
    assert result["names"][:2] == ["input.weight", "input.bias"]
    std, flerm = result["modes"]["standard"], result["modes"]["flerm"]
    # Adam moves a hidden matrix's function-space contribution ~ with its fan-in
    assert "blocks.0.weight" in std["flagged"] and std["drift"]["blocks.0.weight"] > 4
    assert flerm["drift"]["blocks.0.weight"] < 2 and "blocks.0.weight" not in flerm["flagged"]
    assert all(len(v) == 2 for v in flerm["movement"].values())
    mup = result["modes"]["mup"]  # muP: the same model at 1x, the hidden drift mostly removed
    assert mup["movement"]["blocks.0.weight"][0] == std["movement"]["blocks.0.weight"][0]
    assert mup["drift"]["blocks.0.weight"] < std["drift"]["blocks.0.weight"] / 2
    table = format_check(result)
    assert table.startswith("standard:") and "flerm:" in table and "blocks.0.weight" in table
    json.dumps(result, allow_nan=False)


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
