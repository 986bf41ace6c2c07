"""A functional view of an ``nn.Module``: its tensors as dicts and its output as one flat vector.

Shared by :mod:`fslr_func.probe.sampling` and :mod:`fslr_func.probe.exact`. The module itself is
never
mutated: parameters are substituted through :func:`torch.func.functional_call`, buffers are
cloned for every forward (so BatchNorm running statistics are untouched by a probe), frozen
parameters are passed as constants, and tied parameters appear once (``named_parameters()``
de-duplicates them; ``functional_call`` re-ties them).
"""

from __future__ import annotations

import contextlib
import difflib
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call
from torch.utils._pytree import tree_flatten, tree_map_only

from ..stats.checks import torch_seed
from .names import unwrapped

Inputs = Tensor | tuple[Any, ...] | Mapping[str, Any]
OutputFn = Callable[[Any], Tensor]


def renormed_in_forward(model: nn.Module) -> list[Tensor]:
    """The weights that ``model``'s forward changes in place: those of ``nn.Embedding`` and
    ``nn.EmbeddingBag`` with ``max_norm``, whose looked-up rows are renormalised in place.

    Probes and ``exact`` run their forwards on copies of these, so that measuring leaves the
    model's weights as they were (as it leaves its buffers).

    Examples:
        >>> len(renormed_in_forward(nn.Embedding(3, 2, max_norm=1.0)))
        1
        >>> len(renormed_in_forward(nn.Embedding(3, 2)))
        0
    """
    return [
        m.weight
        for m in model.modules()
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.max_norm is not None
    ]


@dataclass(frozen=True)
class ModuleTensors:
    """The tensors of a module, split the way the probe needs them.

    Attributes:
        trainable: ``requires_grad`` parameters by (de-duplicated) name: the primals.
        frozen: parameters with ``requires_grad=False``: constants.
        buffers: buffers (running statistics and the like): cloned for every forward.
    """

    trainable: dict[str, Tensor]
    frozen: dict[str, Tensor]
    buffers: dict[str, Tensor]

    @classmethod
    def of(cls, model: nn.Module) -> ModuleTensors:
        """Split ``model``'s parameters and buffers (detached; no copies are made, except of
        the weights the forward changes in place: see :func:`renormed_in_forward`)."""
        trainable: dict[str, Tensor] = {}
        frozen: dict[str, Tensor] = {}
        renormed = renormed_in_forward(model)
        for name, p in model.named_parameters():
            t = p.detach().clone() if any(p is w for w in renormed) else p.detach()
            (trainable if p.requires_grad else frozen)[name] = t
        buffers = {name: b for name, b in model.named_buffers()}
        return cls(trainable, frozen, buffers)

    def constants(self) -> dict[str, Tensor]:
        """Frozen parameters and fresh clones of the buffers, for one forward."""
        cloned = {k: v.clone() for k, v in self.buffers.items()}
        return {**self.frozen, **cloned}


def split_inputs(inputs: Inputs) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Positional and keyword arguments from a tensor, a tuple of args or a mapping of kwargs."""
    if isinstance(inputs, Tensor):
        return (inputs,), {}
    if isinstance(inputs, tuple):
        return inputs, {}
    if isinstance(inputs, Mapping):
        return (), dict(inputs)
    raise TypeError(
        f"inputs must be a Tensor, a tuple of positional arguments or a dict of keyword "
        f"arguments, got {type(inputs).__name__}"
    )


def as_output_tensor(out: Any, output_fn: OutputFn | None) -> Tensor:
    """Apply ``output_fn`` and check that the model output is a floating tensor."""
    if output_fn is not None:
        out = output_fn(out)
    if not isinstance(out, Tensor):
        hint = ""
        if isinstance(getattr(out, "logits", None), Tensor):  # Hugging Face ModelOutput
            hint = " (it has .logits: output_fn=lambda out: out.logits)"
        elif isinstance(out, Mapping):
            hint = f" (a mapping with keys {list(out)[:6]})"
        raise TypeError(
            f"the model output is a {type(out).__name__}{hint}, not a Tensor: pass "
            f"output_fn=... that selects the output tensor whose movement the FSLR measures"
        )
    if not out.is_floating_point():
        raise TypeError(f"the model output must be a floating tensor, got dtype {out.dtype}")
    return out


@contextlib.contextmanager
def transformable_attention() -> Iterator[None]:
    """Run scaled-dot-product attention through the MATH kernel.

    The CPU flash kernel has neither a vmap batching rule for its backward nor forward-mode AD;
    the MATH kernel has both and computes the same function.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        yield


