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
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
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
    mean_valid_log_stats,
)
from .functional import Inputs, check_single_process, is_dtensor, readout_module
from .names import WRAPPER_PREFIXES, short_list, unwrapped
from .options import ProbeOptions, Strategy
from .probe import GradientReduction, run_probe

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from .options import ProbeKwargs

__all__ = ["FSLRModule", "Measurement", "Reading", "param_lrs"]

_STATE_VERSION = 3  # 3: tensor names are the bare model's (fslr_func.names)
_EXTRA = "_extra_state"
_METADATA_KEY = "fslr_state"  # the wrapper's state, in the state dict's metadata


def _renamed(state: Mapping[str, Any], rename: Callable[[str], str]) -> dict[str, Any]:
    """The EMA's or readout roles' state with every per-tensor dict's names renamed."""
    return {
        k: {rename(n): x for n, x in v.items()} if isinstance(v, dict) else v
        for k, v in state.items()
    }


def _save_bare(fm: FSLRModule, state: dict[str, Any], prefix: str, local: dict[str, Any]) -> None:
    """State-dict post-hook: the model's keys without the wrapper prefixes, the wrapper's own
    state in the metadata (where torch keeps module versions), so the bare model loads it."""
    metadata = getattr(state, "_metadata", None)
    if metadata is None:  # a destination without metadata: the wrapper's form, state as a key
        return
    inner = prefix + fm.wrapper_prefix
    for key in [k for k in state if k.startswith(inner)]:
        state[prefix + key[len(inner) :]] = state.pop(key)
    local[_METADATA_KEY] = state.pop(prefix + _EXTRA)
    for key in [k for k in metadata if k.startswith(prefix + WRAPPER_PREFIXES[1][:-1])]:
        if key.startswith(inner):
            metadata[prefix + key[len(inner) :]] = metadata.pop(key)
        elif inner.startswith(key + "."):  # a wrapper's entry; the bare model's has its version
            entry = metadata.pop(key)
            if key == inner[:-1]:
                local.update(entry)


def _load_bare(
    fm: FSLRModule, state: dict[str, Any], prefix: str, local: Mapping[str, Any], *_: Any
) -> None:
    """Load-state-dict pre-hook: bare keys back under the wrapper prefixes. A state dict with
    the state as a key is in the wrapper's form already (saved before names were bare)."""
    if prefix + _EXTRA in state:
        return
    state[prefix + _EXTRA] = local.get(_METADATA_KEY)  # None: a bare model's, kept as it is
    inner = prefix + fm.wrapper_prefix
    for key in [k for k in state if k.startswith(prefix) and k != prefix + _EXTRA]:
        state[inner + key[len(prefix) :]] = state.pop(key)


@dataclass
class Measurement:
    """One measured optimiser step, filled in when the ``measure`` block exits.

    Attributes:
        before: the trainable tensors before the step (name -> clone).
        lrs: the learning rate of each tensor's param group at the step.
        delta: the unit-learning-rate updates, ``(after - before) / lr``.
        log_sq: the wrapper's log ``||Delta_W f||^2_RMS`` estimates after folding this
            step's probes in, on the device (NaN: nothing valid measured yet).
        folded: per tensor, how many of this step's probes were folded into its EMA (the
            others were left out as not finite, or the tensor did not move), on the device.
        changed: per tensor, whether the step changed it (a 0-d bool on the device). A tensor
            the step left unchanged (no gradient, a step skipped by a ``GradScaler``) keeps
            its EMA; read as :attr:`moved`.
    """

    before: dict[str, Tensor]
    lrs: dict[str, float]
    delta: dict[str, Tensor] = field(default_factory=dict)
    log_sq: dict[str, Tensor] = field(default_factory=dict)
    folded: dict[str, Tensor] = field(default_factory=dict)
    changed: dict[str, Tensor] = field(default_factory=dict)
    reader: Callable[[Measurement], Reading] | None = None
    _reading: Reading | None = None

    def read(self) -> Reading:
        """This step's estimates on the host: one synchronisation, made once and kept."""
        if self._reading is None:
            if self.reader is None:
                return Reading({}, {}, (), ())
            self._reading = self.reader(self)
        return self._reading

    @property
    def fslr(self) -> dict[str, Tensor]:
        """The FSLR estimates after this step (float64 scalars), read as
        :meth:`FSLRModule.fslr` reads them; tensors without a valid measurement are left out."""
        return self.read().fslr

    @property
    def moved(self) -> tuple[str, ...]:
        """The tensors the step changed (the others kept their estimates); empty: nothing
        moved, as in a step skipped by a ``GradScaler``."""
        return self.read().moved

    @property
    def left_out(self) -> tuple[str, ...]:
        """Tensors that moved but none of whose probes at this step could be folded in (their
        statistics were not finite)."""
        return self.read().left_out


