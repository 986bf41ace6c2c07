r"""``with_fslr``: wrap any module so its optimiser steps report function-space learning rates.

Around an optimiser step the wrapper snapshots the weights, lets the step run, forms the
unit-learning-rate update of every tensor, ``dW = (W_after - W_before) / lr_W`` (the rate of the
param group holding ``W``), probes at the *pre-update* weights (functionally: the module is not
touched) and folds the probe's statistics into bias-corrected EMAs. Using the unit-rate update
keeps the EMA consistent when rates change (schedules, FLeRM), as in the paper.

Examples:
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
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from ..parallel.process_group import next_seed
from ..probe import forward_cache
from ..probe.exact import exact
from ..probe.functional import (
    Inputs,
    ModuleTensors,
    check_inputs,
    check_not_meta,
    check_not_scripted,
    check_single_process,
    nonfinite_fslr_error,
)
from ..probe.names import WRAPPER_PREFIXES, unwrapped
from ..probe.options import ProbeOptions, Strategy
from ..probe.readout import find_readout, readout_module, readout_roles
from ..probe.sampling import GradientReduction, run_probe
from ..stats.checks import torch_seed
from ..stats.estimator import (
    EMA,
    Estimator,
    Grouping,
    ReadoutRole,
    check_estimator,
    log_sq_norm,
    mean_valid_log_stats_all,
)
from .measurement import DropReports, Measurement, Reading, read_estimates
from .update_scaling import Snapshots
from .wrapper_state import extra_state, load_bare, load_bare_keys, load_extra_state, save_bare

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from ..probe.options import ProbeKwargs

__all__ = ["FSLRModule", "Measurement", "Reading"]


def _probe_batches(inputs: Inputs | list[Inputs]) -> list[Inputs]:
    """``inputs`` as a list of probe batches; an empty list is refused (nothing to probe)."""
    if not isinstance(inputs, list):
        return [inputs]
    if not inputs:
        raise ValueError("inputs is an empty list: pass a probe batch, or a non-empty list of them")
    return inputs


class LogSqAtStep(Mapping[str, Tensor]):
    """A wrapper's log ``||Delta_W f||^2_RMS`` estimates as they stand now (its
    :meth:`FSLRModule.log_sq`), computed when first read: a measured step whose estimates
    are never read (read them once every so many steps, as :meth:`FSLRModule.fslr` does)
    skips about a dozen small operations per tensor. The EMA's tensors are replaced, never
    modified in place, by its updates, so copies of its dicts keep this moment's values:
    read later, the estimates are the same bit for bit."""

    def __init__(self, fm: FSLRModule) -> None:
        ema = fm.ema
        self._ema = EMA(ema.beta, dict(ema.log_m), dict(ema.counts))
        self._estimator: Estimator = fm.estimator
        self._roles = dict(fm.readout_roles)
        self._values: dict[str, Tensor] | None = None

    def _computed(self) -> dict[str, Tensor]:
        if self._values is None:
            self._values = _log_sq(self._ema, self._estimator, self._roles)
        return self._values

    def __getitem__(self, name: str) -> Tensor:
        return self._computed()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._computed())

    def __len__(self) -> int:
        return len(self._computed())

    def __repr__(self) -> str:
        return repr(self._computed())


def _log_sq(ema: EMA, estimator: Estimator, roles: Mapping[str, ReadoutRole]) -> dict[str, Tensor]:
    return {n: log_sq_norm(v, estimator, roles.get(n)) for n, v in ema.value().items()}


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
        estimator: ``"kron"``, ``"full"`` or ``"iid"``, estimated from ``samples`` omega
            draws per probe batch; or ``"exact"``: each probe batch's
            ``||J dW||_RMS`` by forward-mode AD (:func:`fslr_func.exact`), no
            sampling and no estimator bias, at one ``jvp`` per moved tensor and probe batch
            (host synchronisations per tensor; one process only: a data-parallel probe
            needs a sampled estimator). Of the probe's options, ``output_fn``,
            ``forward_seed`` and ``readout`` (to find the readout for ``match="features"``)
            apply to it, and ``samples`` still sets how many probe batches a Recorder's or
            FLeRM's warm-up takes (``ceil(warmup_samples / samples)``).
        beta: EMA decay across probes (bias-corrected).
        seed: seeds the omega generators (one per device, each drawing omega where the
            model's output lives); ``None`` takes it from torch's global RNG without
            advancing it (the run's own draws, dropout masks, are as without the wrapper).
        reduction: how a probe spans several processes
            (:class:`~fslr_func.probe.sampling.GradientReduction`); ``None``: this process only.
        **options: the probe's options (:class:`~fslr_func.probe.options.ProbeOptions`).

    With a sampled estimator a measured step never synchronises with the host (``exact``
    reads each tensor's flags and value there): omega is drawn on the device, the EMAs
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
        check_estimator(estimator, distributed=reduction is not None)
        self.options = ProbeOptions(**options)
        self.ema = EMA(beta)
        check_not_scripted(model)  # at construction, not at the first measured step
        if isinstance(unwrapped(model)[0], FSLRModule):
            raise TypeError(
                "the model is a with_fslr wrapper already: wrapping it again would probe it "
                "twice under names prefixed 'module.module.'; use that wrapper, or wrap the "
                "model inside it (fm.module)"
            )
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
        self._readout_searched = False  # estimator="exact": its probe does not find it
        self._measuring = False
        self._snapshots = Snapshots()  # the weights before a measured step, reused
        self._updates = Snapshots()  # its unit-rate updates, reused (release_buffers)
        self._strict_load = True
        self.probes = 0
        self.reported = DropReports()  # drops already warned about
        if seed is None:
            seed = next_seed()
        self.seed = torch_seed(seed, "seed")
        self.generators: dict[str, torch.Generator] = {}
        self.register_state_dict_post_hook(save_bare)  # type: ignore[no-untyped-call]
        self.loading_prefix: str | None = None  # set by load_bare for load_bare_keys
        self.register_load_state_dict_pre_hook(load_bare)  # type: ignore[no-untyped-call]
        self.register_load_state_dict_post_hook(load_bare_keys)  # type: ignore[no-untyped-call]

    def __getattr__(self, name: str) -> Any:
        """``nn.Module``'s lookup, then the bare model's own submodules, parameters and
        buffers: the state dict's keys are the bare model's
        (:mod:`fslr_func.training.wrapper_state`), and tools that resolve those keys on the
        module they were given (``torch.distributed.checkpoint.state_dict.get_state_dict``)
        find them on the wrapper too."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            inner = vars(self).get("_modules", {}).get("module")
            if inner is not None:
                bare, _ = unwrapped(inner)
                for slot in ("_modules", "_parameters", "_buffers"):
                    found = vars(bare).get(slot, {})
                    if name in found:
                        return found[name]
            raise

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
        without it (:mod:`fslr_func.probe.names`)."""
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
        """The omega generator of ``device``, seeded with :attr:`seed` on first use.

        Raises:
            ValueError: ``device`` is the meta device (a model not yet materialised).
        """
        key = str(device)
        if key not in self.generators:
            if device.type == "meta":
                check_not_meta(self.module)
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

        With a sampled estimator nothing here synchronises with the host (``exact`` reads
        each tensor's flags and value there): statistics that are not finite are left out
        of the EMA (per omega sample, and per tensor when every sample is), and reported by
        the next :meth:`fslr`.

        Args:
            inputs: one probe batch, or a list of batches probed in turn (EMA warm-up).
            delta: name -> unit-learning-rate update.
            params: the weights to probe at (e.g. before the step); default: current ones.
            step: the label the warnings give a dropped probe (default: the number of probe
                batches folded in before it, :attr:`probes`).
            strict: refuse NaN or Inf in ``delta`` and the output, NaN in the inputs, and an
                infinite input that reaches a gradient, with an error instead (this reads them
                on the host).
            changed: name -> 0-d bool on the device; a tensor marked ``False`` (the step did
                not change it) keeps its EMA. Default: every tensor is folded in.

        Raises:
            ValueError: ``inputs`` is an empty list (nothing would be probed).
        """
        batches = _probe_batches(inputs)
        moved: dict[str, Tensor] = {}
        if self.estimator == "exact":  # the flags read on the host, as exact values are
            moved = {n: d for n, d in delta.items() if changed is None or bool(changed[n])}
        for batch in batches:
            if self.estimator == "exact":
                means = self._exact_stats(batch, delta, moved, params=params, strict=strict)
            else:
                means = self._sampled_stats(batch, delta, params=params, strict=strict)
            self.ema.update(means, step=self.probes if step is None else step, include=changed)
            self.probes += 1

    def _sampled_stats(
        self,
        batch: Inputs,
        delta: Mapping[str, Tensor],
        *,
        params: Mapping[str, Tensor] | None,
        strict: bool,
    ) -> dict[str, Tensor]:
        """One probe batch's mean log statistics per tensor, from its omega samples
        (:func:`~fslr_func.probe.sampling.run_probe`); the readout found as it runs."""
        result = run_probe(
            self.module,
            batch,
            delta,
            self.options.replace(strategy=self.resolved_strategy),
            generator=self.generator_for(next(self.module.parameters()).device),
            params=params,
            reduction=self.reduction,
            strict=strict,
        )
        if strict and (nan := [n for n, v in result.log_stats.items() if v.isnan().any()]):
            # an Inf input reaching a gradient, or a NaN gradient: named, not left out
            raise nonfinite_fslr_error(nan, self._infinite(batch))
        self.resolved_strategy = result.strategy
        self.readout_roles.update(result.readout)
        return mean_valid_log_stats_all(result.log_stats)

    def _exact_stats(
        self,
        batch: Inputs,
        delta: Mapping[str, Tensor],
        moved: Mapping[str, Tensor],
        *,
        params: Mapping[str, Tensor] | None,
        strict: bool,
    ) -> dict[str, Tensor]:
        """``estimator="exact"``: one probe batch's log ``||J dW||^2_RMS`` of each tensor in
        ``moved`` (:func:`~fslr_func.probe.exact.exact`, not strict), the one statistic of each;
        the other tensors of ``delta`` (unchanged by the step, skipped by the EMA) read NaN.
        The readout is found once, by a forward on the first batch measured, for what needs it
        (``match="features"``)."""
        log_sq = {}
        if moved:  # nothing moved: a step a GradScaler skipped
            if not self._readout_searched and self.options.readout is not None:
                self._find_readout(batch)
            values = exact(
                self.module,
                batch,
                moved,
                output_fn=self.options.output_fn,
                params=params,
                forward_seed=self.options.forward_seed,
                strict=strict,
            )
            log_sq = {n: 2 * v.log() for n, v in values.items()}
        unmeasured = torch.tensor([math.nan], dtype=torch.float64)
        return {
            n: log_sq[n].reshape(1) if n in log_sq else unmeasured.to(d.device)
            for n, d in delta.items()
        }

    def _find_readout(self, batch: Inputs) -> None:
        """Set :attr:`readout_roles` from the readout the wrapper's ``readout`` option names or
        one forward on ``batch`` finds (the sampled estimators' probe finds it as it runs).
        The roles only name the readout here: the row-independence check of the sampled
        probe, which picks its estimator variants, is not run (exact values need none)."""
        named = self.options.readout
        forward_seed = self.options.forward_seed
        name, outputs = find_readout(
            self.module, batch, self.options.output_fn, forward_seed=forward_seed
        )
        self._readout_searched = True
        if named != "auto":
            name = named
        trainable = dict(ModuleTensors.of(self.module).trainable)
        self.readout_roles = readout_roles(
            self.module, name, trainable, outputs, named=named != "auto"
        )

    def _infinite(self, batch: Inputs) -> list[str]:
        """The probe batch's inputs with infinite entries (every rank's, distributed)."""
        return check_inputs(batch)

    def observe(
        self,
        inputs: Inputs | list[Inputs],
        delta: Mapping[str, Tensor],
        *,
        params: Mapping[str, Tensor] | None = None,
    ) -> dict[str, Tensor]:
        """Probe ``delta`` on ``inputs``, fold the result into the EMAs and read them.

        :meth:`fold` (refusing NaN or Inf in ``delta`` and the output, NaN in the inputs, an
        infinite input that reaches a gradient) followed by :meth:`fslr`.

        Returns:
            The current FSLR estimates (name -> float64 scalar).
        """
        self.fold(inputs, delta, params=params, strict=True)
        return self.fslr()

    def release_buffers(self) -> None:
        """Free the buffers a measured step keeps for the next one: the weights before the
        step and its updates, two copies of the trainable weights. A Recorder or FLeRM calls
        it after a probe when none is due within 50 steps (a static set point, a long
        ``every``); the next measured step allocates them again.

        Examples:
            >>> import torch, fslr_func as ff
            >>> fm = ff.with_fslr(torch.nn.Linear(3, 2), samples=2, seed=0)
            >>> fm.release_buffers()
        """
        self._snapshots = Snapshots()
        self._updates = Snapshots()

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
            ValueError: the optimiser updates none of the module's parameters; every rate
                is 0 and no scheduler drives them (a warm-up from 0 warns and measures
                nothing); ``inputs`` is an empty list.
            RuntimeError: a ``measure`` block inside another one (one step, measured once).
        """
        batches = _probe_batches(inputs)
        if self._measuring:
            raise RuntimeError(
                "fm.measure blocks cannot be nested: a step is measured once, and a measuring "
                "block (fm.measure, or a Recorder's or FLeRM's step() on this wrapper) is "
                "already open around it. Two FLeRMs (one per optimiser, Muon + AdamW) probe in "
                "their own blocks: `with f1.step(): muon.step()` then `with f2.step(): "
                "adamw.step()`, or attach() both. With a Recorder or FLeRM, do not also call "
                "fm.measure; a Recorder and FLeRM on one wrapper cannot both probe one step: "
                "start the Recorder after FLeRM's set points, or record through a second "
                "with_fslr(model)"
            )
        optimizers = [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else optimizer
        m, scaled = Measurement.before_step(self.module, optimizers, self._snapshots)
        self._measuring = True
        try:
            yield m
        finally:
            self._measuring = False
        m.after_step(self.module, scaled, self._updates)
        counts = dict(self.ema.counts)
        if m.delta:  # empty at a step whose every rate is 0 (a warm-up from 0)
            self.fold(batches, m.delta, params=m.before, step=step, changed=m.changed)
        m.log_sq, m.ema, m.reported = LogSqAtStep(self), self.ema, self.reported
        m.inputs = batches
        m.folded = {n: c - counts[n] if n in counts else c for n, c in self.ema.counts.items()}

    def log_sq(self) -> dict[str, Tensor]:
        """Log of the current estimates of ``||Delta_W f||^2_RMS`` (float64, ``-inf``: zero)."""
        return _log_sq(self.ema, self.estimator, self.readout_roles)

    def fslr(self) -> dict[str, Tensor]:
        """Current FSLR per tensor (float64 scalars); empty before the first measurement.

        The one host synchronisation of the wrapper: tensors with no valid measurement yet
        (every probe of them dropped) are left out, and probes dropped since the last read are
        reported in one warning naming the step and the tensors.
        """
        return read_estimates(self.log_sq(), self.ema, {}, {}, self.reported).fslr

    def reset(self) -> None:
        """Forget the EMAs and what the probes found about the model (its readout layer and
        roles), e.g. after a change of model or task: the next probe looks again."""
        self.ema = EMA(self.ema.beta)
        self.readout_roles = {}
        self._readout_searched = False
        forward_cache.forget(self.module)

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
        """EMA, readout roles, omega generators and configuration, saved with ``state_dict``
        (:mod:`fslr_func.training.wrapper_state`)."""
        return extra_state(self)

    def set_extra_state(self, state: Any) -> None:
        """Restore what :meth:`get_extra_state` saved, after checking its configuration.

        Raises:
            ValueError: a state of another fslr_func version, or saved by a wrapper with
                another configuration (:meth:`config`), unless loaded with ``strict=False``
                (the EMAs are then loaded as they are, under this wrapper's configuration).
        """
        load_extra_state(self, state, self._strict_load)

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
