r"""FLeRM variants measured on the transfer matrix (issue 23): prototypes built on the public API.

Static FLeRM (the paper's main results) sets each tensor's rate once, at step 0, from the
first update of the scaled run, which under Adam is :math:`\mathrm{sign}(g)` (bias-corrected
first step: :math:`m/\sqrt v = g/|g|`), against the base run's first update:

.. math::

    r_W = \frac{\mathrm{FSLR}^\text{base}_W(0)}{\mathrm{FSLR}_W(0)}, \qquad \eta_W = \eta_0 r_W .

The sign of a gradient summed over a batch moves the function more per unit rate than later
Adam updates (a moving average of noisy gradients over their RMS): on the ResMLP and the conv
nets of the transfer matrix most tensors' unit-rate FSLR falls to 4-45% of its step-0 value
in steps 10-40, and for some (the readout; the conv net's input, hidden and readout weights)
by a different fraction at 8x than at 1x (docs/reproduction.md, "Why FLeRM under-sets width
rates"). Where it falls further at 8x, :math:`r_W` read at step 0 is too small for the rest
of training.

:class:`WindowFLeRM` keeps the step-0 set point and then matches the function-space movement
accumulated over a window of later steps: with unit-rate FSLRs probed every ``every`` steps
in ``[lo, hi]`` (each probe its own estimate, ``beta = 0``, in the base record too),

.. math::

    r_W(t) = \frac{\sum_{s \in S_t} T_W(s)}{\sum_{s \in S_t} \mathrm{FSLR}_W(s)}, \qquad
    S_t = \{s : lo \le s \le t,\ s \equiv lo \pmod{every}\},

set at every probe step :math:`t` of the window (``cumulative``) or once, at its end, and
held afterwards: the movement per step, summed over the window, equals the base's. The sums
(not a mean of per-probe ratios) keep the noise of a single probe from setting a rate.

:class:`HiddenWidthPolicy` changes the targets instead of the set point. In the standard
parametrisation the readout's weights are :math:`\Theta(n^{-1/2})` at width :math:`n`, and a
gradient-driven change :math:`\delta` per coordinate of the features (the readout's input) is
aligned with them, so it moves the output by about :math:`\sqrt n \, \delta`: holding each
hidden tensor's output movement at the base's, as FLeRM does, shrinks its feature movement by
:math:`\sqrt{m}` at :math:`m` times the width (feature learning fades with width, the
regime muP was built to avoid). The policy keeps the feature movement instead: a hidden
tensor's target is the base's times :math:`m_\text{in}^{\alpha}`, :math:`\alpha = 1/2`,
:math:`m_\text{in}` its fan-in multiplier; a *hidden* tensor is one whose fan-out and fan-in
(dims 0 and 1) both grow with the width (muP's "two infinite dimensions": hidden linear and
conv weights, attention and MLP matrices); every other tensor (input layer, embeddings,
biases, norms, readout) keeps the base's target. Measured, not derived, where it matters:
on the ResMLP of 300 steps, multiplying the hidden weights' rates by 2.83 after FLeRM's set
point gives 0.720 (re-tuned standard training 0.735, FLeRM 0.818), while doing the same to
the input layer too gives 0.803.

Three variants ask what muP still has where the rules trail it (docs/reproduction.md, "What
muP still has"): :class:`ReadoutBuiltMuPRatesFLeRM`, a control (muP's rates in FLeRM's run,
the same training as muP's); :class:`ReadoutLocalFLeRM`, each layer's own output movement
matched (:func:`local_gains`, muP's principle measured); :class:`ReadoutMuPAnchorFLeRM`, the
re-matching of ``readout_built_upstream`` started from muP's rates.

:data:`VARIANTS` names the variants the matrix runs (``SweepConfig.flerm_variant``); each
carries the probe options (``with_fslr`` keywords) of its base recordings and FLeRM runs.

Examples:
    >>> import torch, fslr_func as ff
    >>> def run(width, lr, base=None):
    ...     torch.manual_seed(0)
    ...     net = torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.Tanh(),
    ...                               torch.nn.Linear(width, 3))
    ...     fm = ff.with_fslr(net, samples=4, seed=0, beta=0.0)
    ...     opt = torch.optim.Adam(fm.parameters(), lr=lr)
    ...     probes = (torch.randn(16, 4) for _ in range(1000))
    ...     ctl = (ff.Recorder(fm, probes, optimizer=opt, warmup_samples=4, every=2)
    ...            if base is None else WindowFLeRM(fm, opt, base, probe_batches=probes,
    ...                                             warmup_samples=4, every=2, window=(2, 6)))
    ...     for t in range(8):
    ...         opt.zero_grad()
    ...         fm(torch.randn(16, 4)).square().mean().backward()
    ...         with ctl.step():
    ...             opt.step()
    ...     return ctl
    >>> flerm = run(32, 1e-2, run(8, 1e-2).record)
    >>> [p.step for p in flerm.history]  # step 0, then the window's end
    [0, 6]
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..io.record import FSLRRecord
from ..probe.functional import Inputs
from ..probe.readout import find_readout
from ..training import policies
from ..training.feature_gains import (
    NoReadoutError,
    feature_gains,
    hidden_fan_in,
    readout_of,
    step_gains,
)
from ..training.flerm import FLeRM, Matched, SetPoint
from ..training.readout_scale import readout_width_scale, scale_readout
from ..training.recorder import Recorder
from ..training.wrapper import FSLRModule
from ..training.wrapper_state import READOUT_SCALE_MARK
from . import mup

__all__ = [
    "BUDGET_POWER_STEPS",
    "VARIANTS",
    "FeatureSpaceWindowFLeRM",
    "FeatureWindowFLeRM",
    "GainTrackingFLeRM",
    "GainTrackingRecorder",
    "HiddenWidthPolicy",
    "ReadoutGainFLeRM",
    "ReadoutInitFreshFLeRM",
    "ReadoutInitWindowFLeRM",
    "ReadoutUpstreamFLeRM",
    "ReadoutWidthBuiltFLeRM",
    "ReadoutWidthFLeRM",
    "Variant",
    "WindowFLeRM",
    "budget_power",
    "window_ratios",
]


def window_ratios(
    targets: Iterable[Mapping[str, float]],
    fslrs: Iterable[Mapping[str, float]],
    *,
    min_fslr: float = 1e-12,
) -> dict[str, float]:
    r"""Per tensor, :math:`\sum_s T_W(s) / \sum_s \mathrm{FSLR}_W(s)` over paired probes;
    tensors with a non-finite value in any probe, or a sum at most ``min_fslr``, are left out.

    Examples:
        >>> window_ratios([{"w": 2.0}, {"w": 4.0}], [{"w": 1.0}, {"w": 1.0}])
        {'w': 3.0}
        >>> window_ratios([{"w": 1.0}], [{"w": float("nan")}])
        {}
    """
    num: dict[str, float] = {}
    den: dict[str, float] = {}
    bad: set[str] = set()
    for tgt, got in zip(targets, fslrs, strict=True):
        for name, t in tgt.items():
            f = got.get(name, math.nan)
            if not (math.isfinite(t) and math.isfinite(f)):
                bad.add(name)
                continue
            num[name] = num.get(name, 0.0) + t
            den[name] = den.get(name, 0.0) + f
    return {
        n: num[n] / den[n] for n in num if n not in bad and den[n] > min_fslr and num[n] > min_fslr
    }


class WindowFLeRM(FLeRM):
    r"""Static FLeRM, then movement matched over a window of later steps (module docstring).

    Args:
        fm: as :class:`~fslr_func.training.flerm.FLeRM`; wrapped with ``beta=0`` (each probe
            its own estimate).
        optimizer: as :class:`~fslr_func.training.flerm.FLeRM`.
        base: as :class:`~fslr_func.training.flerm.FLeRM`; recorded with one probe every
            ``every`` steps and ``beta=0``.
        window: ``(lo, hi)``: the steps whose probes are matched; ``lo`` a multiple of
            ``every`` after FLeRM's ``start_step``.
        cumulative: re-match at every probe of the window (else once, at ``hi``).
        every: the probe period (the base record's).
        **kwargs: FLeRM's other options (``mode`` is ``"static"``).

    Attributes:
        window_record: the scaled run's probes in the window (an FSLR record).
    """

    def __init__(
        self,
        fm: FSLRModule,
        optimizer: torch.optim.Optimizer,
        base: FSLRRecord,
        *,
        probe_batches: Iterable[Inputs],
        window: tuple[int, int],
        cumulative: bool = False,
        every: int = 10,
        **kwargs: Any,
    ) -> None:
        kwargs.pop("mode", None)
        super().__init__(
            fm, optimizer, base, probe_batches=probe_batches, mode="static", every=every, **kwargs
        )
        lo, hi = window
        if not (lo >= 1 and hi >= lo and lo % every == 0):
            raise ValueError(f"window must be (lo, hi), 1 <= lo <= hi, lo a multiple of {every}")
        self.window = (lo, hi)
        self.cumulative = cumulative
        self.every = every
        self._recorder = self._window_recorder(probe_batches, lo)

    def _window_recorder(
        self,
        probe_batches: Iterable[Inputs],
        start_step: int,
        cls: Callable[..., Recorder] = Recorder,
        **options: Any,
    ) -> Recorder:
        """The recorder of the window's probes: ``cls`` with ``options`` (a hook for
        subclasses)."""
        return cls(
            self.fm,
            probe_batches,
            optimizer=self.optimizer,
            warmup_samples=self.fm.samples,
            every=self.every,
            start_step=start_step,
            **options,
        )

    @property
    def window_record(self) -> FSLRRecord:
        """The scaled run's unit-rate FSLRs probed in the window so far."""
        return self._recorder.record

    @contextlib.contextmanager
    def step(self, optimizer: torch.optim.Optimizer | None = None) -> Iterator[None]:
        """FLeRM's step; inside the window the recorder measures the optimiser's own update
        (its direction is the scaled update's), and at a probe step the rates are re-matched."""
        t = self.t
        lo, hi = self.window
        inside = lo <= t <= hi
        with super().step(optimizer):
            if t <= hi:  # the recorder counts steps from its first call: call it every step
                with self._recorder.step(self.optimizer):
                    yield
            else:
                yield
        rec = self._recorder.record
        probed = inside and len(rec) and rec.steps[-1] == t
        if probed and (self.cumulative or t + self.every > hi):
            self._rematch(t)

    def _adjust(self, ratios: dict[str, float]) -> dict[str, float]:
        """The window's ratios as set (a hook for subclasses: here unchanged)."""
        return ratios

    def _window_ratios(
        self, steps: Sequence[int], targets: list[dict[str, float]], fslrs: list[dict[str, float]]
    ) -> dict[str, float]:
        """The window's ratios from its probes' targets and FSLRs (:func:`window_ratios`; a
        hook for subclasses that match something else over the same probes)."""
        return window_ratios(targets, fslrs, min_fslr=self.min_fslr)

    def _rematch(self, t: int) -> None:
        rec = self._recorder.record
        targets = [self.targets.at(s, self.names, self._note_each) for s in rec.steps]
        fslrs = [rec.at(s, unknown="omit") for s in rec.steps]  # unknown: left out
        ratios = self._adjust(self._window_ratios(rec.steps, targets, fslrs))
        self.ratios.update({n: r for n, r in ratios.items() if n in self.ratios})
        self.history.append(
            SetPoint(
                step=t,
                lrs=self.lrs(),
                fslr=fslrs[-1],
                targets=targets[-1],
                held=tuple(n for n in self.names if n not in ratios),
            )
        )


