r"""``with_fslr``: wrap any module so its optimiser steps report function-space learning rates.

Around an optimiser step the wrapper snapshots the weights, lets the step run, forms the
unit-learning-rate update of every tensor, ``dW = (W_after - W_before) / lr_W`` (the rate of the
param group holding ``W``), probes at the *pre-update* weights (functionally: the module is not
touched) and folds the probe's statistics into bias-corrected EMAs. Using the unit-rate update
keeps the EMA consistent when rates change (schedules, FLeRM), as in the paper.

Example:
    >>> import torch, fslr_func as ff
    >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
    <torch._C.Generator object at ...>
    >>> fm = ff.with_fslr(torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(),
    ...                                       torch.nn.Linear(16, 3)), samples=4)
    >>> opt = torch.optim.Adam(fm.parameters(), lr=1e-3)
    >>> x, y = torch.randn(32, 4), torch.randint(0, 3, (32,))
    >>> torch.nn.functional.cross_entropy(fm(x), y).backward()
    >>> with fm.measure(opt, torch.randn(32, 4)):
    ...     opt.step()
    >>> sorted(fm.fslr())
    ['0.bias', '0.weight', '2.bias', '2.weight']
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from .estimator import (
    EMA,
    Estimator,
    Grouping,
    ReadoutRole,
    check_estimator,
    fslr_from_log,
    log_sq_norm,
    mean_log_stats,
)
from .functional import Inputs, check_single_process, readout_module
from .options import ProbeOptions, Strategy
from .probe import GradientReduction, run_probe

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from .options import ProbeKwargs

__all__ = ["FSLRModule", "Measurement", "param_lrs"]

_STATE_VERSION = 1


@dataclass
class Measurement:
    """One measured optimiser step, filled in when the ``measure`` block exits.

    Attributes:
        before: the trainable tensors before the step (name -> clone).
        lrs: the learning rate of each tensor's param group at the step.
        delta: the unit-learning-rate updates, ``(after - before) / lr``.
        fslr: the wrapper's FSLR estimates after folding this step's probes in.
        moved: the tensors the step changed; only these are probed and folded into the EMAs
            (a tensor without a gradient, or a step skipped by a ``GradScaler``, keeps its
            estimate); empty: nothing moved and nothing was probed.
    """

    before: dict[str, Tensor]
    lrs: dict[str, float]
    delta: dict[str, Tensor] = field(default_factory=dict)
    fslr: dict[str, Tensor] = field(default_factory=dict)
    moved: tuple[str, ...] = ()


def param_lrs(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, float]:
    """Learning rate in force for each trainable named parameter the optimiser updates.

    Works for any param-group layout; parameters the optimiser does not hold are left out.
    """
    names = {id(p): n for n, p in model.named_parameters() if p.requires_grad}
    lrs = {}
    for group in optimizer.param_groups:
        lr = group["lr"]
        lr = float(lr.item() if isinstance(lr, Tensor) else lr)
        for p in group["params"]:
            name = names.get(id(p))
            if name is not None:
                lrs[name] = lr
    return lrs


class FSLRModule(nn.Module):
    """A module that behaves exactly like the wrapped one and measures its FSLRs.

    Build it with :func:`fslr_func.with_fslr`. ``fm(x)`` is ``model(x)``; the wrapped module is
    ``fm.module`` and its parameters are ``fm``'s, under the names of ``model``.

    Args:
        model: any module with trainable parameters.
        estimator: ``"kron"``, ``"full"`` or ``"iid"``.
        beta: EMA decay across probes (bias-corrected).
        seed: seeds the omega generator; ``None`` draws it from torch's global RNG.
        reduction: how a probe spans several processes
            (:class:`~fslr_func.probe.GradientReduction`); ``None``: this process only.
        **options: the probe's options (:class:`~fslr_func.options.ProbeOptions`).

    Attributes:
        options: the validated probe options.
        resolved_strategy: the path the first probe took (``"auto"`` resolved, ``"timed"``
            timed, or a fallback), reused by later probes and saved in the state.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        estimator: Estimator = "kron",
        beta: float = 0.9,
        seed: int | None = None,
        reduction: GradientReduction | None = None,
        **options: Unpack[ProbeKwargs],
    ) -> None:
        super().__init__()
        check_estimator(estimator)
        self.options = ProbeOptions(**options)
        self.ema = EMA(beta)
        check_single_process(model)
        if self.options.readout not in (None, "auto"):
            readout_module(model, self.options.readout)
        if not any(p.requires_grad for p in model.parameters()):
            raise ValueError(
                f"{type(model).__name__} has no trainable parameters: nothing to measure"
            )
        self.module = model
        self.estimator: Estimator = estimator
        self.reduction = reduction
        self.resolved_strategy: Strategy = self.options.strategy
        self.readout_roles: dict[str, ReadoutRole] = {}
        self._measuring = False
        if seed is None:
            seed = int(torch.randint(0, 2**62, ()).item())
        self.generator = torch.Generator().manual_seed(seed)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped model's forward, unchanged."""
        return self.module(*args, **kwargs)

    @property
    def beta(self) -> float:
        """EMA decay."""
        return self.ema.beta

    @property
    def samples(self) -> int:
        """Omega samples per probe batch."""
        return self.options.samples

    @property
    def grouping(self) -> Grouping:
        """Kronecker factors of tensors of rank 3 or more."""
        return self.options.grouping

    def observe(
        self,
        inputs: Inputs | list[Inputs],
        delta: Mapping[str, Tensor],
        *,
        params: Mapping[str, Tensor] | None = None,
    ) -> dict[str, Tensor]:
        """Probe ``delta`` on ``inputs`` and fold the result into the EMAs.

        Args:
            inputs: one probe batch, or a list of batches probed in turn (EMA warm-up).
            delta: name -> unit-learning-rate update.
            params: the weights to probe at (e.g. before the step); default: current ones.

        Returns:
            The current FSLR estimates (name -> float64 scalar).
        """
        batches = inputs if isinstance(inputs, list) else [inputs]
        for batch in batches:
            result = run_probe(
                self.module,
                batch,
                delta,
                self.options.replace(strategy=self.resolved_strategy),
                generator=self.generator,
                params=params,
                reduction=self.reduction,
            )
            self.resolved_strategy = result.strategy
            self.readout_roles.update(result.readout)
            self.ema.update({n: mean_log_stats(s) for n, s in result.log_stats.items()})
        return self.fslr()

    @contextlib.contextmanager
    def measure(
        self,
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
        inputs: Inputs | list[Inputs],
    ) -> Iterator[Measurement]:
        """Measure the optimiser step taken inside the ``with`` block.

        A tensor the step left unchanged (no gradient, a step skipped by a ``GradScaler``) is
        not probed and its EMA is untouched; a tensor that moved but does not move the
        function (LoRA ``A`` while ``B = 0``) is probed and reads 0.

        Args:
            optimizer: any ``torch.optim`` optimiser over (some of) the module's parameters,
                or several (Muon on the matrices, AdamW on the rest) stepped in the block.
            inputs: the probe batch (separate from the training batch), or a list of them.

        Yields:
            A :class:`Measurement`, filled in when the block exits.

        Raises:
            ValueError: the optimiser updates none of the module's parameters.
            RuntimeError: a ``measure`` block inside another one (one step, measured once).
        """
        if self._measuring:
            raise RuntimeError(
                "fm.measure blocks cannot be nested: the outer block already measures this "
                "optimiser step (with Recorder or FLeRM, do not also call fm.measure)"
            )
        optimizers = [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else optimizer
        held = {n: lr for o in optimizers for n, lr in param_lrs(self.module, o).items()}
        if not held:
            raise ValueError(
                "the optimiser updates none of the module's trainable parameters: build it "
                "from fm.parameters()"
            )
        lrs = {n: lr for n, lr in held.items() if lr != 0.0}
        if not lrs:
            raise ValueError(
                "every learning rate is 0 at this step (a warm-up from 0?): there is no update "
                "to measure; measure a step with a non-zero rate (Recorder and FLeRM wait for "
                "one by themselves)"
            )
        current = dict(self.module.named_parameters())
        before = {n: current[n].detach().clone() for n in lrs}
        m = Measurement(before, lrs)
        self._measuring = True
        try:
            yield m
        finally:
            self._measuring = False
        m.delta = {n: (current[n].detach() - before[n]) / lrs[n] for n in lrs}
        m.moved = tuple(n for n in lrs if not torch.equal(current[n].detach(), before[n]))
        moved = {n: m.delta[n] for n in m.moved}
        m.fslr = self.observe(inputs, moved, params=before) if moved else self.fslr()

    def log_sq(self) -> dict[str, Tensor]:
        """Log of the current estimates of ``||Delta_W f||^2_RMS`` (float64, ``-inf``: zero)."""
        return {
            n: log_sq_norm(v, self.estimator, self.readout_roles.get(n))
            for n, v in self.ema.value().items()
        }

    def fslr(self) -> dict[str, Tensor]:
        """Current FSLR per tensor (float64 scalars); empty before the first measurement."""
        return {n: fslr_from_log(v) for n, v in self.log_sq().items()}

    def reset(self) -> None:
        """Forget the EMAs (e.g. after a change of model or task)."""
        self.ema = EMA(self.ema.beta)

    def get_extra_state(self) -> dict[str, Any]:
        """EMA, readout roles and omega generator, saved with ``state_dict``."""
        return {
            "version": _STATE_VERSION,
            "ema": self.ema.state_dict(),
            "readout_roles": dict(self.readout_roles),
            "generator": self.generator.get_state(),
            "resolved_strategy": self.resolved_strategy,
        }

    def set_extra_state(self, state: Any) -> None:
        """Restore what :meth:`get_extra_state` saved."""
        if not isinstance(state, dict) or state.get("version") != _STATE_VERSION:
            raise ValueError("this FSLRModule state was saved by an incompatible fslr_func version")
        self.ema.load_state_dict(state["ema"])
        self.readout_roles = dict(state["readout_roles"])
        self.generator.set_state(state["generator"])
        self.resolved_strategy = state.get("resolved_strategy", self.options.strategy)
