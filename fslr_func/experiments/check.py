r"""``fslr check``: muP's coordinate check, in function space, for any model family.

muP's coordinate check trains a model at several widths for a few steps and plots the size of
each layer's activations against width: a parametrisation is right when nothing grows or shrinks
with width. This is the same check on what FLeRM controls: for every parameter tensor ``W`` and
scale ``s``, the function-space movement per step,

.. math::

    m_W(s) = \eta_W \, \mathrm{FSLR}_W = \lVert \Delta_W f \rVert_\mathrm{RMS},

the RMS change of the model's outputs that the optimiser's update of ``W`` causes (the paper's
function-space learning rate), averaged over the probes of a short run at one learning rate
(each scale: the same seed, ``steps`` steps, a probe every ``every`` steps after an EMA warm-up,
steps 1 and later). Under standard training the movements of a badly parametrised model drift with
scale; under FLeRM (static, its set point at step 0 from the base scale's record of the same
run) they should stay where the base model's were; ``"mup"`` shows where muP puts them;
``"features"`` is ``FLeRM(..., match="features")``, which holds the hidden tensors' movement of
the features (the readout's input) at the base's instead. A tensor whose movement changes by
more than ``threshold`` (default 2) between its smallest and largest value over the scales is
flagged.

The standard runs also measure each hidden tensor's *feature gain* at every scale (its first
update's output movement over its movement of the features,
:mod:`fslr_func.training.feature_gains`), from which
:func:`~fslr_func.experiments.prediction.predict` says what the transfer matrix predicts
about FLeRM's transfer for this model.

Only tensors present at every scale are compared (along depth, the extra blocks have no
counterpart; under FLeRM's ``share_blocks`` policy each block's share of its base block's
movement then falls with depth by design).

Examples:
    >>> import functools, torch
    >>> from fslr_func.experiments import batches
    >>> from fslr_func.experiments.task import Task
    >>> x, y = torch.randn(256, 6), torch.randint(0, 3, (256,))
    >>> def build(scale, seed):
    ...     w = int(8 * scale)
    ...     return torch.nn.Sequential(torch.nn.Linear(6, w), torch.nn.ReLU(),
    ...                                torch.nn.Linear(w, 3))
    >>> task = Task("tiny", build, functools.partial(batches, x, y, 32),
    ...             lambda seed: (b for b, _ in batches(x, y, 32, seed + 99)))
    >>> result = coord_check(task, (1, 4), 0.01, steps=4, every=1, warmup_samples=8)
    >>> sorted(result["modes"]), result["names"][:2], result["prediction"]["kind"]
    (['flerm', 'standard'], ['0.weight', '0.bias'], 'no hidden tensor')
    >>> len(result["modes"]["standard"]["movement"]["0.weight"])
    2
"""

from __future__ import annotations

import contextlib
import math
import textwrap
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple, cast

import torch

from ..io.record import FSLRRecord
from ..training.feature_gains import NoReadoutError, hidden_fan_in
from ..training.flerm import FLeRM
from ..training.recorder import Recorder
from ..training.wrap import with_fslr
from .configs import scale_key
from .mup import apply_mup, base_shapes
from .prediction import predict
from .task import Task
from .train import make_optimizer, train

__all__ = ["CHECK_MODES", "coord_check", "format_check"]

CHECK_MODES = ("standard", "mup", "flerm", "features")
"""Modes :func:`coord_check` can compare (``"mup"``:
:func:`~fslr_func.experiments.mup.apply_mup`; ``"features"``: ``FLeRM(...,
match="features")``)."""


class _Run(NamedTuple):
    """One short run's records: ``movement`` from step 1 (every mode alike: the movement
    compared), ``start`` of step 0 (not under FLeRM, whose set point is step 0's probe; a
    standard run's is FLeRM's base record, with the feature gains of the first update);
    ``diverged``: its loss went non-finite (the run stopped there) or rose a thousandfold."""

    movement: FSLRRecord
    start: FSLRRecord | None
    diverged: bool


