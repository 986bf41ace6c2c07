"""A 200-step training run with a Recorder or a periodic FLeRM, checkpointed atomically, that
meets a NaN probe batch and a skipped optimiser step, and can be killed (``kill -9`` of itself)
at a given step. ``tests/io/test_fault_injection.py`` runs it in a subprocess, kills it, resumes
it in-process from the last checkpoint and compares with an undisturbed run.

Usage: ``python tests/io/_fault_run.py record|flerm DIR KILL_AT`` (``KILL_AT`` -1: never).
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

import fslr_func as ff
from fslr_func.io.record import FSLRRecord
from fslr_func.training.flerm import FLeRM
from fslr_func.training.recorder import Recorder

STEPS = 200
EVERY = 10  # probe / set-point period
CHECKPOINT_EVERY = 25
NAN_PROBE = 7  # the index of the probe batch that holds a NaN
SKIPPED_STEP = 40  # a probe step without a gradient: the optimiser moves nothing
WIDTH = {"record": 16, "flerm": 48}


def probe_batches() -> Iterator[Tensor]:
    """Endless, re-creatable probe batches; batch ``NAN_PROBE`` holds a NaN."""
    g = torch.Generator().manual_seed(123)
    index = 0
    while True:
        x = torch.randn(16, 6, generator=g, dtype=torch.float64)
        if index == NAN_PROBE:
            x[3, 2] = float("nan")
        yield x
        index += 1


def batch(step: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(10_000 + step)
    return torch.randn(32, 6, generator=g, dtype=torch.float64), torch.randint(
        0, 3, (32,), generator=g
    )


def build(kind: str) -> tuple[ff.FSLRModule, torch.optim.Optimizer]:
    torch.manual_seed(0)
    width = WIDTH[kind]
    net = nn.Sequential(nn.Linear(6, width), nn.Tanh(), nn.Linear(width, 3)).double()
    fm = ff.with_fslr(net, samples=4, seed=1, strategy="loop")
    return fm, torch.optim.Adam(fm.parameters(), lr=1e-2)


def controller(kind: str, fm: ff.FSLRModule, opt: torch.optim.Optimizer, out: Path) -> Any:
    if kind == "record":
        return Recorder(fm, probe_batches(), optimizer=opt, warmup_samples=8, every=EVERY)
    base = FSLRRecord.load(out / "base.json")
    return FLeRM(
        fm, opt, base, probe_batches=probe_batches(), mode="periodic", every=EVERY,
        warmup_samples=8,
    )  # fmt: skip


def save(path: Path, state: dict[str, Any]) -> None:
    """torch.save to a temporary file, then an atomic rename: a kill never leaves half a file."""
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def run(kind: str, out: Path, kill_at: int = -1, resume: bool = False) -> Any:
    """Train to ``STEPS``; returns the controller (its record or history is the result)."""
    fm, opt = build(kind)
    ctl = controller(kind, fm, opt, out)
    checkpoint = out / f"{kind}.pt"
    start = 0
    if resume:
        state = torch.load(checkpoint, weights_only=False)
        fm.load_state_dict(state["fm"])
        opt.load_state_dict(state["opt"])
        ctl.load_state_dict(state["ctl"])
        start = state["step"]
    for step in range(start, STEPS):
        if step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = batch(step)
        opt.zero_grad()
        if step != SKIPPED_STEP:
            nn.functional.cross_entropy(fm(x), y).backward()
        with ctl.step():
            opt.step()
        if (step + 1) % CHECKPOINT_EVERY == 0:
            save(
                checkpoint,
                {
                    "step": step + 1,
                    "fm": fm.state_dict(),
                    "opt": opt.state_dict(),
                    "ctl": ctl.state_dict(),
                },
            )
    return ctl


if __name__ == "__main__":
    kind, out, kill_at = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    ctl = run(kind, out, kill_at)
    if kind == "record":
        ctl.record.save(out / "base.json")
