"""Wall-time overhead of FLeRM: plain Adam vs static FLeRM vs periodic FLeRM, in one process.

Three copies of a ResMLP (default width 512, 4 blocks, batch 128, digits-sized inputs) train for
``--steps`` Adam steps on the same pre-generated batches: plainly, with static FLeRM (rates set
once after the 40-sample EMA warm-up at step 0) and with periodic FLeRM (and re-set every
``--every`` steps with one probe). The three runs take their steps in turn (round robin,
rotating who goes first), so that they share the machine's load, and every step (zero_grad,
forward, backward, optimiser step inside the FLeRM block) is timed. ``--repeats`` times
during the run, the warm-up probes alone (``ceil(40 / samples)`` probes of one update) are
timed too: their median is the allowance of the first target.

Reported per run: the sum of the step times, the median step time over ordinary steps (no set
point), the time of the set-point steps, and a *robust total*, the median ordinary step times
the number of ordinary steps plus the set-point steps (insensitive to a busy neighbour's
spikes). Targets:

- static:   robust total(static) - robust total(plain) <= warm-up probes + 2% of plain;
- periodic: robust total(periodic) <= 1.05 x robust total(static).

A set point costs about ``samples`` backward passes per probe: ``--samples 1`` is the paper's
configuration (40 one-sample warm-up probes, one one-sample probe per periodic set point).

Run: ``python benchmarks/flerm_overhead.py`` (about 2 minutes on one CPU core).
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

import fslr_func as ff
from fslr_func import FLeRM, FSLRRecord, Recorder
from fslr_func.experiments import ResMLP

IN, CLASSES = 64, 10


def probe_stream(batch: int, seed: int) -> Iterator[Tensor]:
    g = torch.Generator().manual_seed(seed)
    while True:
        yield torch.randn(batch, IN, generator=g)


def base_record(batch: int) -> FSLRRecord:
    """A base record (width 128) of one step: ``base.at(t)`` is that row at every step."""
    torch.manual_seed(0)
    fm = ff.with_fslr(ResMLP(IN, CLASSES, width=128), seed=0)
    opt = torch.optim.Adam(fm.parameters(), lr=1e-3)
    recorder = Recorder(fm, probe_stream(batch, 1), every=None)
    F.cross_entropy(fm(torch.randn(batch, IN)), torch.randint(0, CLASSES, (batch,))).backward()
    with recorder.step(opt):
        opt.step()
    return recorder.record


@dataclass
class Run:
    """One training run and its step times."""

    name: str
    fm: ff.FSLRModule
    opt: torch.optim.Optimizer
    flerm: FLeRM | None
    times: list[float] = field(default_factory=list)

    def step(self, x: Tensor, y: Tensor) -> None:
        start = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        F.cross_entropy(self.fm(x), y).backward()
        if self.flerm is None:
            self.opt.step()
        else:
            with self.flerm.step():
                self.opt.step()
        self.times.append(time.perf_counter() - start)

    def set_points(self) -> list[int]:
        return [] if self.flerm is None else [p.step for p in self.flerm.history]

    def robust_total(self) -> float:
        special = set(self.set_points())
        ordinary = [t for i, t in enumerate(self.times) if i not in special]
        return statistics.median(ordinary) * len(ordinary) + sum(self.times[i] for i in special)


def wrap(args: argparse.Namespace) -> ff.FSLRModule:
    torch.manual_seed(1)
    model = ResMLP(IN, CLASSES, width=args.width)
    return ff.with_fslr(model, seed=1, samples=args.samples, strategy=args.strategy)


def make_run(name: str, args: argparse.Namespace, base: FSLRRecord | None, mode: str) -> Run:
    torch.manual_seed(1)
    fm = wrap(args)
    opt = torch.optim.Adam(fm.parameters(), lr=1e-3)
    flerm = None
    if base is not None:
        flerm = FLeRM(
            fm,
            opt,
            base,
            probe_batches=probe_stream(args.batch, 2),
            mode=mode,  # type: ignore[arg-type]
            every=args.every,
        )
    return Run(name, fm, opt, flerm)


class WarmupProbes:
    """Times the warm-up probes alone: ``ceil(40 / samples)`` probes of one update."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.fm = wrap(args)
        self.delta = {n: torch.randn_like(p) for n, p in self.fm.module.named_parameters()}
        self.probes = probe_stream(args.batch, 3)
        self.count = math.ceil(40 / args.samples)
        self.times: list[float] = []

    def measure(self) -> None:
        batches = [next(self.probes) for _ in range(self.count)]
        start = time.perf_counter()
        self.fm.observe(batches, self.delta)
        self.times.append(time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--samples", type=int, default=8, help="omega samples per probe")
    parser.add_argument("--strategy", default="auto", help="probe strategy of with_fslr")
    parser.add_argument("--every", type=int, default=100, help="period of periodic FLeRM")
    parser.add_argument("--repeats", type=int, default=10, help="timings of the warm-up probes")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    wall = time.perf_counter()

    base = base_record(args.batch)
    runs = [
        make_run("plain", args, None, "static"),
        make_run("static FLeRM", args, base, "static"),
        make_run(f"periodic FLeRM (every {args.every})", args, base, "periodic"),
    ]
    g = torch.Generator().manual_seed(4)
    data = [
        (
            torch.randn(args.batch, IN, generator=g),
            torch.randint(0, CLASSES, (args.batch,), generator=g),
        )
        for _ in range(64)
    ]
    warmup = WarmupProbes(args)
    every_probe = max(args.steps // args.repeats, 1)
    for t in range(args.steps):  # round robin, rotated: the runs share the machine's load
        for k in range(len(runs)):
            runs[(t + k) % len(runs)].step(*data[t % len(data)])
        if t % every_probe == every_probe // 2:
            warmup.measure()
    probes = statistics.median(warmup.times)

    plain, static, periodic = runs
    print(
        f"ResMLP width {args.width}, depth 4, batch {args.batch}, Adam, {args.steps} steps, "
        f"{torch.get_num_threads()} thread(s), probes of {args.samples} samples on "
        f"batches of {args.batch} (strategy {args.strategy})"
    )
    print(
        f"{'run':<28} {'sum (s)':>8} {'median step (ms)':>17} {'set points (s)':>15} "
        f"{'robust total (s)':>17} {'vs plain':>9}"
    )
    for run in runs:
        special = sum(run.times[i] for i in run.set_points())
        ordinary = [t for i, t in enumerate(run.times) if i not in set(run.set_points())]
        print(
            f"{run.name:<28} {sum(run.times):8.2f} {1e3 * statistics.median(ordinary):17.2f} "
            f"{special:15.3f} {run.robust_total():17.2f} "
            f"{run.robust_total() / plain.robust_total():9.4f}"
        )
    ordinary = [
        statistics.median(t for i, t in enumerate(run.times) if i not in set(run.set_points()))
        for run in runs
    ]
    print(
        f"ordinary steps (median): static {100 * (ordinary[1] / ordinary[0] - 1):+.2f}%, "
        f"periodic {100 * (ordinary[2] / ordinary[0] - 1):+.2f}% vs plain"
    )
    over = static.robust_total() - plain.robust_total()
    allowance = probes + 0.02 * plain.robust_total()
    ratio = periodic.robust_total() / static.robust_total()
    n = math.ceil(40 / args.samples)
    print(
        f"warm-up probes alone ({n} x {args.samples} samples, median of {len(warmup.times)}): "
        f"{probes:.3f} s"
    )
    print(
        f"target static:   overhead {over:.3f} s <= warm-up probes + 2% of plain = "
        f"{allowance:.3f} s: {'met' if over <= allowance else 'NOT met'}"
    )
    print(
        f"target periodic: periodic / static = {ratio:.4f} <= 1.05: "
        f"{'met' if ratio <= 1.05 else 'NOT met'}"
    )
    per_point = (periodic.robust_total() - static.robust_total()) / max(
        len(periodic.set_points()) - 1, 1
    )
    print(
        f"periodic cost per extra set point: {per_point:.3f} s "
        f"= {per_point / statistics.median(plain.times):.1f} plain steps"
    )
    print(f"benchmark wall time: {time.perf_counter() - wall:.0f} s")


if __name__ == "__main__":
    main()