@contextlib.contextmanager
def seeded_forward(seed: int | None) -> Iterator[None]:
    """Run a forward under its own RNG state seeded with ``seed`` (``None``: do nothing).

    The global RNG state is restored afterwards, so the caller's random stream is not
    advanced. Two forwards with the same seed draw the same random numbers (dropout masks):
    this is how :func:`fslr_func.probe.exact` and the probe measure the same function.
    """
    if seed is None:
        yield
        return
    value = torch_seed(seed, "forward_seed")
    with torch.random.fork_rng():
        torch.manual_seed(value)
        yield


def compiled_inner(model: nn.Module) -> tuple[nn.Module, str]:
    """The module a ``torch.compile`` wrapper runs, and the prefix its names carry.

    ``torch.compile(model)`` returns an ``OptimizedModule`` whose parameters are named
    ``_orig_mod.<name>``. The probe and ``exact`` keep those names (they are the ones the
    optimiser and the user see) but run the original module eagerly: torch.func transforms
    of a compiled forward would recompile under every transform, or not trace at all.
    """
    return unwrapped(model, data_parallel=False)


@contextlib.contextmanager
def unscaled_embedding_gradients(model: nn.Module) -> Iterator[None]:
    """Run ``nn.Embedding``/``nn.EmbeddingBag`` layers with ``scale_grad_by_freq=False``.

    With ``scale_grad_by_freq=True`` the backward divides each row's gradient by the count of
    its token in the batch: the probe's vjp would not be ``J^T omega`` (a batch repeating
    tokens read 0.41 of ``exact``). The forward is the same function either way; the flag
    is restored on exit. ``F.embedding(..., scale_grad_by_freq=True)`` called directly is not
    seen.

    Examples:
        >>> emb = nn.Embedding(3, 2, scale_grad_by_freq=True)
        >>> with unscaled_embedding_gradients(emb):
        ...     emb.scale_grad_by_freq
        False
        >>> emb.scale_grad_by_freq
        True
    """
    scaled = [
        m
        for m in model.modules()
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.scale_grad_by_freq
    ]
    for m in scaled:
        m.scale_grad_by_freq = False
    try:
        yield
    finally:
        for m in scaled:
            m.scale_grad_by_freq = True


@contextlib.contextmanager
def backward_hooks_off(model: nn.Module) -> Iterator[None]:
    """Run ``model``'s forward without its modules' backward hooks (and the global ones).

    A backward hook that returns a new gradient (scaling, clipping, reversing it) makes the
    probe's vjp something other than ``J^T omega``: ``register_full_backward_hook(lambda m,
    gi, go: (gi[0] * 0.1,))`` read 0.1 of ``exact`` for every tensor before the module,
    silently. Module backward hooks are attached to the graph during the forward, so a
    forward without them gives a backward without them; they are restored on exit.
    ``Tensor.register_hook`` inside the forward is not removed (see
    :mod:`fslr_func.probe.connectivity`, which warns of it).

    Examples:
        >>> layer = nn.Linear(2, 2)
        >>> _ = layer.register_full_backward_hook(lambda m, gi, go: None)
        >>> with backward_hooks_off(layer):
        ...     len(layer._backward_hooks)
        0
        >>> len(layer._backward_hooks)
        1
    """
    from torch.nn.modules import module as module_globals

    hooks = [module_globals._global_backward_hooks, module_globals._global_backward_pre_hooks]
    hooks += [d for m in model.modules() for d in (m._backward_hooks, m._backward_pre_hooks)]
    saved = [(d, dict(d)) for d in hooks if d]
    for d, _ in saved:
        d.clear()
    try:
        yield
    finally:
        for d, kept in saved:
            d.update(kept)


