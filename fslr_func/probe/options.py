"""The probe's options: one frozen, validated object built at every public entry point.

:func:`fslr_func.estimate`, :func:`fslr_func.probe.sampling.probe`, :func:`fslr_func.with_fslr` and
the data-parallel functions of :mod:`fslr_func.distributed` take the probe's options as keyword
arguments (:class:`ProbeKwargs`, typed for the checker) and turn them into one
:class:`ProbeOptions` as their first step, so a bad value raises there, with the same message
whichever entry point received it, before any model code runs. Everything below the entry
points receives the object.

Examples:
    >>> opts = ProbeOptions(samples=4, omega="rademacher", chunk_size=2)
    >>> opts.samples, opts.chunk_size, opts.strategy
    (4, 2, 'auto')
    >>> ProbeOptions(chunk_size=0)
    Traceback (most recent call last):
    ...
    ValueError: chunk_size must be None or a positive integer, got 0
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal, TypedDict, get_args

from ..stats.checks import integer, torch_seed
from ..stats.estimator import Grouping, check_grouping
from .functional import OutputFn

__all__ = [
    "OMEGAS",
    "STRATEGIES",
    "OmegaKind",
    "ProbeKwargs",
    "ProbeOptions",
    "Strategy",
    "check_forward_seed",
]

OmegaKind = Literal["gaussian", "rademacher"]
"""Distribution of the omega entries: Gaussian (the paper's) or Rademacher (lower variance)."""
Strategy = Literal["auto", "vmap", "loop", "autograd", "timed"]
"""How the vjp is applied to the samples (see :class:`ProbeOptions`)."""
OMEGAS: tuple[str, ...] = get_args(OmegaKind)
"""The omega distributions: ``"gaussian"`` (the paper's) and ``"rademacher"``."""
STRATEGIES: tuple[str, ...] = get_args(Strategy)
"""The ways of running the samples: ``"auto"``, ``"vmap"``, ``"loop"``, ``"autograd"``,
``"timed"``."""


def check_forward_seed(seed: int | None) -> int | None:
    """``seed`` as a plain int (:func:`torch_seed`), or ``None``.

    Raises:
        TypeError: ``seed`` is neither ``None`` nor an integer.
        ValueError: ``seed`` is outside torch's range.
    """
    return None if seed is None else torch_seed(seed, "forward_seed")


@dataclass(frozen=True)
class ProbeOptions:
    """How a probe is run; validated when built.

    Attributes:
        samples: number ``S`` of omega samples per probe batch.
        omega: ``"gaussian"`` or ``"rademacher"``.
        output_fn: maps the model output to the tensor whose movement is measured
            (``lambda o: o.logits``); ``None``: the output itself, which must be a tensor.
        readout: ``"auto"`` (detect the readout layer), a module name, or ``None`` (no
            readout variants).
        chunk_size: samples per vmap call (peak memory grows with it); ``None``: chosen by
            bytes, as many as keep one chunk's omegas and gradients within
            :data:`fslr_func.probe.CHUNK_BYTES` (all ``S`` on small models, one per chunk for a
            language model's output).
        strategy: ``"auto"`` (vmap, or on a CPU a loop for conv nets and for large probes:
            decided from the model, the device and the shapes,
            :func:`fslr_func.probe.vjp.default_strategy`, so reruns agree bit for bit; falls back,
            with one warning, where a path fails), ``"vmap"``, ``"loop"`` (one backward per
            sample through the one forward's graph, by plain ``torch.autograd.grad``: the same
            arithmetic as a loop of ``torch.func`` vjps, with less overhead, and for models
            torch.func cannot trace too), ``"autograd"`` (the same, named for the fallback)
            or ``"timed"`` (time
            vmap against the loop on the first chunk and keep the faster: may differ from run
            to run in path and rounding; falls back as ``"auto"`` does).
        grouping: Kronecker factors of tensors of rank 3 or more
            (:func:`fslr_func.stats.estimator.grouped_shape`): ``"auto"``, ``"dims"``, ``"matrix"``
            or a callable ``(name, shape) -> view shape``.
        forward_seed: run the forward under its own RNG seeded with this (restoring the
            global state after): the same seed in :func:`fslr_func.probe.exact` gives the same
            dropout masks. ``None``: the forward uses the global RNG.

    Raises:
        ValueError: an option out of its range or not one of its choices.
        TypeError: ``output_fn`` not callable, ``readout`` or ``forward_seed`` of a wrong type.
    """

    samples: int = 8
    omega: OmegaKind = "gaussian"
    output_fn: OutputFn | None = None
    readout: str | None = "auto"
    chunk_size: int | None = None
    strategy: Strategy = "auto"
    grouping: Grouping = "auto"
    forward_seed: int | None = None

    def __post_init__(self) -> None:
        # numpy and other integers are kept as plain ints (saved states, records' JSON)
        object.__setattr__(self, "samples", integer(self.samples, "samples", low=1))
        if self.omega not in OMEGAS:
            raise ValueError(f"unknown omega {self.omega!r}; choose one of {', '.join(OMEGAS)}")
        if self.output_fn is not None and not callable(self.output_fn):
            raise TypeError(
                f"output_fn must be None or a callable mapping the model output to a tensor "
                f"(e.g. lambda out: out.logits), got {self.output_fn!r}"
            )
        if self.readout is not None and not isinstance(self.readout, str):
            raise TypeError(f"readout must be 'auto', a module name or None, got {self.readout!r}")
        if self.chunk_size is not None:
            chunk = integer(self.chunk_size, "chunk_size", low=1, optional=True)
            object.__setattr__(self, "chunk_size", chunk)
        if self.strategy not in STRATEGIES:
            raise ValueError(
                f"unknown strategy {self.strategy!r}; choose one of {', '.join(STRATEGIES)}"
            )
        check_grouping(self.grouping)
        object.__setattr__(self, "forward_seed", check_forward_seed(self.forward_seed))

    def replace(self, **changes: object) -> ProbeOptions:
        """A copy with ``changes`` applied (and validated)."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]  # checked in __post_init__


class ProbeKwargs(TypedDict, total=False):
    """The keyword form of :class:`ProbeOptions` taken by the public entry points."""

    samples: int
    omega: OmegaKind
    output_fn: OutputFn | None
    readout: str | None
    chunk_size: int | None
    strategy: Strategy
    grouping: Grouping
    forward_seed: int | None
