"""What a learning-rate transfer sweep runs: :class:`SweepConfig`, and the demo's defaults.

A sweep trains one model family at several *scales* along one *axis* (width, depth, both
together, or initialisation scale; the smallest scale is the base model) for every learning
rate and seed, once with the plain optimiser at that learning rate (``"standard"``), once in
muP with the base model as muP's base shapes (``"mup"``, :mod:`fslr_func.experiments.mup`) and
once with FLeRM driven by the base model's FSLRs recorded at that learning rate
(``"flerm"``). A config is plain, frozen and JSON-able: every run of a sweep is a pure function
of its config and ``(mode, scale, lr, seed)``, which is what makes the sweep cache
(:mod:`fslr_func.experiments.cache`) safe.

:data:`DEMO` is the configuration of ``fslr demo``: change the demo here, in one place.

Examples:
    >>> cfg = SweepConfig(scales=(1, 2), lrs=octaves(-8, -6), steps=20, seeds=1)
    >>> cfg.base_scale, cfg.policy, [f"{lr:g}" for lr in cfg.lrs]
    (1.0, 'identity', ['0.00390625', '0.0078125', '0.015625'])
    >>> SweepConfig(axis="depth").policy, SweepConfig(axis="depth", flerm_policy="equal").policy
    ('share_blocks', 'equal')
    >>> SweepConfig(axis="sideways").validate()  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    fslr_func.experiments.configs.ConfigError: axis: must be one of width, depth, width_depth, ...
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from fslr_func.experiments.models import NormType
from fslr_func.experiments.train import OPTIMIZERS, SCHEDULES
from fslr_func.experiments.variants import VARIANTS
from fslr_func.probe.options import STRATEGIES, Strategy
from fslr_func.training.flerm import Mode
from fslr_func.training.policies import POLICIES

__all__ = [
    "AXES",
    "CONV_MODELS",
    "DATA",
    "DATA_SEEDS",
    "DEMO",
    "DEPTH_AXES",
    "FLERM_INITS",
    "MODELS",
    "MODES",
    "NORMS",
    "WIDTH_AXES",
    "ConfigError",
    "SweepConfig",
    "lr_key",
    "model_defaults",
    "octaves",
    "scale_key",
]

AXES = ("width", "depth", "width_depth", "init_scale")
"""Axes a sweep can scale; the base model is the smallest scale. ``width_depth`` multiplies the
width and the number of blocks by the same scale."""
WIDTH_AXES = ("width", "width_depth")
"""Axes that change the width."""
DEPTH_AXES = ("depth", "width_depth")
"""Axes that change the number of blocks (FLeRM's default policy there: ``share_blocks``)."""
FLERM_INITS = ("standard", "mup")
"""Initialisations of FLeRM's models (:attr:`SweepConfig.flerm_init`)."""
MODELS = ("resmlp", "transformer", "resconv", "resconv_bn")
"""Built-in model families: the paper's ResMLP and transformer, and residual conv nets
(:class:`~fslr_func.experiments.models.ResConvNet`, width = channels) without and with
BatchNorm, 1-D on ``mnist1d``, 2-D (8x8) on ``digits`` and ``digits_aug``."""
CONV_MODELS = ("resconv", "resconv_bn")
"""Models whose width is a number of conv channels."""
DATA: dict[str, tuple[str, ...]] = {
    "resmlp": ("mnist1d", "digits", "digits_aug"),
    "transformer": ("text",),
    "resconv": ("mnist1d", "digits", "digits_aug"),
    "resconv_bn": ("mnist1d", "digits", "digits_aug"),
}
"""Data sets each built-in model can train on."""
DATA_SEEDS: dict[str, int] = {"mnist1d": 42, "digits_aug": 0}
"""Data sets generated from a seed (:attr:`SweepConfig.data_seed`), with their default seed."""
MODES = ("standard", "mup", "flerm")
"""Training modes compared by a sweep."""
NORMS = ("prenorm", "postnorm", "prenormpostmod")
"""Norm placements of the built-in transformer
(:class:`~fslr_func.experiments.models.Transformer`)."""

_NOT_RUN_FIELDS = ("scales", "lrs", "seeds", "modes")
"""Fields that do not change what a single run computes (so not part of its cache fingerprint)."""


class ConfigError(ValueError):
    """An invalid :class:`SweepConfig` field; ``field`` names it (the CLI maps it to a flag).

    Attributes:
        field: the offending field of :class:`SweepConfig`.
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def octaves(lo: int, hi: int, per_octave: int = 1) -> tuple[float, ...]:
    """Learning rates ``2**lo .. 2**hi``, ``per_octave`` of them per factor of two.

    Examples:
        >>> octaves(-3, -1)
        (0.125, 0.25, 0.5)
        >>> [round(x, 3) for x in octaves(-1, 0, per_octave=2)]
        [0.5, 0.707, 1.0]
    """
    if hi < lo or per_octave < 1:
        raise ValueError(f"need lo <= hi and per_octave >= 1, got {lo}, {hi}, {per_octave}")
    n = (hi - lo) * per_octave
    return tuple(2.0 ** (lo + i / per_octave) for i in range(n + 1))


def model_defaults(model: str) -> dict[str, Any]:
    """Config fields whose sensible default depends on the model family.

    Examples:
        >>> model_defaults("transformer")["data"]
        'text'
    """
    if model == "transformer":
        return {
            "data": "text",
            "width": 32,
            "depth": 2,
            "batch_size": 16,
            "seq_len": 64,
            "lrs": octaves(-12, -4),
        }
    if model in CONV_MODELS:
        return {
            "model": model,
            "data": "mnist1d",
            "width": 16,
            "depth": 4,
            "batch_size": 128,
            "lrs": octaves(-12, -3),
        }
    return {
        "data": "mnist1d",
        "width": 32,
        "depth": 4,
        "batch_size": 128,
        "lrs": octaves(-12, -4),
    }


@dataclass(frozen=True)
class SweepConfig:
    """A learning-rate transfer sweep: models, data, budget, grid and FSLR settings.

    Attributes:
        model: ``"resmlp"`` (paper Appendix A.1), ``"transformer"`` (A.2), ``"resconv"`` or
            ``"resconv_bn"`` (a residual conv net without or with BatchNorm, 1-D on
            ``mnist1d``, 2-D on 8x8 images: :class:`~fslr_func.experiments.models.ResConvNet`).
        axis: ``"width"``, ``"depth"``, ``"width_depth"`` (both by the same multiplier) or
            ``"init_scale"``.
        scales: multipliers of the base model along ``axis``; the smallest is the base.
            Width and depth multipliers must give whole numbers of units and blocks.
        lrs: learning rates (the base model's ``lr_0`` in FLeRM and muP modes).
        steps: optimiser steps per run.
        seeds: seeds per (mode, scale, lr); base records are averaged over them (paper: 8).
        data: ``"mnist1d"``, ``"digits"`` or ``"digits_aug"`` (ResMLP and conv nets;
            :func:`~fslr_func.experiments.data.digits_aug`: shifted, noised digits),
            ``"text"`` (transformer: Python's own documentation, bytes).
        data_seed: the generation seed of ``mnist1d`` or ``digits_aug`` (another data set of
            the same kind); ``None``: the data set's default (:data:`DATA_SEEDS`).
        batch_size: training (and probe) batch size.
        width: base width: the ResMLP hidden dimension, the transformer's ``d_model``
            (``d_ff = 4 * width``, 16-dimensional heads), the conv nets' channels.
        depth: base number of residual blocks.
        init_scale: base initialisation scale of the block weights.
        num_samples: size of the generated MNIST-1D data set (train + test).
        seq_len: context length of the transformer.
        norm: the transformer's norm placement, ``"prenorm"`` (``x + f(Norm(x))``),
            ``"postnorm"`` (``Norm(x + f(x))``) or ``"prenormpostmod"`` (``x + Norm(f(x))``);
            the ResMLP has no norms and takes only the default, ``"prenorm"``.
        last: the loss of a run is its training loss averaged over its last ``last`` batches
            (the paper: 200); a diverged run scores infinity.
        samples: omega samples per FSLR probe.
        warmup_samples: omega samples of the EMA warm-up (paper: 40).
        every: the base runs record an FSLR probe every ``every`` steps (the FSLR-vs-time
            plot); periodic FLeRM resets the rates every ``every`` steps.
        flerm_policy: FLeRM's policy by name (:data:`fslr_func.training.policies.POLICIES`), e.g.
            the paper's ablations ``"equal"`` and ``"equal_all"``; ``None``: the axis's own
            (:attr:`policy`).
        flerm_init: the models of FLeRM's runs: ``"standard"`` (the task's own) or ``"mup"``
            (muP's initialisation and readout multiplier,
            :func:`~fslr_func.experiments.mup.mup_init_task`; FLeRM still sets every rate; the
            same model as the task's at the base scale).
        flerm_mode: ``"static"`` (the paper's main results: rates set once, at step 0, after
            the EMA warm-up) or ``"periodic"`` (and again every ``every`` steps, matching the
            base record over time).
        flerm_variant: a FLeRM variant of :data:`fslr_func.experiments.variants.VARIANTS`
            for the FLeRM runs (prototypes measured on the transfer matrix); ``None``: FLeRM.
        modes: which of ``"standard"``, ``"mup"`` and ``"flerm"`` to run.
        optimizer: ``"adam"``, ``"adamw"``, ``"sgd"`` (momentum 0.9), ``"signsgd"``,
            ``"adagrad"`` or ``"adamax"`` (:func:`~fslr_func.experiments.train.make_optimizer`).
        weight_decay: the optimiser's weight decay (decoupled for AdamW).
        schedule: ``"constant"``, ``"cosine"`` or ``"warmup_cosine"`` (10% linear warm-up);
            FLeRM follows the scaled run's own schedule.
        strategy: the probe strategy of every run (:func:`fslr_func.with_fslr`). Pinned, not
            ``"auto"``: ``"auto"`` decides by timing and vmap and the loop differ in float
            rounding, while a sweep must be reproducible (FLeRM at the base scale reproduces
            the standard run exactly).
    """

    model: str = "resmlp"
    axis: str = "width"
    scales: tuple[float, ...] = (1, 2, 4, 8)
    lrs: tuple[float, ...] = field(default_factory=lambda: model_defaults("resmlp")["lrs"])
    steps: int = 150
    seeds: int = 2
    data: str = "mnist1d"
    data_seed: int | None = None
    batch_size: int = 128
    width: int = 32
    depth: int = 4
    init_scale: float = 1.0
    num_samples: int = 25000
    seq_len: int = 64
    norm: NormType = "prenorm"
    last: int = 30
    samples: int = 8
    warmup_samples: int = 40
    every: int = 10
    flerm_policy: str | None = None
    flerm_init: str = "standard"
    flerm_mode: Mode = "static"
    flerm_variant: str | None = None
    modes: tuple[str, ...] = MODES
    strategy: Strategy = "vmap"
    optimizer: str = "adam"
    weight_decay: float = 0.0
    schedule: str = "constant"

    def __post_init__(self) -> None:
        # normalise sequences to sorted/ordered tuples of floats, so equal configs compare equal
        object.__setattr__(self, "scales", tuple(sorted(float(s) for s in self.scales)))
        object.__setattr__(self, "lrs", tuple(sorted(float(lr) for lr in self.lrs)))
        object.__setattr__(self, "modes", tuple(m for m in MODES if m in self.modes))

    @classmethod
    def for_model(cls, model: str = "resmlp", **overrides: Any) -> SweepConfig:
        """A config with the model family's defaults (:func:`model_defaults`), then overrides.

        Examples:
            >>> SweepConfig.for_model("transformer", steps=10).depth
            2
        """
        return cls(**{"model": model, **model_defaults(model), **overrides})

    # ------------------------------------------------------------------ derived

    @property
    def base_scale(self) -> float:
        """The smallest scale: the base model."""
        return self.scales[0]

    @property
    def task_name(self) -> str:
        """Name of the built-in task (model family and data), part of the cache fingerprint.

        A transformer with another norm placement than PreNorm names it.

        Examples:
            >>> SweepConfig().task_name
            'resmlp/mnist1d'
            >>> SweepConfig.for_model("transformer", norm="postnorm").task_name
            'transformer-postnorm/text'
        """
        norm = "" if self.norm == "prenorm" else f"-{self.norm}"
        seed = "" if self.data_seed is None else f"-seed{self.data_seed}"
        return f"{self.model}{norm}/{self.data}{seed}"

    @property
    def train_size(self) -> int | None:
        """Training samples of a classification data set (``None`` for text).

        Examples:
            >>> SweepConfig(num_samples=25000).train_size, SweepConfig(data="digits").train_size
            (20000, 1438)
        """
        if self.data == "digits":
            return 1438
        if self.data == "mnist1d":
            return int(self.num_samples // 10 * 10 * 0.8)
        if self.data == "digits_aug":
            return int(self.num_samples * 0.8)
        return None

    @property
    def policy(self) -> str:
        """FLeRM's policy: :attr:`flerm_policy` if set, else the axis's: ``share_blocks`` where
        the depth changes, ``identity`` otherwise."""
        if self.flerm_policy is not None:
            return self.flerm_policy
        return "share_blocks" if self.axis in DEPTH_AXES else "identity"

    def model_kwargs(self, scale: float) -> dict[str, Any]:
        """Width, depth and init scale of the model at ``scale`` along :attr:`axis`.

        Examples:
            >>> SweepConfig(width=32, depth=4).model_kwargs(4)
            {'width': 128, 'depth': 4, 'init_scale': 1.0}
            >>> SweepConfig(axis="depth", depth=4).model_kwargs(2)
            {'width': 32, 'depth': 8, 'init_scale': 1.0}
            >>> SweepConfig(axis="width_depth", width=32, depth=4).model_kwargs(2)
            {'width': 64, 'depth': 8, 'init_scale': 1.0}
        """
        width, depth, init_scale = self.width, self.depth, self.init_scale
        if self.axis in WIDTH_AXES:
            width = round(width * scale)
        if self.axis in DEPTH_AXES:
            depth = round(depth * scale)
        if self.axis == "init_scale":
            init_scale = init_scale * scale
        return {"width": width, "depth": depth, "init_scale": init_scale}

    # ------------------------------------------------------------------ validation

    def validate(self, builtin: bool = True) -> SweepConfig:
        """Check every field; returns ``self``.

        Args:
            builtin: also check what only matters for the built-in models and data (model,
                data, whole widths and depths, batch size against the data set); ``False``
                for a sweep of your own :class:`~fslr_func.experiments.task.Task`.

        Raises:
            ConfigError: naming the first invalid field.
        """

        def need(ok: bool, name: str, message: str) -> None:
            if not ok:
                raise ConfigError(name, message)

        need(self.axis in AXES, "axis", f"must be one of {', '.join(AXES)}, got {self.axis!r}")
        if builtin:
            need(
                self.model in MODELS,
                "model",
                f"must be one of {', '.join(MODELS)}, got {self.model!r}",
            )
            allowed = DATA[self.model]
            need(
                self.data in allowed,
                "data",
                f"model {self.model!r} trains on {' or '.join(allowed)}, got {self.data!r}",
            )
        need(
            self.strategy in STRATEGIES,
            "strategy",
            f"must be one of {', '.join(STRATEGIES)}, got {self.strategy!r}",
        )
        for name in ("steps", "seeds", "batch_size", "width", "depth", "samples", "every"):
            value = getattr(self, name)
            need(
                isinstance(value, int) and not isinstance(value, bool) and value >= 1,
                name,
                f"must be a positive integer, got {value!r}",
            )
        need(
            isinstance(self.last, int) and 1 <= self.last <= self.steps,
            "last",
            f"must be an integer in [1, steps={self.steps}], got {self.last!r}",
        )
        need(
            isinstance(self.warmup_samples, int) and self.warmup_samples >= 1,
            "warmup_samples",
            f"must be a positive integer, got {self.warmup_samples!r}",
        )
        need(
            isinstance(self.num_samples, int) and self.num_samples >= 100,
            "num_samples",
            f"must be an integer >= 100, got {self.num_samples!r}",
        )
        need(
            isinstance(self.seq_len, int) and self.seq_len >= 2,
            "seq_len",
            f"must be an integer >= 2, got {self.seq_len!r}",
        )
        need(
            math.isfinite(self.init_scale) and self.init_scale > 0,
            "init_scale",
            f"must be a finite number > 0, got {self.init_scale!r}",
        )
        need(len(self.scales) >= 1, "scales", "give at least one scale")
        need(
            all(math.isfinite(s) and s > 0 for s in self.scales),
            "scales",
            f"must be finite numbers > 0, got {list(self.scales)}",
        )
        need(
            len(set(self.scales)) == len(self.scales),
            "scales",
            f"must be distinct, got {list(self.scales)}",
        )
        if builtin:
            self._validate_builtin(need)
        need(len(self.lrs) >= 1, "lrs", "give at least one learning rate")
        need(
            all(math.isfinite(lr) and lr > 0 for lr in self.lrs),
            "lrs",
            f"must be finite numbers > 0, got {list(self.lrs)}",
        )
        keys = [lr_key(lr) for lr in self.lrs]
        need(
            len(set(keys)) == len(keys),
            "lrs",
            f"must be distinct, got {list(self.lrs)}",
        )
        need(
            self.norm in NORMS,
            "norm",
            f"must be one of {', '.join(NORMS)}, got {self.norm!r}",
        )
        need(
            self.flerm_policy is None or self.flerm_policy in POLICIES,
            "flerm_policy",
            f"must be one of {', '.join(POLICIES)}, got {self.flerm_policy!r}",
        )
        need(
            not (
                self.flerm_policy == "identity"
                and self.axis in DEPTH_AXES
                and "flerm" in self.modes
                and len(self.scales) > 1
            ),
            "flerm_policy",
            f"'identity' needs the base and scaled models to have the same tensors, and axis "
            f"{self.axis!r} adds blocks: use share_blocks (the default there), equal or "
            "equal_all",
        )
        need(
            self.flerm_init in FLERM_INITS,
            "flerm_init",
            f"must be one of {', '.join(FLERM_INITS)}, got {self.flerm_init!r}",
        )
        need(
            self.flerm_mode in ("static", "periodic"),
            "flerm_mode",
            f"must be 'static' or 'periodic', got {self.flerm_mode!r}",
        )
        need(
            self.flerm_variant is None or self.flerm_variant in VARIANTS,
            "flerm_variant",
            f"must be one of {', '.join(VARIANTS)}, got {self.flerm_variant!r}",
        )
        need(bool(self.modes), "modes", f"must include one of {', '.join(MODES)}")
        need(
            self.optimizer in OPTIMIZERS,
            "optimizer",
            f"must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}",
        )
        need(
            math.isfinite(self.weight_decay) and self.weight_decay >= 0,
            "weight_decay",
            f"must be a finite number >= 0, got {self.weight_decay!r}",
        )
        need(
            self.schedule in SCHEDULES,
            "schedule",
            f"must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}",
        )
        return self

    def _validate_builtin(self, need: Callable[[bool, str, str], None]) -> None:
        """The checks of :meth:`validate` that only concern the built-in models and data."""
        scaled: list[tuple[str, int, str]] = []
        if self.axis in WIDTH_AXES:
            scaled.append(("width", self.width, "units"))
        if self.axis in DEPTH_AXES:
            scaled.append(("depth", self.depth, "blocks"))
        for name, unit, units in scaled:
            bad = [s for s in self.scales if abs(unit * s - round(unit * s)) > 1e-9]
            need(not bad, "scales", f"{name} {unit} times {bad} is not a whole number of {units}")
        need(
            self.data_seed is None or self.data in DATA_SEEDS,
            "data_seed",
            f"only {' and '.join(DATA_SEEDS)} are generated from a seed, got data {self.data!r}",
        )
        need(
            self.model == "transformer" or self.norm == "prenorm",
            "norm",
            f"only the transformer has norms; model {self.model!r} takes the default "
            f"'prenorm', got {self.norm!r}",
        )
        train_size = self.train_size
        need(
            train_size is None or self.batch_size <= train_size,
            "batch_size",
            f"must be at most the {train_size} training samples of {self.data}, "
            f"got {self.batch_size}",
        )
        if self.model == "transformer" and self.axis in WIDTH_AXES:
            bad = [s for s in self.scales if round(self.width * s) % 16]
            need(
                not bad and self.width % 16 == 0,
                "scales",
                f"transformer widths must be multiples of the head size 16; width {self.width} "
                f"times {bad or list(self.scales)} is not",
            )

    # ------------------------------------------------------------------ (de)serialisation

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict of every field (tuples as lists)."""
        return {
            k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SweepConfig:
        """Inverse of :meth:`to_dict`; unknown keys are ignored (newer files).

        Examples:
            >>> cfg = SweepConfig(steps=7)
            >>> SweepConfig.from_dict(cfg.to_dict()) == cfg
            True
        """
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs: dict[str, Any] = {
            k: tuple(v) if isinstance(v, list) else v for k, v in data.items() if k in names
        }
        return cls(**kwargs)

    def fingerprint(self, extra: Mapping[str, Any] | None = None) -> str:
        """Hash of the fields that change what one run computes (not the grid: lrs, seeds,
        modes, and of the scales only the base scale, which FLeRM's base records and muP's
        base shapes come from), plus ``extra``; cached runs with another fingerprint are
        re-run.

        ``base_scale``, ``norm``, ``flerm_policy``, ``flerm_init``, ``data_seed`` and
        ``flerm_variant`` enter only when they are not their defaults (``1``, ``"prenorm"``,
        ``None``, ``"standard"``, ``None``, ``None``), so sweeps cached before those fields
        entered keep their fingerprints.

        Examples:
            >>> a, b = SweepConfig(lrs=(0.1,)), SweepConfig(lrs=(0.1, 0.2), seeds=5)
            >>> c = SweepConfig(lrs=(0.1,), steps=9)
            >>> a.fingerprint() == b.fingerprint(), a.fingerprint() == c.fingerprint()
            (True, False)
            >>> d = SweepConfig.for_model("transformer")
            >>> d.fingerprint() == d.replace(norm="postnorm").fingerprint()
            False
            >>> a.fingerprint() == a.replace(flerm_policy="equal").fingerprint()
            False
            >>> a.replace(scales=(1, 2)).fingerprint() == a.replace(scales=(1, 4)).fingerprint()
            True
            >>> a.replace(scales=(1, 4)).fingerprint() == a.replace(scales=(2, 4)).fingerprint()
            False
        """
        d = {k: v for k, v in self.to_dict().items() if k not in _NOT_RUN_FIELDS}
        if self.base_scale != 1:  # FLeRM's base records and muP's base shapes come from it
            d["base_scale"] = self.base_scale
        if d["norm"] == "prenorm":
            del d["norm"]
        if d["flerm_policy"] is None:
            del d["flerm_policy"]
        if d["flerm_init"] == "standard":
            del d["flerm_init"]
        if d["data_seed"] is None:
            del d["data_seed"]
        if d["flerm_variant"] is None:
            del d["flerm_variant"]
        if extra:
            d["extra"] = dict(extra)
        text = json.dumps(d, sort_keys=True, default=repr)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def replace(self, **changes: Any) -> SweepConfig:
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)


def _exact_key(x: float, short: str) -> str:
    """``short`` if it reads back as exactly ``x``, else ``repr(x)`` (the shortest string that
    does): distinct numbers always get distinct keys."""
    return short if float(short) == x else repr(float(x))


def lr_key(lr: float) -> str:
    """The learning rate as it appears in file names and JSON keys: exact and unique.

    8 significant digits when they are exact, else every digit needed to read it back.

    Examples:
        >>> lr_key(2.0**-10), lr_key(0.001), lr_key(2.0**-0.5)
        ('0.0009765625', '0.001', '0.7071067811865476')
    """
    return _exact_key(lr, f"{lr:.8g}")


def scale_key(scale: float) -> str:
    """The scale as it appears in file names and JSON keys: exact and unique.

    Examples:
        >>> scale_key(8.0), scale_key(0.5), scale_key(1.000001), scale_key(1 + 1e-12)
        ('8', '0.5', '1.000001', '1.000000000001')
    """
    return _exact_key(scale, f"{scale:g}")


DEMO = SweepConfig(
    model="resmlp",
    axis="width",
    scales=(1, 2, 4, 8),
    lrs=octaves(-12, -4),
    steps=150,
    seeds=3,
    data="mnist1d",
    batch_size=128,
    width=32,
    depth=4,
    num_samples=25000,
    last=30,
    every=10,
)
"""The ``fslr demo`` configuration: ResMLP width transfer (32 -> 256 units, 4 blocks) on procedural
MNIST-1D, 9 learning rates an octave apart, 3 seeds. One pass over 20,000 training samples (150
steps of 128), so train loss measures learning, not memorisation; see ``docs/demo.md`` for why
this task."""
