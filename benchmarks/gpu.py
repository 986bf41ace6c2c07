"""The probe on a GPU (issue 22, item 4): no host synchronisation inside a measured step, and
its speed and memory against the paper's sequential method, side by side in one run.

Run where CUDA is: ``python benchmarks/gpu.py`` (a few minutes on one H100; ``--out DIR``
also writes ``DIR/gpu.json``). ``python benchmarks/gpu.py --device cpu --quick`` runs the same
code on the CPU as a smoke check; the synchronisation check is CUDA's own and is skipped there.

1. **Synchronisation.** For each model, ``with_fslr`` and ``fm.measure(opt, x)`` around SGD
   steps (SGD reads nothing on the host; Adam without ``capturable=True`` reads its step
   count): two steps to warm up, then three measured steps, each under
   ``torch.cuda.set_sync_debug_mode("error")``, which raises at any operation that waits for
   the GPU. The loss and its backward run outside the checked block (a model's own forward
   may synchronise); reading the estimates (``m.fslr``) is the one synchronisation the user
   asks for, after it. A failure prints the innermost library frame and the innermost frame.
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
import json
import os
import statistics
import sys
import traceback
from collections.abc import Callable
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
    return out


def where(err: BaseException) -> str:
    """The innermost fslr_func frame and the innermost frame of ``err``'s traceback."""
    frames = traceback.extract_tb(err.__traceback__)
    ours = [f for f in frames if f"{os.sep}fslr_func{os.sep}" in f.filename]
    shown = [ours[-1]] if ours else []
    if frames and (not ours or frames[-1] is not ours[-1]):
        shown.append(frames[-1])
    return " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(shown))


def check_sync(
    model: nn.Module, x: Tensor, loss: Callable[..., Tensor], output_fn: Any, samples: int
) -> str:
    """``"PASS"``, or what synchronised inside a measured step."""
    fm = ff.with_fslr(model, samples=samples, seed=0, output_fn=output_fn)
    opt = torch.optim.SGD(fm.parameters(), lr=1e-6)
    cuda = next(model.parameters()).is_cuda
    for step in range(5):
        opt.zero_grad(set_to_none=True)
        loss(fm(x)).backward()
        checked = cuda and step >= 2
        if checked:
            torch.cuda.set_sync_debug_mode("error")
        try:
            with fm.measure(opt, x) as m:
                opt.step()
        except RuntimeError as err:
            return f"FAIL at step {step}: {str(err).splitlines()[0][:120]} ({where(err)})"
        finally:
            if checked:
                torch.cuda.set_sync_debug_mode(0)
        if not all(torch.isfinite(torch.as_tensor(v)) for v in m.fslr.values()):
            return f"FAIL at step {step}: an estimate is not finite"
    return "PASS" if cuda else "skipped (not CUDA)"


def llama_speed(
    model: nn.Module, ids: Tensor, samples: int, rounds: int, sync: Callable[[], None], seq: int
) -> dict[str, float]:
    """The Llama's median ratio sequential / estimate, and probe over step peak memory."""
    g = torch.Generator().manual_seed(1)
    targets = torch.randint(0, llm.VOCAB, ids.shape, generator=g).to(ids.device)
    delta = llm.make_delta(model, ids, targets, "adam")
    ctx = llm.Context(model, ids, targets, delta, samples)
    fns = {
        "step": llm.step_case(ctx),
        "estimate": llm.probe_case()(ctx),
        "sequential": lambda: llm.sequential(ctx),
    }
    times, _ = probe.interleaved(fns, rounds, sync)
    ratio = statistics.median(
        s / e for s, e in zip(times["sequential"], times["estimate"], strict=True)
    )
    print(f"\nthin Llama, vocabulary {llm.VOCAB}, batch {llm.BATCH}, seq {seq}, S={samples}:")
    for name, t in times.items():
        print(f"  {name:<12} {statistics.median(t):8.4f} s")
    print(f"  sequential / estimate {ratio:5.2f}x  >= 2 {probe.verdict(ratio >= 2)}")
    result = {"estimate": ratio}
    if ids.is_cuda:
        peaks = {}
        for name in ("step", "estimate"):
            sync()
            torch.cuda.reset_peak_memory_stats()
            fns[name]()
            sync()
            peaks[name] = torch.cuda.max_memory_allocated() / 2**20
        memory = peaks["estimate"] / peaks["step"]
        print(
            f"  peak allocated MiB: step {peaks['step']:.0f}, estimate {peaks['estimate']:.0f};"
            f" estimate / step {memory:.2f}  <= 1.25 {probe.verdict(memory <= 1.25)}"
        )
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
        fns = probe.cases(kind, args.samples, args.device)
        ratios = probe.report_speed(kind, args.samples, *probe.interleaved(fns, rounds, sync))
        if kind == "transformer":
            print(
                f"  GPU target: sequential / estimate >= 2 {probe.verdict(ratios['estimate'] >= 2)}"
            )
        results[kind] = ratios
    model, ids, _, _ = built["llama"]
    results["llama"] = llama_speed(model, ids, args.samples, rounds, sync, seq)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gpu.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
