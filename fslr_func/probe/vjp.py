"""One forward of a model under a vjp, and the vjp mapped over a batch of cotangents.

:func:`prepare_vjp` runs the model's forward once, functionally, under
:func:`torch.func.vjp` (or plain autograd where torch.func cannot trace the model), detecting
the readout layer on the way; :meth:`VjpSetup.map_samples` applies a per-sample function built
on the returned ``vjp_fn`` to every row of a batch of omegas, by :func:`torch.func.vmap` or by a
loop (``strategy="auto"`` picks one from the model and device, the same on every run;
``"timed"`` times the two on the first call and keeps the faster). The probe
(:mod:`fslr_func.probe.sampling`) is built on the two.

What the forward's structure decides (the readout layer, that no probed tensor is cut out of
the graph, names and shapes, the path the samples take) is kept per model, weakly, under a
key of everything it depends on (:mod:`fslr_func.probe.forward_cache`), so a one-shot
estimate called again with the same model and shapes does not find it again.

Examples:
    >>> import torch
    >>> from fslr_func.probe.options import ProbeOptions
    >>> model = torch.nn.Linear(3, 2)
    >>> delta = {n: torch.ones_like(p) for n, p in model.named_parameters()}
    >>> setup = prepare_vjp(model, torch.randn(5, 3), delta, ProbeOptions(strategy="loop"))
    >>> setup.num_outputs, setup.readout_module
    (10, '')
    >>> grads = setup.map_samples(lambda w: setup.vjp_fn(w)[0], torch.randn(4, 10))
    >>> grads["weight"].shape
    torch.Size([4, 2, 3])
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.func import vjp, vmap

from ..stats.estimator import ReadoutRole, grouped_shape
from .connectivity import (
    HOOK_WARNING,
    CutFinder,
    check_connected,
    cut_behind_message,
    partly_cut_message,
)
from .fallback import first_line, warn_once
from .forward_cache import KnownForward, known, probe_signature, remember
from .functional import (
    Inputs,
    as_output_tensor,
    check_inputs,
    check_output,
    evaluation_point,
    model_forward,
    substituted,
    transformable_attention,
)
from .options import ProbeOptions, Strategy
from .readout import ReadoutFinder, readout_roles, rows_independent
from .split_head import HeadCapture, LinearHead, SplitHead, linear_head

__all__ = [
    "LOOP_WORK",
    "TIMED_VMAP_ROWS",
    "SampleFn",
    "SplitWhen",
    "VjpFn",
    "VjpSetup",
    "prepare_vjp",
]

VjpFn = Callable[[Tensor], tuple[dict[str, Tensor]]]
"""The vjp of the probe's forward: a cotangent of the output to gradients by tensor name."""
SplitWhen = Callable[[int, torch.dtype, torch.device], bool]
"""Whether a probe whose output has this many elements of this dtype, on this device, is worth
splitting at its readout (:mod:`fslr_func.probe.split_head`)."""
SampleFn = Callable[[Tensor], dict[str, Tensor]]
"""One omega sample to what the sampling loop keeps of it (statistics by tensor name)."""
TIMED_VMAP_ROWS = 3
"""Samples vmapped while ``strategy="timed"`` times vmap against the loop on a first chunk."""


LOOP_WORK = 2**26
"""On a CPU, probes with more work than this (probed parameter elements times output rows,
:func:`default_strategy`) loop over the samples instead of batching them with vmap."""


def default_strategy(model: nn.Module, device: torch.device, work: int = 0) -> Strategy:
    """What ``strategy="auto"`` runs: a function of the model, the device and the shapes,
    never of timing.

    ``"vmap"`` batches the samples' backward passes into one: on a GPU it fills the device,
    and on a CPU it removes the per-sample dispatch that dominates small probes. On a CPU,
    convolutional networks, whose batched convolution backward is slower there than a loop,
    and probes of more than :data:`LOOP_WORK` of ``work`` get ``"loop"``: their backward is
    matrix products large enough that a loop pays no dispatch to speak of, while vmap's
    batched elementwise steps (layer norms, activations, softmax) over ``S`` times larger
    tensors cost more than ``S`` separate ones (measured on the benchmark models,
    ``docs/benchmarks.md``: the loop was 13% faster on the ResMLP of width 512 at batch 256,
    work ``2.8e8``, and 20% on the Transformer of d_model 256, ``1.8e9``; vmap 1.5 to 2.4x
    faster below ``2e7``). Two runs of the same set-up take the same path and agree bit for
    bit.

    Args:
        model: the module probed.
        device: the device of its output.
        work: the probed parameters' elements times the rows of the output (its elements
            over its last dim): the size of the weight-gradient products of one sample.

    Examples:
        >>> default_strategy(torch.nn.Linear(2, 2), torch.device("cpu"))
        'vmap'
        >>> default_strategy(torch.nn.Conv1d(1, 1, 3), torch.device("cpu"))
        'loop'
        >>> default_strategy(torch.nn.Linear(512, 512), torch.device("cpu"), 512 * 512 * 1024)
        'loop'
        >>> default_strategy(torch.nn.Linear(512, 512), torch.device("cuda"), 512 * 512 * 1024)
        'vmap'
    """
    if device.type != "cpu":
        return "vmap"
    convolutional = any(isinstance(m, nn.modules.conv._ConvNd) for m in model.modules())
    return "loop" if convolutional or work > LOOP_WORK else "vmap"