@dataclass(frozen=True)
class Reading:
    """Estimates read on the host.

    Attributes:
        fslr: tensor name -> FSLR (float64 scalar), for the tensors with a valid measurement.
        values: the same as Python floats (read in the same synchronisation).
        moved: the tensors the step read changed (every tensor, outside a step).
        left_out: tensors that moved but none of whose probes could be folded in.
    """

    fslr: dict[str, Tensor]
    values: dict[str, float]
    moved: tuple[str, ...]
    left_out: tuple[str, ...]


def _changed(delta: Tensor) -> Tensor:
    """Whether an update is non-zero anywhere: a 0-d bool on the device. An FSDP2 shard's
    answer is reduced over the ranks (a DTensor's ``full_tensor``), so every rank agrees."""
    flag = delta.any()  # a NaN counts as a change, as with != 0; no bool temporary
    return flag.full_tensor() if is_dtensor(flag) else flag  # type: ignore[attr-defined]


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

    ``fm.state_dict()`` has the bare model's keys (without ``module.``, nor the ``_orig_mod.``
    of a ``torch.compile``-d model): ``model.load_state_dict(fm.state_dict())`` and
    ``fm.load_state_dict(model.state_dict())`` both work. The wrapper's own state (EMAs, omega
    generators) rides in the state dict's metadata, as torch's module versions do:
    ``torch.save``/``torch.load`` keep it, a copied plain ``dict`` does not, and a state dict
    without it (a bare model's) leaves the wrapper's state as it is.

    Args:
        model: any module with trainable parameters.
        estimator: ``"kron"``, ``"full"`` or ``"iid"``.
        beta: EMA decay across probes (bias-corrected).
        seed: seeds the omega generators (one per device, each drawing omega where the
            model's output lives); ``None`` draws it from torch's global RNG.
        reduction: how a probe spans several processes
            (:class:`~fslr_func.probe.GradientReduction`); ``None``: this process only.
        **options: the probe's options (:class:`~fslr_func.options.ProbeOptions`).

    A measured step never synchronises with the host: omega is drawn on the device, the EMAs
    stay there, and a probe whose statistics are not finite (a NaN in the probe batch, an
    output that overflowed, a diverged update) is left out of the EMA on the device. Reading
    the estimates (:meth:`fslr`) is the one synchronisation; it warns about what was left out.

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
        if reduction is None:  # a probe with a reduction spans processes (distributed.py)
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
        self._strict_load = True
        self.probes = 0
        self._reported: dict[str, int] = {}
        if seed is None:
            seed = int(torch.randint(0, 2**62, ()).item())
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise TypeError(f"seed must be an int or None, got {seed!r}")
        self.seed = seed
        self.generators: dict[str, torch.Generator] = {}
        self.register_state_dict_post_hook(_save_bare)  # type: ignore[no-untyped-call]
        self.register_load_state_dict_pre_hook(_load_bare)  # type: ignore[no-untyped-call]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped model's forward, unchanged."""
        return self.module(*args, **kwargs)

    @property
    def wrapper_prefix(self) -> str:
        """What the wrapper's ``state_dict`` removes from its keys: ``module.`` (``fm.module``)
        and the prefixes of wrappers inside it (``_orig_mod.`` of ``torch.compile``)."""
        return WRAPPER_PREFIXES[1] + self.name_prefix

    @property
    def name_prefix(self) -> str:
        """The prefix wrappers inside :attr:`module` add to the bare model's tensor names
        (``_orig_mod.`` of ``torch.compile``; ``""`` for a bare model). Records hold names
        without it (:mod:`fslr_func.names`)."""
        return unwrapped(self.module)[1]

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

    def generator_for(self, device: torch.device) -> torch.Generator:
        """The omega generator of ``device``, seeded with :attr:`seed` on first use."""
        key = str(device)
        if key not in self.generators:
            self.generators[key] = torch.Generator(device=device).manual_seed(self.seed)
        return self.generators[key]

    def fold(
        self,
        inputs: Inputs | list[Inputs],
        delta: Mapping[str, Tensor],
        *,
        params: Mapping[str, Tensor] | None = None,
        step: int | None = None,
        strict: bool = False,
        changed: Mapping[str, Tensor] | None = None,
    ) -> None:
        """Probe ``delta`` on ``inputs`` and fold the result into the EMAs, on the device.

        Nothing here synchronises with the host: statistics that are not finite are left out
        of the EMA (per omega sample, and per tensor when every sample is), and reported by
        the next :meth:`fslr`.

        Args:
            inputs: one probe batch, or a list of batches probed in turn (EMA warm-up).
            delta: name -> unit-learning-rate update.
            params: the weights to probe at (e.g. before the step); default: current ones.
            step: the label the warnings give a dropped probe (default: the number of probe
                batches folded in before it, :attr:`probes`).
            strict: refuse NaN or Inf in ``delta``, the inputs and the output with an error
                instead (this reads them on the host).
            changed: name -> 0-d bool on the device; a tensor marked ``False`` (the step did
                not change it) keeps its EMA. Default: every tensor is folded in.
        """
        batches = inputs if isinstance(inputs, list) else [inputs]
        generator = self.generator_for(next(self.module.parameters()).device)
        for batch in batches:
            result = run_probe(
                self.module,
                batch,
                delta,
                self.options.replace(strategy=self.resolved_strategy),
                generator=generator,
                params=params,
                reduction=self.reduction,
                strict=strict,
            )
            self.resolved_strategy = result.strategy
            self.readout_roles.update(result.readout)
            means = {n: mean_valid_log_stats(s) for n, s in result.log_stats.items()}
            self.ema.update(means, step=self.probes if step is None else step, include=changed)
            self.probes += 1

    def observe(
        self,
        inputs: Inputs | list[Inputs],
        delta: Mapping[str, Tensor],
        *,
        params: Mapping[str, Tensor] | None = None,
    ) -> dict[str, Tensor]:
        """Probe ``delta`` on ``inputs``, fold the result into the EMAs and read them.

        :meth:`fold` (refusing NaN or Inf in ``delta``, the inputs and the output) followed by
        :meth:`fslr`.

        Returns:
            The current FSLR estimates (name -> float64 scalar).
        """
        self.fold(inputs, delta, params=params, strict=True)
        return self.fslr()

    @contextlib.contextmanager
    def measure(
        self,
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
        inputs: Inputs | list[Inputs],
        *,
        step: int | None = None,
    ) -> Iterator[Measurement]:
        """Measure the optimiser step taken inside the ``with`` block.

        A tensor the step left unchanged (no gradient, a step skipped by a ``GradScaler``) is
        not probed and its EMA is untouched; a tensor that moved but does not move the
        function (LoRA ``A`` while ``B = 0``) is probed and reads 0.

        Args:
            optimizer: any ``torch.optim`` optimiser over (some of) the module's parameters,
                or several (Muon on the matrices, AdamW on the rest) stepped in the block.
            inputs: the probe batch (separate from the training batch), or a list of them.
            step: the label warnings give this step's probes if they are left out (see
                :meth:`fold`).

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
        current = dict(self.module.named_parameters())
        # A zero-size tensor moves nothing: it has no FSLR and is not probed.
        lrs = {n: lr for n, lr in held.items() if lr != 0.0 and current[n].numel() > 0}
        if not lrs:
            raise ValueError(
                "every learning rate is 0 at this step (a warm-up from 0?): there is no update "
                "to measure; measure a step with a non-zero rate (Recorder and FLeRM wait for "
                "one by themselves)"
            )
        before = {n: current[n].detach().clone() for n in lrs}
        m = Measurement(before, lrs)
        self._measuring = True
        try:
            yield m
        finally:
            self._measuring = False
        m.delta = {n: torch.sub(current[n].detach(), before[n]).div_(lrs[n]) for n in lrs}
        # Which tensors moved is decided on the device (reading it would synchronise every
        # step): an unchanged tensor's probe is computed but not folded in.
        m.changed = {n: _changed(m.delta[n]) for n in lrs}
        counts = dict(self.ema.counts)
        self.fold(inputs, m.delta, params=before, step=step, changed=m.changed)
        m.log_sq, m.reader = self.log_sq(), self._read_measurement
        m.folded = {n: c - counts[n] if n in counts else c for n, c in self.ema.counts.items()}

    def log_sq(self) -> dict[str, Tensor]:
        """Log of the current estimates of ``||Delta_W f||^2_RMS`` (float64, ``-inf``: zero)."""
        return {
            n: log_sq_norm(v, self.estimator, self.readout_roles.get(n))
            for n, v in self.ema.value().items()
        }

    def fslr(self) -> dict[str, Tensor]:
        """Current FSLR per tensor (float64 scalars); empty before the first measurement.

        The one host synchronisation of the wrapper: tensors with no valid measurement yet
        (every probe of them dropped) are left out, and probes dropped since the last read are
        reported in one warning naming the step and the tensors.
        """
        return self._read(self.log_sq(), {}, {}).fslr

    def _read_measurement(self, m: Measurement) -> Reading:
        return self._read(m.log_sq, m.folded, m.changed)

    def _read(
        self,
        log_sq: Mapping[str, Tensor],
        folded: Mapping[str, Tensor],
        changed: Mapping[str, Tensor],
    ) -> Reading:
        """``log_sq`` as FSLRs, after one synchronisation that finds and reports the drops."""
        names = list(log_sq)
        if not names:
            return Reading({}, {}, tuple(changed), ())
        rows = [
            torch.stack(
                [
                    torch.isnan(log_sq[n]),
                    self.ema.dropped[n],
                    self.ema.last_dropped[n],
                    folded[n] if n in folded else self.ema.counts[n],
                    fslr_from_log(log_sq[n]),
                    changed[n] if n in changed else torch.ones_like(self.ema.dropped[n]),
                ]
            ).to(torch.float64)
            for n in names
        ]
        flags = torch.stack([r.to(rows[0].device) for r in rows]).tolist()
        by_step: dict[int, list[str]] = {}
        for n, (_, dropped, last, *_) in zip(names, flags, strict=True):
            if dropped > self._reported.get(n, 0):
                by_step.setdefault(int(last), []).append(n)
            self._reported[n] = int(dropped)
        if by_step:
            listed = "; ".join(f"step {k}: {short_list(v)}" for k, v in sorted(by_step.items()))
            warnings.warn(
                f"fslr_func: probe statistics that were not finite (NaN or Inf: a NaN in the "
                f"probe batch, an output that overflowed, or a diverged update) were left out "
                f"of the FSLR averages ({listed}); those averages kept their previous values",
                RuntimeWarning,
                stacklevel=3,
            )
        valid = [(n, row) for n, row in zip(names, flags, strict=True) if not row[0]]
        fslr = {n: fslr_from_log(log_sq[n]) for n, _ in valid}
        rows_of = dict(zip(names, flags, strict=True))
        went = tuple(n for n in changed if rows_of[n][5])
        left_out = tuple(n for n in went if rows_of[n][3] == 0)
        return Reading(fslr, {n: row[4] for n, row in valid}, went, left_out)

    def reset(self) -> None:
        """Forget the EMAs (e.g. after a change of model or task)."""
        self.ema = EMA(self.ema.beta)

    def config(self) -> dict[str, Any]:
        """The settings that give the saved EMAs their meaning; checked when a state loads."""
        output_fn = self.options.output_fn
        return {
            "estimator": self.estimator,
            "beta": self.beta,
            "samples": self.options.samples,
            "omega": self.options.omega,
            "grouping": self.options.grouping,
            "readout": self.options.readout,
            "output_fn": None if output_fn is None else getattr(output_fn, "__qualname__", "?"),
        }

    def get_extra_state(self) -> dict[str, Any]:
        """EMA, readout roles, omega generators and configuration, saved with ``state_dict``;
        tensors under the bare model's names (as records have them)."""
        return {
            "version": _STATE_VERSION,
            "config": self.config(),
            "ema": _renamed(self.ema.state_dict(), lambda n: n.removeprefix(self.name_prefix)),
            "readout_roles": {
                n.removeprefix(self.name_prefix): r for n, r in self.readout_roles.items()
            },
            "generators": {k: g.get_state() for k, g in self.generators.items()},
            "probes": self.probes,
            "resolved_strategy": self.resolved_strategy,
        }

    def set_extra_state(self, state: Any) -> None:
        """Restore what :meth:`get_extra_state` saved, after checking its configuration.

        Raises:
            ValueError: a state of another fslr_func version, or saved by a wrapper with
                another configuration (:meth:`config`), unless loaded with ``strict=False``
                (the EMAs are then loaded as they are, under this wrapper's configuration).
        """
        if state is None:  # a bare model's state dict: the wrapper's state stays as it is
            return
        if not isinstance(state, dict) or state.get("version") not in (1, 2, _STATE_VERSION):
            raise ValueError("this FSLRModule state was saved by an incompatible fslr_func version")
        saved = state.get("config", {})
        differ = {
            k: (v, saved[k]) for k, v in self.config().items() if k in saved and saved[k] != v
        }
        if differ and self._strict_load:
            listed = "; ".join(
                f"{k}: this wrapper {v!r}, saved {w!r}" for k, (v, w) in differ.items()
            )
            raise ValueError(
                f"the FSLRModule state was saved with another configuration ({listed}): build "
                f"the wrapper with the saved settings, or load with strict=False to keep this "
                f"wrapper's settings and the saved averages"
            )
        prefix = self.name_prefix if state["version"] == _STATE_VERSION else ""
        beta = self.beta
        self.ema.load_state_dict(_renamed(state["ema"], lambda n: prefix + n))
        self.ema.beta = beta
        self.readout_roles = {prefix + n: r for n, r in state["readout_roles"].items()}
        saved_generators = state.get("generators", {"cpu": state.get("generator")})
        self.generators = {}
        for key, generator_state in saved_generators.items():
            if generator_state is not None:
                self.generator_for(torch.device(key)).set_state(generator_state)
        self.probes = int(state.get("probes", 0))
        self._reported = {n: int(v) for n, v in self.ema.dropped.items()}
        self.resolved_strategy = state.get("resolved_strategy", self.options.strategy)

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """:meth:`torch.nn.Module.load_state_dict`; ``strict=False`` also accepts a wrapper
        state saved under another configuration (see :meth:`set_extra_state`)."""
        self._strict_load = strict
        try:
            return super().load_state_dict(state_dict, strict=strict, assign=assign)
        finally:
            self._strict_load = True