@contextlib.contextmanager
def shared_submodules_kept(model: nn.Module) -> Iterator[None]:
    """Put back the parameters and buffers of submodules registered under several names (a
    module assigned to two attributes; PEFT's trainable tokens on tied embeddings) after
    ``functional_call``, whose restore writes such a module's attribute once per name, the
    second time with the substituted tensor (the model was left holding plain tensors, no
    longer the optimiser's parameters).

    Examples:
        >>> lin = nn.Linear(2, 2)
        >>> net = nn.Sequential(lin, lin)
        >>> weight = lin.weight
        >>> with shared_submodules_kept(net):
        ...     out = functional_call(net, {"0.weight": torch.zeros(2, 2)}, (torch.ones(1, 2),))
        >>> lin.weight is weight
        True
    """
    seen: set[int] = set()
    shared: dict[int, nn.Module] = {}  # one walk of the module tree, at every probe forward
    for _, m in model.named_modules(remove_duplicate=False):
        if id(m) in seen:
            shared[id(m)] = m
        seen.add(id(m))
    kept = [(m, dict(m._parameters), dict(m._buffers), set(vars(m))) for m in shared.values()]
    try:
        yield
    finally:
        for m, parameters, buffers, attributes in kept:
            slots: tuple[tuple[dict[str, Any], dict[str, Any]], ...] = (
                (m._parameters, parameters),
                (m._buffers, buffers),
            )
            for slot, saved in slots:
                for name, t in saved.items():
                    if slot.get(name) is not t:
                        if name not in attributes:  # a plain attribute left in its place
                            vars(m).pop(name, None)
                        slot[name] = t


@contextlib.contextmanager
def eager_submodules() -> Iterator[None]:
    """Run compiled submodules unoptimised: ``torch.compile``-d ones eagerly
    (``torch.compiler.set_stance("force_eager")``), TorchScript ones in the plain interpreter
    (``torch.jit.optimized_execution(False)``).

    Dynamo cannot trace a compiled submodule under torch.func transforms; its original forward
    computes the same function. TorchScript's profiling executor replaces a scripted module's
    graph after its first runs by one whose backward reads ``.data``, which fails under
    ``vmap``; the interpreter runs the same ops. The dynamo stance is a no-op unless
    torch.compile has been used in the process.
    """
    set_stance = getattr(torch.compiler, "set_stance", None)
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.jit._fuser.optimized_execution(False))
        if "torch._dynamo.eval_frame" in sys.modules and set_stance is not None:
            stack.enter_context(set_stance("force_eager"))
        yield


def check_delta(
    delta: Mapping[str, Tensor],
    tensors: ModuleTensors,
    *,
    what: str = "delta",
    finite: bool = True,
    structure: bool = True,
) -> None:
    """Check names, shapes and (with ``finite``) finiteness of an update dict.

    ``structure=False`` skips everything but the finiteness check: for an update whose names,
    types and shapes passed against the same parameters before.

    Raises:
        ValueError: a model without trainable parameters; empty ``delta``; unknown or
            misspelled names (with close matches); names of frozen parameters; shape
            mismatches; zero-size tensors; NaN or Inf entries.
    """
    if structure:
        _check_delta_structure(delta, tensors, what)
    if not finite:
        return
    non_finite = [n for n, d in delta.items() if not all_finite(d)]
    if non_finite:
        fix = (
            "the weights to linearise at must be finite (check where they came from)"
            if what == "params"
            else "the update is not finite, so its function-space learning rate is undefined "
            "(check the loss and learning rates)"
        )
        raise ValueError(f"{what} has NaN or Inf entries in {non_finite}: {fix}")


