"""The probe on a GPU (issue 22, item 4): no host synchronisation inside a measured step, and
its speed and memory against the paper's sequential method, side by side in one run.

Run where CUDA is: ``python benchmarks/gpu.py`` (a few minutes on one H100; ``--out DIR``
also writes ``DIR/gpu.json``). ``python benchmarks/gpu.py --device cpu --quick`` runs the same
code on the CPU as a smoke check; the synchronisation check is CUDA's own and is skipped there.

1. **Synchronisation.** For each model, ``with_fslr`` and ``fm.measure(opt, x)`` around SGD
   steps (SGD reads nothing on the host; Adam without ``capturable=True`` reads its step
   count): two steps to warm up, then three measured steps, each under
   ``torch.cuda.set_sync_debug_mode("warn")``, which warns at any operation that waits for
   the GPU; every such site is listed (innermost library frame and innermost frame), with its
   count per step. The check fails on a site whose innermost frame outside torch is
   fslr_func's; the model's own code may synchronise (Hugging Face's check for packed
   sequences does, in the probe's forward as in any forward): such sites are listed, not
   counted against the probe. The loss and its backward run outside the checked block;
   reading the estimates (``m.fslr``) is the one synchronisation the user asks for, after
   it.
2. **Speed.** The cases of ``probe.py`` on the device (``estimate``, ``sequential``,
   ``measure``, ``sgd step``, ``forward``, ``forward+backward``) for its ResMLP and
   Transformer, and for the thin Llama of ``llm.py`` (128,256-token vocabulary, sequence
   ``--seq``) the default ``estimate`` against the sequential method and a training step, in
   interleaved rounds, each timed after ``torch.cuda.synchronize()``. Target at S = 8:
   ``sequential / estimate`` at least 2 on the Transformer and the Llama.
3. **Memory.** The Llama's peak allocated memory (``torch.cuda.max_memory_allocated``,
   model and batch included) of one default probe over that of one Adam training step;
   target at most 1.25.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import json
import os
import statistics
import sys
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import llm  # benchmarks/ is on sys.path when run as a script
import probe
import torch
from torch import Tensor, nn

import fslr_func as ff


def synchronizer(device: str) -> Callable[[], None]:
    """What waits for the device before a clock is read."""
    return torch.cuda.synchronize if device.startswith("cuda") else lambda: None


def models(
    device: str, seq: int
) -> dict[str, tuple[nn.Module, Tensor, Callable[..., Tensor], Any]]:
    """Name -> (model, probe and training input, loss of the model's output, output_fn)."""
    out: dict[str, tuple[nn.Module, Tensor, Callable[..., Tensor], Any]] = {}
    for kind in ("resmlp", "transformer"):
        model, x, loss = probe.build(kind, device)
        out[kind] = (model, x, loss, None)
    model, ids, targets = llm.build(seq, "sdpa", device)

    def llama_loss(output: Any) -> Tensor:
        return nn.functional.cross_entropy(
            llm.logits(output).reshape(-1, llm.VOCAB), targets.reshape(-1)
        )

    out["llama"] = (model, ids, llama_loss, llm.logits)
    out["llama-bf16"] = (autocast_forward(model, device), ids, llama_loss, llm.logits)
    return out


def autocast_forward(model: nn.Module, device: str) -> nn.Module:
    """A copy of ``model`` whose forward enters bfloat16 autocast itself, as accelerate's
    wrapper and ``Trainer(bf16=True)`` run a model: torch.func's backward fails on it and
    the probe runs on plain autograd (one warning)."""
    twin = copy.deepcopy(model)
    twin.forward = torch.autocast(torch.device(device).type, dtype=torch.bfloat16)(twin.forward)
    return twin


TORCH = str(Path(torch.__file__).parent) + os.sep
"""torch's own files (a path containing ``/torch/`` may be anything in a venv named torch)."""


def site(frames: list[traceback.FrameSummary]) -> tuple[bool, str]:
    """Whether the innermost frame outside torch is fslr_func's, and the innermost fslr_func
    frame and the innermost frame outside ``warnings``."""
    frames = [f for f in frames if not f.filename.endswith(f"{os.sep}warnings.py")]
    ours = [f for f in frames if f"{os.sep}fslr_func{os.sep}" in f.filename]
    caller = next((f for f in reversed(frames) if not f.filename.startswith(TORCH)), None)
    shown = [ours[-1]] if ours else []
    if frames and (not ours or frames[-1] is not ours[-1]):
        shown.append(frames[-1])
    where = " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(shown))
    return caller is not None and caller in ours, where


@contextlib.contextmanager
def synchronising_sites(active: bool) -> Iterator[collections.Counter[tuple[bool, str]]]:
    """Count, by call site, the operations that wait for the GPU inside the block.

    Under ``torch.cuda.set_sync_debug_mode("warn")`` each synchronising operation warns; the
    warning's Python stack names the site. Every site is collected, not only the first.
    """
    sites: collections.Counter[tuple[bool, str]] = collections.Counter()
    if not active:
        yield sites
        return

    def record(message: Any, *args: Any, **kwargs: Any) -> None:
        if "synchroniz" in str(message):
            sites[site(traceback.extract_stack()[:-1])] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield sites
        finally:
            torch.cuda.set_sync_debug_mode(0)


def check_sync(
    model: nn.Module, x: Tensor, loss: Callable[..., Tensor], output_fn: Any, samples: int
) -> str:
    """``"PASS"`` where no operation called from fslr_func synchronised inside a measured
    step, else ``"FAIL"``; either way every synchronising site, with its count per step
    (the model's own forward may synchronise: Hugging Face's check for packed sequences)."""
    fm = ff.with_fslr(model, samples=samples, seed=0, output_fn=output_fn)
    opt = torch.optim.SGD(fm.parameters(), lr=1e-6)
    cuda = next(model.parameters()).is_cuda
    found: collections.Counter[tuple[bool, str]] = collections.Counter()
    for step in range(5):
        opt.zero_grad(set_to_none=True)
        loss(fm(x)).backward()
        with synchronising_sites(cuda and step >= 2) as sites, fm.measure(opt, x) as m:
            opt.step()
        found.update(sites)
        if not all(torch.isfinite(torch.as_tensor(v)) for v in m.fslr.values()):
            return f"FAIL at step {step}: an estimate is not finite"
    if not cuda:
        return "skipped (not CUDA)"
    verdict = "FAIL" if any(ours for ours, _ in found) else "PASS"
    listed = "".join(
        f"\n    {n / 3:g} per step, {'from fslr_func' if ours else 'outside fslr_func'}: {where}"
        for (ours, where), n in found.most_common()
    )
    return verdict + (f", synchronising sites over 3 measured steps:{listed}" if found else "")


def trace(fns: dict[str, Callable[[], object]], out: Path | None, kind: str) -> None:
    """Where a call's time goes on the device: launches, device busy time, wall time.

    One profiled call of each case (after the timed rounds warmed it); the full operator table
    goes to ``out/trace-<kind>.txt`` when ``--out`` is given. A diagnosis: where the profiler
    fails it says so, and the figures still print.
    """
    try:
        _trace(fns, out, kind)
    except Exception as err:
        print(f"  trace {kind} failed: {err!r}")


def _trace(fns: dict[str, Callable[[], object]], out: Path | None, kind: str) -> None:
    tables = []
    for name, fn in fns.items():
        torch.cuda.synchronize()
        with torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        ) as prof:
            fn()
            torch.cuda.synchronize()
        events = prof.key_averages()
        kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        launches = sum(e.count for e in kernels)
        busy = sum(e.self_device_time_total for e in kernels) / 1e3
        print(f"  trace {kind} {name:<12} {launches:6d} kernels, device busy {busy:8.2f} ms")
        tables.append(
            f"== {kind} {name}\n" + events.table(sort_by="self_cuda_time_total", row_limit=25)
        )
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / f"trace-{kind}.txt").write_text("\n\n".join(tables))


