"""Speed and memory of the probe against a plain training step and the paper's sequential method.

Run: ``python benchmarks/probe.py`` (about 5 minutes on 2 CPU cores; ``--quick`` for a smoke
run). Everything is measured side by side in one run; times are medians over ``--repeats``.

* plain step: forward + backward + Adam step on the training batch;
* probe (this library): one forward under ``torch.func.vjp``, ``vjp_fn`` over S omegas
  (``strategy="auto"``), statistics reduced per sample;
* sequential (the paper's method): for each of the S omegas a fresh forward and backward of
  ``phi = sum(omega * F) / sqrt(M)`` and the same statistics.

Peak memory is the resident-set high-water mark of a fresh subprocess that builds the model,
resets the mark, and runs one probe with ``chunk_size=4``, with ``MALLOC_MMAP_THRESHOLD_=65536``
so that glibc returns freed blocks (see DESIGN.md); it is reported with the resident size
just before the probe, and against one unchunked S=32 probe.
Targets: probe at S=8 at least 1.3x faster than sequential; peak at S=32 at most 1.25x S=4.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from _memory import status_mib  # benchmarks/ is on sys.path when run as a script
from torch import Tensor, nn

import fslr_func as ff
from fslr_func.estimator import ScaledUpdate, product_log_statistics
from fslr_func.experiments import ResMLP, Transformer


def build(kind: str) -> tuple[nn.Module, Tensor, Callable[[Tensor], Tensor]]:
    """Model, probe/training inputs and loss for the two benchmark configurations."""
    torch.manual_seed(0)
    if kind == "resmlp":
        model: nn.Module = ResMLP(64, 10, width=512, depth=4)
        x = torch.randn(256, 64)
        y = torch.randint(0, 10, (256,))
        return model, x, lambda out: nn.functional.cross_entropy(out, y)
    model = Transformer(vocab_size=256, d_model=256, n_heads=4, d_ff=1024, depth=2, seq_len=128)
    x = torch.randint(0, 256, (8, 128))
    targets = torch.randint(0, 256, (8, 128))
    return (
        model,
        x,
        lambda out: nn.functional.cross_entropy(out.reshape(-1, 256), targets.reshape(-1)),
    )


def unit_delta(model: nn.Module) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(1)
    return {n: 1e-3 * torch.randn(p.shape, generator=g) for n, p in model.named_parameters()}


def sequential_probe(model: nn.Module, x: Tensor, delta: dict[str, Tensor], samples: int) -> None:
    """The paper's method: a fresh forward and backward of phi for every omega sample."""
    params = [p for _, p in model.named_parameters()]
    names = [n for n, _ in model.named_parameters()]
    updates = {n: ScaledUpdate.of(d) for n, d in delta.items()}  # once, as the probe does
    for _ in range(samples):
        out = model(x).reshape(-1)
        omega = torch.randn(out.numel())
        phi = (omega * out).sum() / math.sqrt(out.numel())
        grads = torch.autograd.grad(phi, params)
        for n, g in zip(names, grads, strict=True):
            product_log_statistics(g, updates[n])


def median_time(fn: Callable[[], Any], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def speed(kind: str, sample_counts: list[int], repeats: int) -> dict[str, float]:
    model, x, loss_fn = build(kind)
    delta = unit_delta(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)

    def plain_step() -> None:
        opt.zero_grad()
        loss_fn(model(x)).backward()
        opt.step()

    result = {"plain step": median_time(plain_step, repeats)}
    for s in sample_counts:
        result[f"probe S={s}"] = median_time(
            lambda s=s: ff.estimate(model, x, delta, samples=s), repeats
        )
        result[f"sequential S={s}"] = median_time(
            lambda s=s: sequential_probe(model, x, delta, s), repeats
        )
    return result


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="1 repeat, S in {1, 8}")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        peak_child(args.child[0], int(args.child[1]), int(args.child[2]) or None)
        return
    repeats = 1 if args.quick else args.repeats
    sample_counts = [1, 8] if args.quick else [1, 8, 32]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, repeats={repeats}")
    for kind in ("resmlp", "transformer"):
        label = (
            "ResMLP width 512, 4 blocks, batch 256"
            if kind == "resmlp"
            else "Transformer d_model 256, 2 blocks, seq 128, batch 8"
        )
        times = speed(kind, sample_counts, repeats)
        print(f"\n{label}: median seconds")
        plain = times["plain step"]
        print(f"  {'plain step':<16} {plain:8.4f}")
        for s in sample_counts:
            p, q = times[f"probe S={s}"], times[f"sequential S={s}"]
            print(
                f"  S={s:<3} probe {p:8.4f} ({p / plain:5.2f}x step)   sequential {q:8.4f}"
                f"   sequential/probe {q / p:5.2f}x"
            )
        ratio8 = times["sequential S=8"] / times["probe S=8"]
        verdict = "PASS" if ratio8 >= 1.3 else "MISS"
        print(f"  target S=8 sequential/probe >= 1.3: {ratio8:.2f} {verdict}")
        base, p4 = peak(kind, 4)
        _, p32 = peak(kind, 32)
        _, p32_whole = peak(kind, 32, chunk_size=None)
        growth = p32 / p4
        print(
            f"  peak RSS MiB (chunk_size=4): resident before the probe {base:.0f}, probe S=4"
            f" {p4:.0f}, S=32 {p32:.0f}; S=32/S=4 {growth:.3f}"
            f" {'PASS' if growth <= 1.25 else 'MISS'} (target <= 1.25)"
        )
        print(
            f"  probe memory above the resident baseline: S=4 {p4 - base:.0f} MiB,"
            f" S=32 {p32 - base:.0f} MiB; S=32 without chunking {p32_whole - base:.0f} MiB"
        )


if __name__ == "__main__":
    main()