class HiddenWidthPolicy:
    r"""A policy: ``inner``'s targets, hidden tensors' times :math:`m_\text{in}^\alpha`.

    Args:
        model: the scaled model (its ``named_parameters()`` names are the policy's).
        base_shapes: the base model's, by name (``FSLRRecord.shapes``); extra blocks of a
            deeper model are compared with their role in the base
            (:func:`hidden_fan_in`).
        alpha: the exponent (1/2: keep the features' movement in the standard
            parametrisation; 0: ``inner`` itself).
        inner: the policy mapping base FSLRs to the scaled tensors (default identity).

    Attributes:
        factors: tensor name -> the factor on its target (hidden tensors only).

    Examples:
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 64), torch.nn.Linear(64, 64),
        ...                           torch.nn.Linear(64, 3))
        >>> small = {n: tuple(p.shape) for n, p in torch.nn.Sequential(
        ...     torch.nn.Linear(4, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 3)
        ... ).named_parameters()}
        >>> pol = HiddenWidthPolicy(net, small)
        >>> pol.factors
        {'1.weight': 2.0}
        >>> pol({n: 1.0 for n in small}, list(small))["1.weight"]
        2.0
    """

    def __init__(
        self,
        model: torch.nn.Module,
        base_shapes: Mapping[str, Sequence[int]],
        *,
        alpha: float = 0.5,
        inner: policies.PolicySpec = "identity",
    ) -> None:
        self.inner = policies.resolve(inner)
        self.one_to_one = policies.is_one_to_one(self.inner)
        self.alpha = float(alpha)
        shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
        self.factors = {n: m**self.alpha for n, m in hidden_fan_in(shapes, base_shapes).items()}
        self.__name__ = f"hidden_width(alpha={self.alpha:g})"

    def __call__(self, base: Mapping[str, float], scaled: Sequence[str], /) -> dict[str, float]:
        """``inner``'s targets, each hidden tensor's times its factor."""
        targets = policies.apply(self.inner, base, scaled, allow_zero=True)
        return {n: v * self.factors.get(n, 1.0) for n, v in targets.items()}


class FeatureWindowFLeRM(WindowFLeRM):
    """``match="features"``'s hidden-tensor factors on :class:`WindowFLeRM`'s rates: the
    step-0 set point and the window's re-match both match output movement, then each hidden
    tensor's ratio is multiplied by its factor (measured once, at the step-0 set point).

    Args:
        hidden_only: re-match only the hidden tensors in the window (the others keep their
            step-0 rates): on the ResMLP the window raises the readout's rate, which costs
            loss there (``benchmarks/transfer_boost.py``), while the hidden tensors' drift is
            what the conv nets' loss follows.
        raise_only: the window's re-match never lowers a rate below its step-0 value (to
            test whether lowering was what cost the 600-step ResMLP; measured: it was not,
            the window raises the hidden tensors' rates there as on the conv nets,
            docs/reproduction.md).
        *args: :class:`WindowFLeRM`'s.
        **kwargs: :class:`WindowFLeRM`'s (``match`` is ``"features"``).
    """

    def __init__(
        self, *args: Any, hidden_only: bool = False, raise_only: bool = False, **kwargs: Any
    ) -> None:
        super().__init__(*args, **{**kwargs, "match": "features"})
        self.hidden_only = hidden_only
        self.raise_only = raise_only

    def _adjust(self, ratios: dict[str, float]) -> dict[str, float]:
        factors = self.feature_factors or {}
        keep = set(factors) if self.hidden_only else set(ratios)
        adjusted = {n: r * factors.get(n, 1.0) for n, r in ratios.items() if n in keep}
        if self.raise_only:
            return {n: max(r, self.ratios.get(n, r)) for n, r in adjusted.items()}
        return adjusted


