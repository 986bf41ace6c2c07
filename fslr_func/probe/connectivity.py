"""Does the probe's output depend on the probed tensors? Silent zeros turned into errors.

A forward that cuts a parameter out of the autograd graph (``torch.no_grad`` or ``.detach()``
around it, reentrant activation checkpointing, which runs its segment under ``no_grad``)
gives that parameter a gradient of exactly zero in the probe, so its FSLR would read 0
whatever the update. :class:`CutFinder` watches the probe's forward: it notes every probed
tensor that an operation used while gradients were off (or detached), and after the forward
walks the output's graph back to the tensors it reaches. A tensor that was used but is not
reached was cut: an error names it and the fix. A tensor the forward never uses (an unused
head) is not an error: it really does not move the function. The walk and the bookkeeping are
host-side only (no synchronisation with the device).

A tensor used out of the graph that the output still reaches is partly cut, and
:meth:`CutFinder.partly_cut` names it for one warning (:func:`partly_cut_message`): a view of
part of it was detached (``torch.cat([w[:3].detach(), w[3:]])``), or the whole of it in one
use and not in another, which both the probe's vjp and ``exact``'s jvp miss (the FSLR reads
too small); or it was used under ``torch.no_grad`` as well (``w / w.norm()`` with the norm
under ``no_grad``), which the probe misses and forward mode sees. Parametrization originals
are left out of the second kind: spectral norm's power iteration runs under ``no_grad`` by
torch's own convention. Gradient hooks registered on tensors during the forward
(``Tensor.register_hook``) are counted, for a warning (:data:`HOOK_WARNING`): the probe's
backward runs them.

Examples:
    >>> import torch
    >>> w = torch.ones(3, requires_grad=True)
    >>> with CutFinder({"w": w}) as finder:
    ...     with torch.no_grad():
    ...         out = (w * 2).sum() + torch.ones(())
    >>> finder.cut(out)
    ['w']
    >>> with CutFinder({"w": w}) as finder:
    ...     out = torch.cat([w[:1].detach(), w[1:]]).sum()
    >>> finder.partly_cut(out)
    (['w'], [])
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.autograd.forward_ad as forward_ad
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

__all__ = [
    "FIX",
    "HOOK_WARNING",
    "CutFinder",
    "DisconnectedOutputError",
    "check_connected",
    "cut_behind_message",
    "cut_error",
    "disconnected_output_error",
    "partly_cut_message",
    "reaches",
]


def reaches(output: Tensor, tensor: Tensor) -> bool:
    """Whether the autograd graph of ``output`` leads back to the leaf ``tensor``."""
    return output.requires_grad and id(tensor) in _reached(output)


def _reached(output: Tensor, seen: set[Any] | None = None) -> set[int]:
    """``id``s of the leaf tensors the autograd graph of ``output`` leads back to, leaving
    out the nodes of ``seen`` (added to it), walked before."""
    reached: set[int] = set()
    seen = set() if seen is None else seen
    stack = [output.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None:
            reached.add(id(variable))
        stack.extend(fn for fn, _ in node.next_functions)
    return reached


def _detaches(func: Any) -> bool:
    """Whether ``func`` returns its tensor out of the autograd graph (``detach``,
    ``detach_``). ``.data`` and ``new_tensor`` are followed apart: reading ``w.data.dtype``
    or making ``w.new_tensor([1.0])`` uses no value of ``w``.

    Examples:
        >>> _detaches(Tensor.detach), _detaches(Tensor.add)
        (True, False)
    """
    return func is Tensor.detach or func is torch.detach or func is Tensor.detach_


def _reads_data(func: Any) -> bool:
    """Whether ``func`` is the read of a tensor's ``.data`` (the tensor out of the graph)."""
    return getattr(func, "__self__", None) is Tensor.data and func.__name__ == "__get__"


