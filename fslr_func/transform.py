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
from typing import Any

import torch
from torch import Tensor, nn

from .estimator import (
    EMA,
    Grouping,
    check_estimator,
    check_grouping,
    fslr_from_log,
    log_sq_norm,
    mean_log_stats,
)
from .functional import Inputs, OutputFn
from .probe import OMEGAS, STRATEGIES, ProbeResult, probe

_STATE_VERSION = 1


@dataclass
class Measurement:
    """One measured optimiser step, filled in when the ``measure`` block exits.

    Attributes:
        before: the trainable tensors before the step (name -> clone).
        lrs: the learning rate of each tensor's param group at the step.
        delta: the unit-learning-rate updates, ``(after - before) / lr``.
        fslr: the wrapper's FSLR estimates after folding this step's probes in.
    """

    before: dict[str, Tensor]
    lrs: dict[str, float]
    delta: dict[str, Tensor] = field(default_factory=dict)
    fslr: dict[str, Tensor] = field(default_factory=dict)


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

    Build it with :func:`with_fslr`. ``fm(x)`` is ``model(x)``; the wrapped module is
    ``fm.module`` and its parameters are ``fm``'s, under the names of ``model``.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        samples: int = 8,
        estimator: str = "kron",
        omega: str = "gaussian",
        beta: float = 0.9,
        readout: str | None = "auto",
        output_fn: OutputFn | None = None,
        chunk_size: int | None = None,
        strategy: str = "auto",
        seed: int | None = None,
        grouping: Grouping = "auto",
    ) -> None:
        super().__init__()
        check_estimator(estimator)
        check_grouping(grouping)
        if omega not in OMEGAS:
            raise ValueError(f"unknown omega {omega!r}; choose one of {', '.join(OMEGAS)}")
        if strategy not in STRATEGIES:
            raise ValueError(f"unknown strategy {strategy!r}; choose one of {STRATEGIES}")
        if not isinstance(samples, int) or samples < 1:
            raise ValueError(f"samples must be a positive integer, got {samples!r}")
        if not any(p.requires_grad for p in model.parameters()):
            raise ValueError(
                f"{type(model).__name__} has no trainable parameters: nothing to measure"
            )
        self.module = model
        self.samples = samples
        self.estimator = estimator
        self.omega = omega
        self.readout = readout
        self.output_fn = output_fn
        self.chunk_size = chunk_size
        self.strategy = strategy
        # What "auto" resolved to on the first probe (timing, fallbacks): reused afterwards.
        self.resolved_strategy = strategy
        self.grouping = grouping
        self.ema = EMA(beta)
        self.readout_roles: dict[str, str] = {}
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

    def observe(
        self,
        inputs: Inputs | Sequence[Inputs],
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
        batches: list[Inputs] = list(inputs) if isinstance(inputs, list) else [inputs]  # type: ignore[list-item]
        for batch in batches:
            result = self._probe(batch, delta, params)
            self.resolved_strategy = result.strategy
            self.readout_roles.update(result.readout)
            self.ema.update({n: mean_log_stats(s) for n, s in result.log_stats.items()})
        return self.fslr()

    def _probe(
        self, inputs: Inputs, delta: Mapping[str, Tensor], params: Mapping[str, Tensor] | None
    ) -> ProbeResult:
        """One probe of ``delta`` on ``inputs`` (the data-parallel subclass all-reduces it)."""
        return probe(self.module, inputs, delta, params=params, **self._probe_options())

    def _probe_options(self) -> dict[str, Any]:
        """The probe's keyword arguments, shared with the data-parallel subclass."""
        return {
            "samples": self.samples,
            "omega": self.omega,
            "generator": self.generator,
            "output_fn": self.output_fn,
            "readout": self.readout,
            "chunk_size": self.chunk_size,
            "strategy": self.resolved_strategy,
            "grouping": self.grouping,
        }

    @contextlib.contextmanager
    def measure(
        self, optimizer: torch.optim.Optimizer, inputs: Inputs | Sequence[Inputs]
    ) -> Iterator[Measurement]:
        """Measure the optimiser step taken inside the ``with`` block.

        Args:
            optimizer: any ``torch.optim`` optimiser over (some of) the module's parameters.
            inputs: the probe batch (separate from the training batch), or a list of them.

        Yields:
            A :class:`Measurement`, filled in when the block exits.
        """
        lrs = {n: lr for n, lr in param_lrs(self.module, optimizer).items() if lr != 0.0}
        if not lrs:
            raise ValueError(
                "the optimiser updates none of the module's trainable parameters with a "
                "non-zero learning rate: build it from fm.parameters()"
            )
        current = dict(self.module.named_parameters())
        before = {n: current[n].detach().clone() for n in lrs}
        m = Measurement(before, lrs)
        yield m
        m.delta = {n: (current[n].detach() - before[n]) / lrs[n] for n in lrs}
        m.fslr = self.observe(inputs, m.delta, params=before)

    def log_sq(self) -> dict[str, Tensor]:
        """Log of the current estimates of ``||Delta_W f||^2_RMS`` (float64, ``-inf``: zero)."""
        return {
            n: log_sq_norm(v, self.estimator, self.readout_roles.get(n))  # type: ignore[arg-type]
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
        self.resolved_strategy = state.get("resolved_strategy", self.strategy)


def with_fslr(
    model: nn.Module,
    *,
    samples: int = 8,
    estimator: str = "kron",
    omega: str = "gaussian",
    beta: float = 0.9,
    readout: str | None = "auto",
    output_fn: OutputFn | None = None,
    chunk_size: int | None = None,
    strategy: str = "auto",
    seed: int | None = None,
    distributed: bool | None = None,
    group: Any = None,
    grouping: Grouping = "auto",
) -> FSLRModule:
    """Wrap ``model`` so that its optimiser steps can report function-space learning rates.

    Args:
        model: any ``nn.Module``.
        samples: omega samples per probe batch.
        estimator: ``"kron"`` (default), ``"full"`` or ``"iid"``.
        omega: ``"gaussian"`` or ``"rademacher"``.
        beta: EMA decay across probes (bias-corrected).
        readout: ``"auto"``, a module name, or ``None`` to switch the readout variants off.
        output_fn: maps the model output to the tensor measured (``lambda o: o.logits``).
        chunk_size: samples per vmap call (bounds the probe's peak memory).
        strategy: ``"auto"``, ``"vmap"``, ``"loop"`` or ``"autograd"``.
        seed: seeds the omega generator; ``None`` draws it from torch's global RNG (rank 0's
            when distributed).
        distributed: all-reduce the probe over the ranks of ``group`` so every rank gets the
            estimates of the global batch (:mod:`fslr_func.distributed`); ``None``: exactly
            when ``model`` is a ``DistributedDataParallel`` module, which is always unwrapped.
        group: the process group of a distributed probe; ``None``: the default group.
        grouping: Kronecker factors of tensors of rank 3 or more: ``"auto"`` (conv weights as
            ``out x rest``), ``"dims"`` (the paper's one per dim), ``"matrix"`` or a callable
            ``(name, shape) -> view shape`` (:func:`fslr_func.estimator.grouped_shape`).

    Returns:
        An :class:`FSLRModule`; ``fm(x) == model(x)``.
    """
    from .distributed import DistributedFSLRModule, is_data_parallel

    if distributed or is_data_parallel(model):
        return DistributedFSLRModule(
            model,
            distributed=distributed,
            group=group,
            samples=samples,
            estimator=estimator,
            omega=omega,
            beta=beta,
            readout=readout,
            output_fn=output_fn,
            chunk_size=chunk_size,
            strategy=strategy,
            seed=seed,
            grouping=grouping,
        )
    return FSLRModule(
        model,
        samples=samples,
        estimator=estimator,
        omega=omega,
        beta=beta,
        readout=readout,
        output_fn=output_fn,
        chunk_size=chunk_size,
        strategy=strategy,
        seed=seed,
        grouping=grouping,
    )
