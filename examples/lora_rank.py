"""LoRA rank transfer with FLeRM (paper section 4.2.4 and appendix C), on CPU in minutes.

A small GPT-2 (built from ``GPT2Config``: 2 layers, width 64, byte vocabulary; nothing is
downloaded) is pretrained briefly on the English text of Python's documentation
(``pydoc_data.topics``). LoRA adapters (PEFT, on every attention ``c_attn``, the paper's Gaussian
initialisation: ``A`` Gaussian, ``B = 0``, ``lora_alpha = 8``) then continue training it on
another text, the standard library's Python source, at ranks 2 to 16, sweeping the learning
rate of ``B`` with ``A``'s fixed (``--sweep B``, the paper's figure 5) or the rate of ``A`` with
``B``'s fixed (``--sweep A``, its appendix), for several seeds:

* **standard**: Adam with those rates.
* **FLeRM**: the smallest rank is the base. Its FSLRs are recorded at step ``--start-step``
  (LoRA's ``A`` does not move the function while ``B = 0``, so its FSLR is exactly 0 at step
  0: the paper warms FLeRM up a few steps in, and so do we) and averaged over the seeds; every
  other rank is run with :class:`FLeRM` (static: rates set once, at that step) so each adapter
  tensor moves the function as the base adapter's did at the same learning rates. At the base
  rank FLeRM's runs are the base runs.

muP has no rule for LoRA rank, so there is no muP baseline here.

The base runs use two learning rates (``A``'s and ``B``'s); the record keeps each tensor's rate
(``record.lrs``) and :class:`FLeRM` matches each base tensor's movement at its own rate: each
tensor gets ``lr_base(W) * FSLR_base(W) / FSLR(W)``.

It prints the sweep's table (best rate per rank, ``!`` on the grid's edge, the shift in
octaves) and the largest rank's loss at the base rank's best rate, and writes the figure
(``--out``, default ``lora_rank_runs/lora_rank_B.png`` or ``_A.png``; the numbers beside it
as ``.json``; the figures in docs/ come from ``--out docs/img/lora_rank_B.png``): training loss
(mean of the last 20 steps, over the seeds) against the swept rate, one line per rank; a line
that stops marks a diverged run.

Run: ``python examples/lora_rank.py --sweep B`` (about 10 minutes on 2 CPU cores, ``--jobs``
processes); ``--quick`` for a smoke run (2 ranks, 3 rates, 1 seed, 30 steps).
"""

from __future__ import annotations

import argparse
import itertools
import math
import multiprocessing
import os
import time
import warnings
from collections.abc import Iterator, Mapping
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

import fslr_func as ff
from fslr_func import FLeRM, FSLRRecord, Recorder
from fslr_func.experiments import lm_batches, lm_loss, pydoc_text, stdlib_source
from fslr_func.experiments.cache import mean_record
from fslr_func.experiments.configs import SweepConfig, scale_key
from fslr_func.experiments.plot import plot_transfer
from fslr_func.experiments.run import RunSpec, finite_or_none
from fslr_func.experiments.summary import format_table, summarise, transferred
from fslr_func.io.atomic import write_json

VOCAB = 256
SEQ = 64
BATCH = 16


def logits(out: Any) -> Tensor:
    return out.logits