class CutFinder(TorchFunctionMode):
    """Notes the probed tensors used with gradients off; :meth:`cut` names the lost ones.

    Args:
        tensors: the probed tensors as the forward sees them (name -> tensor).
    """

    def __init__(self, tensors: Mapping[str, Tensor]) -> None:
        super().__init__()
        self._names = {id(t): n for n, t in tensors.items()}
        self._views: dict[int, str] = {}
        self._kept: list[Tensor] = []  # the views, alive while their ids are keys above
        self._cut_use: set[str] = set()
        self._cut_activation: set[str] = set()  # behind an activation taken out of the graph
        self._data: dict[int, str] = {}  # w.data of a probed w, by id (kept alive in _kept)
        self._walked: set[Any] = set()  # graph nodes walked for cut activations: each once
        self._detached: set[str] = set()
        self.gradient_hooks = 0
        """Calls of ``Tensor.register_hook`` during the forward (see :data:`HOOK_WARNING`)."""

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        # new_tensor copies its data argument out of the graph; its self gives dtype and device
        values = (args[1:], kwargs) if func is Tensor.new_tensor else (args, kwargs)
        leaves = [leaf for leaf in tree_flatten(values)[0] if isinstance(leaf, Tensor)]
        named = {
            name
            for leaf in leaves
            if (name := self._names.get(id(leaf), self._views.get(id(leaf)))) is not None
        }
        # a value of w.data used (not its dtype or shape): w taken out of the graph
        from_data = {n for leaf in leaves if (n := self._data.get(id(leaf))) is not None}
        detach = _detaches(func) or func is Tensor.new_tensor
        self.gradient_hooks += func is Tensor.register_hook
        grad_off = not torch.is_grad_enabled()
        if named and (detach or grad_off):
            self._cut_use |= named
            if detach:
                self._detached |= named
        elif detach or grad_off:
            self._note_cut_activations(args, kwargs, detach)
        result = func(*args, **kwargs)
        if from_data and isinstance(result, Tensor):
            self._cut_use |= from_data
            self._detached |= from_data
        if len(named) == 1 and isinstance(result, Tensor) and _reads_data(func):
            self._data[id(result)] = next(iter(named))
            self._kept.append(result)
            return result
        if len(named) == 1 and isinstance(result, Tensor) and result._is_view():
            # A view of a probed tensor (a slice, a transpose): its later uses are the
            # tensor's. Under forward AD a view's ``_base`` is not the dual tensor, so views
            # are followed as they are made.
            self._views[id(result)] = next(iter(named))
            self._kept.append(result)
        return result

    def _note_cut_activations(self, args: Any, kwargs: Any, detach: bool) -> None:
        """An activation of probed tensors taken out of the graph (``h.detach()``, ``h`` used
        under ``no_grad``, ``w.clone().detach_()``): the probed tensors its graph leads back
        to, or under forward AD (``exact``) the probed tensor whose tangent it carries, which
        a detach drops (``no_grad`` does not stop tangents)."""
        for leaf in tree_flatten((args, kwargs))[0]:
            if not isinstance(leaf, Tensor) or leaf.is_nested:
                continue
            if detach and forward_ad.unpack_dual(leaf).tangent is not None:  # type: ignore[no-untyped-call]
                self._cut_activation |= set(self._names.values())
            elif leaf.requires_grad and leaf.grad_fn is not None:
                # nodes walked before had their leaves noted then: the walks stay linear
                reached = _reached(leaf, self._walked)
                self._cut_activation |= {n for i, n in self._names.items() if i in reached}

    @property
    def used_without_grad(self) -> set[str]:
        """Probed tensors some operation used with gradients off, or detached."""
        return set(self._cut_use)

    @property
    def behind_cut_activations(self) -> set[str]:
        """Probed tensors behind an activation the forward took out of the graph."""
        return set(self._cut_activation)

    @property
    def detached(self) -> set[str]:
        """Probed tensors the forward detached, the whole of them or a view."""
        return set(self._detached)

    def cut(self, output: Tensor) -> list[str]:
        """Probed tensors used with gradients off that the graph of ``output`` does not reach."""
        return self._unreached(output, self._cut_use)

    def cut_behind(self, output: Tensor) -> list[str]:
        """Probed tensors the graph of ``output`` reaches only through an activation the
        forward took out of it (``h.detach()``, ``h`` used under ``no_grad``): their
        gradients, and FSLRs, read 0, as a straight-through estimator's codebook does."""
        return [n for n in self._unreached(output, self._cut_activation) if n not in self._cut_use]

    def _unreached(self, output: Tensor, names: set[str]) -> list[str]:
        if not names:
            return []
        reached = _reached(output) if output.requires_grad else set()
        return sorted(n for i, n in self._names.items() if n in names and i not in reached)

    def partly_cut(self, output: Tensor) -> tuple[list[str], list[str]]:
        """Probed tensors used out of the graph that the graph of ``output`` still reaches.

        Returns:
            Those the forward detached (the whole or a view), and those it used under
            ``torch.no_grad`` only, leaving out the originals of parametrizations (spectral
            norm's power iteration, which torch's own gradients ignore too).
        """
        if not self._cut_use or not output.requires_grad:
            return [], []
        reached = _reached(output)
        both = sorted(n for i, n in self._names.items() if n in self._cut_use and i in reached)
        no_grad = [n for n in both if n not in self._detached and ".parametrizations." not in n]
        return [n for n in both if n in self._detached], no_grad


