"""Layer 2, the probe: validated options, a functional view of any module, the checks on what
goes in and comes out, one forward under ``torch.func.vjp``, the one sampling loop over omega
(with a reduction hook for probes that span processes) and the ``jvp`` ground truth.

``fslr_func.probe.probe``, ``run_probe``, ``estimate``, ``ProbeResult`` and
``GradientReduction`` keep the names they had when this was one module.
"""

from .exact import exact
from .options import OMEGAS, STRATEGIES, OmegaKind, ProbeKwargs, ProbeOptions, Strategy
from .sampling import (
    CHUNK_BYTES,
    GradientReduction,
    OmegaSlice,
    ProbeResult,
    chunk_size_for,
    draw_omega,
    estimate,
    fill_omega_,
    probe,
    run_probe,
)

__all__ = [
    "CHUNK_BYTES",
    "OMEGAS",
    "STRATEGIES",
    "GradientReduction",
    "OmegaKind",
    "OmegaSlice",
    "ProbeKwargs",
    "ProbeOptions",
    "ProbeResult",
    "Strategy",
    "chunk_size_for",
    "draw_omega",
    "estimate",
    "exact",
    "fill_omega_",
    "probe",
    "run_probe",
]
