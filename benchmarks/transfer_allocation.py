"""Tune the base's hidden-tensor rate too, then FLeRM: does a better base allocation transfer?

FLeRM transfers the base's *allocation* of movement across tensors along with its level. The
base's one tuned rate ``b`` is a compromise between tensors (docs/reproduction.md, "Why FLeRM
under-sets width rates", 4: at 1x, 300 steps, the hidden weights at twice ``b`` score 1.048
against 1.072), and a compromise that costs little at 1x may cost more at 8x, where the
hidden tensors carry more of the function. This measures whether tuning one more knob on the
cheap model, a factor ``h`` on the hidden tensors' rate, is what the long ResMLP cells want.

For a matrix cell (``benchmarks/transfer_matrix.py``), all in one run, the cell's seeds:

1. standard training at 1x on the cell's grid, with the hidden tensors (fan-out and fan-in
   both grown with width: :func:`fslr_func.training.feature_gains.hidden_fan_in`) at ``h``
   times the rate, for each ``h`` of ``--factors``; each run recorded as a base for
   ``FLeRM(match="features")``; the best ``(b_h, h)`` by seed-mean loss;
2. at 8x, ``FLeRM(match="features")`` from the base records of ``h = 1`` (the matrix's
   ``feature`` variant) and of the best ``h``, each at its ``b_h`` and the octaves around it
   (widened until its optimum is interior);
3. standard training at 8x re-tuned on ``b_1 / 8 .. b_1`` (widened likewise), the reference.

Prints per row the shift from its base rate, the loss at it (sd over seeds), its ratio to
re-tuned standard training's best, and the test loss at it (the held-out split's loss after
training: does a gain in training loss on repeated data hold on unseen data?).

Run, e.g.: ``nice -n 15 python benchmarks/transfer_allocation.py --cell resmlp-w32-s600
--factors 1,2,4 --jobs 2`` (results cached in ``--out``; a second call re-prints).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import math
import multiprocessing
import statistics
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from fslr_func.experiments.cache import mean_record
from fslr_func.experiments.configs import SweepConfig
from fslr_func.experiments.run import RunSpec, execute, unusable
from fslr_func.experiments.task import builtin_task
from fslr_func.io.atomic import write_json
from fslr_func.io.record import FSLRRecord
from fslr_func.training.feature_gains import hidden_fan_in

sys.path.insert(0, str(Path(__file__).parent))
from transfer_matrix import BUDGET_CELLS, CELLS, EXTRA_CELLS, HELD_OUT_CELLS

Job = tuple[str, float, float, int, float]
"""(mode, scale, lr, seed, h): one run; ``h`` the hidden factor of a base run (1 otherwise)."""


def hidden_names(config: SweepConfig) -> list[str]:
    """The tensors of the cell's model that are hidden (both dims grow with the width)."""
    task = builtin_task(config)
    shapes = {
        s: {n: tuple(p.shape) for n, p in task.build(s, 0).named_parameters()}
        for s in (config.base_scale, 2 * config.base_scale)
    }
    return sorted(hidden_fan_in(shapes[2 * config.base_scale], shapes[config.base_scale]))


def _key(job: Job) -> str:
    mode, scale, lr, seed, h = job
    return f"{mode}_scale={scale:g}_lr={lr!r}_seed={seed}_h={h:g}"


def _worker(config: SweepConfig, hidden: Sequence[str], job: Job, base: Any) -> tuple[dict, Any]:
    torch.set_num_threads(1)
    mode, scale, lr, seed, h = job
    factors = dict.fromkeys(hidden, h) if mode == "standard" and h != 1.0 else None
    result, record = execute(
        builtin_task(config),
        config,
        RunSpec(mode, scale, lr, seed),
        base,
        record=mode == "standard" and scale == config.base_scale,
        lr_factors=factors,
    )
    return result, record