def _func_vjp(
    flat_output: Callable[[dict[str, Tensor]], Tensor], primals: dict[str, Tensor]
) -> tuple[Tensor, VjpFn]:
    result = vjp(flat_output, primals)
    return result[0], result[1]


def _autograd_vjp(
    flat_output: Callable[[dict[str, Tensor]], Tensor],
    primals: dict[str, Tensor],
    backward_context: Callable[[], contextlib.AbstractContextManager[None]] | None = None,
) -> tuple[Tensor, VjpFn, VjpFn]:
    """The output, its vjp by plain autograd, and the vjp of a batch of cotangents at once
    (``is_grads_batched``: the backward vmapped over dim 0 of the cotangent)."""
    leaves = {n: p.detach().requires_grad_(True) for n, p in primals.items()}
    with torch.enable_grad():
        out = flat_output(leaves)

    def grads_of(cotangent: Tensor, batched: bool) -> tuple[dict[str, Tensor]]:
        # Activation checkpointing recomputes the forward inside this backward: it must see
        # the forward's tensors and attention kernel (functional.substituted).
        with transformable_attention() if backward_context is None else backward_context():
            grads = torch.autograd.grad(
                out,
                list(leaves.values()),
                cotangent,
                retain_graph=True,
                allow_unused=True,
                is_grads_batched=batched,
            )
        lead = cotangent.shape[:1] if batched else ()
        return (
            {
                n: leaf.new_zeros(lead + leaf.shape) if g is None else g
                for (n, leaf), g in zip(leaves.items(), grads, strict=True)
            },
        )

    unbatched = functools.partial(grads_of, batched=False)
    return out.detach(), unbatched, functools.partial(grads_of, batched=True)