class GainTrackingRecorder(Recorder):
    """A base run's recorder that also keeps the feature gains of every recorded update, in
    ``record.meta["feature_gain_at"]`` (step -> tensor -> gain), for
    :class:`GainTrackingFLeRM` and :class:`FeatureSpaceWindowFLeRM` (``feature_gains`` is
    on).

    Args:
        *args: :class:`~fslr_func.training.recorder.Recorder`'s.
        names: the tensors whose gains are kept, by bare name (default: every tensor the
            update moved).
        **kwargs: :class:`~fslr_func.training.recorder.Recorder`'s.
    """

    def __init__(self, *args: Any, names: Collection[str] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **{**kwargs, "feature_gains": True})
        self.gain_names = names

    def _measured(self, m: Any) -> None:
        at = self.record.meta.setdefault("feature_gain_at", {})
        at[str(self.t)] = step_gains(self.fm, m, self.gain_names)
        super()._measured(m)


class FeatureSpaceWindowFLeRM(FeatureWindowFLeRM):
    r""":class:`FeatureWindowFLeRM` (hidden tensors only) with the window matched in feature
    space: each hidden tensor's movement of the *features* (the readout's input), summed over
    the window's probes, is the base's,

    .. math::

        r_W = \frac{\sum_s T_W(s) / G^\text{base}_W(s)}
                   {\sum_s \mathrm{FSLR}_W(s) / G^\text{scaled}_W(s)},

    with :math:`G_W(s)` the feature gain of the update probed at step :math:`s` (output over
    feature movement, :func:`~fslr_func.training.feature_gains.step_gains`; the base's from
    :class:`GainTrackingRecorder`). :class:`FeatureWindowFLeRM` multiplies the window's
    output-matched ratio by the gain ratio of step 0; this one reads the gains of every probe
    in the window, so that a drift of the gains after Adam's first step (the update's
    alignment with the features fading, faster at larger width) is matched too. A hidden
    tensor without a gain at some probe of the window keeps its step-0 rate.

    Args:
        *args: :class:`WindowFLeRM`'s (the base record from :class:`GainTrackingRecorder`).
        **kwargs: :class:`WindowFLeRM`'s.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, hidden_only=True, **kwargs)

    def _window_recorder(
        self,
        probe_batches: Iterable[Inputs],
        start_step: int,
        cls: Callable[..., Recorder] = GainTrackingRecorder,
        **options: Any,
    ) -> Recorder:
        """The window's recorder, keeping the hidden tensors' gains of every probe."""
        return super()._window_recorder(
            probe_batches, start_step, cls, **{"names": set(self._hidden()), **options}
        )

    def _adjust(self, ratios: dict[str, float]) -> dict[str, float]:
        """The window's ratios as set: already in feature space (no step-0 factor)."""
        return ratios

    def _window_ratios(
        self, steps: Sequence[int], targets: list[dict[str, float]], fslrs: list[dict[str, float]]
    ) -> dict[str, float]:
        """:func:`window_ratios` of the hidden tensors' feature movements: each probe's target
        and FSLR over the base's and this run's gain at that step (NaN, so left out, where a
        value or gain is missing or not positive and finite)."""
        base_at = self.base.meta.get("feature_gain_at", {})
        scaled_at = self._recorder.record.meta.get("feature_gain_at", {})
        prefix = self.fm.name_prefix
        hidden = list(self._hidden())
        moved: list[dict[str, float]] = []  # the base's feature movements, per probe
        got: list[dict[str, float]] = []  # this run's
        for s, tgt, fslr in zip(steps, targets, fslrs, strict=True):
            gb, gs = base_at.get(str(s), {}), scaled_at.get(str(s), {})
            moved.append({})
            got.append({})
            for bare in hidden:
                name = prefix + bare
                t, f, b, g = tgt.get(name), fslr.get(name), gb.get(bare), gs.get(bare)
                ok = all(v is not None and 0 < v < math.inf for v in (t, f, b, g))
                moved[-1][name] = t / b if ok else math.nan
                got[-1][name] = f / g if ok else math.nan
        return window_ratios(moved, got, min_fslr=self.min_fslr)


def _readout_scale(ratios: Iterable[float]) -> float:
    """One over the geometric mean of the hidden tensors' gain ratios ``G_scaled / G_base``
    (1 where there is none): the readout scale that brings the gain back to the base's."""
    logs = [math.log(r) for r in ratios]
    return math.exp(-sum(logs) / len(logs)) if logs else 1.0


class ReadoutGainFLeRM(FLeRM):
    r"""FLeRM on a readout re-initialised in function space: muP's readout, measured.

    In the standard parametrisation the readout of a model ``m`` times wider moves the output
    about :math:`\sqrt m` times more per unit of (gradient-aligned) feature movement than the
    base's (:mod:`fslr_func.training.feature_gains`); muP's readout initialisation and
    multiplier remove that factor. This does it without rewriting the model: at the first
    set point (step 0) the hidden tensors' feature gains are measured against the base's,
    :math:`c = (\prod_W G^\text{base}_W / G^\text{scaled}_W)^{1/k}` over the ``k`` hidden
    tensors, and after the step the readout's weight is multiplied by :math:`c`: the output
    then moves per unit of feature movement as the base's does (:math:`c \approx 1/\sqrt 8`
    for the 8x ResMLP, about 1 for the transformer, whose readout reads a normalised stream:
    nothing changes there). The rates match output movement, with every tensor upstream of
    the readout rated :math:`1/c` higher from step 0 (its output movement per unit rate fell
    by :math:`c`), and, with ``mode="periodic"``, again at every set point as the readout
    grows. ``readout_scale`` keeps :math:`c` (1 where nothing was measured).

    Args:
        *args: :class:`~fslr_func.training.flerm.FLeRM`'s.
        power: :math:`c` is raised to it (2: the readout shrinks as muP's multiplier
            :math:`1/m` does where the gain grows as :math:`\sqrt m`).
        **kwargs: :class:`~fslr_func.training.flerm.FLeRM`'s (``match`` is ``"features"``:
            the base record needs its feature gains).
    """

    def __init__(self, *args: Any, power: float = 1.0, **kwargs: Any) -> None:
        super().__init__(*args, **{**kwargs, "match": "features", "feature_power": 1.0})
        self.power = power
        self.readout_scale: float | None = None
        self._pending: float | None = None

    def _measured(self, m: Any) -> None:
        if self.feature_factors is not None:  # after the first set point: output matching
            super()._measured(m)
            return
        scale = _readout_scale(self._feature_factors(m).values()) ** self.power
        readout = readout_of(self.fm.readout_roles)
        own = f"{self.fm.name_prefix}{readout}."
        self.feature_factors = {n: 1.0 / scale for n in self.names if not n.startswith(own)}
        super()._measured(m)
        self.feature_factors = {}
        self.readout_scale = self._pending = scale

    def _finish(self) -> None:
        super()._finish()  # the set point's update, at its rates, is in place now
        if self._pending is not None:
            weight = f"{self.fm.name_prefix}{readout_of(self.fm.readout_roles)}.weight"
            with torch.no_grad():
                self.targets.params[weight].mul_(self._pending)
            self._pending = None


