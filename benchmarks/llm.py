"""The probe at language-model scale: a thin Llama with a 128,256-token vocabulary.

Run: ``python benchmarks/llm.py --seq 128`` (about 6 minutes on 2 CPU cores) and
``python benchmarks/llm.py --seq 512 --repeats 1`` (about 5 minutes; the unchunked default
probe is skipped there, see below). ``--cases`` picks cases, ``--samples`` sets S.

The model is Hugging Face's ``LlamaForCausalLM`` built from a config, never downloaded: hidden
size 64, 2 layers, 4 heads, MLP 256, vocabulary 128,256, untied head, ``use_cache=False``,
``attn_implementation="sdpa"`` (the probe runs SDPA through the MATH kernel itself, DESIGN.md;
``--attn eager`` to compare). Batch 8 at sequence T gives ``M = 8 T 128256`` output elements:
131M (0.5 GB in float32) at T = 128, 525M (2.1 GB) at T = 512. The parameters are 16.5M, half
of them the head and half the embedding, so the cost of everything is the output's size.

Cases, each in a fresh subprocess (``MALLOC_MMAP_THRESHOLD_=65536`` so that glibc gives freed
blocks back and the resident-set high-water mark is the live peak, DESIGN.md):

* ``step``: one training step, forward, cross-entropy, backward and ``torch.optim.Adam``;
* ``default``: ``ff.estimate(model, ids, delta, output_fn=logits)`` with the library's defaults;
* ``chunk1``, ``chunk2``: the same with ``chunk_size=1`` and ``2``;
* ``sequential``: the paper's method, S times a fresh forward, ``phi = omega . F / sqrt(M)`` and
  ``torch.autograd.grad``, then the same statistics of ``Z = delta * grad``
  (:class:`fslr_func.stats.statistics.ProductStatistics`).

A child builds the model, the unit-learning-rate ``delta`` (``--delta adam``: the first Adam
step's update at ``lr = 1``, ``-g / (|g| + eps)``; ``--delta random``: ``1e-3`` Gaussian) and
then resets the high-water mark (``echo 5 > /proc/self/clear_refs``), so the peak is that of
the case itself plus what was resident before (model, ids, delta: about 0.5 GB, shown as
*resident*), runs the case once and reports its wall time and peak. ``--repeats`` rounds run
every case once each, in an order rotated from round to round, so that a machine whose load
drifts (a shared one) slows all cases alike; the table gives the median time and the largest
peak over the rounds (the first call in a process is included: at this size torch.func's
one-time set-up is negligible).

Every child runs under ``RLIMIT_AS = --max-gb`` (default 12) so that it fails with an error
instead of exhausting a shared machine; a case whose predicted peak exceeds the limit is skipped
and reported as such (before the default chunked by bytes, it would have needed about 36 GB at
T = 512: S omegas of 2.1 GB, their scaled copies, the output). ``--force`` runs it anyway,
still under the limit.

Targets (with library defaults, no user tuning, at T = 128 and T = 512): the default probe at
S = 8 at least 1.3x faster than the sequential method measured in the same run, and its peak
resident memory at most 1.25x that of one training step.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from _memory import status_mib  # benchmarks/ is on sys.path when run as a script
from torch import Tensor, nn

import fslr_func as ff
from fslr_func.stats.statistics import ProductStatistics, ScaledUpdate

VOCAB = 128_256
BATCH = 8
GIB = 1024**3


@dataclass
class Context:
    """What a case needs: the model, its batch and targets, the update, S."""

    model: nn.Module
    ids: Tensor
    targets: Tensor
    delta: dict[str, Tensor]
    samples: int

    @property
    def num_outputs(self) -> int:
        return self.ids.numel() * VOCAB


Case = Callable[[Context], Callable[[], object]]
"""Set-up of a case: gets the context, returns the callable that is timed."""


def build(seq: int, attn: str = "sdpa", device: str = "cpu") -> tuple[nn.Module, Tensor, Tensor]:
    """The thin Llama, a batch of token ids and next-token targets (seeded on the CPU, then
    moved to ``device``)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=max(seq, 128),
        use_cache=False,
        tie_word_embeddings=False,
        attn_implementation=attn,
    )
    model = LlamaForCausalLM(config)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, seq), generator=g)
    targets = torch.randint(0, VOCAB, (BATCH, seq), generator=g)
    return model.to(device), ids.to(device), targets.to(device)