@dataclass
class VjpSetup:
    """One forward of the model under a vjp, and what the probe needs to use it.

    Attributes:
        model: the module probed.
        num_outputs: ``M``, the number of elements of the flat model output. The output itself
            is not kept: at language-model size it is as large as one omega sample.
        device: the output's device.
        dtype: the output's dtype.
        vjp_fn: maps a cotangent of the flat output to ``({name: gradient},)``.
        readout: readout tensor names -> ``"weight"`` or ``"bias"``.
        readout_module: the readout module's name, or ``None``.
        views: tensor name -> the shape ``Z`` is viewed as before its statistics (grouping).
        strategy: the path the samples take: ``"vmap"``, ``"loop"``, ``"autograd"`` (the
            forward fell back to plain autograd) or ``"timed"`` (undecided until the first call).
        requested: the strategy asked for (``"auto"`` and ``"timed"`` allow fallbacks).
        signature: the probe's key in :mod:`fslr_func.probe.forward_cache` (``None``: not
            cached).
        head: the readout's part of the vjp where the backward is split at it
            (:mod:`fslr_func.probe.split_head`): :attr:`vjp_fn` then maps a cotangent of the
            readout's input ``H``, not of the output.
        splittable: whether later probes may split at the readout.
        batched_vjp_fn: with :attr:`head` on the plain-autograd path, :attr:`vjp_fn` of a
            batch of cotangents at once (``is_grads_batched``), gradients stacked on dim 0.
    """

    model: nn.Module
    num_outputs: int
    device: torch.device
    dtype: torch.dtype
    vjp_fn: VjpFn
    readout: dict[str, ReadoutRole]
    readout_module: str | None
    views: dict[str, tuple[int, ...]]
    strategy: Strategy
    requested: str
    signature: Hashable | None = None
    head: SplitHead | None = None
    splittable: bool = True
    batched_vjp_fn: VjpFn | None = None

    def remember(self) -> None:
        """Keep what this forward found (readout, views, the path its samples took) for the
        next probe of its model with the same :attr:`signature`
        (:mod:`fslr_func.probe.forward_cache`)."""
        found = KnownForward(
            self.readout_module,
            self.readout,
            self.views,
            self.strategy,
            self.num_outputs,
            self.dtype,
            self.device,
            self.splittable,
        )
        remember(self.model, self.signature, found)

    def map_samples(self, fn: SampleFn, omegas: Tensor) -> dict[str, Tensor]:
        """``fn`` applied to every row of ``omegas``, results stacked along a new dim 0.

        ``"vmap"`` batches the rows through :func:`torch.func.vmap`; ``"loop"`` and
        ``"autograd"`` call ``fn`` row by row. ``"timed"`` times the two on the first call
        (row 0 by loop, the next :data:`TIMED_VMAP_ROWS` rows by vmap, so no row is computed
        twice), keeps the faster per row and runs the remaining rows with it; a vmap that
        fails falls back to the loop with one warning. The choice made is left in
        :attr:`strategy` for later calls and probes.
        """
        if self.strategy == "timed":
            if len(omegas) < 2:
                return self._loop(fn, omegas)
            start = time.perf_counter()
            parts = [self._loop(fn, omegas[:1])]
            per_row_loop = time.perf_counter() - start
            timed = omegas[1 : 1 + TIMED_VMAP_ROWS]
            start = time.perf_counter()
            parts.append(self._vmap(fn, timed))
            if self.strategy == "timed":  # vmap worked: keep the faster path
                per_row_vmap = (time.perf_counter() - start) / len(timed)
                self.strategy = "vmap" if per_row_vmap < per_row_loop else "loop"
            rest = omegas[1 + len(timed) :]
            if len(rest):
                parts.append(self.map_samples(fn, rest))
            return {n: torch.cat([p[n] for p in parts]) for n in parts[0]}
        if self.strategy == "vmap" and len(omegas) > 1:  # a batch of one gains nothing
            return self._vmap(fn, omegas)
        return self._loop(fn, omegas)

    def _loop(self, fn: SampleFn, omegas: Tensor) -> dict[str, Tensor]:
        rows = [fn(w) for w in omegas]
        return {n: torch.stack([r[n] for r in rows]) for n in rows[0]}

    def _vmap(self, fn: SampleFn, omegas: Tensor) -> dict[str, Tensor]:
        try:
            result: dict[str, Tensor] = vmap(fn)(omegas)
        except (RuntimeError, NotImplementedError) as err:
            if self.requested == "vmap" or isinstance(err, torch.distributed.DistError):
                raise
            # the loop first: where it fails too (a forward wrapped in autocast), the
            # caller's fallback to plain autograd gives the one warning
            looped = self._loop(fn, omegas)
            warn_once(
                self.model,
                "loop",
                f"vmap over the probe's vjp failed for {type(self.model).__name__} "
                f"({first_line(err)}); falling back to a loop over samples (same result, may "
                f"be slower)",
            )
            self.strategy = "loop"
            return looped
        return result


def _output_at(
    model: nn.Module, inputs: Inputs, options: ProbeOptions, state: Mapping[str, Tensor]
) -> Tensor:
    """The model output (after ``output_fn``) at ``state``, with the same random draws at
    every call: the forward's own seed, or a fixed one under a fork of the RNG state."""
    seed = 0 if options.forward_seed is None else options.forward_seed
    raw = model_forward(model, state, inputs, options.output_fn, forward_seed=seed)
    return as_output_tensor(raw, options.output_fn)


