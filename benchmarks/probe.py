"""Speed and memory of the probe against a plain training step and the paper's sequential method.

Run: ``python benchmarks/probe.py`` (about 2 minutes with ``--threads 1``, 6 at the default 2
threads on 2 shared cores; ``--quick`` for a smoke run, ``--no-memory`` to skip the
peak-memory subprocesses). Everything is measured side by
side in one run, on the two benchmark models (ResMLP width 512, 4 blocks, batch 256; the
Transformer d_model 256, 2 blocks, sequence 128, batch 8), at ``S = --samples`` (8);
``--models small`` adds a small ResMLP (width 128, 4 blocks, input 40, batch 128), where the
wrapper's fixed cost per measured step (snapshots, updates, EMA) weighs most.

Cases, timed in ``--rounds`` interleaved rounds (every case once per round, in an order
rotated from round to round, so that a shared machine's drifting load hits all alike):

* ``estimate``: the one-shot ``ff.estimate(model, x, delta, samples=S)``, default options;
* ``sequential`` (the paper's method): for each of the S omegas a fresh forward and backward
  of ``phi = sum(omega * F) / sqrt(M)`` and the same statistics of ``Z = delta * grad``
  (:class:`fslr_func.stats.statistics.ProductStatistics`, the updates scaled once);
* ``measure``: the wrapper's ``with fm.measure(opt, x): opt.step()`` around a plain SGD step,
  and ``sgd step``: the same step alone, whose time is subtracted;
* ``forward``, ``forward+backward``: a plain forward building the graph, and a fresh forward
  with the backward of ``phi`` (one sequential sample without its statistics);
* ``exact``: ``ff.exact(model, x, delta)``, one forward-mode pass per tensor: the cost of a
  probe of ``with_fslr(..., estimator="exact")``, printed over ``estimate``'s.

Reported per model: medians of the times; the medians over rounds of the per-round ratios
``sequential / estimate`` and ``sequential / (measure - sgd step)``; and the ceiling of the
probe's one saving (a forward per sample, the backward kept), from the plain forward ``F``
and backward ``B = (forward+backward) - F`` measured in the same rounds:
``S (F + B) / (F + S B)``, which is ``3S / (1 + 2S)`` (1.41 at S = 8) where ``B = 2F``.
Targets: each ratio at least 1.3, and at least 90% of the ceiling.

Beside each time, the case's minor page faults per call (median): glibc gives the free top of
its heap back to the kernel once it exceeds the trim threshold (128 KiB at start, raised by
glibc to twice the largest block it had mapped on its own and freed, up to 64 MiB), and every
page touched again after that costs a fault of about 1-2 us. On a small model the blocks
freed are a few MiB, the threshold stays below what one probe or one sequential call frees,
and both fault on every call (about 10,000 faults, 10% of the ResMLP's probe); a process
that has freed a 32 MiB tensor, or runs with ``MALLOC_TRIM_THRESHOLD_`` and
``MALLOC_MMAP_THRESHOLD_`` set (printed at the top), keeps its heap and faults almost never.
docs/benchmarks.md quotes both.

``--profile`` adds the split of one ``estimate`` call into the model's forward (under the
vjp, with the checks), the backward passes, the statistics and the rest (bookkeeping: omega,
options, stacking), timed by wrapping those three functions of the library in place.

Peak memory (unless ``--no-memory``) is the resident-set high-water mark of a fresh
subprocess that builds the model, resets the mark, and runs one probe with ``chunk_size=4``,
with ``MALLOC_MMAP_THRESHOLD_=65536`` so that glibc returns freed blocks (see DESIGN.md); it
is reported with the resident size just before the probe, and against one unchunked S=32
probe. Target: peak at S=32 at most 1.25x S=4.

The load average of the machine is printed before and after: other processes on the cores
slow every case, and the probe's large batched operations differently from the sequential
method's many small ones, so ratios from a loaded machine are marked as such.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from _memory import status_mib  # benchmarks/ is on sys.path when run as a script
from torch import Tensor, nn

import fslr_func as ff
import fslr_func.probe.sampling as probe_module
from fslr_func.experiments import ResMLP, Transformer
from fslr_func.stats.statistics import ProductStatistics, ScaledUpdate

LABELS = {
    "resmlp": "ResMLP width 512, 4 blocks, batch 256",
    "transformer": "Transformer d_model 256, 2 blocks, seq 128, batch 8",
    "small": "ResMLP width 128, 4 blocks, input 40, batch 128",
}


def build(kind: str, device: str = "cpu") -> tuple[nn.Module, Tensor, Callable[[Tensor], Tensor]]:
    """Model, probe/training inputs and loss for the two benchmark configurations (built on
    the CPU from seeds, then moved to ``device``)."""
    torch.manual_seed(0)
    if kind == "small":  # where the wrapper's fixed cost per step shows
        model: nn.Module = ResMLP(40, 10, width=128, depth=4).to(device)
        x = torch.randn(128, 40).to(device)
        y = torch.randint(0, 10, (128,)).to(device)
        return model, x, lambda out: nn.functional.cross_entropy(out, y)
    if kind == "resmlp":
        model = ResMLP(64, 10, width=512, depth=4).to(device)
        x = torch.randn(256, 64).to(device)
        y = torch.randint(0, 10, (256,)).to(device)
        return model, x, lambda out: nn.functional.cross_entropy(out, y)
    model = Transformer(vocab_size=256, d_model=256, n_heads=4, d_ff=1024, depth=2, seq_len=128)
    model = model.to(device)
    x = torch.randint(0, 256, (8, 128)).to(device)
    targets = torch.randint(0, 256, (8, 128)).to(device)
    return (
        model,
        x,
        lambda out: nn.functional.cross_entropy(out.reshape(-1, 256), targets.reshape(-1)),
    )


def unit_delta(model: nn.Module) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(1)
    return {
        n: 1e-3 * torch.randn(p.shape, generator=g).to(p.device)
        for n, p in model.named_parameters()
    }


def phi_gradients(model: nn.Module, x: Tensor) -> tuple[Tensor, ...]:
    """A fresh forward and the backward of ``phi = omega . F / sqrt(M)`` for one omega."""
    out = model(x).reshape(-1)
    omega = torch.randn(out.numel(), device=out.device)
    phi = (omega * out).sum() / math.sqrt(out.numel())
    return torch.autograd.grad(phi, list(model.parameters()))


def sequential_probe(model: nn.Module, x: Tensor, delta: dict[str, Tensor], samples: int) -> None:
    """The paper's method: a fresh forward and backward of phi for every omega sample."""
    names = [n for n, _ in model.named_parameters()]
    statistics = ProductStatistics({n: ScaledUpdate.of(d) for n, d in delta.items()})  # once
    for _ in range(samples):
        statistics(dict(zip(names, phi_gradients(model, x), strict=True)))


