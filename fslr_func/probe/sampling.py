r"""The probe: one forward, one vjp, and the vjp applied to ``S`` random output projections.

For outputs ``F`` flattened to ``M`` elements and ``omega`` with i.i.d. zero-mean unit-variance
entries, the probe ``phi = sum(omega * F) / sqrt(M)`` has gradient ``g = J^T omega / sqrt(M)``.
The forward runs once under :func:`torch.func.vjp` (:mod:`fslr_func.probe.vjp`); the returned
``vjp_fn`` is then applied to every omega, and each sample is reduced at once to the ``D + 2``
log statistics of ``Z = dW * g`` (:class:`fslr_func.stats.statistics.ProductStatistics`), so
only statistics leave the per-sample function. With ``strategy="vmap"`` the samples go through
:func:`torch.func.vmap` in chunks of ``chunk_size`` (peak memory grows with the chunk, not
with ``S``); ``"loop"`` applies ``vjp_fn`` once per sample; ``"autograd"`` uses plain
``torch.autograd.grad`` for models that torch.func cannot trace. ``"auto"`` (the default)
picks vmap, or on a CPU the loop for conv nets and large probes, from the model, the device
and the shapes (:func:`fslr_func.probe.vjp.default_strategy`), so reruns take the same path and
agree bit for bit;
``"timed"`` times both on the first chunk and keeps the faster. Both fall back, with one
warning, when a path fails.

A probe whose batch is split over processes is the same loop (:func:`run_probe`) with a
:class:`GradientReduction` hook (:mod:`fslr_func.distributed`): it says which slice of each
global omega this process uses and sums the per-sample gradients over the processes before
their statistics are taken.

Every omega sample is drawn on its own from ``generator``, so the result for a given seed does
not depend on the strategy or the chunk size.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
from torch import Tensor, nn
from torch.func import vmap

from ..stats.estimator import (
    Estimator,
    ReadoutRole,
    SampledEstimator,
    check_estimator,
    fslr_from_log,
    grouped_shape,
    log_sq_norm,
    mean_log_stats,
)
from ..stats.statistics import ProductStatistics, ScaledUpdate
from .exact import exact
from .fallback import first_line, warn_once
from .functional import Inputs, check_inputs, nonfinite_fslr_error, nonfinite_names
from .options import OMEGAS, OmegaKind, ProbeOptions, Strategy
from .split_head import SplitHead
from .vjp import VjpSetup, prepare_vjp

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from .options import ProbeKwargs

__all__ = [
    "CHUNK_BYTES",
    "GradientReduction",
    "OmegaSlice",
    "ProbeResult",
    "chunk_size_for",
    "draw_omega",
    "estimate",
    "fill_omega_",
    "probe",
    "run_probe",
    "split_chunk_size",
    "split_worthwhile",
]


@dataclass
class ProbeResult:
    """What one probe measured.

    Attributes:
        log_stats: tensor name -> ``(S, D + 2)`` float64 log statistics, one row per sample,
            ``D`` the rank of the tensor's grouped view
            (:func:`fslr_func.stats.estimator.grouped_shape`).
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
    strategy: Strategy

    def fslr(self, estimator: SampledEstimator = "kron") -> dict[str, Tensor]:
        """One-probe FSLR per tensor: the square root of the estimator on the sample means.

        Raises:
            ValueError: ``estimator="exact"``, which is not computed from samples.
        """
        check_estimator(estimator, sampled=True)
        return {
            n: fslr_from_log(log_sq_norm(mean_log_stats(ls), estimator, self.readout.get(n)))
            for n, ls in self.log_stats.items()
        }


OMEGA_DTYPE = torch.float32
"""The dtype omega is drawn in, whatever the model's (then cast to the output's dtype)."""


