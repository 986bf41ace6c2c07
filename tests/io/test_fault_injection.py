"""Issue 10's fault-injection test: a Recorder run and a periodic FLeRM run meet a NaN probe
batch, a skipped optimiser step and a ``kill -9`` in the middle; resumed from the last
checkpoint they end with the record and the rates of an undisturbed run with the same data."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import _fault_run as fault

KILL_AT = 137  # after the checkpoint of step 125, before the one of step 150


def killed_then_resumed(kind: str, out: Path) -> object:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path.cwd()), *sys.path])}
    proc = subprocess.run(
        [sys.executable, fault.__file__, kind, str(out), str(KILL_AT)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == -9, proc.stderr[-2000:]  # it really was killed
    assert (out / f"{kind}.pt").exists() and not (out / f"{kind}.tmp").exists()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return fault.run(kind, out, resume=True)


def test_record_and_flerm_survive_a_nan_probe_a_skipped_step_and_kill_9(tmp_path: Path) -> None:
    undisturbed, killed = tmp_path / "undisturbed", tmp_path / "killed"
    undisturbed.mkdir()
    killed.mkdir()

    with pytest.warns(RuntimeWarning) as caught:
        reference = fault.run("record", undisturbed)
    messages = " ".join(str(w.message) for w in caught)
    # Probe batches: 2 of warm-up at step 0, then one per probe step; the skipped step 40 drew
    # one before finding that nothing moved, and step 41 the next, so batch 7 meets step 50.
    nan_step = 50
    assert f"step {nan_step}" in messages and "not finite" in messages
    assert f"step {fault.SKIPPED_STEP} is not measured" in messages
    record = reference.record
    # The NaN probe reached the weights' gradients only: their row kept the previous average.
    row, previous = record.at(nan_step), record.at(nan_step - 1)
    assert row["0.weight"] == previous["0.weight"]
    assert row["2.weight"] == previous["2.weight"]
    # The skipped step's probe moved to the next step that changed the weights.
    expected = [s for s in range(0, fault.STEPS, fault.EVERY) if s != fault.SKIPPED_STEP]
    assert record.steps == sorted([*expected, fault.SKIPPED_STEP + 1])
    assert all(v > 0 for r in record.fslr.values() for v in r)  # no silent zeros
    record.save(undisturbed / "base.json")

    resumed = killed_then_resumed("record", killed)
    assert resumed.record.to_dict() == record.to_dict()

    record.save(killed / "base.json")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        flerm_reference = fault.run("flerm", undisturbed)
    flerm_resumed = killed_then_resumed("flerm", killed)
    # repr: a held tensor's measured FSLR is NaN in both (NaN != NaN under ==).
    assert repr(flerm_resumed.history) == repr(flerm_reference.history)
    assert [p.step for p in flerm_reference.history] == record.steps
    nan_point = next(p for p in flerm_reference.history if p.step == nan_step)
    assert "0.weight" in nan_point.held and "2.weight" in nan_point.held
