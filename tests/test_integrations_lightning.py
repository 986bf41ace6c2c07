"""The Lightning callbacks with the real ``lightning.Trainer`` (CPU, a few steps, bf16 mixed
precision and fp32): a base
record, FLeRM with a warm-up from 0, accumulation and clipping, logging, checkpoint, and a resume
whose weights equal the uninterrupted run's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _scripts import load_script

from fslr_func.record import FSLRRecord

pytest.importorskip("lightning")


@pytest.mark.parametrize("precision", ["bf16-mixed", "32-true"])
def test_lightning_record_flerm_checkpoint_resume(tmp_path: Path, precision: str) -> None:
    module = load_script("examples/lightning.py")
    full, resumed = module.main(str(tmp_path), steps=4, precision=precision)
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