def _check_delta_structure(delta: Mapping[str, Tensor], tensors: ModuleTensors, what: str) -> None:
    """The checks of :func:`check_delta` that depend on names, types and shapes only."""
    if not isinstance(delta, Mapping):
        raise TypeError(
            f"{what} must be a dict from parameter names to tensors, got {type(delta).__name__}"
        )
    if not tensors.trainable:
        raise ValueError(
            "the model has no trainable parameters (none with requires_grad=True): "
            "nothing to measure"
        )
    if len(delta) == 0:
        raise ValueError(f"{what} is empty: pass a dict from parameter names to updates")
    unknown = [n for n in delta if n not in tensors.trainable]
    if unknown:
        lines = []
        for n in unknown:
            if n in tensors.frozen:
                lines.append(f"  {n!r} is frozen (requires_grad=False): drop it from {what}")
                continue
            close = difflib.get_close_matches(n, list(tensors.trainable), n=3)
            lines.append(f"  {n!r}" + (f": did you mean {close}?" if close else ""))
        raise ValueError(
            f"{what} names tensors that are not trainable parameters of the model "
            f"(names are those of model.named_parameters()):\n" + "\n".join(lines)
        )
    not_tensor = [
        f"  {n!r}: {type(d).__name__}" for n, d in delta.items() if not isinstance(d, Tensor)
    ]
    if not_tensor:
        raise TypeError(f"{what} values must be tensors:\n" + "\n".join(not_tensor))
    masks = [n for n, d in delta.items() if d.dtype == torch.bool]
    if masks:
        raise TypeError(
            f"{what} values must be numeric updates, got bool tensors (a mask?) for {masks}: "
            "pass the update itself, (W_after - W_before) / lr, as a floating tensor"
        )
    integral = [
        f"{n!r} ({d.dtype})"
        for n, d in delta.items()
        if what == "params" and not (d.is_floating_point() or d.is_complex())
    ]
    if integral:
        raise ValueError(
            f"params are the weights to linearise at, as floating tensors; got "
            f"{', '.join(integral)}: "
            "pass the parameters' values (a float32 master copy of a bfloat16 model is cast)"
        )
    complex_ = [n for n, d in delta.items() if d.is_complex() or tensors.trainable[n].is_complex()]
    if complex_:
        raise ValueError(
            f"complex parameters are not supported (the FSLR of a complex update is not "
            f"defined by the estimators): {complex_}; pass the real parameters only"
        )
    bad_shape = [
        f"  {n!r}: {tuple(d.shape)} != {tuple(tensors.trainable[n].shape)}"
        for n, d in delta.items()
        if d.shape != tensors.trainable[n].shape
    ]
    if bad_shape:
        raise ValueError(f"{what} shapes differ from the parameters':\n" + "\n".join(bad_shape))
    empty = [n for n, d in delta.items() if d.numel() == 0]
    if empty:
        raise ValueError(
            f"{what} holds zero-size tensors {empty}: an empty tensor has no function-space "
            f"learning rate; leave it out (or freeze it with requires_grad_(False))"
        )


def stored_entries(t: Tensor) -> Tensor:
    """The entries ``t`` stores: its values for a sparse tensor (a sparse embedding's
    gradient, coalesced: duplicate indices summed), else ``t`` itself.

    Examples:
        >>> g = torch.sparse_coo_tensor([[0, 2, 2]], [1.0, 2.0, 3.0], (4,))
        >>> stored_entries(g).tolist(), stored_entries(torch.ones(2)).tolist()
        ([1.0, 5.0], [1.0, 1.0])
    """
    if t.layout == torch.strided:
        return t
    return t.coalesce().values() if t.layout == torch.sparse_coo else t.values()