def ceiling(samples: int, forward: float, backward: float) -> float:
    """Sequential over probe when the probe saves exactly one forward per sample."""
    return samples * (forward + backward) / (forward + samples * backward)


def cases(
    kind: str, samples: int, device: str = "cpu", strategies: tuple[str, ...] = ()
) -> dict[str, Callable[[], object]]:
    """The timed callables of one model (see the module docstring); ``strategies`` adds an
    ``estimate <strategy>`` case for each strategy pinned."""
    model, x, loss_fn = build(kind, device)
    delta = unit_delta(model)
    fm = ff.with_fslr(model, samples=samples, seed=0)
    opt = torch.optim.SGD(fm.parameters(), lr=1e-6)
    loss_fn(fm(x)).backward()  # gradients for every SGD step below (never zeroed)

    def measure() -> None:
        with fm.measure(opt, x):
            opt.step()

    pinned = {
        f"estimate {s}": functools.partial(
            ff.estimate, model, x, delta, samples=samples, strategy=s
        )
        for s in strategies
    }
    return {
        "estimate": lambda: ff.estimate(model, x, delta, samples=samples),
        **pinned,
        "sequential": lambda: sequential_probe(model, x, delta, samples),
        "exact": lambda: ff.exact(model, x, delta),
        "measure": measure,
        "sgd step": opt.step,
        "forward": lambda: model(x),
        "forward+backward": lambda: phi_gradients(model, x),
    }