class ReadoutInitFLeRM(FLeRM):
    r""":class:`ReadoutGainFLeRM`'s readout scale, applied before the first step: muP's small
    readout from the start, measured.

    Before the first set point's step (the gradients are in, the weights not yet moved) each
    hidden tensor's feature gain is measured for the update Adam's first step takes,
    :math:`-\mathrm{sign}(g)`, on one probe batch, against the base record's (the same first
    update of the base run); the readout's weight is multiplied by
    :math:`c = (\prod_W G^\text{base}_W / G^\text{scaled}_W)^{1/k}`, and FLeRM then matches
    output movement (``mode="periodic"``: again every ``every`` steps as the readout grows).
    ``readout_scale`` keeps :math:`c`. The first gradient is the unscaled model's and stays in
    the optimiser's state (Adam's moments); :class:`ReadoutInitFreshFLeRM` takes that step
    back, :class:`ReadoutWidthBuiltFLeRM` scales at construction.

    Args:
        *args: :class:`~fslr_func.training.flerm.FLeRM`'s.
        match: ``"features"`` or ``"features_all"``
            (:class:`~fslr_func.training.flerm.FLeRM`'s; ``"output"`` is refused: the readout
            scale reads feature gains).
        **kwargs: :class:`~fslr_func.training.flerm.FLeRM`'s (the base record needs its
            feature gains).
    """

    def __init__(self, *args: Any, match: Matched = "features", **kwargs: Any) -> None:
        if match not in ("features", "features_all"):
            raise ValueError(
                f"match={match!r}: the readout variants read feature gains; give 'features' "
                "or 'features_all'"
            )
        super().__init__(*args, match=match, **kwargs)
        self.readout_scale: float | None = None

    def _prepare(self, optimizers: list[torch.optim.Optimizer]) -> None:
        if self.readout_scale is None:
            self.readout_scale = self._rescale_readout()
            self.feature_factors = {}  # the readout carries the factor: output matching
        super()._prepare(optimizers)

    def _rescale_readout(self) -> float:
        prefix, params = self.fm.name_prefix, self.targets.params
        model, output_fn = self.fm.module, self.fm.options.output_fn
        (x,) = self._feed.take(1)
        readout, _ = find_readout(model, x, output_fn, forward_seed=self.fm.options.forward_seed)
        if readout is None:
            return 1.0
        scale = self._readout_factor(x, readout)
        with torch.no_grad():
            params[f"{prefix}{readout}.weight"].mul_(scale)
        return scale

    def _readout_factor(self, x: Inputs, readout: str) -> float:
        """The readout's scale: the base's feature gain over this model's, measured for the
        first update (1 where no hidden tensor has a gradient or a base gain)."""
        prefix, params = self.fm.name_prefix, self.targets.params
        delta = {
            n: -params[prefix + n].grad.sign()  # type: ignore[union-attr]
            for n in self._hidden()
            if n in self.base_gains and params[prefix + n].grad is not None
        }
        if not delta:
            return 1.0
        options = self.fm.options
        gains = feature_gains(
            self.fm.module,
            x,
            delta,
            readout=readout,
            output_fn=options.output_fn,
            forward_seed=options.forward_seed,
        )
        return _readout_scale(g / self.base_gains[n] for n, g in gains.items())


