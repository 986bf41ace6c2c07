r"""How far a tensor's update moves the output per unit of movement of the features.

FLeRM matches each tensor's *output* movement to the base's. For a *hidden* tensor of a wider
model (fan-out and fan-in both grown: muP's two infinite dimensions) that is not the movement
of the features it should keep: under the standard parametrisation the readout's weights are
:math:`\Theta(n^{-1/2})` at width :math:`n`, and an update's change of the features (the
readout's input) is aligned with them, so the same output movement needs less feature
movement at larger width, and feature learning fades (docs/reproduction.md, "Why FLeRM
under-sets width rates": the features of the 8x ResMLP moved at half the base's).

The *feature gain* of an update :math:`\Delta W` is the ratio of the two movements, both
exact (:func:`fslr_func.exact`, forward-mode AD):

.. math::

    G_W = \frac{\|J_f\,\Delta W\|_\mathrm{RMS}}{\|J_h\,\Delta W\|_\mathrm{RMS}},

with :math:`f` the model's output and :math:`h` the readout's input. Scaling a hidden tensor's
rate by :math:`G^\text{scaled}_W / G^\text{base}_W` after FLeRM's set point makes its feature
movement the base's (``FLeRM(..., match="features")``, which reads the base's gains from
``Recorder(..., feature_gains=True)``). Measured on the transfer matrix (docs/reproduction.md,
"Candidate fixes measured on the matrix"): within 2% of re-tuned standard training on 12 of
its 13 cells, against 5 for FLeRM matching output movement.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from torch import Tensor, nn

from ..probe.connectivity import DisconnectedOutputError
from ..probe.exact import exact
from ..probe.functional import Inputs, OutputFn
from ..probe.names import block_role
from ..stats.estimator import ReadoutRole
from .measurement import Measurement
from .wrapper import FSLRModule

__all__ = [
    "NoReadoutError",
    "feature_gains",
    "hidden_fan_in",
    "readout_of",
    "require_readout",
    "step_gains",
]


class NoReadoutError(ValueError):
    """The probe found no readout layer (a head tied to the embedding, an output that is not
    one module's), or the readout gets no tensor input: there are no features to measure."""


def require_readout(fm: FSLRModule, what: str) -> None:
    """Refuse, when ``what`` is built, a wrapper made with ``readout=None``: without the
    readout layer there are no features to measure (it would fail at the first probe).

    Raises:
        NoReadoutError: ``fm.options.readout`` is ``None``.
    """
    if fm.options.readout is None:
        raise NoReadoutError(
            f"{what} measures the movement of the features, the readout layer's input, and "
            "the wrapper was built with readout=None: wrap with with_fslr(..., "
            "readout='auto') or name the readout module"
        )


def require_one_process(fm: FSLRModule, what: str, instead: str) -> None:
    """Refuse, when ``what`` is built, a wrapper whose probe runs across processes: feature
    gains are measured in one process, on this rank's shard, so the ranks would hold
    different gains (and a record saved on rank 0 its shard's).

    Raises:
        ValueError: ``fm`` probes across processes (``fm.reduction`` is set).
    """
    if getattr(fm, "reduction", None) is not None:
        raise ValueError(
            f"{what} measures feature gains in one process, on this rank's shard of the probe "
            f"batch, and does not run across processes yet (ranks would differ): {instead}"
        )


def hidden_fan_in(
    shapes: Mapping[str, Sequence[int]],
    base_shapes: Mapping[str, Sequence[int]],
    counterparts: Mapping[str, Sequence[str]] | None = None,
) -> dict[str, float]:
    """The *hidden* tensors of a scaled model and their fan-in multipliers: tensors of rank 2
    or more whose dims 0 and 1 (fan-out, fan-in) both differ from the base's (muP's two
    infinite dimensions); a tensor the base lacks (an extra block) is compared with its
    counterpart in the base (the depth policy's, where given: any block pattern), else with
    its role (:func:`fslr_func.probe.names.block_role`, the default pattern's).

    Args:
        shapes: the scaled model's tensor shapes, by name.
        base_shapes: the base model's (``FSLRRecord.shapes``).
        counterparts: scaled name -> the base names a depth policy maps onto it
            (:func:`fslr_func.training.policies.counterparts`).

    Examples:
        >>> base = {"0.weight": (16, 4), "0.bias": (16,), "1.weight": (16, 16), "1.bias": (16,)}
        >>> hidden_fan_in({"0.weight": (64, 4), "1.weight": (64, 64)}, base)
        {'1.weight': 4.0}
    """
    roles: dict[str, tuple[int, ...]] = {}
    for name, shape in base_shapes.items():
        roles.setdefault(block_role(name), tuple(shape))
    out: dict[str, float] = {}
    for name, shape in shapes.items():
        ref = tuple(base_shapes[name]) if name in base_shapes else roles.get(block_role(name))
        mapped = [b for b in (counterparts or {}).get(name, ()) if b in base_shapes]
        if name not in base_shapes and mapped:
            ref = tuple(base_shapes[mapped[0]])
        if ref is None or len(shape) < 2 or len(ref) != len(shape):
            continue
        if shape[0] != ref[0] and shape[1] != ref[1]:
            out[name] = shape[1] / ref[1]
    return out


def _trainable(model: nn.Module) -> dict[str, Tensor]:
    """The trainable parameters by name (frozen ones, a fine-tune's or LoRA's base weights,
    are constants of the function whose movement is measured)."""
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def readout_of(roles: Mapping[str, ReadoutRole]) -> str | None:
    """The readout module's name from the probe's readout roles (its weight's name less the
    last part), or ``None`` where the probe found no readout (a tied head).

    Examples:
        >>> readout_of({"head.weight": "weight", "head.bias": "bias"})
        'head'
    """
    weights = [n for n, r in roles.items() if r == "weight"]
    return weights[0].rpartition(".")[0] if len(weights) == 1 else None


class SubmoduleTensor(nn.Module):
    """``model``'s forward, returning the input (``output=False``) or the output of its
    submodule ``name`` instead, caught by a hook for the duration of the call (the last
    call's); its parameters are ``m.<name>``. :func:`feature_gains` measures the readout's
    input through it; the transfer matrix's local gains each layer's output.

    Raises (when called):
        NoReadoutError: the submodule got no tensor input, or returned no tensor.
    """

    def __init__(self, model: nn.Module, name: str, *, output: bool = False) -> None:
        super().__init__()
        self.m = model
        self.name = name
        self.output = output

    def forward(self, *args: Any, **kwargs: Any) -> Tensor:
        caught: list[Tensor] = []

        def keep(value: Any) -> None:
            if isinstance(value, Tensor):
                caught.append(value)

        module = self.m.get_submodule(self.name)
        handle = (
            module.register_forward_hook(lambda _m, _i, out: keep(out))
            if self.output
            else module.register_forward_pre_hook(
                lambda _m, inputs: keep(inputs[0] if inputs else None)
            )
        )
        try:
            self.m(*args, **kwargs)
        finally:
            handle.remove()
        if not caught:
            what = (
                "did not return a tensor" if self.output else "was not called with a tensor input"
            )
            raise NoReadoutError(
                f"the module {self.name!r} {what}: there are no features to measure"
            )
        return caught[-1]


def feature_gains(
    model: nn.Module,
    inputs: Inputs,
    delta: Mapping[str, Tensor],
    *,
    readout: str,
    at_output: bool = False,
    params: Mapping[str, Tensor] | None = None,
    output_fn: OutputFn | None = None,
    forward_seed: int | None = None,
) -> dict[str, float]:
    r"""Per tensor, the feature gain :math:`G_W` of its update (module docstring): output
    movement over movement of the readout's input, both by :func:`fslr_func.exact` at
    ``params``. Tensors whose update moves neither (the readout's own, which do not move its
    input) are left out.

    Args:
        model: the module (not mutated).
        inputs: one probe batch.
        delta: tensor name -> update (any scale: the gain is a ratio).
        readout: the readout module's name (:func:`readout_of`).
        at_output: measure the movement of ``readout``'s output instead of its input (any
            submodule's: the transfer matrix's local gains, each layer's own output).
        params: the weights to linearise at (default: the current ones).
        output_fn: maps the model output to the tensor whose movement counts, as in the probe.
        forward_seed: every forward's own RNG seed (dropout), as in the probe (``None``: the
            global RNG's): with a seed, both movements see the same dropout masks.

    Raises:
        NoReadoutError: ``readout`` gets no tensor input (returns no tensor, ``at_output``).
        ValueError: ``readout`` is not a module of ``model``, and :func:`fslr_func.exact`'s
            errors.

    Examples:
        >>> import torch
        >>> net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
        >>> delta = {n: 0.1 * torch.ones_like(p) for n, p in net.named_parameters()}
        >>> sorted(feature_gains(net, torch.randn(8, 3), delta, readout="1"))
        ['0.bias', '0.weight']
    """
    point = _trainable(model) if params is None else dict(params)
    out = exact(model, inputs, delta, params=point, output_fn=output_fn, forward_seed=forward_seed)
    try:
        features = exact(
            SubmoduleTensor(model, readout, output=at_output),
            inputs,
            {f"m.{n}": d for n, d in delta.items()},
            params={f"m.{n}": v for n, v in point.items()},
            forward_seed=forward_seed,
        )
    except DisconnectedOutputError:  # no update moves the features (only the readout trains)
        return {}
    gains = {}
    for name in delta:
        o, f = float(out[name]), float(features[f"m.{name}"])
        if o > 0 and f > 0 and math.isfinite(o / f):
            gains[name] = o / f
    return gains


def step_gains(
    fm: FSLRModule, m: Measurement, names: Collection[str] | None = None
) -> dict[str, float]:
    """:func:`feature_gains` of a measured step's update, on its first probe batch, at the
    weights before the step, by the bare model's names (those of records).

    Args:
        fm: the wrapper that measured the step.
        m: the step's measurement.
        names: the tensors to measure, by bare name (two forward-mode passes each); default:
            every tensor the step moved.

    Raises:
        NoReadoutError: the probe found no readout (a head tied to the embedding): there
            are no features to measure.
    """
    named = fm.options.readout not in (None, "auto")
    readout = fm.options.readout if named else readout_of(fm.readout_roles)
    if readout is None:
        raise NoReadoutError(
            "matching feature movement needs the readout layer, and the probe found none (a "
            "readout tied to another tensor, a frozen one, or an output that is not one "
            "module's): pass with_fslr(..., readout='<module name>')"
        )
    prefix = fm.name_prefix
    delta = (
        m.delta
        if names is None
        else {n: d for n, d in m.delta.items() if n.removeprefix(prefix) in names}
    )
    if not delta:  # nothing to measure (a model no wider than the base has no hidden tensor)
        return {}
    gains = feature_gains(
        fm.module,
        m.inputs[0],
        delta,
        readout=readout,
        params={**_trainable(fm.module), **m.before},
        output_fn=fm.options.output_fn,
        forward_seed=fm.options.forward_seed,
    )
    return {n.removeprefix(prefix): g for n, g in gains.items()}
