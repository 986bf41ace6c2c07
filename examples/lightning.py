"""FLeRM in a PyTorch Lightning script: one callback each, nothing else changed.

A small MLP ``LightningModule`` with a linear warm-up from 0 is trained in bf16 mixed precision
(``precision="bf16-mixed"``) on scikit-learn's digits with ``FSLRCallback`` (the base record
lands in ``<out>/base/fslr_record.json``); a 4x wider one is then trained with
``FLeRMCallback`` (checkpointed every 2 steps) and resumed from its half-way checkpoint by a
second ``Trainer`` with ``ckpt_path=``, which continues FLeRM's step count, rates and probe
batches: its weights equal the uninterrupted run's.

Run: ``python examples/lightning.py --out /tmp/pl_flerm`` (a few seconds on one CPU core).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

# run as a script, this file's folder comes first on sys.path and its name would hide the
# lightning package
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from fslr_func.experiments import digits  # noqa: E402
from fslr_func.integrations.lightning import FLeRMCallback, FSLRCallback  # noqa: E402

DATA = digits()


class Classifier(pl.LightningModule):
    """The user's existing module: an MLP, AdamW and a linear warm-up from 0."""

    def __init__(self, width: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(64, width), torch.nn.Tanh(), torch.nn.Linear(width, 10)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: min(t / 2, 1.0))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def loader() -> DataLoader[Any]:
    x = torch.as_tensor(DATA.x_train[:128], dtype=torch.float32)
    y = torch.as_tensor(DATA.y_train[:128])
    return DataLoader(TensorDataset(x, y), batch_size=32)


def fit(
    width: int,
    out: str,
    callback: pl.Callback,
    steps: int,
    ckpt: str | None = None,
    precision: str = "bf16-mixed",
    accelerator: str = "cpu",
) -> Classifier:
    """Train for ``steps`` optimiser steps; without ``ckpt``, checkpoint every 2 steps
    (``<out>/step-<step>.ckpt``, here the end of an epoch), else resume from ``ckpt``."""
    module = Classifier(width)
    # Resume from a checkpoint ModelCheckpoint takes at a train step that ends an epoch:
    # Lightning continues it exactly (the resumed weights equal the uninterrupted run's). One
    # saved by trainer.save_checkpoint after fit() stopped at max_steps, or by ModelCheckpoint
    # at on_train_epoch_end, is resumed one batch into an epoch Lightning counts as
    # unfinished: the first step after it accumulates 1 batch instead of 2, on other data.
    saving = pl.callbacks.ModelCheckpoint(
        dirpath=out, filename="step-{step}", auto_insert_metric_name=False, save_top_k=-1,
        every_n_train_steps=2,
    )  # fmt: skip
    trainer = pl.Trainer(
        default_root_dir=out, max_steps=steps, accelerator=accelerator, logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=ckpt is None,
        accumulate_grad_batches=2, gradient_clip_val=1.0, precision=precision,
        callbacks=[callback] if ckpt else [callback, saving],
    )  # fmt: skip
    trainer.fit(module, loader(), ckpt_path=ckpt)
    return module


def main(
    out: str, steps: int = 4, precision: str = "bf16-mixed", accelerator: str = "cpu"
) -> tuple[Classifier, Classifier]:
    """Record the base run, train the wide one with FLeRM, and resume it half way, in
    Lightning's ``precision`` (``"bf16-mixed"``: autocast, the usual way; ``"32-true"``) on
    Lightning's ``accelerator`` (``"cpu"``, ``"cuda"``)."""
    probes = torch.as_tensor(DATA.x_train[256:320], dtype=torch.float32)
    base_dir = os.path.join(out, "base")
    base = FSLRCallback(probes, every=2, warmup_samples=8)
    fit(16, base_dir, base, steps, None, precision, accelerator)
    record = os.path.join(base_dir, "fslr_record.json")

    def callback() -> FLeRMCallback:
        return FLeRMCallback(record, probes, warmup_samples=8, mode="periodic", every=1)

    wide = os.path.join(out, "wide")
    full = fit(64, wide, callback(), steps, None, precision, accelerator)
    # the checkpoint at the last epoch end (every 2 steps) at or before half way
    half = os.path.join(wide, f"step-{max(2, steps // 4 * 2)}.ckpt")
    resumed = fit(64, wide, callback(), steps, half, precision, accelerator)
    return full, resumed


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="pl_flerm")
    parser.add_argument(
        "--steps", type=int, default=4, help="optimiser steps, at least 2 (the first checkpoint)"
    )
    parser.add_argument("--precision", default="bf16-mixed", help="Lightning's precision")
    parser.add_argument("--accelerator", default="cpu", help="Lightning's accelerator (cuda)")
    cli = parser.parse_args()
    if cli.steps < 2:  # step 0 is a warm-up from 0 (nothing recorded); it resumes at step 2
        parser.error(f"--steps must be at least 2, got {cli.steps}")
    full, resumed = main(cli.out, cli.steps, cli.precision, cli.accelerator)
    same = all(
        torch.equal(a, b) for a, b in zip(full.parameters(), resumed.parameters(), strict=True)
    )
    print(f"resumed run equals the uninterrupted one: {same}")
    rates = {k: f"{float(v):.2e}" for k, v in full.trainer.callback_metrics.items()}
    print(rates)