def make_gpt2(seed: int) -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging

    logging.set_verbosity_error()
    torch.manual_seed(seed)
    config = GPT2Config(
        n_layer=2,
        n_embd=64,
        n_head=2,
        vocab_size=VOCAB,
        n_positions=128,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return GPT2LMHeadModel(config)


def pretrain(steps: int, seed: int = 0) -> dict[str, Tensor]:
    """Pretrain GPT-2 on Python's documentation text; return its state dict."""
    model = make_gpt2(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    data = lm_batches(pydoc_text(), BATCH, SEQ, generator=seed)
    for _ in range(steps):
        x, y = next(data)
        opt.zero_grad()
        lm_loss(model(input_ids=x, use_cache=False).logits, y).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def make_lora(pretrained: Mapping[str, Tensor], rank: int, seed: int) -> Any:
    from peft import LoraConfig, get_peft_model

    model = make_gpt2(seed)
    model.load_state_dict(pretrained)
    torch.manual_seed(seed)
    config = LoraConfig(
        r=rank,
        lora_alpha=8,
        lora_dropout=0.0,
        target_modules=["c_attn"],
        fan_in_fan_out=True,  # GPT-2's projections are transformers' Conv1D
        init_lora_weights="gaussian",
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return get_peft_model(model, config)


def probe_batches(seed: int) -> Iterator[dict[str, Any]]:
    """Probe inputs: their own stream of the fine-tuning text, separate from training."""
    for x, _ in lm_batches(stdlib_source(), 8, SEQ, generator=1000 + seed):
        yield {"input_ids": x, "use_cache": False}


def finetune(
    pretrained: Mapping[str, Tensor],
    rank: int,
    lr_b: float,
    lr_a: float,
    steps: int,
    start_step: int,
    seed: int = 0,
    record: bool = False,
    base: FSLRRecord | None = None,
) -> tuple[float, FSLRRecord | None]:
    """LoRA-train at one rank and B learning rate; return the final loss (NaN: diverged)."""
    model = make_lora(pretrained, rank, seed)
    fm = ff.with_fslr(model, samples=8, output_fn=logits, seed=seed)
    a = [p for n, p in model.named_parameters() if p.requires_grad and ".lora_A." in n]
    b = [p for n, p in model.named_parameters() if p.requires_grad and ".lora_B." in n]
    opt = torch.optim.Adam([{"params": b, "lr": lr_b}, {"params": a, "lr": lr_a}])
    recorder, flerm = None, None
    if record:
        recorder = Recorder(
            fm, probe_batches(seed), every=None, start_step=start_step, base_lr=lr_b
        )
    if base is not None:
        flerm = FLeRM(fm, opt, base, probe_batches=probe_batches(seed), start_step=start_step)
    data = lm_batches(stdlib_source(), BATCH, SEQ, generator=seed)
    losses: list[float] = []
    for _ in range(steps):
        x, y = next(data)
        opt.zero_grad()
        loss = lm_loss(fm(input_ids=x, use_cache=False).logits, y)
        if not math.isfinite(loss.item()):
            return math.nan, None
        loss.backward()
        losses.append(loss.item())
        try:
            if recorder is not None:
                with recorder.step(opt):
                    opt.step()
            elif flerm is not None:
                with flerm.step():
                    opt.step()
            else:
                opt.step()
        except ValueError as err:  # a NaN update reaches the probe: the run has diverged
            if "NaN or Inf" not in str(err):
                raise
            return math.nan, None
    final = sum(losses[-20:]) / len(losses[-20:])
    return final, (recorder.record if recorder is not None else None)


def _cell(job: tuple[Any, ...]) -> tuple[float, FSLRRecord | None]:
    """One fine-tuning run in a worker process (one thread: the workers share the cores)."""
    torch.set_num_threads(1)
    return finetune(*job[:-2], record=job[-2], base=job[-1])


def _run_all(jobs: list[tuple[Any, ...]], workers: int) -> list[tuple[float, FSLRRecord | None]]:
    if workers == 1:
        return [_cell(job) for job in jobs]
    context = multiprocessing.get_context("spawn")  # torch is not fork-safe once it has threads
    with ProcessPoolExecutor(workers, mp_context=context) as pool:
        return list(pool.map(_cell, jobs))


def _transferred(config: SweepConfig, summary: Mapping[str, Any], runs: Mapping[str, Any]) -> str:
    """The largest rank's loss at the base rank's best learning rate, mean and per seed."""
    lines = []
    for mode, data in summary["modes"].items():
        tuned = data["best_lr"][scale_key(config.scales[0])]
        if tuned is None:
            continue
        t = transferred(config, summary, runs, mode, tuned)
        shown = ", ".join(f"{v:.3f}" if math.isfinite(v) else "diverged" for v in t["losses"])
        mean = f"{t['mean']:.3f}" if math.isfinite(t["mean"]) else "diverged"
        lines.append(f"  {mode:8s} at {tuned:.3g}: {mean} (seeds {shown})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sweep", choices=("B", "A"), default="B", help="which rate to sweep")
    parser.add_argument(
        "--fixed",
        type=float,
        default=None,
        help="the other tensor's fixed rate (default: A at 1e-3 when sweeping B, B at 2^-8 "
        "when sweeping A)",
    )
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument(
        "--lrs",
        type=float,
        nargs="+",
        default=[2.0**k for k in range(-12, -1)],
        help="learning rates swept (default 2^-12 ... 2^-2)",
    )
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--jobs", type=int, default=min(8, os.cpu_count() or 1))
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--pretrain-steps", type=int, default=300)
    parser.add_argument("--start-step", type=int, default=5)
    parser.add_argument(
        "--out", type=Path, default=None, help="figure (default lora_rank_runs/lora_rank_<B|A>.png)"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: ranks 2 and 8, 3 rates, 1 seed, 30 steps, 50 pretraining steps",
    )
    args = parser.parse_args(argv)
    for name in ("seeds", "jobs", "steps", "pretrain_steps"):
        if getattr(args, name) < 1:
            parser.error(
                f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}"
            )
    if min(args.ranks) < 1 or args.start_step < 0:
        parser.error("--ranks must be at least 1 and --start-step at least 0")
    if args.quick:
        args.ranks, args.steps, args.pretrain_steps, args.seeds = [2, 8], 30, 50, 1
        args.lrs = [2.0**-10, 2.0**-7, 2.0**-4]
    fixed = args.fixed if args.fixed is not None else (1e-3 if args.sweep == "B" else 2.0**-8)
    ranks, lrs, seeds = sorted(set(args.ranks)), sorted(set(args.lrs)), range(args.seeds)
    base_rank = ranks[0]
    out = args.out or Path("lora_rank_runs") / f"lora_rank_{args.sweep}.png"
    torch.set_num_threads(1)
    start = time.time()
    pretrained = pretrain(args.pretrain_steps)
    print(f"pretrained {args.pretrain_steps} steps on pydoc text ({time.time() - start:.0f} s)")

    def job(rank: int, lr: float, seed: int, record: bool, base: FSLRRecord | None) -> tuple:
        lr_b, lr_a = (lr, fixed) if args.sweep == "B" else (fixed, lr)
        return (pretrained, rank, lr_b, lr_a, args.steps, args.start_step, seed, record, base)

    # standard runs; the base rank's record their FSLRs (FLeRM at the base rank is the base run)
    cells = [(rank, lr, s) for rank in ranks for lr in lrs for s in seeds]
    done = _run_all([job(r, lr, s, r == base_rank, None) for r, lr, s in cells], args.jobs)
    runs: dict[str, dict[str, Any]] = {}
    records: dict[float, list[FSLRRecord]] = {lr: [] for lr in lrs}
    for (rank, lr, s), (loss, record) in zip(cells, done, strict=True):
        for mode in ("standard", "flerm") if rank == base_rank else ("standard",):
            runs[RunSpec(mode, rank / base_rank, lr, s).key] = {"loss": finite_or_none(loss)}
        if record is not None:
            records[lr].append(record)
    print(f"standard runs done ({time.time() - start:.0f} s)")
    # FLeRM: each rank matched to the base rank's record of the same rates, mean over seeds
    bases = {lr: mean_record(records[lr]) for lr in lrs}
    cells = [(r, lr, s) for r in ranks[1:] for lr in lrs for s in seeds if bases[lr] is not None]
    done = _run_all([job(r, lr, s, False, bases[lr]) for r, lr, s in cells], args.jobs)
    losses = {cell: loss for cell, (loss, _) in zip(cells, done, strict=True)}
    for rank, lr, s in itertools.product(ranks[1:], lrs, seeds):
        # a rate whose base runs all diverged has no FLeRM run: it scores as diverged
        loss = losses.get((rank, lr, s), math.inf)
        runs[RunSpec("flerm", rank / base_rank, lr, s).key] = {"loss": finite_or_none(loss)}

    config = SweepConfig(
        axis="rank",
        scales=tuple(r / base_rank for r in ranks),
        lrs=tuple(lrs),
        seeds=args.seeds,
        modes=("standard", "flerm"),
        steps=args.steps,
        last=20,
    )
    summary = summarise(config, runs)
    summary["scale_labels"] = {scale_key(r / base_rank): f"rank {r}" for r in ranks}
    summary["task"] = (
        f"GPT-2 LoRA, rate of {args.sweep} swept, {'AB'[args.sweep == 'A']} at {fixed:g}"
    )
    print(
        f"\nbest learning rate of {args.sweep} per rank (loss: mean of the last 20 steps, "
        f"{args.seeds} seed(s)):\n"
    )
    print(format_table(summary))
    print(f"\nrank {ranks[-1]} at the rank-{base_rank} optimum:")
    print(_transferred(config, summary, runs))
    out.parent.mkdir(parents=True, exist_ok=True)
    plot_transfer(summary, out, xlabel=f"learning rate of {args.sweep}")
    write_json(out.with_suffix(".json"), {"summary": summary, "runs": runs})
    print(f"wrote {out} and its .json ({time.time() - start:.0f} s in all)")
    return summary


if __name__ == "__main__":
    main()
