"""FLeRM in a Hugging Face ``Trainer`` script: one callback each, nothing else changed.

A small GPT-2 (built from a config, no download) is trained in bf16 mixed precision
(``Trainer(bf16=True)``, the usual way) on byte-level text from Python's own documentation with
a linear warm-up from 0 and gradient accumulation; ``FSLRCallback`` records its
FSLRs into ``<out>/base/fslr_record.json``. A 4x wider GPT-2 is then trained by the same script
with ``FLeRMCallback`` pointing at that record, checkpointing half way; a second Trainer resumes
from that checkpoint and ends with the same weights as the uninterrupted run. The FSLRs and FLeRM's
per-tensor rates appear in the Trainer's logs (``fslr/...``, ``flerm_lr/...``).

Run: ``python examples/hf_trainer.py --out /tmp/hf_flerm`` (a few seconds on one CPU core).
"""

from __future__ import annotations

import argparse
import os
from pydoc_data.topics import topics
from typing import Any

import torch
import transformers

from fslr_func.integrations.transformers import FLeRMCallback, FSLRCallback

SEQ = 16


def dataset(n: int, offset: int = 0) -> list[dict[str, list[int]]]:
    """``n`` byte-level sequences of Python's documentation, with labels = inputs."""
    text = " ".join(topics.values()).encode()[offset * SEQ :]
    rows = [list(text[i * SEQ : (i + 1) * SEQ]) for i in range(n)]
    return [{"input_ids": r, "labels": r} for r in rows]


def build(arch: str, width: int) -> transformers.PreTrainedModel:
    """A 2-layer GPT-2 or Llama of hidden size ``width``, from a config (no download)."""
    torch.manual_seed(0)
    if arch == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(
            num_hidden_layers=2, hidden_size=width, intermediate_size=2 * width,
            num_attention_heads=2, num_key_value_heads=2, vocab_size=256,
            max_position_embeddings=SEQ,
        ))  # fmt: skip
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=width, n_head=2, vocab_size=256, n_positions=SEQ, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0,
    ))  # fmt: skip


def with_lora(model: transformers.PreTrainedModel, rank: int) -> Any:
    """PEFT LoRA of rank ``rank`` on the attention projections (``A`` Gaussian, ``B = 0``);
    only the adapters train."""
    import peft

    targets = (
        ["c_attn"] if isinstance(model, transformers.GPT2LMHeadModel) else ["q_proj", "v_proj"]
    )
    config = peft.LoraConfig(
        r=rank, lora_alpha=8, target_modules=targets, init_lora_weights="gaussian",
        fan_in_fan_out=isinstance(model, transformers.GPT2LMHeadModel),  # GPT-2's Conv1D
    )  # fmt: skip
    return peft.get_peft_model(model, config)


def train(
    model: transformers.PreTrainedModel,
    out: str,
    callback: transformers.TrainerCallback,
    steps: int,
    resume: str | None = None,
    **args: Any,
) -> transformers.Trainer:
    """The user's existing Trainer script, with ``callback`` added."""
    training_args = transformers.TrainingArguments(
        output_dir=out,
        max_steps=steps,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        learning_rate=3e-3,
        lr_scheduler_type="linear",
        warmup_steps=2,  # a linear warm-up from 0
        logging_steps=2,
        report_to=[],
        seed=0,
        disable_tqdm=True,
        save_steps=max(steps // 2, 1),
        **args,
    )
    trainer = transformers.Trainer(
        model=model,
        args=training_args,
        train_dataset=dataset(8 * steps),
        data_collator=transformers.default_data_collator,
        callbacks=[callback],
    )
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def main(
    out: str,
    steps: int = 6,
    arch: str = "gpt2",
    precision: str = "bf16",
    lora: bool = False,
    device: str = "cpu",
) -> tuple[transformers.Trainer, transformers.Trainer]:
    """Record the base run, train the wide model with FLeRM, and resume it half way.

    With ``lora``, the model is the 64-wide one fine-tuned through PEFT LoRA adapters, the
    base run at rank 2 and the FLeRM run at rank 8 (the paper's LoRA-rank transfer), FLeRM's
    set points starting once ``B`` has moved.

    ``precision``: ``"bf16"`` (``Trainer(bf16=True)``: autocast, the usual way to fine-tune),
    ``"fp16"`` (``Trainer(fp16=True)``, with accelerate's ``GradScaler``) or ``"fp32"``.
    ``device``: ``"cpu"`` (``use_cpu=True``) or ``"cuda"`` (the Trainer's own GPU).

    Returns:
        The uninterrupted wide run's Trainer and the resumed one's.
    """
    probes = dataset(16, offset=10_000)
    mixed = {"bf16": {"bf16": True}, "fp16": {"fp16": True}, "fp32": {}}[precision]
    mixed["use_cpu"] = device == "cpu"
    base_dir = os.path.join(out, "base")
    callback = FSLRCallback(probes, every=2, warmup_samples=8)
    small = with_lora(build(arch, 64), 2) if lora else build(arch, 16)
    train(small, base_dir, callback, steps, **mixed)
    record = os.path.join(base_dir, "fslr_record.json")

    def wide(resume: str | None = None) -> transformers.Trainer:
        callback = FLeRMCallback(record, probes, warmup_samples=8, mode="periodic", every=2)
        large = with_lora(build(arch, 64), 8) if lora else build(arch, 64)
        return train(large, os.path.join(out, "wide"), callback, steps, resume, **mixed)

    full = wide()
    return full, wide(resume=os.path.join(out, "wide", f"checkpoint-{steps // 2}"))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="hf_flerm")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--arch", choices=["gpt2", "llama"], default="gpt2")
    parser.add_argument("--precision", choices=["bf16", "fp16", "fp32"], default="bf16")
    parser.add_argument("--lora", action="store_true", help="LoRA rank 2 -> 8 instead of width")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    cli = parser.parse_args()
    if cli.steps < 2:  # step 0 is a warm-up from 0: nothing is recorded before step 1
        parser.error(f"--steps must be at least 2, got {cli.steps}")
    full, resumed = main(cli.out, cli.steps, cli.arch, cli.precision, cli.lora, cli.device)
    same = all(
        torch.equal(a, b)
        for a, b in zip(full.model.parameters(), resumed.model.parameters(), strict=True)
    )
    print(f"resumed run equals the uninterrupted one: {same}")
    for entry in full.state.log_history:
        if "loss" not in entry:  # the Trainer's closing summary (train_runtime, ...)
            continue
        lrs = {k: f"{v:.2e}" for k, v in entry.items() if k.startswith("flerm_lr/")}
        print(entry.get("step"), entry["loss"], dict(list(lrs.items())[:3]))