def fill_omega_(out: Tensor, kind: OmegaKind, generator: torch.Generator | None) -> Tensor:
    """Fill ``out`` in place with i.i.d. zero-mean, unit-variance entries; returns ``out``.

    ``"gaussian"``: standard normal; ``"rademacher"``: +1 or -1 with equal probability. The
    generator must live on ``out``'s device. Filling a reused buffer row by row draws exactly
    the numbers :func:`draw_omega` would, without allocating a sample.

    Examples:
        >>> buf = torch.empty(2, 3)
        >>> row = fill_omega_(buf[0], "gaussian", torch.Generator().manual_seed(0))
        >>> cpu = torch.device("cpu")
        >>> g = torch.Generator().manual_seed(0)
        >>> torch.equal(buf[0], draw_omega(3, "gaussian", g, cpu, torch.float32))
        True
    """
    if kind == "gaussian":
        return out.normal_(generator=generator)
    if kind == "rademacher":
        return out.random_(0, 2, generator=generator).mul_(2.0).sub_(1.0)
    raise ValueError(f"unknown omega {kind!r}; choose one of {', '.join(OMEGAS)}")


def draw_omega(
    num: int,
    kind: OmegaKind,
    generator: torch.Generator | None,
    device: torch.device,
    dtype: torch.dtype,
) -> Tensor:
    """One omega sample of ``num`` entries (:func:`fill_omega_`), returned in ``dtype``.

    Drawn in float32 on the generator's device (``device`` without one), then moved to
    ``device`` and ``dtype``: models in bfloat16 and float64 see the same numbers.

    Examples:
        >>> g = torch.Generator().manual_seed(0)
        >>> w = draw_omega(4, "rademacher", g, torch.device("cpu"), torch.float32)
        >>> sorted(set(w.tolist())) in ([-1.0, 1.0], [-1.0], [1.0])
        True
    """
    gen_device = generator.device if generator is not None else device
    out = torch.empty(num, device=gen_device, dtype=OMEGA_DTYPE)
    return fill_omega_(out, kind, generator).to(device=device, dtype=dtype)


CHUNK_BYTES = 64 * 2**20
"""What one chunk of samples may hold, in bytes, when ``chunk_size=None``."""


