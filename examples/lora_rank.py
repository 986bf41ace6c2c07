"""LoRA rank transfer with FLeRM (paper section 4.2.4), on CPU in a few minutes.

A small GPT-2 (built from ``GPT2Config``: 2 layers, width 64, byte vocabulary; nothing is
downloaded) is pretrained briefly on the English text of Python's documentation
(``pydoc_data.topics``). LoRA adapters (PEFT, on every attention ``c_attn``, the paper's Gaussian
initialisation: ``A`` Gaussian, ``B = 0``) then continue training it on another text, the
standard library's Python source, at ranks 2 to 32, sweeping the learning rate of ``B`` with
``A``'s fixed, as in the paper:

* **Standard**: Adam with those rates.
* **FLeRM**: rank 2 is the base. Its FSLRs are recorded at step ``--start-step`` (LoRA's ``A``
  does not move the function while ``B = 0``, so its FSLR is exactly 0 at step 0: the paper
  warms FLeRM up a few steps in, and so do we); every other rank is run with :class:`FLeRM`
  (static: rates set once, at that step) so each adapter tensor moves the function as the
  rank-2 adapter did at the same learning rates.

The figure (``docs/img/lora_rank.png``) plots the training loss (mean of the last 20 steps)
against ``B``'s learning rate, one line per rank; a line that stops marks a diverged run. The
standard optimum moves with the rank; with FLeRM it should stay with rank 2's.

The base runs use two learning rates (``A``'s and ``B``'s); the record keeps each tensor's rate
(``record.lrs``) and :class:`FLeRM` matches each base tensor's movement at its own rate: each
tensor gets ``lr_base(W) * FSLR_base(W) / FSLR(W)``.

Run: ``python examples/lora_rank.py`` (about 5 minutes on one CPU core);
``--quick`` for a smoke run (2 ranks, 3 rates, 30 steps).
"""

from __future__ import annotations

import argparse
import math
import time
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

import fslr_func as ff
from fslr_func.experiments import lm_batches, lm_loss, pydoc_text, stdlib_source
from fslr_func.flerm import FLeRM
from fslr_func.record import FSLRRecord
from fslr_func.recorder import Recorder

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


def plot(
    results: dict[str, dict[int, list[float]]], lrs: list[float], lr_a: float, out: Path
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
    ranks = sorted(results["Standard"])
    cmap = plt.get_cmap("viridis")
    finite = [v for mode in results.values() for r in mode.values() for v in r if math.isfinite(v)]
    for ax, mode in zip(axes, ("Standard", "FLeRM"), strict=True):
        for i, rank in enumerate(ranks):
            color = cmap(i / max(1, len(ranks) - 1))
            losses = results[mode][rank]
            ax.plot(lrs, losses, "o-", color=color, label=f"r={rank}", markersize=4)
            best = min(
                range(len(lrs)), key=lambda k: losses[k] if math.isfinite(losses[k]) else 1e9
            )
            if math.isfinite(losses[best]):
                ax.plot(
                    lrs[best], losses[best], "*", color=color, markersize=13, markeredgecolor="k"
                )
        ax.set_xscale("log")
        ax.set_xlabel("learning rate of B")
        ax.set_title(
            f"{mode} (Adam; lr of A = {lr_a:g})" if mode == "Standard" else "FLeRM (base: rank 2)"
        )
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("training loss (last 20 steps)")
    if finite:
        lo, hi = min(finite), max(finite)
        axes[0].set_ylim(lo - 0.05 * (hi - lo), min(hi, lo + 1.5) + 0.05 * (hi - lo))
    axes[1].legend(title="LoRA rank", fontsize=8)
    fig.suptitle(
        "LoRA rank transfer: GPT-2 (2 layers, width 64) pretrained on pydoc text, "
        "LoRA on stdlib source",
        fontsize=10,
    )
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, dict[int, list[float]]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8, 16, 32])
    parser.add_argument(
        "--lrs",
        type=float,
        nargs="+",
        default=[10 ** (k / 2) for k in range(-7, 0)],
        help="learning rates of B (default 10^-3.5 ... 10^-0.5)",
    )
    parser.add_argument("--lr-a", type=float, default=1e-3, help="learning rate of A (fixed)")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--pretrain-steps", type=int, default=300)
    parser.add_argument("--start-step", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parents[1] / "docs" / "img" / "lora_rank.png"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: ranks 2 and 8, 3 rates, 30 steps, 50 pretraining steps",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.ranks, args.steps, args.pretrain_steps = [2, 8], 30, 50
        args.lrs = [1e-3, 1e-2, 1e-1]
    if 2 not in args.ranks:
        raise SystemExit("--ranks must include 2, the FLeRM base rank")
    torch.set_num_threads(1)
    start = time.time()
    pretrained = pretrain(args.pretrain_steps, args.seed)
    print(f"pretrained {args.pretrain_steps} steps on pydoc text ({time.time() - start:.0f} s)")
    results: dict[str, dict[int, list[float]]] = {"Standard": {}, "FLeRM": {}}
    bases: dict[float, FSLRRecord | None] = {}
    for rank in sorted(args.ranks):
        for mode in ("Standard", "FLeRM"):
            row = []
            for lr in args.lrs:
                if rank == 2:  # the base: FLeRM at the base rank is the standard run
                    if mode == "FLeRM":
                        row = results["Standard"][2]
                        break
                    loss, bases[lr] = finetune(
                        pretrained,
                        2,
                        lr,
                        args.lr_a,
                        args.steps,
                        args.start_step,
                        args.seed,
                        record=True,
                    )
                elif mode == "Standard":
                    loss, _ = finetune(
                        pretrained, rank, lr, args.lr_a, args.steps, args.start_step, args.seed
                    )
                elif bases[lr] is None:  # the base run diverged before its record
                    loss = math.nan
                else:
                    loss, _ = finetune(
                        pretrained,
                        rank,
                        lr,
                        args.lr_a,
                        args.steps,
                        args.start_step,
                        args.seed,
                        base=bases[lr],
                    )
                row.append(loss)
            results[mode][rank] = row
            cells = " ".join(f"{v:6.3f}" for v in row)
            print(f"{mode:8s} rank {rank:2d}: {cells}   ({time.time() - start:.0f} s)")
    print("\nbest learning rate of B per rank:")
    for mode, by_rank in results.items():
        best = {}
        for rank, row in by_rank.items():
            finite = [(v, lr) for v, lr in zip(row, args.lrs, strict=True) if math.isfinite(v)]
            best[rank] = f"{min(finite)[1]:.2g}" if finite else "-"
        print(f"  {mode:8s} " + "  ".join(f"r={r}: {lr}" for r, lr in sorted(best.items())))
    plot(results, args.lrs, args.lr_a, args.out)
    print(f"wrote {args.out} ({time.time() - start:.0f} s in all)")
    return results


if __name__ == "__main__":
    main()
