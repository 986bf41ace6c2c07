"""The ``fslr`` console script: smoke runs of demo/sweep/plot, --help, argument errors."""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from fslr_func.experiments import sweep
from fslr_func.experiments.cli import main
from fslr_func.experiments.cli_args import parse_lrs

PNGS = ("transfer.png", "fslr_time.png", "flerm_lrs.png")
# a tiny configuration of the demo: digits (instant to load), widths 8 and 16, 2 lrs, 8 steps
TINY = [
    "--data", "digits", "--width", "8", "--depth", "2", "--scales", "1,2", "--lrs", "2^-7,2^-5",
    "--steps", "8", "--last", "4", "--seeds", "1", "--batch-size", "32", "--samples", "4",
    "--warmup-samples", "8", "--every", "4", "--jobs", "1", "--quiet",
]  # fmt: skip


def _no_data(config: object) -> None:
    raise AssertionError("the data were loaded although every run is cached")


def test_demo_smoke_writes_files_and_summary(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "demo"
    assert main(["demo", "--out", str(out), *TINY]) == 0
    printed = capsys.readouterr().out
    assert "standard best lr" in printed and "flerm best lr" in printed and "shift" in printed
    assert "mup best lr" in printed
    for name in PNGS:
        png = out / name
        assert png.stat().st_size > 1000, name
    summary = json.loads((out / "summary.json").read_text())
    assert summary["axis"] == "width" and summary["scales"] == [1.0, 2.0]
    assert summary["lrs"] == [2.0**-7, 2.0**-5]
    assert summary["config"]["data"] == "digits" and summary["wall_seconds"] > 0
    for mode in ("standard", "mup", "flerm"):
        m = summary["modes"][mode]
        assert set(m["best_lr"]) == set(m["best_loss"]) == {"1", "2"}
        assert all(lr in summary["lrs"] for lr in m["best_lr"].values())
        assert all(isinstance(v, float) for v in m["best_loss"].values())
        assert isinstance(m["shift_octaves"], float)
    assert summary["identity_check"]["lr_ratio_min"] == 1.0
    # a finished sweep re-plots from its cache, without training or even loading the data
    monkeypatch.setattr(sweep, "builtin_task", _no_data)
    assert main(["demo", "--out", str(out), *TINY]) == 0
    assert "0 run(s) trained, 12 cached" in capsys.readouterr().out


def test_sweep_depth_and_plot_commands(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "depth"
    args = ["sweep", "--axis", "depth", "--out", str(out), *TINY, "--no-plots"]
    assert main(args) == 0
    assert not (out / "transfer.png").exists()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["axis"] == "depth" and summary["config"]["depth"] == 2
    capsys.readouterr()
    figs = tmp_path / "figs"
    assert main(["plot", str(out), "--out", str(figs)]) == 0
    assert "shift" in capsys.readouterr().out
    assert all((figs / name).stat().st_size > 1000 for name in PNGS)
    record = next((out / "records").glob("lr=*_seed=0.json"))
    assert main(["plot", str(record), "--out", str(figs)]) == 0
    assert (figs / f"{record.stem}.png").stat().st_size > 1000


def test_width_depth_sweep_with_an_ablation_policy_gets_its_own_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from fslr_func.experiments.plot import _scale_label

    monkeypatch.chdir(tmp_path)
    assert main(["sweep", *TINY, "--axis", "width_depth", "--policy", "equal", "--no-plots"]) == 0
    summary = json.loads((tmp_path / "fslr_runs/resmlp_width_depth-equal/summary.json").read_text())
    assert summary["axis"] == "width_depth" and summary["config"]["flerm_policy"] == "equal"
    assert _scale_label(summary, 2.0) == "width 16, depth 4 (2x)"
    capsys.readouterr()


def test_nearly_equal_scales_get_their_own_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # issue 10: scale keys kept 6 digits, so 1 and 1.000001 shared run files ("-1 cached")
    out = tmp_path / "init"
    args = ["sweep", *TINY, "--axis", "init_scale", "--scales", "1,1.000001,4", "--lrs", "2^-5",
            "--modes", "standard", "--out", str(out), "--no-plots"]  # fmt: skip
    assert main(args) == 0
    assert "3 run(s) trained, 0 cached" in capsys.readouterr().out
    assert len(list((out / "runs").glob("*.json"))) == 3
    assert set(json.loads((out / "summary.json").read_text())["modes"]["standard"]["loss"]) == {
        "1", "1.000001", "4"}  # fmt: skip
    assert main(args) == 0
    assert "0 run(s) trained, 3 cached" in capsys.readouterr().out


def test_steps_below_the_default_last_average_over_every_step() -> None:
    """`fslr sweep --steps 20` alone ran into the default `--last 30` ("argument --last: must
    be an integer in [1, steps=20], got 30"), an option the user never gave."""
    from fslr_func.experiments.cli import _config, build_parser

    parser = build_parser()[0]

    def last(*argv: str) -> int:
        return _config(parser.parse_args(list(argv)), argv[0] == "demo").validate().last

    assert last("sweep", "--steps", "6") == 6
    assert last("demo", "--steps", "20") == 20
    assert last("sweep", "--steps", "6", "--last", "4") == 4
    assert last("demo", "--steps", "100") == 30  # the default, where it fits


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["sweep", "--scales", "1,x"], "argument --scales"),
        (["sweep", "--scales", "1,-2"], "argument --scales"),
        (["sweep", "--scales", "1,1.5", "--width", "5"], "argument --scales"),
        (["sweep", "--lrs", "0.1,-1"], "argument --lrs"),
        (["sweep", "--lrs", "2^2000"], "argument --lrs"),  # OverflowError traceback before
        (["sweep", "--scales", "1,2**5000"], "argument --scales"),
        (["demo", "--init-scale", "2^9999"], "argument --init-scale"),
        (["sweep", "--lrs", "2^-3..2^-5"], "argument --lrs"),
        (["sweep", "--steps", "0"], "argument --steps"),
        (["sweep", "--steps", "ten"], "argument --steps"),
        (["sweep", "--seeds", "-1"], "argument --seeds"),
        (["sweep", "--axis", "sideways"], "argument --axis"),
        (["sweep", "--model", "cnn"], "argument --model"),
        (["sweep", "--data", "text"], "argument --data"),
        (["sweep", "--model", "transformer", "--data", "digits"], "argument --data"),
        (["sweep", "--steps", "10", "--last", "20"], "argument --last"),
        (["sweep", "--norm", "postnorm"], "argument --norm"),
        (["sweep", "--model", "transformer", "--norm", "sandwich"], "argument --norm"),
        (["sweep", "--modes", "fast"], "argument --modes"),
        (["sweep", "--policy", "deep"], "argument --policy"),
        (
            ["sweep", "--axis", "width_depth", "--depth", "3", "--scales", "1,1.5"],
            "argument --scales",
        ),
        (["sweep", "--data", "digits", "--batch-size", "5000"], "argument --batch-size"),
        (["demo", "--jobs", "0"], "argument --jobs"),
        (["plot", "/nonexistent/folder"], "argument path"),
    ],
)
def test_bad_arguments_exit_2_naming_the_argument(
    args: list[str], named: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main([*args, "--out", str(tmp_path / "x")] if args[0] != "plot" else args)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"fslr {args[0]}: error: {named}" in err, err
    assert not (tmp_path / "x").exists()


def test_out_must_be_a_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(SystemExit):
        main(["sweep", "--out", str(tmp_path / "file"), *TINY])
    assert "argument --out" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["plot", str(tmp_path)])
    assert "argument path: " in capsys.readouterr().err


