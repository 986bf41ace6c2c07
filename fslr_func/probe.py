r"""The probe: one forward, one vjp, and the vjp applied to ``S`` random output projections.

For outputs ``F`` flattened to ``M`` elements and ``omega`` with i.i.d. zero-mean unit-variance
entries, the probe ``phi = sum(omega * F) / sqrt(M)`` has gradient ``g = J^T omega / sqrt(M)``.
The forward runs once under :func:`torch.func.vjp`; the returned ``vjp_fn`` is then applied to
every omega, and each sample is reduced at once to the ``D + 2`` log statistics of
``Z = dW * g`` (:func:`fslr_func.estimator.log_statistics`), so only statistics leave the
per-sample function. With ``strategy="vmap"`` the samples go through :func:`torch.func.vmap` in
chunks of ``chunk_size`` (peak memory grows with the chunk, not with ``S``); ``"loop"`` applies
``vjp_fn`` once per sample; ``"autograd"`` uses plain ``torch.autograd.grad`` for models that
torch.func cannot trace. ``"auto"`` times both on the first chunk (one sample by loop, a few
by vmap: on CPU vmap wins on small models, where per-sample dispatch dominates, and loses on
large ones and conv nets) and keeps the faster for the rest; it also falls back, with one warning,
when a path fails. A probe whose batch is split over processes is the same loop with a
:class:`GradientReduction` hook (:mod:`fslr_func.distributed`): it says which slice of each
global omega this process uses and sums the per-sample gradients over the processes before
their statistics are taken.

Every omega sample is drawn on its own from ``generator``, so the result for a given seed does
not depend on the strategy or the chunk size.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
from torch import Tensor, nn
from torch.func import vjp, vmap

from .estimator import (
    Estimator,
    ReadoutRole,
    check_estimator,
    fslr_from_log,
    grouped_shape,
    log_sq_norm,
    log_statistics,
    mean_log_stats,
)
from .fallback import first_line, warn_once
from .functional import (
    Inputs,
    ReadoutFinder,
    as_output_tensor,
    evaluation_point,
    model_forward,
    readout_roles,
    substituted,
    transformable_attention,
)
from .options import OMEGAS, ProbeOptions

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from .options import ProbeKwargs

__all__ = [
    "GradientReduction",
    "OmegaSlice",
    "ProbeResult",
    "VjpSetup",
    "draw_omega",
    "estimate",
    "prepare_vjp",
    "probe",
    "run_probe",
]


@dataclass
class ProbeResult:
    """What one probe measured.

    Attributes:
        log_stats: tensor name -> ``(S, D + 2)`` float64 log statistics, one row per sample,
            ``D`` the rank of the tensor's grouped view (:func:`fslr_func.estimator.grouped_shape`).
        readout: readout tensor names -> ``"weight"`` or ``"bias"``.
        readout_module: the readout module's name, or ``None``.
        num_outputs: ``M``, the number of output elements (of the global batch when the probe
            spans several processes).
        strategy: the strategy that produced the result.
    """

    log_stats: dict[str, Tensor]
    readout: dict[str, ReadoutRole]
    readout_module: str | None
    num_outputs: int
    strategy: str

    def fslr(self, estimator: Estimator = "kron") -> dict[str, Tensor]:
        """One-probe FSLR per tensor: the square root of the estimator on the sample means."""
        check_estimator(estimator)
        return {
            n: fslr_from_log(log_sq_norm(mean_log_stats(ls), estimator, self.readout.get(n)))
            for n, ls in self.log_stats.items()
        }


def draw_omega(
    num: int,
    kind: str,
    generator: torch.Generator | None,
    device: torch.device,
    dtype: torch.dtype,
) -> Tensor:
    """One omega sample of ``num`` i.i.d. zero-mean, unit-variance entries.

    Drawn on the generator's device (``device`` without one), then moved to ``device``.

    Example:
        >>> g = torch.Generator().manual_seed(0)
        >>> w = draw_omega(4, "rademacher", g, torch.device("cpu"), torch.float32)
        >>> sorted(set(w.tolist())) in ([-1.0, 1.0], [-1.0], [1.0])
        True
    """
    gen_device = generator.device if generator is not None else device
    if kind == "gaussian":
        w = torch.randn(num, generator=generator, device=gen_device)
    elif kind == "rademacher":
        w = torch.randint(0, 2, (num,), generator=generator, device=gen_device) * 2.0 - 1.0
    else:
        raise ValueError(f"unknown omega {kind!r}; choose one of {', '.join(OMEGAS)}")
    return w.to(device=device, dtype=dtype)


VjpFn = Callable[[Tensor], tuple[dict[str, Tensor]]]
SampleFn = Callable[[Tensor], dict[str, Tensor]]
TIMED_VMAP_ROWS = 3
"""Samples vmapped while ``strategy="auto"`` times vmap against the loop on a first chunk."""


def _func_vjp(
    flat_output: Callable[[dict[str, Tensor]], Tensor], primals: dict[str, Tensor]
) -> tuple[Tensor, VjpFn]:
    result = vjp(flat_output, primals)
    return result[0], result[1]


def _autograd_vjp(
    flat_output: Callable[[dict[str, Tensor]], Tensor],
    primals: dict[str, Tensor],
    backward_context: Callable[[], contextlib.AbstractContextManager[None]] | None = None,
) -> tuple[Tensor, VjpFn]:
    leaves = {n: p.detach().requires_grad_(True) for n, p in primals.items()}
    with torch.enable_grad():
        out = flat_output(leaves)

    def vjp_fn(cotangent: Tensor) -> tuple[dict[str, Tensor]]:
        # Activation checkpointing recomputes the forward inside this backward: it must see
        # the forward's tensors and attention kernel (functional.substituted).
        with transformable_attention() if backward_context is None else backward_context():
            grads = torch.autograd.grad(
                out, list(leaves.values()), cotangent, retain_graph=True, allow_unused=True
            )
        return (
            {
                n: torch.zeros_like(leaf) if g is None else g
                for (n, leaf), g in zip(leaves.items(), grads, strict=True)
            },
        )

    return out.detach(), vjp_fn


@dataclass
class VjpSetup:
    """One forward of the model under a vjp, and what the probe needs to use it.

    Attributes:
        model: the module probed.
        output: the flat model output (``M`` elements), detached.
        vjp_fn: maps a cotangent of the flat output to ``({name: gradient},)``.
        readout: readout tensor names -> ``"weight"`` or ``"bias"``.
        readout_module: the readout module's name, or ``None``.
        views: tensor name -> the shape ``Z`` is viewed as before its statistics (grouping).
        strategy: ``"autograd"`` if the forward fell back to plain autograd, else the request.
        requested: the strategy asked for (``"auto"`` allows fallbacks and timing).
    """

    model: nn.Module
    output: Tensor
    vjp_fn: VjpFn
    readout: dict[str, ReadoutRole]
    readout_module: str | None
    views: dict[str, tuple[int, ...]]
    strategy: str
    requested: str

    def map_samples(self, fn: SampleFn, omegas: Tensor) -> dict[str, Tensor]:
        """``fn`` applied to every row of ``omegas``, results stacked along a new dim 0.

        ``"vmap"`` batches the rows through :func:`torch.func.vmap`; ``"loop"`` and
        ``"autograd"`` call ``fn`` row by row. ``"auto"`` times the two on the first call
        (row 0 by loop, the next :data:`TIMED_VMAP_ROWS` rows by vmap, so no row is computed
        twice), keeps the faster per row and runs the remaining rows with it; a vmap that
        fails falls back to the loop with one warning. The choice made is left in
        :attr:`strategy` for later calls and probes.
        """
        if self.strategy == "auto":
            if len(omegas) < 2:
                return self._loop(fn, omegas)
            start = time.perf_counter()
            parts = [self._loop(fn, omegas[:1])]
            per_row_loop = time.perf_counter() - start
            timed = omegas[1 : 1 + TIMED_VMAP_ROWS]
            start = time.perf_counter()
            parts.append(self._vmap(fn, timed))
            if self.strategy == "auto":  # vmap worked: keep the faster path
                per_row_vmap = (time.perf_counter() - start) / len(timed)
                self.strategy = "vmap" if per_row_vmap < per_row_loop else "loop"
            rest = omegas[1 + len(timed) :]
            if len(rest):
                parts.append(self.map_samples(fn, rest))
            return {n: torch.cat([p[n] for p in parts]) for n in parts[0]}
        if self.strategy == "vmap":
            return self._vmap(fn, omegas)
        return self._loop(fn, omegas)

    def _loop(self, fn: SampleFn, omegas: Tensor) -> dict[str, Tensor]:
        rows = [fn(w) for w in omegas]
        return {n: torch.stack([r[n] for r in rows]) for n in rows[0]}

    def _vmap(self, fn: SampleFn, omegas: Tensor) -> dict[str, Tensor]:
        try:
            result: dict[str, Tensor] = vmap(fn)(omegas)
        except (RuntimeError, NotImplementedError) as err:
            if self.requested == "vmap":
                raise
            warn_once(
                self.model,
                "loop",
                f"vmap over the probe's vjp failed for {type(self.model).__name__} "
                f"({first_line(err)}); falling back to a loop over samples (same result, may "
                f"be slower)",
            )
            self.strategy = "loop"
            return self._loop(fn, omegas)
        return result


def prepare_vjp(
    model: nn.Module,
    inputs: Inputs,
    delta: Mapping[str, Tensor],
    options: ProbeOptions,
    *,
    params: Mapping[str, Tensor] | None = None,
) -> VjpSetup:
    """Check the arguments and run the model's forward once under a vjp.

    Only the tensors in ``delta`` are differentiated; the other parameters, frozen parameters
    and cloned buffers are constants. The forward runs under :func:`torch.func.vjp`, or under
    plain autograd when ``options.strategy="autograd"`` or when torch.func cannot trace the
    model and the strategy is ``"auto"`` (one warning). The readout layer is detected during
    this forward. Arguments are those of :func:`run_probe`.
    """
    tensors, point = evaluation_point(model, delta, params)
    primals = {n: point[n] for n in delta}
    fixed = {n: t for n, t in point.items() if n not in delta}
    readout, strategy = options.readout, options.strategy

    finder = ReadoutFinder(model) if readout == "auto" else None
    found: list[str | None] = []
    out_shape: list[torch.Size] = []
    last_state: list[dict[str, Tensor]] = []

    def flat_output(p: dict[str, Tensor]) -> Tensor:
        state = {**fixed, **tensors.constants(), **p}
        last_state[:] = [state]
        with finder if finder is not None else contextlib.nullcontext():
            raw = model_forward(
                model, state, inputs, options.output_fn, forward_seed=options.forward_seed
            )
            out = as_output_tensor(raw, options.output_fn)
        if finder is not None:
            found.append(finder.find(out))
        out_shape.append(out.shape)
        return out.reshape(-1)

    use: str = strategy
    try:
        if strategy == "autograd":
            raise NotImplementedError("autograd requested")
        out, vjp_fn = _func_vjp(flat_output, primals)
    except (RuntimeError, NotImplementedError) as err:
        if strategy not in ("auto", "autograd"):
            raise
        found.clear()
        out_shape.clear()
        out, vjp_fn = _autograd_vjp(flat_output, primals, lambda: substituted(model, last_state[0]))
        if strategy == "auto":
            warn_once(
                model,
                "autograd",
                f"torch.func could not trace {type(model).__name__} ({first_line(err)}); the "
                f"FSLR probe falls back to plain autograd, one backward per sample (same "
                f"result, slower)",
            )
        use = "autograd"

    module_name = found[0] if found else (readout if readout != "auto" else None)
    last_dim = out_shape[-1][-1] if len(out_shape[-1]) else 1
    roles = readout_roles(model, module_name, primals, last_dim)
    views = {
        n: tuple(d.shape) if n in roles else grouped_shape(n, d.shape, options.grouping)
        for n, d in delta.items()
    }
    return VjpSetup(model, out, vjp_fn, roles, module_name, views, use, strategy)


@dataclass(frozen=True)
class OmegaSlice:
    """Where this process's outputs sit in each omega sample.

    Each sample draws ``draw`` entries from ``generator`` and uses ``[offset, offset + local)``
    of them (``local`` the number of this process's output elements); the probe's cotangent
    is scaled by ``1 / sqrt(total)``, ``total`` the global number of output elements. One
    process: ``draw == total == local``, ``offset == 0``.
    """

    generator: torch.Generator | None
    draw: int
    offset: int
    total: int


class GradientReduction(Protocol):
    """The hook that makes one probe span several processes (:mod:`fslr_func.distributed`).

    The probe calls :meth:`omega_slice` once, after its forward, and :meth:`reduce` on every
    chunk of per-sample gradients before their statistics are taken, so the statistics are
    those of the global batch on every process.
    """

    def omega_slice(
        self,
        num_outputs: int,
        delta: Mapping[str, Tensor],
        samples: int,
        generator: torch.Generator | None,
    ) -> OmegaSlice:
        """This process's slice of the global omega, given its ``num_outputs`` elements."""
        ...

    def reduce(self, grads: dict[str, Tensor]) -> dict[str, Tensor]:
        """Per-sample gradients ``(chunk, *shape)`` summed over the processes."""
        ...


def _dense(g: Tensor) -> Tensor:
    """Sparse gradients (``Embedding(sparse=True)``) as dense tensors."""
    return g if g.layout == torch.strided else g.to_dense()


def _chunks(samples: int, chunk_size: int | None) -> Iterator[int]:
    """Sizes of the successive chunks of ``samples`` samples."""
    chunk = samples if chunk_size is None else min(chunk_size, samples)
    for start in range(0, samples, chunk):
        yield min(chunk, samples - start)


def run_probe(
    model: nn.Module,
    inputs: Inputs,
    delta: Mapping[str, Tensor],
    options: ProbeOptions,
    *,
    generator: torch.Generator | None = None,
    params: Mapping[str, Tensor] | None = None,
    reduction: GradientReduction | None = None,
) -> ProbeResult:
    """The one sampling loop behind every probe: :func:`probe` with validated options.

    Args:
        model: any module; it is not mutated (buffers are cloned, parameters substituted).
        inputs: a tensor, a tuple of positional arguments or a dict of keyword arguments.
        delta: parameter name -> unit-learning-rate update (names of ``named_parameters()``).
        options: the validated :class:`~fslr_func.options.ProbeOptions`.
        generator: draws omega.
        params: values to evaluate the gradient at; defaults to the module's parameters.
        reduction: combines the per-sample gradients of several processes
            (:class:`GradientReduction`); ``None``: one process, and each sample is reduced to
            its statistics inside the mapped function, so only statistics leave it.

    Returns:
        A :class:`ProbeResult`.
    """
    setup = prepare_vjp(model, inputs, delta, options, params=params)
    out = setup.output
    local = out.numel()
    where = (
        OmegaSlice(generator, local, 0, local)
        if reduction is None
        else reduction.omega_slice(local, delta, options.samples, generator)
    )
    if where.total == 0:
        raise ValueError("the model output is empty: nothing to probe")
    scale = 1.0 / math.sqrt(where.total)
    home = where.generator.device if where.generator is not None else out.device

    def gradients(w: Tensor) -> dict[str, Tensor]:
        (grads,) = setup.vjp_fn(w * scale)
        return {n: _dense(grads[n]) for n in delta}

    def statistics(grads: dict[str, Tensor]) -> dict[str, Tensor]:
        return {n: log_statistics((grads[n] * d).reshape(setup.views[n])) for n, d in delta.items()}

    def draw(count: int) -> Tensor:
        ws = [
            draw_omega(where.draw, options.omega, where.generator, home, out.dtype)
            for _ in range(count)
        ]
        stacked = torch.stack(ws)
        if where.draw != local:
            stacked = stacked[:, where.offset : where.offset + local]
        return stacked.to(out.device)

    rows = []
    for count in _chunks(options.samples, options.chunk_size):
        if reduction is None:
            rows.append(setup.map_samples(lambda w: statistics(gradients(w)), draw(count)))
        else:
            grads = reduction.reduce(setup.map_samples(gradients, draw(count)))
            rows.append(vmap(statistics)(grads))
    log_stats = {n: torch.cat([r[n] for r in rows]) for n in delta}
    return ProbeResult(log_stats, setup.readout, setup.readout_module, where.total, setup.strategy)


def probe(
    model: nn.Module,
    inputs: Inputs,
    delta: Mapping[str, Tensor],
    *,
    generator: torch.Generator | None = None,
    params: Mapping[str, Tensor] | None = None,
    **options: Unpack[ProbeKwargs],
) -> ProbeResult:
    """Per-sample log statistics of ``Z = delta * d phi / d W`` for every tensor in ``delta``.

    Args:
        model: any module; it is not mutated (buffers are cloned, parameters substituted).
        inputs: a tensor, a tuple of positional arguments or a dict of keyword arguments.
        delta: parameter name -> unit-learning-rate update (names of ``named_parameters()``).
        generator: draws omega; a seeded generator reproduces the result (bit for bit with
            a fixed ``strategy``; ``"auto"`` may pick vmap or the loop from run to run, which
            agree to float rounding).
        params: values to evaluate the gradient at (e.g. the weights before an optimiser
            step); defaults to the module's current parameters. Partial dicts are fine.
        **options: the probe's options (:class:`~fslr_func.options.ProbeOptions`):
            ``samples``, ``omega``, ``output_fn``, ``readout``, ``chunk_size``, ``strategy``,
            ``grouping``, ``forward_seed``.

    Returns:
        A :class:`ProbeResult`; its ``strategy`` is the one that ran (pass it back to skip the
        timing on the next probe of the same model).

    Example:
        >>> model = torch.nn.Linear(3, 2)
        >>> delta = {n: torch.ones_like(p) for n, p in model.named_parameters()}
        >>> r = probe(model, torch.randn(5, 3), delta, samples=4)
        >>> r.log_stats["weight"].shape, r.readout
        (torch.Size([4, 4]), {'weight': 'weight', 'bias': 'bias'})
    """
    return run_probe(
        model, inputs, delta, ProbeOptions(**options), generator=generator, params=params
    )


def estimate(
    model: nn.Module,
    inputs: Inputs,
    delta: Mapping[str, Tensor],
    *,
    estimator: Estimator = "kron",
    generator: torch.Generator | None = None,
    params: Mapping[str, Tensor] | None = None,
    **options: Unpack[ProbeKwargs],
) -> dict[str, Tensor]:
    r"""One-probe estimate of every tensor's function-space learning rate (no EMA).

    ``E`` is the mean over the ``samples`` omegas of one probe; the estimate of
    :math:`\|\Delta_W f\|_\mathrm{RMS}` is the square root of ``kron``
    (:math:`\prod_d E[q_d] / E[q_0]^{D-1}`), ``full`` (:math:`E[(\sum Z)^2]`) or ``iid``
    (:math:`E[\sum Z^2]`); the readout layer's tensors use the row-independent variants with
    ``kron``. ``grouping`` chooses the Kronecker factors of tensors of rank 3 or more (conv
    weights): ``"auto"`` views them as ``out x rest``; ``"dims"`` is the paper's one factor
    per dim. See :mod:`fslr_func.estimator`, :class:`~fslr_func.options.ProbeOptions` for the
    probe's options (``samples=8``, ``omega="gaussian"``, ``output_fn``, ``readout="auto"``,
    ``chunk_size``, ``strategy="auto"``, ``grouping="auto"``, ``forward_seed``) and
    :func:`probe` for the other arguments.

    Returns:
        Tensor name -> float64 scalar FSLR, keyed like ``delta``.

    Example:
        >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
        <torch._C.Generator object at ...>
        >>> model = torch.nn.Sequential(
        ...     torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)
        ... )
        >>> delta = {n: 1e-2 * torch.randn_like(p) for n, p in model.named_parameters()}
        >>> fslr = estimate(model, torch.randn(16, 4), delta, samples=32)
        >>> sorted(fslr)
        ['0.bias', '0.weight', '2.bias', '2.weight']
    """
    check_estimator(estimator)
    opts = ProbeOptions(**options)
    return run_probe(model, inputs, delta, opts, generator=generator, params=params).fslr(estimator)