class ReadoutInitFreshFLeRM(ReadoutInitFLeRM):
    r""":class:`ReadoutInitFLeRM` whose first step is taken back: the readout scaled by the
    measured :math:`c`, then the model and the optimiser's state restored to before that step.

    The measured scale needs the first gradient (its update :math:`-\mathrm{sign}(g)`), which
    is the unscaled model's; :class:`ReadoutInitFLeRM` then keeps it in the optimiser's state
    (Adam's moments), which on the 8x 1-D conv net of 32 base channels costs 0.23 -> 0.41 in
    loss at the same rates (docs/reproduction.md). Here the first set point is measured and the
    readout scaled as there, and after that step every parameter goes back to its value with
    the readout scaled and the optimiser's state is cleared: its first update comes from the
    scaled model's gradient at the second batch, at the set point's rates. One batch is spent
    on the measurement.

    Args:
        *args: :class:`ReadoutInitFLeRM`'s.
        **kwargs: :class:`ReadoutInitFLeRM`'s.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._restart: dict[str, torch.Tensor] | None = None
        self._optimizers: list[torch.optim.Optimizer] = []

    def _prepare(self, optimizers: list[torch.optim.Optimizer]) -> None:
        first = self.readout_scale is None
        super()._prepare(optimizers)  # the readout is scaled on the first call
        if first:
            params = self.targets.params
            self._restart = {n: p.detach().clone() for n, p in params.items()}
            self._optimizers = optimizers

    def _finish(self) -> None:
        super()._finish()
        if self._restart is None:
            return
        with torch.no_grad():
            for n, p in self.targets.params.items():
                p.copy_(self._restart[n])
        for opt in self._optimizers:
            opt.state.clear()
        self._restart, self._optimizers = None, []


class ReadoutWidthFLeRM(ReadoutInitFLeRM):
    r""":class:`ReadoutInitFLeRM` with muP's readout scale instead of the measured one:
    :math:`c = \sqrt{n_\text{base} / n}` for the readout's fan-in :math:`n` (its base's
    :math:`n_\text{base}`, from the base record's shapes), before the first step; FLeRM
    then matches output movement as :class:`ReadoutInitFLeRM` does. On the conv nets the
    measured scale is 0.43-0.56 at 8x width, muP's 0.35.

    Args:
        *args: :class:`ReadoutInitFLeRM`'s.
        **kwargs: :class:`ReadoutInitFLeRM`'s.
    """

    def _readout_factor(self, x: Inputs, readout: str) -> float:
        name = f"{readout}.weight"
        base, shape = self.base.shapes.get(name), self.targets.params[self.fm.name_prefix + name]
        if base is None or len(base) < 2 or shape.dim() < 2:
            return 1.0
        return readout_width_scale(tuple(shape.shape), base)


class ReadoutWidthBuiltFLeRM(ReadoutWidthFLeRM):
    r""":class:`ReadoutWidthFLeRM` with the readout scaled when FLeRM is built, before the
    first forward: muP's forward from the first gradient on.

    :class:`ReadoutInitFLeRM` scales the readout after the first backward, so the optimiser's
    first step and its state (Adam's moments) hold the gradient of the unscaled model; on
    the 8x 1-D conv net of 32 base channels that alone costs 0.23 -> 0.41 in loss at the same
    rates (docs/reproduction.md). The scale needs no gradient here (the readout's fan-in
    against the base record's), so it is applied at construction by
    :func:`~fslr_func.scale_readout`, on one probe batch's forward (which finds the readout):
    with ``hidden_features=True`` or ``False`` this is ``scale_readout`` followed by a plain
    :class:`~fslr_func.training.flerm.FLeRM` (``match="features"`` or ``"output"``), the form
    a user's resumable run takes.

    With ``hidden_features=True`` the hidden tensors are matched in feature space
    (``match="features"``, their gains measured at the first set point on the scaled
    readout), the others in output space: where the measured gain ratio is below muP's
    :math:`\sqrt{m}` (a normalised stream before the readout) output matching through the small
    readout would move the features further than the base's. With a number :math:`t`, the
    hidden tensors are matched in feature space only where the geometric mean of their
    factors (scaled gain over the base's, on the scaled readout) is below :math:`t`: where
    output matching would move the features more than :math:`1/t` times the base's;
    ``hidden_matched`` says which was chosen, ``hidden_factor`` the mean factor.

    Args:
        *args: :class:`ReadoutWidthFLeRM`'s.
        hidden_features: match the hidden tensors' feature movement (``True``), their output
            movement (``False``), or feature movement where the mean factor is below this
            number.
        **kwargs: :class:`ReadoutWidthFLeRM`'s.
    """

    def __init__(self, *args: Any, hidden_features: bool | float = False, **kwargs: Any) -> None:
        if not isinstance(hidden_features, bool) and not 0 < hidden_features < math.inf:
            raise ValueError(
                f"hidden_features={hidden_features!r}: give True, False or a positive finite "
                "threshold on the hidden tensors' mean feature factor (e.g. 0.5)"
            )
        super().__init__(*args, **kwargs)
        (x,) = self._feed.take(1)
        self.readout_scale = scale_readout(self.fm, self.base, x)
        self._below = None if isinstance(hidden_features, bool) else float(hidden_features)
        self.hidden_matched = "features" if hidden_features is True else "output"
        self.hidden_factor: float | None = None
        if hidden_features is False:
            self.feature_factors = {}  # the readout carries the factor: output matching

    def _measured(self, m: Any) -> None:
        if self._below is not None and self.feature_factors is None:
            factors = self._feature_factors(m)
            mean = 1.0 / _readout_scale(factors.values())  # their geometric mean
            self.hidden_factor = mean
            self.hidden_matched = "features" if mean < self._below else "output"
            self.feature_factors = factors if self.hidden_matched == "features" else {}
        super()._measured(m)


class ReadoutUpstreamFLeRM(ReadoutWidthBuiltFLeRM):
    r""":class:`ReadoutWidthBuiltFLeRM` with *every* tensor upstream of the readout matched in
    feature space, not only the hidden ones: ``scale_readout`` then
    ``FLeRM(..., match="features_all")``.

    With muP's readout in place, matching a tensor's output movement asks its features to
    move :math:`1/G`-times further, :math:`G` the output movement per unit of feature
    movement, which at initialisation (the readout not yet aligned with the features' change)
    falls with width. ``hidden_features=True`` corrects this for the hidden matrices; the
    input layer, the embeddings, biases and normalisation gains stay output-matched, and on
    the transformer they were set 2x-4x the base's rate (docs/reproduction.md). Here each
    tensor :math:`W` whose update moves the features (a feature gain in the base record and
    in this run, measured at the first set point) gets the factor
    :math:`G^\text{scaled}_W / G^\text{base}_W` on its output-matched ratio: its feature
    movement is the base's. The readout's own tensors move no features and stay
    output-matched.

    Args:
        *args: :class:`ReadoutWidthBuiltFLeRM`'s.
        **kwargs: :class:`ReadoutWidthBuiltFLeRM`'s (``hidden_features`` is ``True``).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **{**kwargs, "hidden_features": True, "match": "features_all"})


class ReadoutBuiltMuPRatesFLeRM(ReadoutWidthBuiltFLeRM):
    r"""A control, not a rule: :func:`~fslr_func.scale_readout` (muP's readout at
    initialisation, the same function as ``apply_mup``'s on a model with zero biases) and
    then muP's rates, set at step 0 and held, in place of FLeRM's matched ones: with Adam,
    hidden matrices :math:`1/m_\text{in}`, the readout's weight :math:`1/m` (muP's effective
    rate through its :math:`1/m` input multiplier), every other tensor 1, times the base
    rate; with ``torch.optim.SGD``, muP's SGD rules (:func:`_mup_ratios`). A test trains it
    beside ``apply_mup``'s model: the same function after every step (Adam: up to its
    ``eps``; the weight decay of AdamW is not muP's, FLeRM scaling it with the rate). FLeRM's
    probe still runs at step 0, so the run differs from ``readout_built_upstream_static``
    only in the rates.

    It separates, on a cell where ``readout_built_upstream`` trails muP, the rates (this
    control at muP's loss) from everything else (this control at the rule's loss).

    Args:
        *args: :class:`ReadoutWidthBuiltFLeRM`'s.
        **kwargs: :class:`ReadoutWidthBuiltFLeRM`'s.
    """

    def _set_point(self, step: int, fslr: Mapping[str, float]) -> SetPoint:
        point = super()._set_point(step, fslr)
        self.ratios.update(_mup_ratios(self))
        return dataclasses.replace(point, lrs=self._lrs_at(step))


def _mup_ratios(flerm: FLeRM) -> dict[str, float]:
    """muP's rate factors (its Adam rules; its SGD rules for ``torch.optim.SGD``) of the
    tensors ``flerm`` drives, on a model whose readout :func:`~fslr_func.scale_readout`
    scaled, whose weight :math:`W` is muP's :math:`W'/m` (muP's :math:`1/m` input
    multiplier): its factor is muP's over :math:`m` (Adam, scale-free updates) or
    :math:`m^2` (SGD, whose gradient carries the :math:`1/m` too). Adam: hidden matrices
    :math:`1/m_\text{in}`, the readout's weight :math:`1/m`, others 1."""
    prefix, model, shapes = flerm.fm.name_prefix, flerm.fm.module, flerm.base.shapes
    kind = "sgd" if isinstance(flerm.optimizer, torch.optim.SGD) else "adam"
    factors = {g["name"]: g["lr"] for g in mup.mup_groups(model, shapes, 1.0, optimizer=kind)}
    readout = next(n for n, m in model.named_modules() if hasattr(m, READOUT_SCALE_MARK))
    weight = f"{readout}.weight" if readout else "weight"
    m = mup.width_mults(model, shapes)[weight][1] or 1.0
    factors[weight] /= m ** (2 if kind == "sgd" else 1)
    return {name: factors[name.removeprefix(prefix)] for name in flerm.names}


class ReadoutMuPAnchorFLeRM(ReadoutUpstreamFLeRM):
    r""":class:`ReadoutUpstreamFLeRM`'s re-matching to the base's trajectory, anchored at
    muP's rates instead of its own step-0 match: at set point :math:`t`,

    .. math::

        r_W(t) = r^\mu_W \, \frac{r^\text{up}_W(t)}{r^\text{up}_W(0)},

    :math:`r^\mu_W` muP's factor (:class:`ReadoutBuiltMuPRatesFLeRM`) and
    :math:`r^\text{up}_W` the ratio ``readout_built_upstream`` matches. Matched once it is
    the control; the question is whether the re-matching, which put the rule below muP on
    the ResMLP, keeps that lead from muP's start, where the rule's own step-0 rates lose
    (the PreNorm transformer).

    Args:
        *args: :class:`ReadoutUpstreamFLeRM`'s.
        **kwargs: :class:`ReadoutUpstreamFLeRM`'s.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._first: dict[str, float] | None = None
        self._matched: dict[str, float] | None = None

    def _set_point(self, step: int, fslr: Mapping[str, float]) -> SetPoint:
        if self._matched is not None:  # match on the rule's own ratios, not the anchored ones
            self.ratios.clear()
            self.ratios.update(self._matched)
        point = super()._set_point(step, fslr)
        self._matched = dict(self.ratios)
        first = self._first = self._first or dict(self.ratios)
        anchor = self._anchors()
        for name, ratio in self._matched.items():
            if first.get(name, 0.0) > 0 and name in anchor:
                self.ratios[name] = anchor[name] * ratio / first[name]
        return dataclasses.replace(point, lrs=self._lrs_at(step))

    def _anchors(self) -> dict[str, float]:
        """The tensors started from muP's rates, with muP's factors: every one."""
        return _mup_ratios(self)


class ReadoutMuPHiddenFLeRM(ReadoutMuPAnchorFLeRM):
    """:class:`ReadoutMuPAnchorFLeRM` with only the hidden matrices (fan-out and fan-in both
    wider than the base's) started from muP's rates; every other tensor keeps
    ``readout_built_upstream``'s own: it asks whether the rule's loss to muP on the PreNorm
    transformer is its hidden matrices' rates (its step-0 rates 0.11-0.34 of the base's,
    muP's 0.125), or the others'.

    Args:
        *args: :class:`ReadoutMuPAnchorFLeRM`'s.
        **kwargs: :class:`ReadoutMuPAnchorFLeRM`'s.
    """

    def _anchors(self) -> dict[str, float]:
        hidden = {self.fm.name_prefix + n for n in self._hidden()}
        return {n: f for n, f in _mup_ratios(self).items() if n in hidden}


def local_gains(fm: FSLRModule, m: Any, names: Collection[str] | None = None) -> dict[str, float]:
    r"""Per tensor, its *local* gain: the model output's movement over the movement of the
    output of the module that holds it (both :func:`~fslr_func.exact`, RMS per coordinate),
    for a measured step's update, on its first probe batch, at the weights before the step,
    by bare name. The readout's own tensors (whose module output is the model's) have gain 1;
    a tensor whose module returns no tensor, or whose update moves neither, is left out.

    ``feature_gains``'s gain with the features taken at each tensor's own layer instead of
    the readout's input: matching it (the base's gain over the scaled one's, times the
    output-matched ratio) holds each layer's own output movement per step at the base's,
    which under Adam is muP's rule where muP's assumptions hold (a hidden matrix's
    sign-like update moves its output :math:`\propto` fan-in) and is measured where they
    do not.

    Args:
        fm: the wrapper that measured the step.
        m: the step's measurement (its ``delta``, ``before`` and ``inputs``).
        names: the tensors to measure, by bare name (default: every tensor the step moved).

    Examples:
        >>> import types, torch, fslr_func as ff
        >>> net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
        >>> delta = {n: 0.1 * torch.ones_like(p) for n, p in net.named_parameters()}
        >>> m = types.SimpleNamespace(delta=delta, before={}, inputs=[torch.randn(8, 3)])
        >>> gains = local_gains(ff.with_fslr(net), m)
        >>> sorted(gains), round(gains["1.weight"], 6)  # the readout's own layer: gain 1
        (['0.bias', '0.weight', '1.bias', '1.weight'], 1.0)
    """
    prefix, model = fm.name_prefix, fm.module
    delta = {n: d for n, d in m.delta.items() if names is None or n.removeprefix(prefix) in names}
    point = {**{n: p for n, p in model.named_parameters() if p.requires_grad}, **m.before}
    owners: dict[str, dict[str, torch.Tensor]] = {}
    for name, d in delta.items():
        owners.setdefault(name.rpartition(".")[0], {})[name] = d
    gains: dict[str, float] = {}
    for owner, own in owners.items():
        try:
            found = feature_gains(
                model,
                m.inputs[0],
                own,
                readout=owner,
                at_output=True,
                params=point,
                output_fn=fm.options.output_fn,
                forward_seed=fm.options.forward_seed,
            )
        except NoReadoutError:
            continue  # no layer output to measure: the tensor stays output-matched
        gains.update({n.removeprefix(prefix): g for n, g in found.items()})
    return gains


class LocalGainRecorder(Recorder):
    """A base run's recorder that keeps :func:`local_gains` of its first recorded update in
    ``record.meta["feature_gain"]``, where :class:`ReadoutLocalFLeRM` reads its base gains.

    Args:
        *args: :class:`~fslr_func.training.recorder.Recorder`'s.
        **kwargs: :class:`~fslr_func.training.recorder.Recorder`'s.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **{**kwargs, "feature_gains": True})

    def _measured(self, m: Any) -> None:
        if "feature_gain" not in self.record.meta:
            self.record.meta["feature_gain"] = local_gains(self.fm, m)
        super()._measured(m)


class ReadoutLocalFLeRM(ReadoutWidthBuiltFLeRM):
    r""":class:`ReadoutUpstreamFLeRM` with each tensor's *own layer's* output movement matched
    instead of the readout input's: ``scale_readout``, then every tensor's output-matched
    ratio times :math:`G^\text{scaled}_W / G^\text{base}_W`, :math:`G` its
    :func:`local_gains` (model output movement over its module's output movement, measured at
    the first set point; the base's by :class:`LocalGainRecorder`), so that each layer's
    output moves per step as the base's did. The readout's tensors have gain 1 in both:
    output-matched.

    Args:
        *args: :class:`ReadoutWidthBuiltFLeRM`'s.
        **kwargs: :class:`ReadoutWidthBuiltFLeRM`'s (``hidden_features`` is ``True``).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **{**kwargs, "hidden_features": True, "match": "features_all"})

    def _feature_factors(self, m: Any) -> dict[str, float]:
        prefix = self.fm.name_prefix
        wanted = self._feature_matched()
        gains = local_gains(self.fm, m, names={n for n in wanted if n in self.base_gains})
        return {prefix + n: g / self.base_gains[n] for n, g in gains.items()}


class ReadoutInitWindowFLeRM(ReadoutInitFLeRM, WindowFLeRM):
    """:class:`ReadoutInitFLeRM`'s readout scale before the first step, then
    :class:`WindowFLeRM`'s re-match of the hidden tensors only (``feature_window30h``'s
    window, the readout carrying the feature factor): the conv nets' drift of the hidden
    tensors' movement after the first step, which the window fixes, on muP's small readout.

    Args:
        *args: :class:`WindowFLeRM`'s.
        **kwargs: :class:`WindowFLeRM`'s (the base record needs its feature gains).
    """

    def _adjust(self, ratios: dict[str, float]) -> dict[str, float]:
        hidden = {self.fm.name_prefix + n for n in self._hidden()}
        return {n: r for n, r in ratios.items() if n in hidden}


class GainTrackingFLeRM(FLeRM):
    r"""``match="features"`` with the gains followed through training: at every set point
    (``mode="periodic"``) each hidden tensor's factor is re-measured,
    :math:`G^\text{scaled}_W(t) / G^\text{base}_W(t')` with :math:`t'` the base record's
    latest step at or before :math:`t` (:class:`GainTrackingRecorder`), and multiplies its
    output-matched ratio of step 0 (output movement is matched once). The base's gains are
    those of the mean record's first seed.

    Args:
        *args: :class:`~fslr_func.training.flerm.FLeRM`'s.
        **kwargs: :class:`~fslr_func.training.flerm.FLeRM`'s.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **{**kwargs, "match": "features"})
        self._output: dict[str, float] | None = None

    def _measured(self, m: Any) -> None:
        at = self.base.meta.get("feature_gain_at", {})
        steps = [int(s) for s in at if int(s) <= self.t]
        if steps:
            gains = at[str(max(steps))]
            self.base_gains = {n: float(g) for n, g in gains.items() if g > 0}
        self.feature_factors = self._feature_factors(m)
        super()._measured(m)

    def _set_point(self, step: int, fslr: Mapping[str, float]) -> SetPoint:
        factors = self.feature_factors or {}
        if self._output is None:
            point = super()._set_point(step, fslr)
            self._output = {n: r / factors.get(n, 1.0) for n, r in self.ratios.items()}
            return point
        self.ratios.update({n: r * factors.get(n, 1.0) for n, r in self._output.items()})
        return SetPoint(step=step, lrs=self._lrs_at(step), fslr=dict(fslr), targets={}, held=())


@dataclass(frozen=True)
class Variant:
    """A FLeRM variant: how its controller is made, and how its runs are probed.

    Attributes:
        make: ``make(fm, optimizer, base, *, steps, **flerm_kwargs) -> controller`` with
            FLeRM's ``step()`` context manager and ``history``.
        doc: one line for tables.
        recorder: makes the base runs' recorder (``Recorder``'s signature); ``None``: the
            library's.
        probe: ``with_fslr`` keywords of the variant's base recordings and FLeRM runs
            (e.g. ``beta=0``: each probe its own estimate).
    """

    make: Callable[..., Any]
    doc: str
    probe: Mapping[str, Any] = field(default_factory=dict)
    recorder: Callable[..., Recorder] | None = None


def _window(
    fraction: float,
    cumulative: bool,
    alpha: float | None = None,
    cls: type[WindowFLeRM] = WindowFLeRM,
    **options: Any,
) -> Callable[..., WindowFLeRM]:
    def make(
        fm: FSLRModule,
        optimizer: torch.optim.Optimizer,
        base: FSLRRecord,
        *,
        steps: int,
        every: int = 10,
        policy: policies.PolicySpec = "identity",
        **kwargs: Any,
    ) -> WindowFLeRM:
        hi = max(every, int(fraction * steps) // every * every)
        if alpha is not None:
            policy = HiddenWidthPolicy(fm.module, base.shapes, alpha=alpha, inner=policy)
        return cls(
            fm,
            optimizer,
            base,
            window=(every, hi),
            cumulative=cumulative,
            every=every,
            policy=policy,
            **options,
            **kwargs,
        )

    return make


def _hidden_width(alpha: float) -> Callable[..., FLeRM]:
    def make(
        fm: FSLRModule,
        optimizer: torch.optim.Optimizer,
        base: FSLRRecord,
        *,
        steps: int,
        policy: policies.PolicySpec = "identity",
        **kwargs: Any,
    ) -> FLeRM:
        pol = HiddenWidthPolicy(fm.module, base.shapes, alpha=alpha, inner=policy)
        return FLeRM(fm, optimizer, base, policy=pol, **kwargs)

    return make


_GAINS = functools.partial(Recorder, feature_gains=True)
"""The base runs' recorder of the variants that read feature gains."""


def _flerm(
    cls: type[FLeRM] = FLeRM, *, periodic: bool = False, **options: Any
) -> Callable[..., FLeRM]:
    """``make`` of a variant that is ``cls`` built with ``options`` (``periodic``: set points
    every 10 steps)."""

    def make(
        fm: FSLRModule, optimizer: torch.optim.Optimizer, base: FSLRRecord, *, steps: int, **kw: Any
    ) -> FLeRM:
        every = {"mode": "periodic", "every": 10} if periodic else {}
        return cls(fm, optimizer, base, **{**kw, **options, **every})

    return make


BUDGET_POWER_STEPS = 150
"""The budget at which :func:`budget_power` is 1 (the matrix's 150-step cells)."""


def budget_power(steps: int, slope: float = 0.25) -> float:
    r"""``feature_power`` for a run of ``steps`` steps: :math:`\max(0, 1 + s \log_2(T / 150))`,
    1 at 150 steps and 1.5 at 600 (the powers that were within 2% of re-tuning on the
    matrix's 150 and 600-step cells; docs/reproduction.md), :math:`s` = ``slope`` per
    doubling of the budget. Fitted on those cells, not derived.

    Examples:
        >>> budget_power(150), budget_power(300), budget_power(600), round(budget_power(60), 3)
        (1.0, 1.25, 1.5, 0.67)
    """
    return max(0.0, 1.0 + slope * math.log2(steps / BUDGET_POWER_STEPS))


def _feature_budget(
    fm: FSLRModule, optimizer: torch.optim.Optimizer, base: FSLRRecord, *, steps: int, **kw: Any
) -> FLeRM:
    options = {**kw, "match": "features", "feature_power": budget_power(steps)}
    return FLeRM(fm, optimizer, base, **options)


VARIANTS: dict[str, Variant] = {
    "window30": Variant(
        _window(0.3, cumulative=False),
        "step-0 set point, then movement matched over steps 10..30% of the budget, held",
        {"beta": 0.0, "samples": 32},
    ),
    "window_all": Variant(
        _window(1.0, cumulative=True),
        "step-0 set point, then re-matched at every probe to the movement summed since step 10",
        {"beta": 0.0, "samples": 32},
    ),
    "hidden_sqrt_window30": Variant(
        _window(0.3, cumulative=False, alpha=0.5),
        "hidden_sqrt's targets, matched at step 0 and then over steps 10..30% of the budget",
        {"beta": 0.0, "samples": 32},
    ),
    "feature": Variant(
        _flerm(match="features"),
        "static FLeRM, hidden tensors re-scaled to the base's feature movement (measured)",
        recorder=_GAINS,
    ),
    "feature_periodic": Variant(
        _flerm(match="features", periodic=True),
        "feature's hidden factors (measured at step 0) on output matching every 10 steps",
        recorder=_GAINS,
    ),
    "feature_track": Variant(
        _flerm(GainTrackingFLeRM, periodic=True),
        "feature with its hidden factors re-measured every 10 steps on the step-0 ratios",
        recorder=GainTrackingRecorder,
    ),
    "feature_sq": Variant(
        _flerm(match="features", feature_power=2.0),
        "feature with the square of its hidden factors",
        recorder=_GAINS,
    ),
    "feature_p15": Variant(
        _flerm(match="features", feature_power=1.5),
        "feature with its hidden factors to the power 1.5",
        recorder=_GAINS,
    ),
    "feature_budget": Variant(
        _feature_budget,
        "feature with its hidden factors to the power budget_power(steps): 1 at 150 steps, "
        "1.5 at 600",
        recorder=_GAINS,
    ),
    "feature_window30": Variant(
        _window(0.3, cumulative=False, cls=FeatureWindowFLeRM),
        "feature's hidden factors, rates matched at step 0 and over steps 10..30% of the budget",
        {"beta": 0.0, "samples": 32},
        recorder=_GAINS,
    ),
    "feature_window30h": Variant(
        _window(0.3, cumulative=False, cls=FeatureWindowFLeRM, hidden_only=True),
        "feature_window30, the window re-matching the hidden tensors only",
        {"beta": 0.0, "samples": 32},
        recorder=_GAINS,
    ),
    "feature_fwindow30h": Variant(
        _window(0.3, cumulative=False, cls=FeatureSpaceWindowFLeRM),
        "feature, then the hidden tensors' feature movement matched over steps 10..30% of the "
        "budget (gains measured at every probe, base and scaled)",
        {"beta": 0.0, "samples": 32},
        recorder=GainTrackingRecorder,
    ),
    "feature_fcumulative": Variant(
        _window(1.0, cumulative=True, cls=FeatureSpaceWindowFLeRM),
        "feature, then at every probe the hidden tensors' feature movement summed since step "
        "10 matched to the base's (gains measured at every probe)",
        {"beta": 0.0, "samples": 32},
        recorder=GainTrackingRecorder,
    ),
    "feature_window30h_p15": Variant(
        _window(0.3, cumulative=False, cls=FeatureWindowFLeRM, hidden_only=True, feature_power=1.5),
        "feature_window30h with feature_power 1.5",
        {"beta": 0.0, "samples": 32},
        recorder=_GAINS,
    ),
    "feature_window30h_p15_up": Variant(
        _window(
            0.3,
            cumulative=False,
            cls=FeatureWindowFLeRM,
            hidden_only=True,
            raise_only=True,
            feature_power=1.5,
        ),
        "feature_window30h_p15 whose window only raises rates",
        {"beta": 0.0, "samples": 32},
        recorder=_GAINS,
    ),
    "readout_gain": Variant(
        _flerm(ReadoutGainFLeRM, periodic=True),
        "readout times the base's feature gain over the scaled (measured at step 0), "
        "output movement matched every 10 steps",
        recorder=_GAINS,
    ),
    "readout_gain2": Variant(
        _flerm(ReadoutGainFLeRM, periodic=True, power=2.0),
        "readout_gain with the square of its factor (muP's 1/m where the gain grows as sqrt m)",
        recorder=_GAINS,
    ),
    "readout_init": Variant(
        _flerm(ReadoutInitFLeRM, periodic=True),
        "readout times the base's feature gain over the scaled before step 0, output movement "
        "matched every 10 steps",
        recorder=_GAINS,
    ),
    "readout_width": Variant(
        _flerm(ReadoutWidthFLeRM, periodic=True),
        "readout_init with muP's readout scale sqrt(base fan-in / fan-in) instead of the "
        "measured gain ratio",
        recorder=_GAINS,
    ),
    "readout_init_static": Variant(
        _flerm(ReadoutInitFLeRM),
        "readout_init with output movement matched once, at step 0 (static)",
        recorder=_GAINS,
    ),
    "readout_width_static": Variant(
        _flerm(ReadoutWidthFLeRM),
        "readout_width with output movement matched once, at step 0 (static)",
        recorder=_GAINS,
    ),
    "readout_init_fresh": Variant(
        _flerm(ReadoutInitFreshFLeRM, periodic=True),
        "readout_init with its first step taken back (the readout scaled, the optimiser's "
        "state cleared): the first update is the scaled model's",
        recorder=_GAINS,
    ),
    "readout_built": Variant(
        _flerm(ReadoutWidthBuiltFLeRM, periodic=True),
        "readout_width with the readout scaled before the first forward (muP's forward from "
        "the first gradient), output movement matched every 10 steps",
        recorder=_GAINS,
    ),
    "readout_built_features": Variant(
        _flerm(ReadoutWidthBuiltFLeRM, periodic=True, hidden_features=True),
        "readout_built with the hidden tensors' feature movement matched (gains measured on "
        "the scaled readout), the others' output movement",
        recorder=_GAINS,
    ),
    "readout_built_auto": Variant(
        _flerm(ReadoutWidthBuiltFLeRM, periodic=True, hidden_features=0.5),
        "readout_built with the hidden tensors matched in feature space where output matching "
        "would move their features more than twice the base's (mean factor below 1/2)",
        recorder=_GAINS,
    ),
    "readout_built_upstream": Variant(
        _flerm(ReadoutUpstreamFLeRM, periodic=True),
        "readout_built with every tensor upstream of the readout (input layer, embeddings, "
        "biases, norms, hidden matrices) matched in feature space, the readout in output space",
        recorder=_GAINS,
    ),
    "readout_built_upstream_static": Variant(
        _flerm(ReadoutUpstreamFLeRM),
        "readout_built_upstream matched once, at step 0 (static): its step-0 rates held",
        recorder=_GAINS,
    ),
    "readout_built_mup_rates": Variant(
        _flerm(ReadoutBuiltMuPRatesFLeRM),
        "a control: scale_readout, then muP's rates held from step 0 instead of FLeRM's",
        recorder=_GAINS,
    ),
    "readout_built_local": Variant(
        _flerm(ReadoutLocalFLeRM, periodic=True),
        "readout_built with every tensor's own layer output movement matched (local gains "
        "measured at the first set point), the readout in output space",
        recorder=LocalGainRecorder,
    ),
    "readout_built_mup_anchor": Variant(
        _flerm(ReadoutMuPAnchorFLeRM, periodic=True),
        "readout_built_upstream's re-matching every 10 steps relative to its step 0, from "
        "muP's rates at step 0",
        recorder=_GAINS,
    ),
    "readout_built_mup_hidden": Variant(
        _flerm(ReadoutMuPHiddenFLeRM, periodic=True),
        "readout_built_mup_anchor with only the hidden matrices started from muP's rates, the "
        "other tensors from the rule's own",
        recorder=_GAINS,
    ),
    "readout_built_static": Variant(
        _flerm(ReadoutWidthBuiltFLeRM),
        "readout_built with output movement matched once, at step 0 (static)",
        recorder=_GAINS,
    ),
    "readout_init_window30h": Variant(
        _window(0.3, cumulative=False, cls=ReadoutInitWindowFLeRM),
        "readout_init's readout scale before step 0, output movement matched at step 0, then "
        "the hidden tensors' over steps 10..30% of the budget",
        {"beta": 0.0, "samples": 32},
        recorder=_GAINS,
    ),
    "exact": Variant(
        _flerm(),
        "static FLeRM with every FSLR, the base's and the scaled run's, measured exactly by "
        "forward-mode AD (with_fslr(..., estimator='exact')) instead of estimated by kron",
        {"estimator": "exact"},
    ),
    "readout_built_upstream_exact": Variant(
        _flerm(ReadoutUpstreamFLeRM, periodic=True),
        "readout_built_upstream with exact FSLRs (estimator='exact')",
        {"estimator": "exact"},
        recorder=_GAINS,
    ),
    "hidden_sqrt": Variant(
        _hidden_width(0.5),
        "static FLeRM, hidden tensors' targets times sqrt(fan-in multiplier)",
    ),
}
"""The FLeRM variants the transfer matrix measures (``SweepConfig.flerm_variant``), by name;
their probes take 32 omega samples, each its own estimate (``beta=0``)."""