def logits(out: object) -> Tensor:
    """``output_fn`` of the probe: the logits of a Hugging Face causal-LM output."""
    return out.logits  # type: ignore[attr-defined,no-any-return]


def loss_of(model: nn.Module, ids: Tensor, targets: Tensor) -> Tensor:
    out = logits(model(ids))
    return nn.functional.cross_entropy(out.reshape(-1, VOCAB), targets.reshape(-1))


def make_delta(model: nn.Module, ids: Tensor, targets: Tensor, kind: str) -> dict[str, Tensor]:
    """Unit-learning-rate update: the first Adam step's (``lr = 1``) or a random one."""
    names = [n for n, _ in model.named_parameters()]
    params = [p for _, p in model.named_parameters()]
    if kind == "random":
        g = torch.Generator().manual_seed(2)
        return {
            n: 1e-3 * torch.randn(p.shape, generator=g).to(p.device)
            for n, p in zip(names, params, strict=True)
        }
    grads = torch.autograd.grad(loss_of(model, ids, targets), params)
    # Adam's first step: m_hat = g, v_hat = g^2, update = -lr * g / (|g| + eps).
    return {n: -(g / (g.abs() + 1e-8)) for n, g in zip(names, grads, strict=True)}


def sequential(ctx: Context) -> None:
    """The paper's method: a fresh forward and backward of phi for every omega sample."""
    names = list(ctx.delta)
    params = dict(ctx.model.named_parameters())
    wrt = [params[n] for n in names]
    statistics = ProductStatistics({n: ScaledUpdate.of(d) for n, d in ctx.delta.items()})  # once
    stats = []
    for _ in range(ctx.samples):
        out = logits(ctx.model(ctx.ids)).reshape(-1)
        omega = torch.randn(out.numel(), device=out.device, dtype=out.dtype)
        phi = torch.dot(omega, out) / math.sqrt(out.numel())
        del omega
        grads = torch.autograd.grad(phi, wrt)
        del out, phi
        stats.append(statistics(dict(zip(names, grads, strict=True))))


def step_case(ctx: Context) -> Callable[[], object]:
    opt = torch.optim.Adam(ctx.model.parameters(), lr=1e-4)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss_of(ctx.model, ctx.ids, ctx.targets).backward()
        opt.step()

    return step


def probe_case(**options: object) -> Case:
    def setup(ctx: Context) -> Callable[[], object]:
        return lambda: ff.estimate(
            ctx.model, ctx.ids, ctx.delta, samples=ctx.samples, output_fn=logits, **options
        )

    return setup


CASES: dict[str, Case] = {
    "step": step_case,
    "default": probe_case(),
    "chunk1": probe_case(chunk_size=1),
    "chunk2": probe_case(chunk_size=2),
    "sequential": lambda ctx: lambda: sequential(ctx),
}
"""Case name -> set-up. Scripts that import this module may add cases before :func:`main`."""

PREDICTED_COPIES: dict[str, Callable[[int], float]] = {
    "default": lambda s: 2.2 + 2,  # chunked by bytes: one sample per chunk at this size
    "chunk1": lambda s: 2.2 + 2,
    "chunk2": lambda s: 4.4 + 2,
}
"""Rough peak of a case in units of the output's bytes, for the memory guard (from S)."""


def child(case: str, args: argparse.Namespace) -> dict[str, object]:
    """Body of one subprocess: build, reset the high-water mark, run the case once."""
    limit = int(args.max_gb * GIB)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    torch.set_num_threads(args.threads)
    model, ids, targets = build(args.seq, args.attn)
    delta = make_delta(model, ids, targets, args.delta)
    ctx = Context(model, ids, targets, delta, args.samples)
    fn = CASES[case](ctx)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    resident = status_mib("VmRSS")
    start = time.perf_counter()
    fn()
    times = [time.perf_counter() - start]
    return {"times": times, "resident_mib": resident, "peak_mib": status_mib("VmHWM")}


def run_case(case: str, args: argparse.Namespace) -> dict[str, object]:
    """Run one case in a fresh process; a skipped or failed case says why."""
    out_gb = BATCH * args.seq * VOCAB * 4 / GIB
    predicted = PREDICTED_COPIES.get(case, lambda s: 0.0)(args.samples) * out_gb
    if predicted > args.max_gb and not args.force:
        return {"skipped": f"predicted peak ~{predicted:.0f} GB > --max-gb {args.max_gb:g}"}
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    command = [sys.executable, os.path.abspath(sys.argv[0]), "--child", case]
    command += [a for a in sys.argv[1:] if a != "--child"]
    proc = subprocess.run(command, env=env, capture_output=True, text=True)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"skipped": f"failed (exit {proc.returncode}): {tail[:120]}"}
    return json.loads(lines[-1])  # type: ignore[no-any-return]