def chunk_size_for(
    samples: int, omega_entries: int, itemsize: int, delta: Mapping[str, Tensor]
) -> int:
    """Samples per chunk so that one chunk's omegas and gradients fit in :data:`CHUNK_BYTES`.

    A sample costs its omega (``omega_entries`` values of ``itemsize`` bytes) and one gradient
    of every probed tensor; the vjp's own intermediates are of the same order (the output's
    cotangent and the activations' gradients). Small models get every sample in one chunk;
    a language model whose output alone exceeds the budget (Llama's 128k vocabulary at batch
    8, sequence 128: 0.5 GB per sample) gets one sample per chunk, so the probe's peak stays
    near one backward pass's, whatever ``S``.

    Examples:
        >>> d = {"w": torch.zeros(64, 64)}
        >>> chunk_size_for(8, 1000, 4, d), chunk_size_for(8, 128_256 * 1024, 4, d)
        (8, 1)
    """
    grads = sum(d.numel() * d.element_size() for d in delta.values())
    per_sample = omega_entries * itemsize + grads
    return max(1, min(samples, CHUNK_BYTES // max(per_sample, 1)))


def split_worthwhile(
    samples: int,
    num_outputs: int,
    dtype: torch.dtype,
    device: torch.device,
    *,
    delta: Mapping[str, Tensor],
) -> bool:
    """Whether a probe splits its backward at a linear readout (:mod:`fslr_func.probe.split_head`):
    on an accelerator, where its omegas (``num_outputs`` of ``dtype`` per sample) do not all
    fit one chunk (:func:`chunk_size_for`). Not on a CPU: the launches the split saves cost
    little there, and its batched body backward and stacked gradients cost more (the thin
    Llama of ``benchmarks/llm.py`` at sequence 16 and 64, 2 threads: the split probe took
    1.19x and 1.36x the time of the unsplit one on the vmap path, 1.17x on plain autograd's).

    Examples:
        >>> d = {"w": torch.zeros(64, 64)}
        >>> split_worthwhile(8, 128_256 * 1024, torch.float32, torch.device("cuda"), delta=d)
        True
        >>> split_worthwhile(8, 128_256 * 1024, torch.float32, torch.device("cpu"), delta=d)
        False
    """
    if device.type == "cpu":
        return False
    return chunk_size_for(samples, num_outputs, dtype.itemsize, delta) < samples


def split_chunk_size(head: SplitHead, omega_entries: int, delta: Mapping[str, Tensor]) -> int:
    """Samples per chunk of a probe split at its readout (:mod:`fslr_func.probe.split_head`).

    The omegas live one at a time, so a chunk's per-sample gradients (every probed tensor's,
    the readout's and ``dH``) may take :data:`CHUNK_BYTES` plus the one omega's bytes: the
    memory the unsplit probe spends on its one-sample chunks.
    """
    grads = sum(d.numel() * d.element_size() for d in delta.values())
    per_sample = grads + head.cotangent_bytes
    return (CHUNK_BYTES + omega_entries * head.dtype.itemsize) // max(per_sample, 1)


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
    readout: Mapping[str, ReadoutRole] | None = None
    """The readout roles every process gives (``None``: this process's own)."""


class GradientReduction(Protocol):
    """The hook that makes one probe span several processes (:mod:`fslr_func.distributed`).

    The probe runs inside :meth:`gathered` (the full tensors of sharded parameters), calls
    :meth:`omega_slice` once, after its forward, and :meth:`reduce` on every
    chunk of per-sample gradients before their statistics are taken, so the statistics are
    those of the global batch on every process. A process whose forward or input checks raise
    calls :meth:`abort` instead of :meth:`omega_slice` before re-raising (the data-parallel
    reduction raises from :meth:`abort` itself: the same error on every process).
    """

    def omega_slice(
        self,
        num_outputs: int,
        delta: Mapping[str, Tensor],
        samples: int,
        generator: torch.Generator | None,
        chunk_size: int | None = None,
        readout: Mapping[str, ReadoutRole] | None = None,
    ) -> OmegaSlice:
        """This process's slice of the global omega, given its ``num_outputs`` elements
        (``chunk_size``: the option's, which every process must share) and its ``readout``
        roles, which the slice returns as every process gives them."""
        ...

    def reduce(self, grads: dict[str, Tensor]) -> dict[str, Tensor]:
        """Per-sample gradients ``(chunk, *shape)`` summed over the processes, each in memory
        no other returned gradient shares (the statistics overwrite them in place)."""
        ...

    def abort(
        self, delta: Mapping[str, Tensor], samples: int, chunk_size: int | None = None
    ) -> None:
        """Called instead of :meth:`omega_slice` when this process cannot probe (its forward or
        its checks raised): lets the other processes raise too rather than wait for it."""
        ...

    def gathered(
        self, model: nn.Module, delta: Mapping[str, Tensor], params: Mapping[str, Tensor] | None
    ) -> contextlib.AbstractContextManager[
        tuple[Mapping[str, Tensor], Mapping[str, Tensor] | None]
    ]:
        """The full ``(delta, params)`` of the probe, for its duration: sharded parameters
        (FSDP2) all-gathered, anything else as given."""
        ...


@functools.cache
def _takes_readout(kind: type[GradientReduction]) -> bool:
    """Whether a reduction's ``omega_slice`` takes ``readout`` (one written before it was
    added to :class:`GradientReduction` is called as before, and its processes are trusted
    to give the same readout roles).

    Examples:
        >>> class Old:
        ...     def omega_slice(self, num_outputs, delta, samples, generator, chunk_size=None): ...
        >>> _takes_readout(Old)
        False
    """
    parameters = inspect.signature(kind.omega_slice).parameters
    return "readout" in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values())


def _dense(g: Tensor) -> Tensor:
    """Sparse gradients (``Embedding(sparse=True)``) as dense tensors."""
    return g if g.layout == torch.strided else g.to_dense()


def _chunks(samples: int, chunk_size: int) -> Iterator[int]:
    """Sizes of the successive chunks of ``samples`` samples."""
    for start in range(0, samples, chunk_size):
        yield min(chunk_size, samples - start)


def run_probe(
    model: nn.Module,
    inputs: Inputs,
    delta: Mapping[str, Tensor],
    options: ProbeOptions,
    *,
    generator: torch.Generator | None = None,
    params: Mapping[str, Tensor] | None = None,
    reduction: GradientReduction | None = None,
    strict: bool = True,
) -> ProbeResult:
    """The one sampling loop behind every probe: :func:`probe` with validated options.

    Args:
        model: any module; it is not mutated (buffers are cloned, parameters substituted).
        inputs: a tensor, a tuple of positional arguments or a dict of keyword arguments.
        delta: parameter name -> unit-learning-rate update (names of ``named_parameters()``).
        options: the validated :class:`~fslr_func.probe.options.ProbeOptions`.
        generator: draws omega.
        params: values to evaluate the gradient at; defaults to the module's parameters.
        reduction: combines the per-sample gradients of several processes
            (:class:`GradientReduction`); ``None``: one process, and each sample is reduced to
            its statistics inside the mapped function, so only statistics leave it.
        strict: refuse NaN or Inf in ``delta``, the inputs and the output with an error
            (one-shot estimates). ``False`` (the wrapper, in training) reads nothing on the
            host, so the probe never synchronises; statistics that are not finite come out
            as NaN or Inf, for the caller to leave out.

    Returns:
        A :class:`ProbeResult`.

    Raises:
        TypeError: ``generator`` is not a ``torch.Generator`` (a seed was passed for one).
    """
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(
            f"generator must be a torch.Generator or None, got {type(generator).__name__} "
            f"{generator!r}: pass torch.Generator().manual_seed(seed)"
        )
    if reduction is None:
        return _run(model, inputs, delta, options, generator, params, None, strict)
    with reduction.gathered(model, delta, params) as (full_delta, rest):
        return _run(model, inputs, full_delta, options, generator, rest, reduction, strict)


def _run(
    model: nn.Module,
    inputs: Inputs,
    delta: Mapping[str, Tensor],
    options: ProbeOptions,
    generator: torch.Generator | None,
    params: Mapping[str, Tensor] | None,
    reduction: GradientReduction | None,
    strict: bool,
) -> ProbeResult:
    """:func:`run_probe` on full tensors: one forward, the samples, the autograd fallback."""

    # One process with the chunks by bytes (fslr_func.probe.split_head).
    split = (
        functools.partial(split_worthwhile, options.samples, delta=delta)
        if reduction is None and options.chunk_size is None
        else None
    )
    try:
        setup = prepare_vjp(
            model, inputs, delta, options, params=params, strict=strict, split=split
        )
    except Exception:  # a forward that fails on one rank's shard too: the others must know
        if reduction is not None:
            reduction.abort(delta, options.samples, options.chunk_size)
        raise
    signature = setup.signature
    retriable = options.strategy in ("auto", "timed") and setup.strategy != "autograd"
    # what a retry needs to draw the same omegas, kept only where one can happen
    rewind = _omega_rewind(generator, setup.device) if retriable and reduction is None else None
    try:
        result = _sample(setup, delta, options, generator, reduction)
    except RuntimeError as err:
        # torch.func traced the forward but its backward fails: a forward that enters
        # autocast itself (accelerate's, Trainer(bf16=True)) casts inside the transform,
        # where the casts are not differentiated. Plain autograd works for any forward. Not
        # after a failed collective: a retry would issue collectives the other ranks never
        # join.
        if not retriable or isinstance(err, torch.distributed.DistError):
            raise
        warn_once(
            model,
            "autograd-backward",
            f"the torch.func backward of the FSLR probe failed for {type(model).__name__} "
            f"({first_line(err)}; e.g. a forward wrapped in autocast, as accelerate and "
            "Trainer(bf16=True) do); the probe falls back to plain autograd, one backward per "
            "sample (for a language model on a GPU, batched before its readout; same result, "
            "slower)",
        )
        setup = prepare_vjp(
            model, inputs, delta, options.replace(strategy="autograd"), params=params, strict=strict
        )
        if rewind is not None:  # the same omegas as the failed try drew: a seed reproduces
            rewind()
        result = _sample(setup, delta, options, generator, reduction)
    # The next probe with the same signature skips the structural checks and takes this path
    # (plain autograd at once where the torch.func backward failed).
    setup.signature = signature  # the autograd retry's setup is kept under the first's key
    setup.remember()
    return result


def _omega_rewind(
    generator: torch.Generator | None, device: torch.device
) -> Callable[[], None] | None:
    """What puts the omegas' random state back where it is now (``generator``'s, or the
    global one of ``device`` the omegas are drawn on without it), so that a retry draws the
    same omegas; ``None`` where that state is not torch's CPU or CUDA one. Reads no device
    value: a CUDA generator's state is its seed and offset, kept on the host."""
    if generator is not None:
        state = generator.get_state()

        def restore() -> None:
            generator.set_state(state)

        return restore
    if device.type == "cpu":
        state = torch.get_rng_state()
        return lambda: torch.set_rng_state(state)
    if device.type == "cuda":
        state = torch.cuda.get_rng_state(device)
        return lambda: torch.cuda.set_rng_state(state, device)
    return None


def _sample(
    setup: VjpSetup,
    delta: Mapping[str, Tensor],
    options: ProbeOptions,
    generator: torch.Generator | None,
    reduction: GradientReduction | None,
) -> ProbeResult:
    """The omega samples of one probe, reduced to their log statistics (:func:`run_probe`)."""
    local = setup.num_outputs
    where = (
        OmegaSlice(generator, local, 0, local)
        if reduction is None
        else reduction.omega_slice(
            local,
            delta,
            options.samples,
            generator,
            options.chunk_size,
            **({"readout": setup.readout} if _takes_readout(type(reduction)) else {}),
        )
    )
    if where.readout is not None and dict(where.readout) != setup.readout:
        # the readout check passed on this process's shard, not on every one: the roles and
        # views of every process, so that all reduce the same statistics
        dropped = setup.readout.keys() - where.readout.keys()
        setup.readout = dict(where.readout)
        setup.views.update({n: grouped_shape(n, delta[n].shape, options.grouping) for n in dropped})
    # The cotangent is omega / sqrt(M); the vjp is linear and every statistic is quadratic in
    # Z, so omega goes in unscaled and log M comes off the log statistics (no scaled copy).
    log_shift = -math.log(where.total)
    home = where.generator.device if where.generator is not None else setup.device
    if setup.head is not None:  # one omega at a time: the buffer holds one sample
        chunk = max(1, min(options.samples, split_chunk_size(setup.head, where.draw, delta)))
    else:
        chunk = options.chunk_size or chunk_size_for(
            options.samples, where.draw, setup.dtype.itemsize, delta
        )
    rows_drawn = 1 if setup.head is not None else min(chunk, options.samples)
    buffer = torch.empty((rows_drawn, where.draw), dtype=OMEGA_DTYPE, device=home)

    def gradients(w: Tensor) -> dict[str, Tensor]:
        (grads,) = setup.vjp_fn(w)
        return {n: _dense(grads[n]) for n in delta}

    # Each update is scaled by its power of two once, outside the sampled function.
    updates = {n: ScaledUpdate.of(d, log_shift) for n, d in delta.items()}
    statistics = ProductStatistics(updates, setup.views)

    def draw(count: int) -> Tensor:
        for row in buffer[:count]:
            fill_omega_(row, options.omega, where.generator)
        ws = buffer[:count, where.offset : where.offset + local]
        return ws.to(device=setup.device, dtype=setup.dtype)

    if setup.head is not None:
        log_stats = _split_samples(setup, setup.head, draw, gradients, statistics, chunk, options)
        return ProbeResult(
            log_stats, setup.readout, setup.readout_module, where.total, setup.strategy
        )

    rows = []
    for count in _chunks(options.samples, chunk):
        if reduction is None:
            rows.append(
                setup.map_samples(lambda w: statistics(gradients(w), overwrite=True), draw(count))
            )
        else:
            grads = reduction.reduce(setup.map_samples(gradients, draw(count)))
            stats = functools.partial(statistics, overwrite=True, disjoint=True)  # fresh pieces
            rows.append(vmap(stats)(grads))
    log_stats = {n: torch.cat([r[n] for r in rows]) for n in delta}
    return ProbeResult(log_stats, setup.readout, setup.readout_module, where.total, setup.strategy)


def _split_samples(
    setup: VjpSetup,
    head: SplitHead,
    draw: Callable[[int], Tensor],
    gradients: Callable[[Tensor], dict[str, Tensor]],
    statistics: ProductStatistics,
    chunk: int,
    options: ProbeOptions,
) -> dict[str, Tensor]:
    """The samples of a probe split at its readout (:mod:`fslr_func.probe.split_head`): per
    chunk, the readout's products one omega at a time, then the body's vjp of the stacked
    ``dH`` (under vmap, or plain autograd's ``is_grads_batched``) and the statistics of all
    the chunk's samples under vmap (a loop, with one warning, where the batched backward
    fails; later probes of the model then run unsplit)."""

    def with_readout(grads: dict[str, Tensor], readout: dict[str, Tensor]) -> dict[str, Tensor]:
        for n, g in readout.items():  # plus the body's part: any use of W or b before it
            grads[n] = grads[n] + g
        return grads

    def batched(d_inputs: Tensor, readout: dict[str, Tensor]) -> dict[str, Tensor]:
        if setup.splittable:
            try:
                if setup.batched_vjp_fn is not None:  # plain autograd's is_grads_batched
                    (grads,) = setup.batched_vjp_fn(d_inputs)
                    grads = {n: _dense(g) for n, g in grads.items()}
                else:
                    grads = vmap(gradients)(d_inputs)
                stats = vmap(functools.partial(statistics, overwrite=True))
                return stats(with_readout(grads, readout))
            except (RuntimeError, NotImplementedError) as err:
                setup.splittable = False  # later probes run unsplit, as they did before
                warn_once(
                    setup.model,
                    "split",
                    f"the batched backward of {type(setup.model).__name__} before its "
                    f"readout failed ({first_line(err)}); this probe loops over its samples "
                    "and later ones run unsplit (same result)",
                )
        rows = [
            statistics(
                with_readout(gradients(d), {n: g[i] for n, g in readout.items()}), overwrite=True
            )
            for i, d in enumerate(d_inputs)
        ]
        return {n: torch.stack([r[n] for r in rows]) for n in rows[0]}

    chunks = []
    for count in _chunks(options.samples, chunk):
        parts = [head.readout_gradients(draw(1)[0]) for _ in range(count)]
        d_inputs = torch.stack([d for d, _ in parts])
        readout = {n: torch.stack([g[n] for _, g in parts]) for n in parts[0][1]}
        del parts  # the stacks hold them now
        chunks.append(batched(d_inputs, readout))
    return {n: torch.cat([c[n] for c in chunks]) for n in chunks[0]}


def probe(
    model: nn.Module,
    inputs: Inputs,
    delta: Mapping[str, Tensor],
    *,
    generator: torch.Generator | None = None,
    params: Mapping[str, Tensor] | None = None,
    reduction: GradientReduction | None = None,
    **options: Unpack[ProbeKwargs],
) -> ProbeResult:
    """Per-sample log statistics of ``Z = delta * d phi / d W`` for every tensor in ``delta``.

    Args:
        model: any module; it is not mutated (buffers are cloned, parameters substituted).
        inputs: a tensor, a tuple of positional arguments or a dict of keyword arguments.
        delta: parameter name -> unit-learning-rate update (names of ``named_parameters()``).
        generator: draws omega; a seeded generator reproduces the result bit for bit (with
            ``strategy="timed"`` to float rounding: it may pick vmap or the loop from run to
            run).
        params: values to evaluate the gradient at (e.g. the weights before an optimiser
            step); defaults to the module's current parameters. Partial dicts are fine.
        reduction: makes the probe span processes (:class:`GradientReduction`; the
            data-parallel one: :func:`fslr_func.distributed.probe`); ``None``: this process.
        **options: the probe's options (:class:`~fslr_func.probe.options.ProbeOptions`):
            ``samples``, ``omega``, ``output_fn``, ``readout``, ``chunk_size``, ``strategy``,
            ``grouping``, ``forward_seed``.

    Returns:
        A :class:`ProbeResult`; its ``strategy`` is the one that ran (pass it back to skip the
        timing on the next probe of the same model).

    Examples:
        >>> model = torch.nn.Linear(3, 2)
        >>> delta = {n: torch.ones_like(p) for n, p in model.named_parameters()}
        >>> r = probe(model, torch.randn(5, 3), delta, samples=4)
        >>> r.log_stats["weight"].shape, r.readout
        (torch.Size([4, 4]), {'weight': 'weight', 'bias': 'bias'})
    """
    opts = ProbeOptions(**options)
    return run_probe(
        model, inputs, delta, opts, generator=generator, params=params, reduction=reduction
    )


def estimate(
    model: nn.Module,
    inputs: Inputs,
    delta: Mapping[str, Tensor],
    *,
    estimator: Estimator = "kron",
    generator: torch.Generator | None = None,
    params: Mapping[str, Tensor] | None = None,
    reduction: GradientReduction | None = None,
    **options: Unpack[ProbeKwargs],
) -> dict[str, Tensor]:
    r"""One-probe estimate of every tensor's function-space learning rate (no EMA).

    ``E`` is the mean over the ``samples`` omegas of one probe; the estimate of
    :math:`\|\Delta_W f\|_\mathrm{RMS}` is the square root of ``kron``
    (:math:`\prod_d E[q_d] / E[q_0]^{D-1}`), ``full`` (:math:`E[(\sum Z)^2]`) or ``iid``
    (:math:`E[\sum Z^2]`); the readout layer's tensors use the row-independent variants with
    ``kron``. ``grouping`` chooses the Kronecker factors of tensors of rank 3 or more (conv
    weights): ``"auto"`` views them as ``out x rest``; ``"dims"`` is the paper's one factor
    per dim. ``exact`` draws no omega: it is :func:`fslr_func.exact` (one forward-mode pass
    per tensor; of the options, ``output_fn`` and ``forward_seed`` apply).
    See :mod:`fslr_func.stats.estimator`, :class:`~fslr_func.probe.options.ProbeOptions`
    for the probe's options (``samples=8``, ``omega="gaussian"``, ``output_fn``, ``readout="auto"``,
    ``chunk_size``, ``strategy="auto"``, ``grouping="auto"``, ``forward_seed``) and
    :func:`probe` for the other arguments.

    Returns:
        Tensor name -> float64 scalar FSLR, keyed like ``delta``.

    Examples:
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
    check_estimator(estimator, distributed=reduction is not None)
    if estimator == "exact":
        opts = ProbeOptions(**options)
        return exact(
            model,
            inputs,
            delta,
            output_fn=opts.output_fn,
            params=params,
            forward_seed=opts.forward_seed,
        )
    result = probe(
        model, inputs, delta, generator=generator, params=params, reduction=reduction, **options
    )
    fslr = result.fslr(estimator)
    if bad := nonfinite_names(fslr):  # an Inf input, or a NaN gradient
        raise nonfinite_fslr_error(bad, check_inputs(inputs))
    return fslr