def all_finite(t: Tensor) -> bool:
    """Whether every entry of ``t`` is finite, without an elementwise mask of ``t``'s size.

    A NaN or Inf entry makes the sum NaN or Inf, so a finite sum proves every entry finite;
    of a sparse tensor, its stored entries are tested;
    only when the sum is not (a non-finite entry, or finite entries whose sum overflows) is
    the elementwise test run, whose temporaries cost several times ``t`` (0.9 GB for a
    language model's 131M logits). One or two host reads.

    Examples:
        >>> all_finite(torch.tensor([1.0, 2.0])), all_finite(torch.tensor([1.0, float("nan")]))
        (True, False)
        >>> all_finite(torch.tensor([3e38, 3e38]))  # the sum overflows, the entries do not
        True
    """
    if not t.is_floating_point():
        return True
    t = stored_entries(t)
    return bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all())


def check_output(out: Tensor, *, finite: bool = True) -> None:
    """Refuse an empty model output, and (with ``finite``) one with NaN or Inf entries.

    Raises:
        ValueError: the output has no elements (an empty batch), or NaN or Inf entries.
    """
    if out.numel() == 0:
        raise ValueError(
            f"the model output is empty (shape {tuple(out.shape)}): nothing to measure; is the "
            f"batch empty?"
        )
    if finite and not all_finite(out):
        raise ValueError(
            "the model output has NaN or Inf entries on this batch (its inputs have no NaN; "
            "an Inf input that reaches the output shows here): the FSLR is undefined there; "
            "check the weights and inputs or use another batch. Logits "
            "masked with -inf (invalid actions, a vocabulary mask) need an output_fn that "
            "measures the finite entries, e.g. output_fn=lambda o: o.masked_fill(mask, 0)"
        )


def check_inputs(inputs: Inputs, *, finite: bool = True) -> list[str]:
    """Check the probe batch's tensors: not all empty, and (with ``finite``) no NaN.

    An infinite entry can be an input's own business (a causal mask of 0 and ``-inf``, as
    ``nn.Transformer.generate_square_subsequent_mask`` makes); the inputs holding one are
    returned, for :func:`nonfinite_fslr_error` to name where an FSLR comes out non-finite.
    One empty tensor beside others is valid too (a memory of length 0 at a sequence's start);
    only a batch whose every tensor is empty is an empty batch.

    Returns:
        The inputs with infinite entries, by position or keyword.

    Raises:
        ValueError: an input tensor on the meta device; a batch whose tensors all have no
            elements; a floating input with NaN entries, named by its position or keyword.
    """
    args, kwargs = split_inputs(inputs)
    named = [(f"positional input {i}", a) for i, a in enumerate(args)]
    named += [(f"input {k}=", v) for k, v in kwargs.items()]
    leaves = [
        (where, leaf)
        for where, value in named
        for leaf in tree_flatten(value)[0]
        if isinstance(leaf, Tensor)
    ]
    for where, leaf in leaves:
        if leaf.is_meta:
            raise ValueError(
                f"{where} is on the meta device (a shape without data): the probe needs "
                "a real batch on the model's device"
            )
    batched = [(where, leaf) for where, leaf in leaves if leaf.dim() > 0]
    if batched and all(leaf.numel() == 0 for _, leaf in batched):
        where, leaf = batched[0]
        raise ValueError(
            f"the probe batch is empty: {where} has shape {tuple(leaf.shape)}; pass a "
            f"batch with at least one example"
        )
    infinite = []
    for where, leaf in leaves:
        if not finite or not leaf.is_floating_point() or all_finite(leaf):
            continue
        if bool(torch.isnan(leaf).any()):
            raise ValueError(
                f"the probe batch has NaN entries in {where}: the FSLR is undefined there; "
                "clean or skip the batch"
            )
        infinite.append(where)
    return infinite


