"""The device the training-path tests run on: ``FSLR_TEST_DEVICE`` (default ``cpu``).

CI runs every test on the CPU. Where a GPU is at hand, ``FSLR_TEST_DEVICE=cuda python -m
pytest tests/training/test_training_matrix.py tests/training/test_attach.py
tests/integrations`` runs the mixed-precision training paths (bf16 and fp16 autocast, a
``GradScaler``, fused optimisers, the hooks form, the trainers' callbacks) on CUDA's kernels
instead: the same assertions, the device's own fused steps and scaler.
"""

from __future__ import annotations

import os

import torch

DEVICE = torch.device(os.environ.get("FSLR_TEST_DEVICE", "cpu"))
if DEVICE.type == "cuda" and not torch.cuda.is_available():
    raise RuntimeError("FSLR_TEST_DEVICE=cuda, but torch sees no CUDA device")


def autocast(dtype: torch.dtype) -> torch.autocast:
    """Autocast to ``dtype`` on the test device."""
    return torch.autocast(DEVICE.type, dtype=dtype)


def grad_scaler(**options: float | int) -> torch.amp.GradScaler:
    """A ``GradScaler`` for the test device."""
    return torch.amp.GradScaler(DEVICE.type, **options)  # type: ignore[arg-type]