def prepare_vjp(
    model: nn.Module,
    inputs: Inputs,
    delta: Mapping[str, Tensor],
    options: ProbeOptions,
    *,
    params: Mapping[str, Tensor] | None = None,
    strict: bool = True,
    split: SplitWhen | None = None,
) -> VjpSetup:
    """Check the arguments and run the model's forward once under a vjp.

    Only the tensors in ``delta`` are differentiated; the other parameters, frozen parameters
    and cloned buffers are constants. The forward runs under :func:`torch.func.vjp`, or under
    plain autograd when ``options.strategy="autograd"`` or when torch.func cannot trace the
    model and the strategy is ``"auto"`` or ``"timed"`` (one warning); ``"auto"`` then
    resolves to :func:`default_strategy`. The readout layer is detected during
    this forward, and a forward that cuts probed tensors out of the graph is refused
    (:mod:`fslr_func.probe.connectivity`). Arguments are those of
    :func:`fslr_func.probe.sampling.run_probe`.

    When an earlier probe of the same model with the same signature succeeded
    (:mod:`fslr_func.probe.forward_cache`), what it found is reused: names, shapes and
    connectivity are not checked again, the readout is not searched for, and ``"auto"`` and
    ``"timed"`` take the path that ran then (plain autograd at once where torch.func
    failed). The checks of the values (NaN or Inf in ``delta`` and the output, NaN in the
    inputs, with ``strict``) run on every call. Such a probe on the vmap or plain-autograd path, for
    which ``split`` says yes of the output's size, dtype and device, splits its backward at a
    linear readout (:mod:`fslr_func.probe.split_head`).

    Raises:
        ValueError: bad names or shapes (:func:`~fslr_func.probe.functional.evaluation_point`); a
            batch whose every input tensor is empty, or a zero-size output; probed tensors cut
            out of the graph; with ``strict``, NaN or Inf in ``delta`` or the output, NaN in
            the inputs.
    """
    signature = probe_signature(model, inputs, delta, params, options)
    cached = known(model, signature)
    tensors, point = evaluation_point(
        model, delta, params, finite=strict, checked=cached is not None
    )
    check_inputs(inputs, finite=strict)
    primals = {n: point[n] for n in delta}
    fixed = {n: t for n, t in point.items() if n not in delta}
    readout, strategy = options.readout, options.strategy

    head = _split_head(model, cached, split)
    if head is not None:
        assert cached is not None

        def state_of(p: dict[str, Tensor]) -> dict[str, Tensor]:
            return {**fixed, **tensors.constants(), **p}

        split_setup = _split_forward(
            model, head, cached, signature, state_of, primals, inputs, options, strict, strategy
        )
        if split_setup is not None:
            return split_setup
        cached = known(model, signature)  # now says: never split

    finder = ReadoutFinder(model) if readout == "auto" and cached is None else None
    found: list[str | None] = []
    out_shape: list[torch.Size] = []
    last_state: list[dict[str, Tensor]] = []

    def flat_output(p: dict[str, Tensor]) -> Tensor:
        state = {**fixed, **tensors.constants(), **p}
        last_state[:] = [state]
        if cached is not None:  # the same forward passed the checks below before
            raw = model_forward(
                model, state, inputs, options.output_fn, forward_seed=options.forward_seed
            )
            return as_output_tensor(raw, options.output_fn).reshape(-1)
        cuts = CutFinder(p)
        with finder if finder is not None else contextlib.nullcontext(), cuts:
            raw = model_forward(
                model, state, inputs, options.output_fn, forward_seed=options.forward_seed
            )
            out = as_output_tensor(raw, options.output_fn)
        check_connected(out, cuts)
        detached, no_grad = cuts.partly_cut(out)
        if detached or no_grad:
            warn_once(model, "partly-cut", partly_cut_message(detached, no_grad))
        behind = cuts.cut_behind(out)
        if behind:
            warn_once(model, "cut-behind", cut_behind_message(behind))
        if cuts.gradient_hooks:
            warn_once(model, "tensor-hook", HOOK_WARNING)
        if finder is not None:
            found.append(finder.find(out))
        out_shape.append(out.shape)
        return out.reshape(-1)

    use: Strategy = strategy if cached is None else cached.strategy

    def backward_context() -> contextlib.AbstractContextManager[None]:
        return substituted(model, last_state[0])

    if use in ("autograd", "loop"):
        # A loop maps nothing over the samples: plain autograd runs the same backward, bit
        # for bit, without torch.func's wrapping of every call (3-5% of a probe on the
        # benchmark models, docs/benchmarks.md).
        out, vjp_fn, _ = _autograd_vjp(flat_output, primals, backward_context)
    else:
        try:
            out, vjp_fn = _func_vjp(flat_output, primals)
        except (RuntimeError, NotImplementedError) as err:
            if strategy not in ("auto", "timed"):
                raise
            found.clear()
            out_shape.clear()
            out, vjp_fn, _ = _autograd_vjp(flat_output, primals, backward_context)
            warn_once(
                model,
                "autograd",
                f"torch.func could not trace {type(model).__name__} ({first_line(err)}); the "
                f"FSLR probe falls back to plain autograd, one backward per sample (same "
                f"result, slower)",
            )
            use = "autograd"

    check_output(out, finite=strict)
    if cached is not None:
        module_name, roles, views = cached.readout_module, cached.readout, cached.views
    else:
        module_name = found[0] if found else (readout if readout != "auto" else None)
        last_dim = out_shape[-1][-1] if len(out_shape[-1]) else 1
        point = {**fixed, **primals}
        roles = readout_roles(model, module_name, primals, last_dim, named=readout != "auto")
        if roles and not rows_independent(
            lambda moved: _output_at(
                model, inputs, options, {**point, **tensors.constants(), **moved}
            ),  # fresh buffers for every forward: one may update them in place
            point,
            roles,
        ):
            roles = {}
        views = {
            n: tuple(d.shape) if n in roles else grouped_shape(n, d.shape, options.grouping)
            for n, d in delta.items()
        }
    if use == "auto":
        rows = out.numel() // max(1, out_shape[-1][-1] if len(out_shape[-1]) else 1)
        use = default_strategy(model, out.device, rows * sum(d.numel() for d in delta.values()))
    return VjpSetup(
        model,
        out.numel(),
        out.device,
        out.dtype,
        vjp_fn,
        roles,
        module_name,
        views,
        use,
        strategy,
        signature,
        splittable=cached is None or cached.splittable,
    )