FIX = (
    "Their FSLRs would read exactly 0. Remove torch.no_grad()/.detach() around trainable "
    "parameters and the output, and use activation checkpointing with use_reentrant=False "
    "(torch.utils.checkpoint.checkpoint(..., use_reentrant=False); Hugging Face: "
    "model.gradient_checkpointing_enable(gradient_checkpointing_kwargs="
    '{"use_reentrant": False}))'
)
"""How to keep parameters in the graph, for the errors below."""


class DisconnectedOutputError(ValueError):
    """The measured output depends on none of the measured parameters."""


def disconnected_output_error() -> DisconnectedOutputError:
    """The error for an output that depends on none of the measured parameters."""
    return DisconnectedOutputError(
        "the model output (after output_fn) does not depend on any of the measured "
        "parameters: the forward or output_fn detached it or ran under torch.no_grad. " + FIX
    )


def cut_error(names: list[str]) -> ValueError:
    """The error for parameters the forward used but cut out of the graph."""
    return ValueError(
        f"the forward cut {names} out of the autograd graph (used under torch.no_grad, "
        f".detach() or reentrant activation checkpointing). " + FIX
    )


HOOK_WARNING = (
    "the forward registers gradient hooks on its tensors (Tensor.register_hook): the FSLR "
    "probe's backward runs them, so a hook that changes the gradient (scaling, clipping, "
    "reversing it) makes the FSLRs of the tensors before it wrong by that change (a hook "
    "scaling by 0.1 read 0.1 of exact); exact (forward mode) does not run them. Register "
    "the hook as a module backward hook (register_full_backward_hook), which the probe "
    "leaves out, or ignore this if the hooks only observe"
)
"""The warning for ``Tensor.register_hook`` inside the forward."""


def cut_behind_message(names: Sequence[str]) -> str:
    """The warning for tensors the output reaches only through a detached activation."""
    return (
        f"the forward took an activation of {list(names)} out of the autograd graph "
        "(h.detach(), h used under torch.no_grad, a straight-through estimator's "
        "(z_q - z).detach()) and the output depends on them only through it: their gradients, "
        "and so the probe's FSLRs, read 0 however the function moves (exact's forward mode "
        "drops a .detach() too, but sees through torch.no_grad). Keep the activation in the "
        "graph to measure them"
    )


def partly_cut_message(detached: Sequence[str], no_grad: Sequence[str] = ()) -> str:
    """The warning for tensors the forward used both in and out of the autograd graph."""
    parts = []
    if detached:
        parts.append(
            f"the forward detached {list(detached)} (or a view of part of them, w[:k].detach()) "
            "and also used them in the autograd graph: the FSLR probe and exact read the "
            "movement of the detached use as 0, so their FSLRs are too small. To freeze part "
            "of a tensor, split it into two parameters and set requires_grad=False on one"
        )
    if no_grad:
        parts.append(
            f"the forward used {list(no_grad)} under torch.no_grad and also in the autograd graph: "
            "the FSLR probe sees only the path with gradients, while exact (forward mode) "
            "sees through torch.no_grad, so the two disagree (a weight divided by its norm "
            "taken under no_grad read 2.2x exact). Compute that use with gradients"
        )
    return "; ".join(parts) + (
        ". If the cut use does not change the output (a logged statistic, a "
        "straight-through estimator's surrogate), ignore this"
    )


def check_connected(output: Tensor, finder: CutFinder) -> None:
    """Raise if the forward cut probed tensors out of the graph of ``output``.

    Raises:
        ValueError: the output does not depend on any probed tensor (a detached
            ``output_fn``, ``torch.no_grad`` around the model), or some probed tensors were
            used with gradients off and are not in the output's graph; the message names
            them and the fix.
    """
    if not output.requires_grad:
        raise disconnected_output_error()
    cut = finder.cut(output)
    if cut:
        raise cut_error(cut)
