"""The Lightning callbacks with the real ``lightning.Trainer`` (CPU, a few steps, bf16 mixed
precision, bf16 weights and inputs (``bf16-true``: the probe batches converted as training
batches are) and fp32): a base
record, FLeRM with a warm-up from 0, accumulation and clipping, logging, checkpoint, and a resume
whose weights equal the uninterrupted run's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from _device import DEVICE
from _scripts import load_script

from fslr_func.io.record import FSLRRecord

pytest.importorskip("lightning")


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true", "32-true"])
def test_lightning_record_flerm_checkpoint_resume(tmp_path: Path, precision: str) -> None:
    module = load_script("examples/lightning.py")
    full, resumed = module.main(str(tmp_path), 4, precision, accelerator=DEVICE.type)
    record = FSLRRecord.load(tmp_path / "base" / "fslr_record.json")
    assert record.steps == [1, 2]  # step 0 has rate 0 (warm-up from 0): its probes at step 1
    logged = full.trainer.callback_metrics
    assert any(k.startswith("flerm_lr/") for k in logged)
    saved = torch.load(tmp_path / "wide" / "step-2.ckpt", weights_only=False)["callbacks"]
    state = saved["FLeRMCallback"]["controller"]
    assert state["t"] == 2 and [p["step"] for p in state["history"]] == [1]
    callback = next(c for c in resumed.trainer.callbacks if type(c).__name__ == "FLeRMCallback")
    flerm = callback.session.controller
    assert flerm.t == 4 and [p.step for p in flerm.history] == [1, 2, 3]
    assert not callback.session._hooks  # detached at the end of training
    uninterrupted = next(c for c in full.trainer.callbacks if type(c).__name__ == "FLeRMCallback")
    assert [p.lrs for p in flerm.history] == [
        p.lrs for p in uninterrupted.session.controller.history
    ]
    for (name, a), (_, b) in zip(full.named_parameters(), resumed.named_parameters(), strict=True):
        assert torch.equal(a, b), name  # the resume continues exactly


def test_lightning_plateau_scheduler_records_and_drives_flerm(tmp_path: Path) -> None:
    # configure_optimizers returns ReduceLROnPlateau (stepped by Lightning on a logged metric):
    # the Recorder reads its schedule from the group, FLeRM's rates follow the plateau's cuts
    import lightning.pytorch as pl

    from fslr_func.integrations.lightning import FLeRMCallback, FSLRCallback

    example = load_script("examples/lightning.py")

    class Plateau(example.Classifier):  # type: ignore[misc, name-defined]
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = super().training_step(batch, batch_idx)
            self.log("rising", float(self.global_step))  # never improves: cut every step
            return loss  # type: ignore[no-any-return]

        def configure_optimizers(self) -> Any:
            opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
            plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0)
            schedule = {"scheduler": plateau, "interval": "step", "monitor": "rising"}
            return {"optimizer": opt, "lr_scheduler": schedule}

    def fit(width: int, callback: pl.Callback, out: Path) -> Any:
        module = Plateau(width)
        trainer = pl.Trainer(
            default_root_dir=str(out), max_steps=4, callbacks=[callback], accelerator=DEVICE.type,
            logger=False, enable_progress_bar=False, enable_model_summary=False,
            enable_checkpointing=False,
        )  # fmt: skip
        trainer.fit(module, example.loader())
        return module

    probes = torch.as_tensor(example.DATA.x_train[256:320], dtype=torch.float32)
    recording = FSLRCallback(probes, every=1, warmup_samples=8)
    fit(16, recording, tmp_path / "base")
    record = FSLRRecord.load(tmp_path / "base" / "fslr_record.json")
    assert record.meta["sched_per_step"] == pytest.approx([1.0, 1.0, 0.5, 0.25])
    driving = FLeRMCallback(str(tmp_path / "base" / "fslr_record.json"), probes, warmup_samples=8)
    fit(64, driving, tmp_path / "wide")
    flerm = driving.session.controller
    assert [p.step for p in flerm.history] == [0]
    rates, at_set_point = flerm.lrs(), flerm.history[0].lrs
    for name, rate in rates.items():  # the plateau cut the rate after steps 1, 2 and 3
        assert rate == pytest.approx(at_set_point[name] / 8, rel=1e-9), name


def test_a_second_fit_that_continues_training_continues_the_record(tmp_path: Path) -> None:
    # before, the second fit started a fresh Recorder: its rows replaced the first fit's
    import lightning.pytorch as pl

    from fslr_func.integrations.lightning import FSLRCallback

    example = load_script("examples/lightning.py")
    probes = torch.as_tensor(example.DATA.x_train[256:320], dtype=torch.float32)
    callback = FSLRCallback(probes, every=1, warmup_samples=8)
    module = example.Classifier(16)
    trainer = pl.Trainer(
        default_root_dir=str(tmp_path), max_steps=2, callbacks=[callback],
        accelerator=DEVICE.type, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False,
    )  # fmt: skip
    trainer.fit(module, example.loader())
    assert FSLRRecord.load(tmp_path / "fslr_record.json").steps == [1]
    trainer.fit_loop.epoch_loop.max_steps = 5
    trainer.fit(module, example.loader())
    # step 2 is the warm-up's rate 0 again (configure_optimizers' new scheduler): no row
    assert FSLRRecord.load(tmp_path / "fslr_record.json").steps == [1, 3, 4]