def _one_line_error(capsys: pytest.CaptureFixture[str], start: str) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.splitlines()[-1].startswith(start), err
    return err.splitlines()[-1]


def test_unusable_out_or_damaged_sweep_json_is_a_one_line_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # issue 10: --out /proc/x and a damaged sweep.json ended in tracebacks
    with pytest.raises(SystemExit) as info:
        main(["sweep", *TINY, "--out", "/proc/x/runs"])
    assert info.value.code == 2
    line = _one_line_error(capsys, "fslr sweep: error: argument --out: cannot create '/proc/x")
    (tmp_path / "sweep.json").write_text('{"config": {"steps": "ten"}}')
    with pytest.raises(SystemExit) as info:
        main(["plot", str(tmp_path)])
    assert info.value.code == 2
    line = _one_line_error(capsys, "fslr plot: error: argument path: ")
    assert "sweep.json is damaged" in line and "steps" in line


def _children(pid: int) -> list[int]:
    """Pids of the live (not zombie) child processes of ``pid``, from /proc."""
    kids = []
    for entry in Path("/proc").iterdir():
        try:
            state, ppid = entry.joinpath("stat").read_text().rsplit(")", 1)[1].split()[:2]
        except (OSError, ValueError):  # not a process, or it just ended
            continue
        if int(ppid) == pid and state != "Z":
            kids.append(int(entry.name))
    return kids


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait_gone(pids: list[int], seconds: float = 10) -> list[int]:
    """The pids still alive after up to ``seconds`` (killed, so none outlives the test)."""
    deadline = time.monotonic() + seconds
    while any(_alive(k) for k in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    survivors = [k for k in pids if _alive(k)]
    for k in survivors:
        os.kill(k, signal.SIGKILL)
    return survivors


_PARENT = """
import subprocess, sys
child = "from fslr_func.experiments.schedule import _die_with_parent; import os, time; "
child += f"_die_with_parent({__import__('os').getpid()}); print(os.getpid(), flush=True); "
child += "time.sleep(60)"
subprocess.Popen([sys.executable, "-c", child]).wait()
"""


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
def test_worker_dies_with_its_killed_parent() -> None:
    # what a sweep's worker runs first (schedule._init_worker); end to end: the slow test below
    parent = subprocess.Popen([sys.executable, "-c", _PARENT], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())  # printed once _die_with_parent has run
        assert _alive(child)
    finally:
        parent.kill()
        parent.wait()
    assert _wait_gone([child]) == []


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
def test_kill_9_of_a_parallel_sweep_leaves_no_process_behind(tmp_path: Path) -> None:
    # issue 10: kill -9 of `fslr sweep --jobs 2` left its workers training as orphans
    out = tmp_path / "killed"
    args = [*TINY, "--lrs", "2^-9..2^-2", "--steps", "30", "--jobs", "2", "--no-plots"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "fslr_func.experiments.cli", "sweep", *args, "--out", str(out)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while not list(out.glob("runs/*.json")):  # the workers are up and training
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        kids = _children(proc.pid)
        assert len(kids) >= 2  # the two workers (and multiprocessing's resource tracker)
    finally:
        proc.kill()
        proc.wait()
    assert _wait_gone(kids) == []
    assert not list(out.rglob("*.tmp"))  # or the next save would have removed them


@pytest.mark.parametrize("command", [[], ["demo"], ["sweep"], ["plot"]])
def test_help_everywhere(command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main([*command, "--help"])
    assert info.value.code == 0
    assert "usage: fslr" in capsys.readouterr().out


def test_console_script_reports_bad_argument() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "fslr_func.experiments.cli", "sweep", "--scales", "one"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "fslr sweep: error: argument --scales: 'one' is not a number" in proc.stderr


def test_parse_lrs() -> None:
    assert parse_lrs("2^-2, 0.5,1e-1") == (0.25, 0.5, 0.1)
    assert parse_lrs("2**-3..2**-1") == (0.125, 0.25, 0.5)
    assert len(parse_lrs("2^-4..2^-2/4")) == 9


# ------------------------------------------------------------------ hostile arguments (issue 21)

HOSTILE = [
    (["sweep", "--lrs", "2^-1000"], "--lrs", "[2^-40, 2^10]"),  # a JSON traceback before
    (["sweep", "--lrs", "1e-400"], "--lrs", "[2^-40, 2^10]"),
    (["sweep", "--lrs", "nan"], "--lrs", "[2^-40, 2^10]"),
    (["sweep", "--lrs", "2^-40..2^10/99999999999999999999"], "--lrs", "[2^-40, 2^10]"),
    (["sweep", "--lrs", ",".join(["0.1"] * 300)], "--lrs", "at most 256"),
    (["sweep", "--lrs", "0x10"], "--lrs", "[2^-40, 2^10]"),
    (["sweep", "--scales", "1,1e9"], "--scales", "[2^-6, 2^10]"),
    (["sweep", "--scales", "1,2", "--width", "8192"], "--scales", "[1, 8192]"),
    (["sweep", "--axis", "depth", "--depth", "100", "--scales", "1,8"], "--scales", "[1, 512]"),
    (["sweep", "--steps", "9" * 30], "--steps", "[1, 1000000]"),
    (["sweep", "--width", "-5"], "--width", "[1, 2^13]"),
    (["sweep", "--weight-decay", "-1"], "--weight-decay", "[0, 10]"),
    (["sweep", "--weight-decay", "inf"], "--weight-decay", "[0, 10]"),
    (["sweep", "--init-scale", "0"], "--init-scale", "[2^-20, 2^20]"),
    (["sweep", "--jobs", "100000"], "--jobs", "[1, 256]"),
    (["sweep", "--num-samples", "5"], "--num-samples", "[100, 1000000]"),
    (["sweep", "--seq-len", "1"], "--seq-len", "[2, 2^12]"),
    (["demo", "--samples", "0"], "--samples", "[1, 2^12]"),
    (["demo", "--warmup-samples", "1.5"], "--warmup-samples", "[1, 2^16]"),
    (["demo", "--every", "-1"], "--every", "[1, 1000000]"),
    (["check", "--lr", "2^-1000"], "--lr", "[2^-40, 2^10]"),
    (["check", "--seed", "-1"], "--seed", "[0, 4294967295]"),
    (["check", "--threshold", "1"], "--threshold", "[1, 2^20]"),
    (["check", "--every", "50", "--steps", "10"], "--every", "[1, --steps - 1 = 9]"),
    (["check", "--every", "10", "--steps", "10"], "--every", "[1, --steps - 1 = 9]"),
    (["check", "--steps", "1"], "--steps", "[2, 1000000]"),
    (["check", "--scales", "1,1e6"], "--scales", "[2^-6, 2^10]"),
    (["plot", "/dev/null"], "path", "record JSON file"),  # a device: never read forever
    (["plot", "/etc/hostname"], "path", "not valid JSON"),
]


@pytest.mark.parametrize(("args", "flag", "accepted"), HOSTILE)
def test_hostile_arguments_end_in_one_line_naming_argument_and_range(
    args: list[str], flag: str, accepted: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    if args[0] != "plot":
        args = [*args, "--out", str(tmp_path / "x")]
    elif not Path(args[1]).exists():
        pytest.skip(f"{args[1]} does not exist here")
    with pytest.raises(SystemExit) as info:
        main(args)
    assert info.value.code == 2
    line = _one_line_error(capsys, f"fslr {args[0]}: error: argument {flag}: ")
    assert accepted in line, line
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("command", ["check", "sweep"])
def test_an_out_folder_under_a_file_is_refused_before_training(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # check trained every model first, then failed writing check.json ("unexpected: report it")
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit) as info:
        main([command, "--out", str(tmp_path / "file" / "sub")])
    assert info.value.code == 2
    line = _one_line_error(capsys, f"fslr {command}: error: argument --out: ")
    assert "Not a directory" in line, line


def test_a_record_that_breaks_the_schema_is_one_line_naming_field_and_row(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from fslr_func.io.record import FSLRRecord

    path = tmp_path / "base.json"
    FSLRRecord(steps=[0, 10], fslr={"w": [0.5, 0.25]}).save(path)
    path.write_text(path.read_text().replace("0.25", '"0.25"'))
    with pytest.raises(SystemExit):
        main(["plot", str(path)])
    line = _one_line_error(capsys, "fslr plot: error: argument path: ")
    assert "fslr['w'] row 1 (step 10)" in line and "re-record" in line


def test_an_unexpected_error_is_one_line_and_status_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("something nobody foresaw\nsecond line")

    monkeypatch.setattr(sweep, "run_sweep", broken)
    assert main(["sweep", *TINY, "--out", str(tmp_path)]) == 1
    line = _one_line_error(capsys, "fslr: error: RuntimeError: something nobody foresaw (")
    assert "FSLR_TRACEBACK=1" in line
    monkeypatch.setenv("FSLR_TRACEBACK", "1")
    with pytest.raises(RuntimeError, match="nobody foresaw"):
        main(["sweep", *TINY, "--out", str(tmp_path)])


@pytest.mark.parametrize("command", ["demo", "sweep", "check"])
def test_fuzzed_numbers_parse_or_name_their_argument(command: str) -> None:
    """Random text for every number option: parsed into its range, or one argparse error
    naming the option (the parser only: nothing runs)."""
    from hypothesis import given
    from hypothesis import strategies as st

    from fslr_func.experiments.cli import build_parser
    from fslr_func.experiments.cli_args import FLOAT_RANGES, INT_RANGES

    parser = build_parser()[1][command]
    words = {"out", "modes"}  # a path and a list of names: not numbers
    flags = [
        a
        for a in parser._actions
        if a.option_strings and a.type is not None and a.dest not in words
    ]
    texts = st.one_of(
        st.text(max_size=12),
        st.integers(-(10**30), 10**30).map(str),
        st.floats(allow_nan=True, allow_infinity=True).map(repr),
        st.integers(-3000, 3000).map(lambda k: f"2^{k}"),
    )

    @given(st.sampled_from(flags), texts)
    def check(action: Any, text: str) -> None:
        flag = action.option_strings[0]
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                value = parser.parse_args([f"{flag}={text}"])
        except SystemExit as exit:
            last = err.getvalue().strip().splitlines()[-1]
            assert exit.code == 2 and f"error: argument {flag}: " in last, last
            assert "Traceback" not in err.getvalue()
            return
        got = getattr(value, action.dest)
        bounds = INT_RANGES.get(action.dest) or FLOAT_RANGES.get(action.dest)
        for v in got if isinstance(got, tuple) else (got,):
            if bounds is not None:
                assert bounds[0] <= v <= bounds[1], (flag, text, v)
            assert math.isfinite(v) and v >= 0, (flag, text, v)

    check()