def llama_speed(
    model: nn.Module,
    ids: Tensor,
    samples: int,
    rounds: int,
    sync: Callable[[], None],
    seq: int,
    out: Path | None,
) -> dict[str, float]:
    """The Llama's median ratio sequential / estimate, and probe over step peak memory."""
    g = torch.Generator().manual_seed(1)
    targets = torch.randint(0, llm.VOCAB, ids.shape, generator=g).to(ids.device)
    delta = llm.make_delta(model, ids, targets, "adam")
    ctx = llm.Context(model, ids, targets, delta, samples)
    bf16 = llm.Context(autocast_forward(model, ids.device.type), ids, targets, delta, samples)
    fns = {
        "step": llm.step_case(ctx),
        "estimate": llm.probe_case()(ctx),
        "estimate loop": llm.probe_case(strategy="loop")(ctx),
        **{f"estimate chunk{c}": llm.probe_case(chunk_size=c)(ctx) for c in (2, 4, 8)},
        "sequential": lambda: llm.sequential(ctx),
        "bf16 estimate": llm.probe_case()(bf16),
        "bf16 sequential": lambda: llm.sequential(bf16),
    }
    with warnings.catch_warnings():  # the bf16 twin's fallback to plain autograd, once
        warnings.simplefilter("ignore")
        times, _ = probe.interleaved(fns, rounds, sync)
    ratios = {
        name: probe.median_ratio(times["sequential"], times[name])
        for name in fns
        if name.startswith("estimate")
    }
    bf16_ratio = probe.median_ratio(times["bf16 sequential"], times["bf16 estimate"])
    ratio = ratios["estimate"]
    print(f"\nthin Llama, vocabulary {llm.VOCAB}, batch {llm.BATCH}, seq {seq}, S={samples}:")
    for name, t in times.items():
        print(f"  {name:<12} {statistics.median(t):8.4f} s")
    for name, r in ratios.items():
        print(f"  sequential / {name:<16} {r:5.2f}x")
    print(f"  sequential / estimate {ratio:5.2f}x  >= 2 {probe.verdict(ratio >= 2)}")
    print(f"  forward in bf16 autocast (plain autograd): sequential / estimate {bf16_ratio:5.2f}x")
    result = {"estimate": ratio, "bf16 estimate": bf16_ratio}
    for name in fns:
        result[f"median {name}"] = statistics.median(times[name])
    if ids.is_cuda:
        traced = ("estimate", "sequential", "bf16 estimate", "bf16 sequential")
        trace({k: fns[k] for k in traced}, out, "llama")
        peaks = {}
        for name in (n for n in fns if not n.endswith("sequential")):
            sync()
            torch.cuda.reset_peak_memory_stats()
            fns[name]()
            sync()
            peaks[name] = torch.cuda.max_memory_allocated() / 2**20
        print("  peak allocated MiB, and over the step's:")
        for name, mib in peaks.items():
            print(f"  {name:<16} {mib:7.0f} MiB  {mib / peaks['step']:5.2f}x")
        memory = peaks["estimate"] / peaks["step"]
        print(f"  estimate / step {memory:.2f}  <= 1.25 {probe.verdict(memory <= 1.25)}")
        result.update({f"memory {n}": v / peaks["step"] for n, v in peaks.items()})
        result["memory"] = memory
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=11, help="interleaved rounds (>= 9)")
    parser.add_argument("--seq", type=int, default=128, help="the Llama's sequence length")
    parser.add_argument("--quick", action="store_true", help="2 rounds, sequence 16")
    parser.add_argument("--out", type=Path, default=None, help="folder for gpu.json")
    args = parser.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("no CUDA device here: run on a GPU machine, or --device cpu for a smoke run")
    rounds, seq = (2, 16) if args.quick else (args.rounds, args.seq)
    sync = synchronizer(args.device)
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU"
    print(f"torch {torch.__version__} on {name}, S={args.samples}, {rounds} rounds")
    results: dict[str, Any] = {"device": name, "samples": args.samples, "rounds": rounds}
    built = models(args.device, seq)
    for kind, (model, x, loss, output_fn) in built.items():
        verdict = check_sync(model, x, loss, output_fn, args.samples)
        print(f"host synchronisation inside a measured step, {kind}: {verdict}")
        results[f"sync/{kind}"] = verdict
    for kind in ("resmlp", "transformer"):
        fns = probe.cases(kind, args.samples, args.device, ("loop",))
        ratios = probe.report_speed(kind, args.samples, *probe.interleaved(fns, rounds, sync))
        if kind == "transformer":
            print(
                f"  GPU target: sequential / estimate >= 2 {probe.verdict(ratios['estimate'] >= 2)}"
            )
        results[kind] = ratios
        if args.device.startswith("cuda"):
            trace({k: fns[k] for k in ("estimate", "sequential")}, args.out, kind)
    model, ids, _, _ = built["llama"]
    results["llama"] = llama_speed(model, ids, args.samples, rounds, sync, seq, args.out)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gpu.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
