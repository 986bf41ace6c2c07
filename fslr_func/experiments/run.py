"""One run of a sweep: :class:`RunSpec` names it, :func:`execute` trains it.

A run is the sweep's optimiser at its learning rate (``standard``; the base-scale ones also
record their FSLRs), in muP with the base model's shapes (``mup``,
:func:`~fslr_func.experiments.mup.apply_mup`), or driven by :class:`~fslr_func.training.flerm.FLeRM`
from the base record of its learning rate (``flerm``). Its
result is a small JSON-able dict (``"format": RUN_FORMAT``), the document the cache stores.

Examples:
    >>> from fslr_func.experiments.configs import SweepConfig
    >>> config = SweepConfig(scales=(1, 2), lrs=(0.5,), seeds=1, modes=("standard",))
    >>> [s.key for s in grid(config)]
    ['standard_scale=1_lr=0.5_seed=0', 'standard_scale=2_lr=0.5_seed=0']
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

from ..io.record import FSLRRecord
from ..training.flerm import FLeRM
from ..training.policies import Policy
from ..training.recorder import Recorder
from ..training.wrap import with_fslr
from .configs import MODES, SweepConfig, lr_key, scale_key
from .mup import apply_mup, base_shapes, mup_init_task
from .task import Task
from .train import AroundStep, OnStep, last_mean, make_optimizer, make_schedule, train
from .variants import VARIANTS

__all__ = ["RUN_FORMAT", "RunSpec", "execute", "grid"]

RUN_FORMAT = "fslr_func.sweep.run"
"""Value of the ``"format"`` key of a cached run file."""
RUN_VERSION = 1
"""Value of the ``"version"`` key of a cached run file."""


class RunSpec(NamedTuple):
    """One run of a sweep.

    Examples:
        >>> RunSpec("flerm", 8.0, 2.0**-10, 1).key
        'flerm_scale=8_lr=0.0009765625_seed=1'
    """

    mode: str
    scale: float
    lr: float
    seed: int

    @property
    def key(self) -> str:
        """File-name key: ``<mode>_scale=<s>_lr=<lr>_seed=<k>``."""
        return f"{self.mode}_scale={scale_key(self.scale)}_lr={lr_key(self.lr)}_seed={self.seed}"


def grid(config: SweepConfig) -> list[RunSpec]:
    """Every run of a config, in a stable order.

    Examples:
        >>> from fslr_func.experiments.configs import SweepConfig
        >>> len(grid(SweepConfig(scales=(1, 2), lrs=(0.1, 0.2, 0.3), seeds=2)))
        36
    """
    return [
        RunSpec(mode, scale, lr, seed)
        for mode in config.modes
        for scale in config.scales
        for lr in config.lrs
        for seed in range(config.seeds)
    ]


def finite_or_none(x: float) -> float | None:
    """``x``, or ``None`` if it is infinite or NaN (strict JSON has neither).

    Examples:
        >>> finite_or_none(0.5), finite_or_none(float("nan"))
        (0.5, None)
    """
    return x if math.isfinite(x) else None


def _policy(task: Task, config: SweepConfig) -> str | Policy:
    return config.policy if task.policy is None else task.policy


def _result(
    spec: RunSpec,
    loss: float,
    test_loss: float | None,
    losses: list[float],
    seconds: float,
    warned: list[str],
) -> dict[str, Any]:
    """The JSON-able result of a run (without the cache's fingerprint stamps)."""
    return {
        "format": RUN_FORMAT,
        "version": RUN_VERSION,
        "key": spec.key,
        "mode": spec.mode,
        "scale": spec.scale,
        "lr": spec.lr,
        "seed": spec.seed,
        "loss": finite_or_none(loss),
        "test_loss": test_loss,
        "losses": [finite_or_none(v) for v in losses],
        "seconds": seconds,
        "warnings": warned,
    }


def unusable(spec: RunSpec) -> dict[str, Any]:
    """The result of a FLeRM run whose base runs all diverged before their first estimate.

    Examples:
        >>> unusable(RunSpec("flerm", 2.0, 0.1, 0))["loss"] is None
        True
    """
    return _result(
        spec,
        math.inf,
        None,
        [],
        0.0,
        ["no base record: every base run of this learning rate diverged"],
    )


def execute(
    task: Task,
    config: SweepConfig,
    spec: RunSpec,
    base: FSLRRecord | None = None,
    *,
    record: bool = False,
    lr_factors: Mapping[str, float] | None = None,
) -> tuple[dict[str, Any], FSLRRecord | None]:
    """Train one run; a pure function of its arguments.

    Args:
        task: model, data and loss.
        config: budget (``steps``, ``last``) and FSLR settings (``samples``,
            ``warmup_samples``, ``every``).
        spec: mode, scale, learning rate and seed.
        base: the base record of ``spec.lr`` (FLeRM mode only).
        record: in standard mode, record the run's FSLRs (the base runs).
        lr_factors: in standard mode, tensor name -> a factor on its learning rate (one param
            group per tensor; the record keeps each tensor's rate, which FLeRM transfers,
            :mod:`fslr_func.training.flerm_targets`): a base run with its own allocation.

    Returns:
        The run's result (JSON-able: ``loss`` is the mean of the last ``config.last`` losses,
        ``None`` if it diverged; ``losses``, ``test_loss``, ``seconds`` and, for FLeRM, the
        per-tensor ``flerm`` rates set) and the record (or ``None``).
    """
    if spec.mode not in MODES:
        raise ValueError(f"unknown mode {spec.mode!r}; choose one of {MODES}")
    if lr_factors and spec.mode != "standard":
        raise ValueError(f"lr_factors applies to standard training only, not {spec.mode!r}")
    if spec.mode == "flerm" and base is None:
        raise ValueError("a FLeRM run needs the base record of its learning rate")
    start = time.perf_counter()
    build = task.build
    if spec.mode == "flerm" and config.flerm_init == "mup":
        build = mup_init_task(task, config.base_scale).build
    torch.manual_seed(spec.seed)
    model = build(spec.scale, spec.seed)
    params: Any = model.parameters()
    mup_lrs: dict[str, float] = {}
    if spec.mode == "mup":
        shapes = base_shapes(task.build, config.base_scale, spec.seed)
        params = apply_mup(
            model, shapes, spec.lr, weight_decay=config.weight_decay, optimizer=config.optimizer
        )
        mup_lrs = {g["name"]: g["lr"] for g in params}
    elif lr_factors:
        unknown = set(lr_factors) - {n for n, _ in model.named_parameters()}
        if unknown:
            raise ValueError(f"lr_factors names tensors the model lacks: {sorted(unknown)[:5]}")
        params = [
            {"params": [w], "lr": spec.lr * lr_factors.get(n, 1.0)}
            for n, w in model.named_parameters()
        ]
    variant = None if config.flerm_variant is None else VARIANTS[config.flerm_variant]
    # a variant's probe options apply to its FLeRM runs and to the base runs it records
    probe: dict[str, Any] = {"samples": config.samples}
    if variant is not None and (spec.mode == "flerm" or record):
        probe.update(variant.probe)
    fm = with_fslr(
        model,
        seed=spec.seed,
        output_fn=task.output_fn,
        strategy=config.strategy,
        **probe,
    )
    opt = make_optimizer(config.optimizer, params, spec.lr, config.weight_decay)
    sched = make_schedule(opt, config.schedule, config.steps)
    on_step: OnStep | None = None if sched is None else lambda t, m, o: sched.step()
    probes = task.probe_batches(spec.seed)
    around: AroundStep | None = None
    recorder: Recorder | None = None
    flerm: Any = None
    if spec.mode == "flerm":
        assert base is not None
        extra: dict[str, Any] = {} if variant is None else {"steps": config.steps}
        make = FLeRM if variant is None else variant.make
        flerm = make(
            fm,
            opt,
            base,
            probe_batches=probes,
            policy=_policy(task, config),
            mode="periodic" if config.flerm_mode == "periodic" else "static",
            every=config.every,
            warmup_samples=config.warmup_samples,
            scheduler=sched,
            **extra,
        )
        ctl = flerm
        around = lambda t: ctl.step()  # noqa: E731
    elif record:
        make_recorder = (
            Recorder if variant is None or variant.recorder is None else variant.recorder
        )
        recorder = make_recorder(
            fm,
            probes,
            warmup_samples=config.warmup_samples,
            every=config.every,
            scheduler=sched,
            base_lr=spec.lr if lr_factors else None,  # the first group's may be factored
            meta={"seed": spec.seed, "scale": spec.scale, "lr": spec.lr},
        )
        rec = recorder
        around = lambda t: rec.step(opt)  # noqa: E731
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses = train(
            fm,
            task.train_batches(spec.seed),
            opt,
            config.steps,
            task.loss_fn,
            on_step=on_step,
            around_step=around,
        )
        loss = last_mean(losses, config.last) if len(losses) == config.steps else math.inf
        test_loss = None
        if task.evaluate is not None and math.isfinite(loss):
            test_loss = finite_or_none(float(task.evaluate(model)))
    result = _result(
        spec,
        loss,
        test_loss,
        losses,
        time.perf_counter() - start,
        sorted({str(w.message) for w in caught})[:5],
    )
    if mup_lrs:
        result["mup"] = {"lrs": mup_lrs}
    if flerm is not None and flerm.history:
        point = flerm.history[0]
        result["flerm"] = {
            "step": point.step,
            "lrs": point.lrs,
            "fslr": point.fslr,
            "targets": point.targets,
            "held": list(point.held),
            "set_points": [p.step for p in flerm.history],
            "final_lrs": flerm.lrs(),
        }
    return result, None if recorder is None else recorder.record