def _run(
    task: Task,
    base_scale: float,
    scale: float,
    lr: float,
    *,
    steps: int,
    seed: int,
    every: int,
    samples: int,
    warmup_samples: int,
    optimizer: str,
    mode: str,
    base: FSLRRecord | None,
    policy: Any,
    gains: bool = False,
) -> _Run:
    """One short run at ``scale`` (under FLeRM from ``base``, set at step 0) and its records
    (with ``gains``, the feature gains of the first update in ``start.meta``)."""
    torch.manual_seed(seed)
    model = task.build(scale, seed)
    params: Any = model.parameters()
    if mode == "mup":
        params = apply_mup(
            model, base_shapes(task.build, base_scale, seed), lr, optimizer=optimizer
        )
    fm = with_fslr(model, samples=samples, seed=seed, output_fn=task.output_fn, strategy="vmap")
    opt = make_optimizer(optimizer, params, lr)

    def recorder(start_step: int, **options: Any) -> Recorder:
        return Recorder(
            fm,
            task.probe_batches(seed),
            optimizer=opt,
            warmup_samples=warmup_samples,
            start_step=start_step,
            **options,
        )

    # The movement from step 1 in every mode: FLeRM's set point measures step 0, before its
    # rates apply. The wrapper's EMAs are shared, so every mode warms them up at step 0 as
    # FLeRM's set point does (a recorder of step 0 alone), and the modes' columns at the base
    # scale, where every mode is the same run, are equal.
    movement = recorder(1, every=every)
    start = None if mode in ("flerm", "features") else recorder(0, every=None, feature_gains=gains)
    flerm = None
    if mode in ("flerm", "features"):
        assert base is not None
        flerm = FLeRM(
            fm,
            opt,
            base,
            probe_batches=task.probe_batches(seed),  # the base's: at 1x the identity
            policy=policy,
            warmup_samples=warmup_samples,
            match="features" if mode == "features" else "output",
        )

    @contextlib.contextmanager
    def around(t: int) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            if flerm is not None:
                stack.enter_context(flerm.step())  # outer: the recorder sees FLeRM's rates
            for controller in (start, movement):
                if controller is not None:
                    stack.enter_context(controller.step())
            yield

    losses = train(fm, task.train_batches(seed), opt, steps, task.loss_fn, around_step=around)
    diverged = not losses or not math.isfinite(losses[-1]) or _rose_a_thousandfold(losses)
    return _Run(movement.record, None if start is None else start.record, diverged)


def _rose_a_thousandfold(losses: Sequence[float]) -> bool:
    """Whether the loss ended more than 1,000 times its first value (at least 0.001) above it
    (a run blown up at too high a rate, before it overflows).

    Examples:
        >>> _rose_a_thousandfold([1.04, 3e9, 3e10]), _rose_a_thousandfold([1.04, 0.98])
        (True, False)
    """
    return losses[-1] - losses[0] > 1e3 * max(abs(losses[0]), 1e-3)  # a loss near 0 or below


def _movement(record: FSLRRecord) -> dict[str, float]:
    """Per tensor, the geometric mean of ``lr_W * FSLR_W`` over the record's rows from step 1."""
    logs: dict[str, list[float]] = {}
    for step in (s for s in record.steps if s >= 1):
        rates = record.lrs_at(step)
        for name, f in record.at(step, unknown="omit").items():
            if name in rates and f > 0:
                logs.setdefault(name, []).append(math.log(rates[name] * f))
    return {n: math.exp(sum(v) / len(v)) for n, v in logs.items()}


def coord_check(
    task: Task,
    scales: Sequence[float],
    lr: float,
    *,
    steps: int = 10,
    seed: int = 0,
    every: int = 1,
    samples: int = 8,
    warmup_samples: int = 40,
    optimizer: str = "adam",
    modes: Sequence[str] = ("standard", "flerm"),
    threshold: float = 2.0,
) -> dict[str, Any]:
    r"""Each tensor's function-space movement per step against scale, standard and FLeRM.

    Args:
        task: the model family (:class:`~fslr_func.experiments.task.Task`; the built-in ones:
            :func:`~fslr_func.experiments.task.builtin_task`).
        scales: the scales; the smallest is FLeRM's base.
        lr: the learning rate (FLeRM: the base model's).
        steps: training steps per run (at least 2: step 0 is FLeRM's set point).
        seed: the seed of every run.
        every: probe every ``every`` steps after the warm-up at step 1.
        samples: omega samples per probe.
        warmup_samples: omega samples of the EMA warm-ups.
        optimizer: a name of :data:`~fslr_func.experiments.train.OPTIMIZERS`.
        modes: a subset of :data:`CHECK_MODES`; ``"mup"`` takes the smallest scale as muP's
            base shapes. Where the feature gains can be measured, the standard runs are made
            at every scale whether asked for or not (they measure them).
        threshold: flag tensors whose movement's max/min ratio over the scales exceeds it.

    Returns:
        ``{"scales", "lr", "names", "modes": {mode: {"movement": {name: [m_W per scale]},
        "drift": {name: max / min}, "flagged": [names], "diverged": [scales whose run's
        loss went non-finite or rose a thousandfold]}}, "gains": {hidden tensor: [G_W
        per scale]} (None: the probe found no readout), "prediction": the matrix's
        (:func:`~fslr_func.experiments.prediction.predict`), "threshold", "steps", "seed"}``
        (JSON-able; names present at every scale, in the base model's order).

    Raises:
        ValueError: for fewer than 2 steps, ``every`` outside ``[1, steps - 1]``, an unknown
            mode, or mode ``"features"`` for a model whose readout the probe does not find.
    """
    if steps < 2:
        raise ValueError(f"steps must be at least 2 (step 0 is FLeRM's set point), got {steps}")
    if not isinstance(every, int) or not 1 <= every <= steps - 1:
        raise ValueError(
            f"every must be in [1, steps - 1 = {steps - 1}] (a probe at a step after the set "
            f"point is what is measured), got {every!r}"
        )
    bad = [m for m in modes if m not in CHECK_MODES]
    if bad or not modes:
        raise ValueError(f"modes must be some of {CHECK_MODES}, got {list(modes)}")
    ordered = sorted(float(s) for s in scales)
    kw: dict[str, Any] = {
        "steps": steps,
        "seed": seed,
        "every": every,
        "samples": samples,
        "warmup_samples": warmup_samples,
        "optimizer": optimizer,
        "policy": task.policy or "identity",
    }
    try:
        first = _run(task, ordered[0], ordered[0], lr, mode="standard", base=None, gains=True, **kw)
    except NoReadoutError as err:
        if "features" in modes:
            raise ValueError(f"mode 'features' measures the features: {err}") from err
        first = _run(task, ordered[0], ordered[0], lr, mode="standard", base=None, **kw)
    assert first.start is not None
    base = first.start
    measured = "feature_gain" in base.meta
    runs = {("standard", ordered[0]): first}

    def run(mode: str, scale: float) -> _Run:
        if (mode, scale) not in runs:
            gains = measured and mode == "standard"
            runs[mode, scale] = _run(
                task, ordered[0], scale, lr, mode=mode, base=base, gains=gains, **kw
            )
        return runs[mode, scale]

    movements = {mode: [_movement(run(mode, s).movement) for s in ordered] for mode in modes}
    gains = (
        _hidden_gains([cast(FSLRRecord, run("standard", s).start) for s in ordered])
        if measured
        else None
    )
    names = [n for n in base.names if all(n in m for ms in movements.values() for m in ms)]
    out: dict[str, Any] = {}
    for mode, per_scale in movements.items():
        movement = {n: [m[n] for m in per_scale] for n in names}
        drift = {n: max(v) / min(v) for n, v in movement.items()}
        out[mode] = {
            "movement": movement,
            "drift": drift,
            "flagged": [n for n in names if drift[n] > threshold],
        }
    for mode, data in out.items():
        data["diverged"] = [s for s in ordered if run(mode, s).diverged]
    result = {
        "scales": ordered,
        "lr": lr,
        "names": names,
        "modes": out,
        "gains": gains,
        "threshold": threshold,
        "steps": steps,
        "seed": seed,
    }
    return {**result, "prediction": predict(result)}