def nonfinite_names(fslr: Mapping[str, Tensor]) -> list[str]:
    """The names whose FSLRs are not finite, read with one synchronisation.

    Examples:
        >>> nonfinite_names({"w": torch.tensor(1.0), "b": torch.tensor(float("nan"))})
        ['b']
    """
    if not fslr:
        return []
    finite = torch.stack([v.isfinite().all() for v in fslr.values()]).tolist()
    return [n for n, ok in zip(fslr, finite, strict=True) if not ok]


def nonfinite_fslr_error(bad: Sequence[str], infinite: Sequence[str]) -> ValueError:
    """The error for FSLRs of ``bad`` that came out NaN or infinite from inputs and an output
    that passed their checks: an infinite input that reached a gradient (``infinite``, the
    inputs holding one, named), or a gradient that is NaN from finite values
    (``torch.where(h > 0, h.sqrt(), 0)``, whose backward is NaN where ``h < 0``)."""
    if infinite:
        return ValueError(
            f"the FSLRs of {list(bad)[:10]} are not finite: the probe batch has Inf entries in "
            f"{list(infinite)}, which reach their gradients (an additive mask of -inf is "
            "fine where it meets no parameter); clean or skip the batch"
        )
    return ValueError(
        f"the FSLRs of {list(bad)[:10]} are not finite although the inputs, the update and the "
        "output are: the backward gives those tensors NaN gradients (an operation whose "
        "derivative is NaN or infinite where the forward is finite, as torch.where(h > 0, "
        "h.sqrt(), 0) at h < 0: use h.clamp(min=0).sqrt()); exact (forward mode) may still "
        "give a finite value"
    )


def is_dtensor(t: object) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (an FSDP2 shard, for one).

    Nothing is imported: no DTensor can exist before ``torch.distributed.tensor`` is.

    Examples:
        >>> is_dtensor(torch.zeros(2))
        False
    """
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    return dtensor is not None and isinstance(t, dtensor)


def check_single_process(model: nn.Module) -> None:
    """Refuse models whose one-process probe would silently measure the wrong thing.

    A ``DistributedDataParallel`` module holds only this rank's shard of each batch, so a
    one-process probe of it measures the shard, not the batch; an FSDP2 module
    (``fully_shard``) holds DTensor shards of its parameters, under forward hooks that put
    FSDP's own unsharded parameters in place of the ones the probe substitutes (every
    gradient, and so every FSLR, would be 0). Both are probed by :mod:`fslr_func.distributed`.

    Raises:
        ValueError: ``model`` is a ``DistributedDataParallel`` module or has DTensor
            (FSDP2-sharded) parameters.
    """
    if isinstance(
        unwrapped(model, data_parallel=False)[0], torch.nn.parallel.DistributedDataParallel
    ):
        raise ValueError(
            "the model is a DistributedDataParallel module: a one-process probe would measure "
            "only this rank's shard of the batch. Use fslr_func.distributed.estimate/probe on "
            "every rank (the global batch's FSLRs), ff.with_fslr(ddp_model) in training, or "
            "pass model.module to measure this rank's shard on purpose"
        )
    if any(is_dtensor(p) for p in model.parameters()):
        raise ValueError(
            "the model's parameters are DTensors (sharded with FSDP2 fully_shard): a "
            "one-process probe cannot see the full parameters. Use "
            "fslr_func.distributed.estimate/probe on every rank, or ff.with_fslr(model) in "
            "training (every rank gets the global batch's FSLRs)"
        )


def check_not_scripted(model: nn.Module) -> None:
    """Refuse a TorchScript model: its parameters cannot be substituted.

    ``torch.func.functional_call`` cannot run a scripted or traced module at other
    parameters; a scripted *submodule* of an eager model runs (its attributes are swapped
    from the eager parent).

    Raises:
        ValueError: ``model`` is a ``torch.jit.ScriptModule`` (``torch.jit.script`` or
            ``torch.jit.trace``).
    """
    if isinstance(model, torch.jit.ScriptModule):
        raise ValueError(
            f"the model is a TorchScript module ({type(model).__name__}, from torch.jit.script "
            "or torch.jit.trace): torch.func cannot run it at other parameters. Pass the eager "
            "module you scripted; scripted submodules inside an eager model are fine"
        )


def check_module(model: object) -> None:
    """Refuse a model that is not an ``nn.Module`` (``None``, a function, a state dict).

    Examples:
        >>> check_module(None)
        Traceback (most recent call last):
        ...
        TypeError: the model must be a torch.nn.Module, got NoneType
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"the model must be a torch.nn.Module, got {type(model).__name__}")


