r"""Per-tensor learning rates for any optimiser, by scaling each tensor's update after the step.

FLeRM gives every tensor :math:`W` its own learning rate :math:`\eta_W`, while the optimiser
holds the user's param groups, each with one rate :math:`\eta_g` (whatever scheduler, scaler,
sharding or checkpointing acts on it). For every optimiser whose update is proportional to its
learning rate, with state that does not depend on it (SGD with momentum, Adam, AdamW, Adamax,
NAdam, RAdam, Adagrad, Adadelta, RMSprop, Muon, sign-SGD, transformers' ``Adafactor`` at a
fixed rate and ``beta1=None``; for-loop, ``foreach`` and ``fused`` kernels alike), one step at
:math:`\eta_g` moves :math:`W` by :math:`\eta_g\,u_W` and one step at :math:`\eta_W` by
:math:`\eta_W\,u_W`, with the same direction :math:`u_W` and the same new optimiser state. So
the step at :math:`\eta_W` is the step the optimiser took, with its displacement scaled by
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
:func:`check_scalable` with the reason and what to use instead. :class:`UpdateScaler` is
FLeRM's whole contact with an optimiser: the groups' rates, the snapshot before a step and the
scaling after it.

Since the optimiser's groups keep their own rates, the factors applied are published per
optimiser (:mod:`fslr_func.training.rates`), where whatever else needs a tensor's rate reads
them.

Examples:
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

import sys
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from .rates import Scaling, group_lr, initial_lr, scaling_registry

__all__ = [
    "Snapshots",
    "UpdateScaler",
    "check_scalable",
    "scale_updates",
    "snapshot",
    "update_rule",
]

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


def _not_scalable(cls: type) -> str | None:
    """Why FLeRM cannot drive optimisers of class ``cls`` itself (not its bases), or None."""
    name, module = cls.__name__, cls.__module__
    why = next(
        (w for (pkg, c), w in _NOT_PROPORTIONAL.items() if c == name and module.startswith(pkg)),
        None,
    )
    return why or next((w for pkg, w in _GROUP_COUPLED.items() if module.startswith(pkg)), None)


def update_rule(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimiser whose rule makes the updates: ``ZeroRedundancyOptimizer``'s local one
    (``.optim``, of its ``optimizer_class``), else ``optimizer`` itself.

    Examples:
        >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
        >>> update_rule(opt) is opt
        True
    """
    local = getattr(optimizer, "optim", None)
    return (
        local if isinstance(local, torch.optim.Optimizer) and local is not optimizer else optimizer
    )


def check_scalable(optimizer: torch.optim.Optimizer) -> None:
    """Refuse an optimiser whose step at one rate, scaled, is not its step at another.

    Args:
        optimizer: the (unwrapped) optimiser FLeRM would drive.

    Raises:
        ValueError: the optimiser is not proportional to its learning rate, or couples the
            tensors of a group through a shared step-size estimate, or has no learning rate
            (transformers' ``Adafactor(lr=None)``); the message says why and what to use.

    Examples:
        >>> w = torch.nn.Parameter(torch.ones(1))
        >>> check_scalable(torch.optim.AdamW([w]))
        >>> check_scalable(torch.optim.Rprop([w]))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: FLeRM cannot drive Rprop: its step sizes start at lr ...
    """
    if getattr(optimizer, "_overlap_with_ddp", False):
        raise ValueError(
            "FLeRM cannot drive ZeroRedundancyOptimizer(overlap_with_ddp=True): its step runs "
            "inside DDP's communication hook, not in optimizer.step(), so there is no step to "
            "scale; build it with overlap_with_ddp=False"
        )
    if update_rule(optimizer) is not optimizer:  # ZeroRedundancyOptimizer(optimizer_class=...)
        check_scalable(update_rule(optimizer))
    name = type(optimizer).__name__
    why = next(filter(None, map(_not_scalable, type(optimizer).__mro__)), None)  # subclasses too
    if why is not None:
        raise ValueError(
            f"FLeRM cannot drive {name}: {why}, so FLeRM's per-tensor rates (each tensor's "
            f"update scaled by its rate over its group's) would not be the steps {name} takes "
            f"at those rates; {_INSTEAD}"
        )
    adafactor = any(c.__name__ == "Adafactor" for c in type(optimizer).__mro__)
    for i, group in enumerate(optimizer.param_groups):
        if adafactor and group.get("beta1"):  # None or 0: no first moment
            # transformers' Adafactor averages the update after multiplying it by the rate
            raise ValueError(
                f"FLeRM cannot drive {name} with param group {i}'s beta1={group['beta1']!r}: "
                "its first moment averages updates already multiplied by the learning rate, "
                "so its state depends on the rate and a scaled step is not the step at "
                "another rate; use beta1=None, or AdamW for momentum"
            )
        if group.get("relative_step") or group.get("lr") is None:
            raise ValueError(
                f"FLeRM cannot drive {name} with param group {i}'s lr={group.get('lr')!r}"
                f"{' and relative_step=True' if group.get('relative_step') else ''}: its step "
                "size is set inside the optimiser, so a tensor's update has no learning rate to "
                "divide by; give it a learning rate (transformers' Adafactor(lr=1e-3, "
                "relative_step=False, scale_parameter=False, warmup_init=False))"
            )


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
    """The tensors, an FSDP2 shard's local tensor for a DTensor (every operation here is
    elementwise, so each rank scales its own shard), for in-place use under ``no_grad``.

    On every step of every driven tensor, so kept cheap: no ``detach`` (not needed under
    ``no_grad``) and the DTensor class looked up once per call (0.33 ms a call on 500 small
    tensors before, 0.04 ms after)."""
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    if dtensor is None:
        return list(tensors)
    return [t.to_local() if isinstance(t, dtensor) else t for t in tensors]


