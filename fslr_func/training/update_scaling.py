r"""Per-tensor learning rates for any optimiser, by scaling each tensor's update after the step.

FLeRM gives every tensor :math:`W` its own learning rate :math:`\eta_W`, while the optimiser
holds the user's param groups, each with one rate :math:`\eta_g` (whatever scheduler, scaler,
sharding or checkpointing acts on it). For every optimiser whose update is proportional to its
learning rate, with state that does not depend on it (SGD with momentum, Adam, AdamW, Adamax,
NAdam, RAdam, Adagrad, Adadelta, RMSprop, Muon, sign-SGD, transformers' ``Adafactor`` at a
fixed rate; for-loop, ``foreach`` and ``fused`` kernels alike), one step at :math:`\eta_g`
moves :math:`W` by :math:`\eta_g\,u_W` and one step at :math:`\eta_W` by :math:`\eta_W\,u_W`,
with the same direction :math:`u_W` and the same new optimiser state. So the step at
:math:`\eta_W` is the step the optimiser took, with its displacement scaled by
:math:`c_W = \eta_W / \eta_g`:

.. math::

    W \leftarrow W_\text{before} + c_W \, (W_\text{after} - W_\text{before}).

The optimiser is stepped once, by the user's loop, with the gradients exactly as it would have
seen them (``GradScaler``, fused unscaling, clipping, accumulation) and its own param groups,
which stay ordinary: schedulers of every kind, ``state_dict``/``load_state_dict`` at any
moment, group state (a step counter), extra group keys and ``ZeroRedundancyOptimizer`` are
untouched. With parameters in bfloat16 or float16 the scaled step is exact up to the
parameter's rounding of the optimiser's own step.

Optimisers for which this is not the step at :math:`\eta_W` are refused by
:func:`check_scalable` with the reason and what to use instead.

Example:
    >>> import torch
    >>> w = torch.nn.Parameter(torch.ones(3))
    >>> opt = torch.optim.SGD([w], lr=0.1)
    >>> before = snapshot([w])
    >>> w.grad = torch.ones(3)
    >>> opt.step()                       # moves w by -0.1
    >>> scale_updates([w], before, [3.0])  # as if stepped at lr 0.3
    >>> w.detach()
    tensor([0.7000, 0.7000, 0.7000])
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ..probe.functional import is_dtensor

__all__ = ["check_scalable", "group_lr", "scale_updates", "snapshot"]

# Optimisers whose step is not proportional to their learning rate, by (module prefix, class).
_NOT_PROPORTIONAL: dict[tuple[str, str], str] = {
    ("torch.optim", "LBFGS"): "it needs a closure and re-evaluates the model inside its step",
    ("torch.optim", "Rprop"): "its step sizes start at lr and are clipped to [min, max]",
    ("torch.optim", "ASGD"): "its step size lr / (1 + lambd * lr * t)^alpha and its average "
    "depend on lr",
    ("torch.optim", "Adafactor"): "its step size is min(lr, 1/sqrt(t)), not proportional to lr",
}
# Packages whose optimisers keep state that couples every tensor of a group to its rate.
_GROUP_COUPLED: dict[str, str] = {
    "prodigyopt": "it estimates one step size for all the tensors of a param group from their "
    "displacements",
    "dadaptation": "it estimates one step size for all the tensors of a param group from their "
    "displacements",
    "schedulefree": "it keeps the weights as an average of its own iterates, so a tensor's "
    "displacement is not its rate times a direction",
}
_INSTEAD = (
    "use an optimiser whose step is proportional to its learning rate (SGD, Adam, AdamW, "
    "Adafactor(relative_step=False, lr=...), Muon...)"
)


def check_scalable(optimizer: torch.optim.Optimizer) -> None:
    """Refuse an optimiser whose step at one rate, scaled, is not its step at another.

    Args:
        optimizer: the (unwrapped) optimiser FLeRM would drive.

    Raises:
        ValueError: the optimiser is not proportional to its learning rate, or couples the
            tensors of a group through a shared step-size estimate, or has no learning rate
            (transformers' ``Adafactor(lr=None)``); the message says why and what to use.

    Example:
        >>> w = torch.nn.Parameter(torch.ones(1))
        >>> check_scalable(torch.optim.AdamW([w]))
        >>> check_scalable(torch.optim.Rprop([w]))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: FLeRM cannot drive Rprop: its step sizes start at lr ...
    """
    cls = type(optimizer)
    name, module = cls.__name__, cls.__module__
    why = next(
        (w for (pkg, c), w in _NOT_PROPORTIONAL.items() if c == name and module.startswith(pkg)),
        None,
    )
    why = why or next((w for pkg, w in _GROUP_COUPLED.items() if module.startswith(pkg)), None)
    if why is not None:
        raise ValueError(
            f"FLeRM cannot drive {name}: {why}, so FLeRM's per-tensor rates (each tensor's "
            f"update scaled by its rate over its group's) would not be the steps {name} takes "
            f"at those rates; {_INSTEAD}"
        )
    for i, group in enumerate(optimizer.param_groups):
        if group.get("relative_step") or group.get("lr") is None:
            raise ValueError(
                f"FLeRM cannot drive {name} with param group {i}'s lr={group.get('lr')!r}"
                f"{' and relative_step=True' if group.get('relative_step') else ''}: its step "
                "size is set inside the optimiser, so a tensor's update has no learning rate to "
                "divide by; give it a learning rate (transformers' Adafactor(lr=1e-3, "
                "relative_step=False, scale_parameter=False, warmup_init=False))"
            )


def group_lr(group: dict[str, Any]) -> float:
    """A param group's learning rate as a Python float (a tensor rate is read once).

    Example:
        >>> group_lr({"lr": torch.tensor(0.5)})
        0.5
    """
    lr = group["lr"]
    return float(lr.item() if isinstance(lr, Tensor) else lr)


def snapshot(params: Sequence[Tensor], into: Sequence[Tensor] | None = None) -> list[Tensor]:
    """Copies of ``params`` before a step (what :func:`scale_updates` scales from).

    Args:
        params: the tensors about to be stepped.
        into: buffers of the same shapes, dtypes and devices to copy into, in one
            multi-tensor pass, without allocating (reused step after step); default: clones.
    """
    if into is None:
        return [p.detach().clone() for p in params]
    buffers = list(into)
    if buffers:
        with torch.no_grad():
            torch._foreach_copy_(_local(buffers), _local(params))
    return buffers


def scale_updates(
    params: Sequence[Tensor], before: Sequence[Tensor], factors: Sequence[float]
) -> None:
    r"""Scale each tensor's displacement since ``before`` in place, :math:`W \leftarrow
    W_\text{before} + c\,(W - W_\text{before})`, as one multi-tensor ``lerp`` (one read of
    each tensor and its copy, one write).

    Args:
        params: the tensors the optimiser just stepped.
        before: their values before the step (:func:`snapshot`).
        factors: :math:`c_W`, one per tensor.
    """
    if not params:
        return
    with torch.no_grad():
        # lerp(W, W_before, 1 - c) = W_before + c (W - W_before)
        torch._foreach_lerp_(_local(params), _local(before), [1.0 - c for c in factors])


def _local(tensors: Sequence[Tensor]) -> list[Tensor]:
    """The tensors' data, an FSDP2 shard's local tensor for a DTensor (every operation here is
    elementwise, so each rank scales its own shard)."""
    return [t.detach().to_local() if is_dtensor(t) else t.detach() for t in tensors]  # type: ignore[attr-defined]