def check_not_meta(model: nn.Module, **updates: Mapping[str, Tensor] | None) -> None:
    """Refuse meta tensors (shapes without data) in the model or the updates.

    Args:
        model: the model, whose parameters and buffers are checked.
        **updates: ``delta`` and ``params`` by the argument's name (``None``: not given).

    Raises:
        ValueError: naming the first few meta tensors and how to materialise them.
    """
    found = [n for n, t in model.state_dict(keep_vars=True).items() if t.is_meta]
    found += [
        f"{what}[{n!r}]"
        for what, tensors in updates.items()
        if isinstance(tensors, Mapping)  # a wrong kind is check_delta's error
        for n, t in tensors.items()
        if isinstance(t, Tensor) and t.is_meta
    ]
    if found:
        raise ValueError(
            f"{found[:3]}{' and others' if len(found) > 3 else ''} are on the meta device "
            "(shapes without data), where no FSLR can be computed: materialise the model "
            "first (model.to_empty(device=...) and initialise or load its weights)"
        )


def evaluation_point(
    model: nn.Module,
    delta: Mapping[str, Tensor],
    params: Mapping[str, Tensor] | None,
    *,
    finite: bool = True,
    checked: bool = False,
) -> tuple[ModuleTensors, dict[str, Tensor]]:
    """The module's tensors and the point to differentiate at, names checked.

    The point is every trainable parameter, with ``params`` (e.g. the weights before an
    optimiser step) substituted where given. ``finite=False`` skips the check for NaN and
    Inf in ``delta`` and ``params``, which reads them on the host (a synchronisation).
    ``checked=True`` skips the checks of names, shapes and the kind of module, for a model,
    ``delta`` and ``params`` that passed them before with the same parameters and shapes
    (the probe's per-model cache, :mod:`fslr_func.probe.vjp`).

    Raises:
        ValueError: a name in ``delta`` or ``params`` that is not a trainable parameter, or a
            shape that differs from the parameter's; a DDP or FSDP2 module
            (:func:`check_single_process`); a TorchScript module (:func:`check_not_scripted`);
            meta tensors (:func:`check_not_meta`).
    """
    if not checked:
        check_module(model)
        check_not_scripted(model)
        check_not_meta(model, delta=delta, params=params)
        check_single_process(model)
    tensors = ModuleTensors.of(model)
    check_delta(delta, tensors, finite=finite, structure=not checked)
    point = dict(tensors.trainable)
    if params is not None:
        check_delta(params, tensors, what="params", finite=finite, structure=not checked)
        # in the parameters' own dtypes (a float32 master copy of a bf16 model), as delta is
        point.update({n: p.detach().to(tensors.trainable[n].dtype) for n, p in params.items()})
    return tensors, point