def interleaved(
    fns: dict[str, Callable[[], object]],
    rounds: int,
    sync: Callable[[], None] = lambda: None,
) -> tuple[dict[str, list[float]], dict[str, list[int]]]:
    """Seconds and minor page faults per case and round; each round runs every case once,
    the order rotated. ``sync`` waits for the device before a clock is read (a GPU runs
    asynchronously: ``torch.cuda.synchronize``)."""
    for fn in fns.values():  # warm-up (torch.func's one-time set-up, the probe's cache)
        fn()
        fn()
    sync()
    names = list(fns)
    times: dict[str, list[float]] = {n: [] for n in names}
    faults: dict[str, list[int]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            before = minor_faults()
            start = time.perf_counter()
            fns[name]()
            sync()
            times[name].append(time.perf_counter() - start)
            faults[name].append(minor_faults() - before)
    return times, faults


def minor_faults() -> int:
    """The process's minor page faults so far (first touches of memory the heap got back
    from the kernel)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


@contextlib.contextmanager
def split_timers(totals: dict[str, float]) -> Iterator[None]:
    """Accumulate the seconds spent in the probe's forward, backward and statistics."""

    def timed(key: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                totals[key] += time.perf_counter() - start

        return wrapper

    prepare, stats = probe_module.prepare_vjp, ProductStatistics.__call__

    def prepare_timed(*args: Any, **kwargs: Any) -> Any:
        setup = timed("forward", prepare)(*args, **kwargs)
        setup.vjp_fn = timed("backward", setup.vjp_fn)
        return setup

    probe_module.prepare_vjp = prepare_timed  # type: ignore[assignment]
    ProductStatistics.__call__ = timed("statistics", stats)  # type: ignore[method-assign]
    try:
        yield
    finally:
        probe_module.prepare_vjp = prepare
        ProductStatistics.__call__ = stats  # type: ignore[method-assign]


def profile_split(kind: str, samples: int, rounds: int) -> dict[str, float]:
    """Mean seconds of one ``estimate`` call in forward, backward, statistics, bookkeeping."""
    model, x, _ = build(kind)
    delta = unit_delta(model)
    ff.estimate(model, x, delta, samples=samples)
    totals = {"forward": 0.0, "backward": 0.0, "statistics": 0.0}
    with split_timers(totals):
        start = time.perf_counter()
        for _ in range(rounds):
            ff.estimate(model, x, delta, samples=samples)
        total = (time.perf_counter() - start) / rounds
    split = {k: v / rounds for k, v in totals.items()}
    split["bookkeeping"] = total - sum(split.values())
    split["total"] = total
    return split


def peak_child(kind: str, samples: int, chunk_size: int | None) -> None:
    """Subprocess body: build the model, reset the RSS high-water mark, probe, print MiB.

    Resetting the high-water mark (``echo 5 > /proc/self/clear_refs``) after the imports, the
    model build and a first small probe (torch.func's one-time initialisation) makes the peak
    that of the measured probe itself, above the resident baseline.
    """
    torch.set_num_threads(1)
    model, x, _ = build(kind)
    delta = unit_delta(model)
    ff.estimate(model, x, delta, samples=2)  # one-time lazy initialisation of torch.func
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    baseline = status_mib("VmRSS")
    if samples > 0:
        ff.estimate(model, x, delta, samples=samples, chunk_size=chunk_size)
    print(json.dumps({"baseline_mib": baseline, "peak_mib": status_mib("VmHWM")}))


def peak(kind: str, samples: int, chunk_size: int | None = 4) -> tuple[float, float]:
    """(resident baseline, peak RSS) in MiB of a fresh process probing once."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    out = subprocess.run(
        [sys.executable, __file__, "--child", kind, str(samples), str(chunk_size or 0)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    row = json.loads(out.stdout.strip().splitlines()[-1])
    return float(row["baseline_mib"]), float(row["peak_mib"])


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def median_ratio(numerators: list[float], denominators: list[float]) -> float:
    """The median over interleaved rounds of the per-round ratio."""
    return statistics.median(n / d for n, d in zip(numerators, denominators, strict=True))


def report_speed(
    kind: str, samples: int, times: dict[str, list[float]], faults: dict[str, list[int]]
) -> dict[str, float]:
    """Print one model's table and ratios; return the ratios and the ceiling."""
    med = {n: statistics.median(t) for n, t in times.items()}
    rounds = len(times["estimate"])
    print(
        f"\n{LABELS[kind]}, S={samples}: median seconds and minor page faults of {rounds}"
        " interleaved rounds"
    )
    for name, t in med.items():
        print(f"  {name:<18} {t:8.4f}  {statistics.median(faults[name]):8.0f} faults")
    seq = times["sequential"]
    one_shot = median_ratio(seq, times["estimate"])
    stepless = [m - g for m, g in zip(times["measure"], times["sgd step"], strict=True)]
    wrapped = median_ratio(seq, stepless)
    forward = med["forward"]
    backward = med["forward+backward"] - forward
    top = ceiling(samples, forward, backward)
    print(
        f"  ceiling S(F+B)/(F+SB) = {top:.2f} (F {forward:.4f} s, B {backward:.4f} s, "
        f"B/F {backward / forward:.2f}; 3S/(1+2S) = {ceiling(samples, 1.0, 2.0):.2f})"
    )
    for label, ratio in (("estimate", one_shot), ("measure - sgd step", wrapped)):
        print(
            f"  sequential / {label:<19} {ratio:5.2f}x  >= 1.3 {verdict(ratio >= 1.3)}"
            f"   {ratio / top:4.0%} of the ceiling, >= 90% {verdict(ratio >= 0.9 * top)}"
        )
    exact = median_ratio(times["exact"], times["estimate"])
    print(f"  exact / estimate {exact:5.2f}x  (estimator='exact': one jvp per tensor)")
    return {"estimate": one_shot, "measure": wrapped, "ceiling": top, "exact": exact}


def report_split(kind: str, samples: int, rounds: int) -> None:
    split = profile_split(kind, samples, rounds)
    total = split.pop("total")
    parts = ", ".join(f"{k} {v:.4f} s ({v / total:.0%})" for k, v in split.items())
    print(f"  profile of one estimate ({total:.4f} s, mean of {rounds}): {parts}")
    share = split["statistics"] / total
    print(f"  statistics {share:.0%} of the probe, <= 10% {verdict(share <= 0.10)}")


def report_memory(kind: str) -> None:
    base, p4 = peak(kind, 4)
    _, p32 = peak(kind, 32)
    _, p32_whole = peak(kind, 32, chunk_size=None)
    growth = p32 / p4
    print(
        f"  peak RSS MiB (chunk_size=4): resident before the probe {base:.0f}, probe S=4"
        f" {p4:.0f}, S=32 {p32:.0f}; S=32/S=4 {growth:.3f} {verdict(growth <= 1.25)}"
        " (target <= 1.25)"
    )
    print(
        f"  probe memory above the resident baseline: S=4 {p4 - base:.0f} MiB,"
        f" S=32 {p32 - base:.0f} MiB; S=32 without chunking {p32_whole - base:.0f} MiB"
    )


def load() -> str:
    one, five, _ = os.getloadavg()
    return f"load average {one:.2f} (1 min), {five:.2f} (5 min) on {os.cpu_count()} cores"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=11, help="interleaved rounds (>= 9)")
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    parser.add_argument("--models", default="resmlp,transformer")
    parser.add_argument("--profile", action="store_true", help="the split of one estimate")
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--quick", action="store_true", help="2 rounds, no memory")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        peak_child(args.child[0], int(args.child[1]), int(args.child[2]) or None)
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    rounds = 2 if args.quick else args.rounds
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, no GPU used")
    tunables = {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")}
    print(f"glibc malloc tunables: {tunables or 'none (defaults)'}")
    print(f"before: {load()}")
    for kind in args.models.split(","):
        report_speed(kind, args.samples, *interleaved(cases(kind, args.samples), rounds))
        if args.profile:
            report_split(kind, args.samples, rounds)
        if not (args.quick or args.no_memory):
            report_memory(kind)
    print(f"\nafter: {load()}")


if __name__ == "__main__":
    main()