class Runs:
    """Runs by job, cached in a JSON file; base records kept in memory for FLeRM."""

    def __init__(self, config: SweepConfig, out: Path, jobs: int) -> None:
        self.config, self.out, self.jobs = config, out, jobs
        self.hidden = hidden_names(config)
        self.path = out / "runs.json"
        self.results: dict[str, dict[str, Any]] = (
            json.loads(self.path.read_text()) if self.path.exists() else {}
        )
        (out / "records").mkdir(exist_ok=True)

    def record(self, job: Job) -> FSLRRecord | None:
        """A base run's record, or ``None`` if it has not run."""
        path = self._record_path(job)
        return FSLRRecord.load(path) if path.exists() else None

    def _record_path(self, job: Job) -> Path:
        return self.out / "records" / f"{_key(job)}.json"

    def run(self, jobs: Iterable[Job], base_of: Callable[[Job], Any] | None = None) -> None:
        """Train the jobs not cached (base runs whose records are missing are re-run)."""
        todo = [
            j
            for j in dict.fromkeys(jobs)
            if _key(j) not in self.results or (self._is_base(j) and self.record(j) is None)
        ]
        if not todo:
            return
        bases = {j: None if base_of is None else base_of(j) for j in todo}
        for j in [j for j in todo if j[0] == "flerm" and bases[j] is None]:
            self.results[_key(j)] = unusable(RunSpec(*j[:4]))  # every base run diverged
            todo.remove(j)
        print(f"{self.out}: {len(todo)} runs to train", flush=True)
        ctx = multiprocessing.get_context("fork")
        with concurrent.futures.ProcessPoolExecutor(self.jobs, mp_context=ctx) as pool:
            futures = {pool.submit(_worker, self.config, self.hidden, j, bases[j]): j for j in todo}
            for f in concurrent.futures.as_completed(futures):
                job = futures[f]
                result, record = f.result()
                self.results[_key(job)] = result
                if record is not None:
                    record.save(self._record_path(job))
                write_json(self.path, self.results)

    def _is_base(self, job: Job) -> bool:
        return job[0] == "standard" and job[1] == self.config.base_scale

    def losses(self, mode: str, scale: float, lr: float, h: float, what: str = "loss") -> list:
        out = []
        for seed in range(self.config.seeds):
            r = self.results.get(_key((mode, scale, lr, seed, h)))
            v = None if r is None else r.get(what)
            out.append(math.inf if v is None else float(v))
        return out

    def mean(self, mode: str, scale: float, lr: float, h: float, what: str = "loss") -> float:
        return statistics.fmean(self.losses(mode, scale, lr, h, what))


def _best(runs: Runs, mode: str, scale: float, lrs: Iterable[float], h: float) -> float:
    return min(lrs, key=lambda lr: runs.mean(mode, scale, lr, h))


def adaptive(
    runs: Runs,
    mode: str,
    scale: float,
    lrs: list[float],
    h: float,
    base_of: Callable[[Job], Any] | None = None,
) -> float:
    """Run ``mode`` at ``scale`` on ``lrs`` (FLeRM from ``base_of(job)``), widened by an
    octave at an edge until the best is interior; the best rate."""
    while True:
        runs.run([(mode, scale, lr, s, h) for lr in lrs for s in range(runs.config.seeds)], base_of)
        best = _best(runs, mode, scale, lrs, h)
        if best == lrs[0] and math.log2(lrs[0]) > -20:
            lrs = [lrs[0] / 2, *lrs]
        elif best == lrs[-1] and math.log2(lrs[-1]) < 2:
            lrs = [*lrs, lrs[-1] * 2]
        else:
            return best


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cell", required=True)
    p.add_argument("--factors", default="1,2,4", help="hidden factors h at the base")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path("fslr_runs/allocation"))
    args = p.parse_args(argv)
    cells = {**CELLS, **EXTRA_CELLS, **HELD_OUT_CELLS, **BUDGET_CELLS}
    config = dataclasses.replace(cells[args.cell], flerm_variant="feature")
    out = args.out / args.cell
    out.mkdir(parents=True, exist_ok=True)
    runs = Runs(config, out, args.jobs)
    seeds = range(config.seeds)
    base, top = config.base_scale, max(config.scales)
    factors = [float(f) for f in args.factors.split(",")]
    print(f"{args.cell}: hidden tensors {runs.hidden}", flush=True)

    b = {h: adaptive(runs, "standard", base, list(config.lrs), h) for h in factors}
    h_best = min(factors, key=lambda h: runs.mean("standard", base, b[h], h))
    for h in factors:
        print(
            f"  base h={h:g}: best rate 2^{math.log2(b[h]):g}, loss "
            f"{runs.mean('standard', base, b[h], h):.4f}",
            flush=True,
        )

    def base_of(h: float) -> Callable[[Job], FSLRRecord | None]:
        def find(job: Job) -> FSLRRecord | None:
            jobs = [("standard", base, job[2], s, h) for s in seeds]
            runs.run(jobs)  # a rate the base grid did not reach
            return mean_record(runs.record(j) for j in jobs)  # type: ignore[misc]

        return find

    std_best = adaptive(runs, "standard", top, [b[1.0] / 2**k for k in (3, 2, 1, 0)], 1.0)
    retuned = runs.mean("standard", top, std_best, 1.0)
    print(
        f"  re-tuned standard at {top:g}x: 2^{math.log2(std_best):g}, loss {retuned:.4f}, test "
        f"{runs.mean('standard', top, std_best, 1.0, 'test_loss'):.4f}",
        flush=True,
    )
    for h in dict.fromkeys([1.0, h_best]):
        best = adaptive(runs, "flerm", top, [b[h] / 2, b[h], b[h] * 2], h, base_of(h))
        at = runs.losses("flerm", top, b[h], h)
        sd = statistics.stdev(at) if len(at) > 1 and all(map(math.isfinite, at)) else math.nan
        print(
            f"  FLeRM features from base h={h:g} (b=2^{math.log2(b[h]):g}): shift "
            f"{math.log2(best / b[h]):+g}; loss at b {statistics.fmean(at):.4f} (sd {sd:.4f}); "
            f"ratio {statistics.fmean(at) / retuned:.3f}; test at b "
            f"{runs.mean('flerm', top, b[h], h, 'test_loss'):.4f}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