def merge(rounds: list[dict[str, object]]) -> dict[str, object]:
    """One case's rounds: all times, the largest peak and resident size; or why it was skipped."""
    done = [r for r in rounds if "times" in r]
    if not done:
        return rounds[-1]
    return {
        "times": [t for r in done for t in r["times"]],  # type: ignore[attr-defined]
        "peak_mib": max(float(r["peak_mib"]) for r in done),  # type: ignore[arg-type]
        "resident_mib": max(float(r["resident_mib"]) for r in done),  # type: ignore[arg-type]
    }


def report(results: dict[str, dict[str, object]], args: argparse.Namespace) -> None:
    print(
        f"\nthin Llama, batch {BATCH}, seq {args.seq}, vocab {VOCAB}: M = "
        f"{BATCH * args.seq * VOCAB / 1e6:.0f}M outputs; S = {args.samples}; torch "
        f"{torch.__version__}, {args.threads} threads; median of {args.repeats} rounds"
    )
    print(f"  {'case':<20} {'median s':>9} {'runs s':<24} {'peak GB':>8} {'resident':>9}")
    for case, r in results.items():
        if "skipped" in r:
            print(f"  {case:<20} skipped: {r['skipped']}")
            continue
        times = r["times"]
        assert isinstance(times, list)
        runs = ", ".join(f"{t:.1f}" for t in times)
        print(
            f"  {case:<20} {statistics.median(times):9.2f} {runs:<24}"
            f" {float(r['peak_mib']) / 1024:8.2f} {float(r['resident_mib']) / 1024:9.2f}"
        )

    def median(case: str) -> float | None:
        r = results.get(case, {})
        return statistics.median(r["times"]) if "times" in r else None  # type: ignore[arg-type]

    seq_t, step_t = median("sequential"), median("step")
    step_peak = float(results["step"]["peak_mib"]) if median("step") else None
    print("  ratios (targets: sequential / probe >= 1.3, probe peak / step peak <= 1.25)")
    for case, r in results.items():
        if case in ("step", "sequential") or "times" not in r:
            continue
        t = median(case)
        assert t is not None
        parts = [f"  {case:<20}"]
        if seq_t:
            ratio = seq_t / t
            parts.append(f"sequential/probe {ratio:5.2f}x {'PASS' if ratio >= 1.3 else 'MISS'}")
        if step_peak:
            m = float(r["peak_mib"]) / step_peak
            parts.append(f"peak/step {m:5.2f}x {'PASS' if m <= 1.25 else 'MISS'}")
        if step_t:
            parts.append(f"time/step {t / step_t:5.2f}x")
        print("   ".join(parts))
    if seq_t and step_t:
        print(f"  {'sequential':<20} time/step {seq_t / step_t:5.2f}x")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=128, help="sequence length (128, 512)")
    parser.add_argument("--samples", type=int, default=8, help="omega samples S")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of all cases (median)")
    parser.add_argument(
        "--cases", default="step,default,chunk1,chunk2,sequential", help="comma-separated"
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"])
    parser.add_argument("--delta", default="adam", choices=["adam", "random"])
    parser.add_argument("--max-gb", type=float, default=12.0, help="address-space cap per case")
    parser.add_argument("--force", action="store_true", help="run cases predicted over --max-gb")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    cases = [c for c in args.cases.split(",") if c]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        parser.error(f"unknown cases {unknown}; choose from {', '.join(CASES)}")
    if args.child:
        print(json.dumps(child(args.child, args)))
        return
    runs: dict[str, list[dict[str, object]]] = {c: [] for c in cases}
    for r in range(args.repeats):  # rounds, order rotated: load drift hits every case alike
        for case in cases[r % len(cases) :] + cases[: r % len(cases)]:
            if runs[case] and "skipped" in runs[case][-1]:
                continue
            runs[case].append(run_case(case, args))
            last = runs[case][-1]
            done = last.get("skipped") or f"{last['times'][0]:.2f} s"  # type: ignore[index]
            print(f"  ... round {r + 1} {case}: {done}", file=sys.stderr, flush=True)
    results = {c: merge(v) for c, v in runs.items()}
    report(results, args)


if __name__ == "__main__":
    main()