class Snapshots:
    """Copies of tensors before a step, and their updates, in buffers kept from step to step:
    no allocation per step (a fresh megabyte-sized tensor is an ``mmap`` and page faults on
    every step: on the benchmark ResMLP a measured step's updates in kept buffers took its
    overhead over a one-shot probe from about 15 to 1-3 ms).

    Examples:
        >>> w = torch.ones(3)
        >>> snaps = Snapshots()
        >>> first = snaps.take({"w": w})["w"]
        >>> w += 1
        >>> second = snaps.take({"w": w})["w"]
        >>> second is first, second.tolist()  # the same buffer, refilled
        (True, [2.0, 2.0, 2.0])
        >>> updates = Snapshots()
        >>> updates.differences({"w": w + 1}, {"w": w}, {"w": 0.5})["w"].tolist()
        [2.0, 2.0, 2.0]
    """

    def __init__(self) -> None:
        self._buffers: dict[str, Tensor] = {}

    def _kept(self, names: Sequence[str], tensors: Mapping[str, Tensor]) -> list[Tensor]:
        """The buffers of ``names``, each like its tensor (made again where its shape,
        dtype or device changed)."""
        for n in names:
            p, kept = tensors[n], self._buffers.get(n)
            if kept is None or (kept.shape, kept.dtype, kept.device) != (
                p.shape,
                p.dtype,
                p.device,
            ):
                self._buffers[n] = torch.empty_like(p.detach())
        return [self._buffers[n] for n in names]

    def take(self, tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """Copies of ``tensors`` (valid until the next :meth:`take` of the same names)."""
        names = list(tensors)
        copies = snapshot([tensors[n].detach() for n in names], into=self._kept(names, tensors))
        return dict(zip(names, copies, strict=True))

    def differences(
        self,
        after: Mapping[str, Tensor],
        before: Mapping[str, Tensor],
        rates: Mapping[str, float],
    ) -> dict[str, Tensor]:
        """``(after - before) / rate`` for each name of ``rates`` (valid until the next
        call), one pass per tensor."""
        names = list(rates)
        out = self._kept(names, after)
        with torch.no_grad():
            for n, into in zip(names, _local(out), strict=True):
                (a, b) = _local([after[n], before[n]])
                torch.sub(a, b, out=into).div_(rates[n])
        return dict(zip(names, out, strict=True))


class UpdateScaler:
    """FLeRM's contact with one optimiser: the groups' rates before a step, the snapshot of
    the tensors whose rate differs from their group's, and the scaling after the step.

    Args:
        optimizer: the (unwrapped) optimiser; refused by :func:`check_scalable` if its step
            is not proportional to its rate.

    Raises:
        ValueError: see :func:`check_scalable`.

    Examples:
        >>> w = torch.nn.Parameter(torch.ones(2))
        >>> opt = torch.optim.SGD([w], lr=0.1)
        >>> scaler = UpdateScaler(opt)
        >>> rates = {"w": (0.1, 0.3)}              # group rate 0.1, FLeRM's rate 0.3
        >>> scaler.begin({"w": w}, rates)
        >>> before = scaler.snapshot({"w": w}, rates)
        >>> w.grad = torch.ones(2)
        >>> opt.step()
        >>> scaler.end({"w": w}, rates, before)
        >>> w.detach()
        tensor([0.7000, 0.7000])
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        check_scalable(optimizer)
        self.optimizer = optimizer
        self.scaling = scaling_registry().setdefault(optimizer, Scaling())
        self._snapshots = Snapshots()

    def __setstate__(self, state: dict[str, Any]) -> None:
        """A copy's optimiser is another key of the registry: the copy registers its own
        :class:`Scaling` there, so that measurements of the copy see its factors."""
        vars(self).update(state)
        scaling_registry()[self.optimizer] = self.scaling

    def held(self, scheduled: bool) -> set[int]:
        """``id`` of every parameter the optimiser holds (param groups added since included).

        Args:
            scheduled: the run's own scheduler drives the schedule: every group gets an
                ``initial_lr`` (its current rate where none is set: ``ReduceLROnPlateau``).
        """
        if scheduled:
            for g in self.optimizer.param_groups:
                initial_lr(g)
        return {id(p) for g in self.optimizer.param_groups for p in g["params"]}

    def schedules(self, name_of: Mapping[int, str]) -> dict[str, tuple[float, float]]:
        """Per named parameter the optimiser holds: its group's rate and that rate's ratio to
        the group's ``initial_lr`` (0 where the initial rate is 0 or absent)."""
        out: dict[str, tuple[float, float]] = {}
        for g in self.optimizer.param_groups:
            lr = group_lr(g)
            initial = group_lr({"lr": g["initial_lr"]}) if "initial_lr" in g else 0.0
            for p in g["params"]:
                if id(p) in name_of:
                    out[name_of[id(p)]] = (lr, lr / initial if initial else 0.0)
        return out

    def begin(self, params: Mapping[str, Tensor], rates: Mapping[str, tuple[float, float]]) -> None:
        """Before the step: open it and publish its factors (final unless a set point changes
        them before :meth:`end`).

        Args:
            params: name -> parameter.
            rates: name -> (group rate, FLeRM's rate) at this step.
        """
        self.scaling.waiting.clear()  # what waited on a step that raised
        self.scaling.open = True
        self._publish(params, rates)

    def snapshot(
        self, params: Mapping[str, Tensor], rates: Mapping[str, tuple[float, float]]
    ) -> dict[str, Tensor]:
        """Copies of the tensors whose rate differs from their group's, in buffers kept from
        step to step (no allocation per step)."""
        return self._snapshots.take({n: params[n] for n, (lr, rate) in rates.items() if rate != lr})

    def end(
        self,
        params: Mapping[str, Tensor],
        rates: Mapping[str, tuple[float, float]],
        before: Mapping[str, Tensor],
    ) -> None:
        """After the step: scale each update to FLeRM's rate, publish the final factors and
        close the step.

        Args:
            params: name -> parameter.
            rates: name -> (group rate, FLeRM's rate), final for this step (after a set point).
            before: the tensors before the step (:meth:`snapshot`, or a measured step's copies).
        """
        names = [n for n in before if n in rates and rates[n][1] != rates[n][0]]
        scale_updates(
            [params[n] for n in names],
            [before[n] for n in names],
            [rates[n][1] / rates[n][0] for n in names],
        )
        self._publish(params, rates)
        self.scaling.applied += 1
        self.scaling.close()

    def _publish(
        self, params: Mapping[str, Tensor], rates: Mapping[str, tuple[float, float]]
    ) -> None:
        self.scaling.factors = {
            id(params[n]): rate / lr for n, (lr, rate) in rates.items() if lr and rate != lr
        }