def _hidden_gains(records: Sequence[FSLRRecord]) -> dict[str, list[float]]:
    """Per tensor hidden at the largest scale (against the smallest), its feature gain at
    each scale (tensors without a gain at some scale left out)."""
    hidden = hidden_fan_in(records[-1].shapes, records[0].shapes)
    per_scale = [r.meta["feature_gain"] for r in records]
    return {n: [g[n] for g in per_scale] for n in hidden if all(n in g for g in per_scale)}


def format_check(result: Mapping[str, Any]) -> str:
    """The table of :func:`coord_check`: movement per tensor and scale, drift, flags; the
    hidden tensors' feature gains and the matrix's prediction where the result has them.

    Examples:
        >>> r = {"scales": [1.0, 4.0], "names": ["w"], "threshold": 2.0, "modes": {
        ...     "standard": {"movement": {"w": [0.01, 0.04]}, "drift": {"w": 4.0},
        ...                  "flagged": ["w"]}}}
        >>> print(format_check(r))
        standard: ||Delta_W f||_RMS per step (x 1e-3)
        tensor  1x        4x        drift
        w       10        40        4.00 !
        ! drifts by more than 2x over the scales: 1 of 1 tensor(s)
    """
    width = max([len("tensor"), *(len(n) for n in result["names"])])
    lines: list[str] = []
    for mode, data in result["modes"].items():
        if lines:
            lines.append("")
        lines.append(f"{mode}: ||Delta_W f||_RMS per step (x 1e-3)")
        lines.append(
            f"{'tensor':<{width}}  "
            + "".join(f"{scale_key(s) + 'x':<10}" for s in result["scales"])
            + "drift"
        )
        for n in result["names"]:
            cells = "".join(f"{v * 1e3:<10.3g}" for v in data["movement"][n])
            flag = " !" if n in data["flagged"] else ""
            lines.append(f"{n:<{width}}  {cells}{data['drift'][n]:.2f}{flag}")
        lines.append(
            f"! drifts by more than {result['threshold']:g}x over the scales: "
            f"{len(data['flagged'])} of {len(result['names'])} tensor(s)"
        )
        if data.get("diverged"):
            at = ", ".join(scale_key(s) + "x" for s in data["diverged"])
            lines.append(
                f"! diverged at {at} (the loss went non-finite or rose a thousandfold): those "
                "movements are of a diverged run; check again at a lower --lr"
            )
    gains = result.get("gains")
    if gains:
        lines += ["", "feature gain G_W of the first update (hidden tensors)"]
        lines.append(
            f"{'tensor':<{width}}  "
            + "".join(f"{scale_key(s) + 'x':<10}" for s in result["scales"])
            + "last/first"
        )
        for n, g in gains.items():
            cells = "".join(f"{v:<10.3g}" for v in g)
            lines.append(f"{n:<{width}}  {cells}{g[-1] / g[0]:.2f}")
    if "prediction" in result:
        lines += ["", *textwrap.wrap("prediction: " + result["prediction"]["text"], 96)]
    return "\n".join(line.rstrip() for line in lines)