def model_forward(
    model: nn.Module,
    tensors: Mapping[str, Tensor],
    inputs: Inputs,
    output_fn: OutputFn | None,
    *,
    forward_seed: int | None = None,
) -> Any:
    """``model`` evaluated at ``tensors`` (raw output, before ``output_fn``).

    A ``torch.compile`` wrapper runs its original module (see :func:`compiled_inner`), and
    compiled submodules run eagerly (:func:`eager_submodules`), embeddings without
    ``scale_grad_by_freq`` (:func:`unscaled_embedding_gradients`) and modules without their
    backward hooks (:func:`backward_hooks_off`); ``forward_seed`` runs the
    forward under its own seeded RNG (see :func:`seeded_forward`). The forward gets copies of
    the input tensors, as buffers are copied: a forward that changes its input in place
    (``x.div_(255)``) would otherwise change the caller's probe batch, and every later
    forward on it (``exact`` runs one per tensor, ``with_fslr`` one per measured step)
    would measure another input.
    """
    args, kwargs = tree_map_only(Tensor, torch.clone, split_inputs(inputs))
    module, prefix = compiled_inner(model)
    if prefix:
        tensors = {k.removeprefix(prefix): v for k, v in tensors.items()}
    with seeded_forward(forward_seed), _as_probed(module):
        try:
            return functional_call(module, dict(tensors), args, kwargs, strict=False)
        except (RuntimeError, TypeError, ValueError, IndexError) as err:
            if hasattr(err, "add_note"):  # Python 3.11+: the error itself is left as it is
                err.add_note(
                    f"(raised in {type(module).__name__}'s forward, run by fslr_func on a "
                    f"probe batch of {_shapes(args, kwargs)}; if that batch is not an input "
                    "the model takes, as a training batch is, fix the probe batches)"
                )
            raise


def _shapes(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str:
    """The shapes of a forward's tensor inputs, for a message.

    Examples:
        >>> _shapes((torch.zeros(4, 7),), {"mask": torch.ones(4)})
        'shapes (4, 7), mask=(4,)'
    """
    parts = [str(tuple(a.shape)) for a in args if isinstance(a, Tensor)]
    parts += [f"{k}={tuple(v.shape)}" for k, v in kwargs.items() if isinstance(v, Tensor)]
    return "shapes " + ", ".join(parts) if parts else "no tensor inputs"


@contextlib.contextmanager
def own_parametrization_cache() -> Iterator[None]:
    """Inside a user's ``torch.nn.utils.parametrize.cached()`` block, give the probe's forward
    a cache of its own: the user's holds the parametrized weights computed from the module's
    parameters, which a forward at substituted tensors would read instead of computing them
    from those tensors (every parametrization's FSLR would read 0). Outside such a block,
    nothing changes.

    Examples:
        >>> import torch.nn.utils.parametrize as P
        >>> with P.cached(), own_parametrization_cache():
        ...     P._cache == {}
        True
    """
    parametrize = torch.nn.utils.parametrize
    if not getattr(parametrize, "_cache_enabled", 0):
        yield
        return
    users = parametrize._cache
    parametrize._cache = {}
    try:
        yield
    finally:
        parametrize._cache = users


@contextlib.contextmanager
def _as_probed(module: nn.Module) -> Iterator[None]:
    """The state a probe's forward runs ``module`` in, and the backward that may recompute
    parts of it (:func:`model_forward`, :func:`substituted`): a transformable attention
    kernel, compiled submodules eager, embeddings without ``scale_grad_by_freq``, no
    backward hooks, shared submodules kept, a parametrization cache of its own."""
    with (
        transformable_attention(),
        eager_submodules(),
        unscaled_embedding_gradients(module),
        backward_hooks_off(module),
        shared_submodules_kept(module),
        own_parametrization_cache(),
    ):
        yield


@contextlib.contextmanager
def substituted(model: nn.Module, tensors: Mapping[str, Tensor]) -> Iterator[None]:
    """Keep ``tensors`` in ``model`` (as :func:`model_forward` does) for a backward pass.

    Activation checkpointing (``torch.utils.checkpoint``, Hugging Face's gradient
    checkpointing) recomputes parts of the forward inside the backward, reading the module's
    attributes again: the plain-autograd paths run their backward passes under this context
    so the recomputation sees the same tensors (and attention kernel) as the forward did.
    """
    from torch.nn.utils.stateless import _reparametrize_module

    module, prefix = compiled_inner(model)
    state = {k.removeprefix(prefix): v for k, v in tensors.items()} if prefix else dict(tensors)
    with _as_probed(module), _reparametrize_module(module, state, tie_weights=True, strict=False):
        yield