class _NotTheHead(Exception):
    """The forward's output was not the output of the readout's one call."""


def _split_head(
    model: nn.Module, cached: KnownForward | None, split: SplitWhen | None
) -> LinearHead | None:
    """The readout to split the backward at, where an earlier probe with the same signature
    took the vmap path or plain autograd's fallback and ``split`` says yes of its output;
    else ``None``."""
    if split is None or cached is None or not cached.splittable:
        return None
    if cached.strategy not in ("vmap", "autograd") or cached.output_device is None:
        return None
    if not split(cached.num_outputs, cached.output_dtype, cached.output_device):
        return None
    return linear_head(model, cached.readout_module)


def _split_forward(
    model: nn.Module,
    head: LinearHead,
    cached: KnownForward,
    signature: Hashable | None,
    state_of: Callable[[dict[str, Tensor]], dict[str, Tensor]],
    primals: dict[str, Tensor],
    inputs: Inputs,
    options: ProbeOptions,
    strict: bool,
    requested: str,
) -> VjpSetup | None:
    """The forward of a probe split at its readout (:mod:`fslr_func.probe.split_head`): the
    model's forward under a vjp whose output is the readout's input ``H``, by
    :func:`torch.func.vjp` or, where the earlier probe fell back to it, plain autograd (with
    its batched vjp). ``None``, and the model never split again for ``signature``, where
    this forward's output is not the readout's own."""
    capture = HeadCapture(model.get_submodule(head.module))
    outputs: list[Tensor] = []
    last_state: list[dict[str, Tensor]] = []

    def readout_input(p: dict[str, Tensor]) -> Tensor:
        state = state_of(p)
        last_state[:] = [state]
        with capture:
            raw = model_forward(
                model, state, inputs, options.output_fn, forward_seed=options.forward_seed
            )
        out = as_output_tensor(raw, options.output_fn)
        if not capture.output_is_head(out):
            raise _NotTheHead
        inputs_h = capture.input
        capture.calls.clear()  # the output is kept below; hold no other reference to it
        outputs[:] = [out.reshape(-1)]
        return inputs_h

    def with_output(p: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        return readout_input(p), outputs.pop()

    batched_vjp: VjpFn | None = None
    try:
        if cached.strategy == "autograd":
            inputs_h, body_vjp, batched_vjp = _autograd_vjp(
                readout_input, primals, lambda: substituted(model, last_state[0])
            )
            out = outputs.pop().detach()
        else:
            inputs_h, body_vjp, out = vjp(with_output, primals, has_aux=True)  # type: ignore[misc]
    except _NotTheHead:
        remember(model, signature, dataclasses.replace(cached, splittable=False))
        return None
    check_output(out, finite=strict)
    values = {**state_of({}), **primals}
    probed = {n for n in (head.weight, head.bias) if n is not None and n in primals}
    return VjpSetup(
        model,
        out.numel(),
        out.device,
        out.dtype,
        body_vjp,
        cached.readout,
        cached.readout_module,
        cached.views,
        cached.strategy,
        requested,
        signature,
        SplitHead(head, inputs_h, values[head.weight].detach(), probed, out.dtype),
        batched_vjp_fn=batched_vjp,
    )
