r"""muP's readout scale for a wider model, applied to any model: :func:`scale_readout`.

In the standard parametrisation a readout of fan-in :math:`n` is initialised at
:math:`\Theta(n^{-1/2})`; muP's is :math:`\Theta(n^{-1})`, and equal to the standard one at
the base's fan-in :math:`n_\text{base}`, so at fan-in :math:`n` it is the standard one times
:math:`\sqrt{n_\text{base} / n}`. :func:`scale_readout` multiplies the readout layer's weight by

.. math::

    c = \sqrt{n_\text{base} / n},

with :math:`n` the product of the weight's dims after the first (``in_features``; a
convolution's ``in_channels * kernel``) and :math:`n_\text{base}` the base record's
(:attr:`~fslr_func.io.record.FSLRRecord.shapes`): 1 where the fan-in did not change (depth,
initialisation scale, LoRA rank). Nothing else of the model changes, and FLeRM then sets the
rates (``match="features_all"``: docs/flerm.md): what FLeRM lacked at width is muP's small
readout, which no learning rate gives (docs/reproduction.md, "The readout scaled before the
first gradient").

It must run *before the first gradient*: an optimiser that has seen the unscaled model's
gradients keeps them in its state (Adam's moments), which on a 1-D conv net of the transfer
matrix took muP itself from 0.234 to 0.424 in loss. Call it once, on the freshly initialised
model, before the optimiser's first step; when resuming, call it before loading the
checkpoint, which holds the scaled weights, or not at all. A second call on the same model is
refused, also after loading a checkpoint of a scaled run (the wrapper's state carries the
scale: ``fm.state_dict()``).

Examples:
    >>> import torch, fslr_func as ff
    >>> def net(width):
    ...     return torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.Tanh(),
    ...                                torch.nn.Linear(width, 3))
    >>> base = ff.FSLRRecord(meta={"shapes": {"0.weight": [8, 4], "2.weight": [3, 8]}})
    >>> fm = ff.with_fslr(net(32))
    >>> ff.scale_readout(fm, base, torch.randn(5, 4))
    0.5
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..io.record import FSLRRecord
from ..probe.functional import Inputs
from ..probe.names import recorded_names
from ..probe.readout import find_readout, readout_module, tied
from .controller import fslr_module_of
from .feature_gains import NoReadoutError
from .wrapper import FSLRModule
from .wrapper_state import READOUT_SCALE_MARK

__all__ = ["readout_width_scale", "scale_readout"]


def readout_width_scale(
    shape: tuple[int, ...], base_shape: tuple[int, ...], *, transposed: bool = False
) -> float:
    r"""muP's readout scale :math:`\sqrt{n_\text{base} / n}` between two readout weight shapes,
    the fan-in :math:`n` being the product of the dims after the first (``transposed``: of
    every dim but the second).

    Args:
        shape: the scaled model's readout weight shape (rank 2 or more).
        base_shape: the base model's (same rank).
        transposed: the weight is stored ``(in, out, ...)``: a transposed convolution's, or
            Hugging Face's ``Conv1D`` (GPT-2).

    Raises:
        ValueError: a weight of rank below 2 (no fan-in), or of another rank than the base's.

    Examples:
        >>> readout_width_scale((10, 256), (10, 32)), readout_width_scale((10, 64, 3), (10, 8, 3))
        (0.3535533905932738, 0.3535533905932738)
        >>> readout_width_scale((256, 10), (32, 10), transposed=True)
        0.3535533905932738
    """
    if len(shape) < 2 or len(shape) != len(base_shape):
        raise ValueError(
            f"the readout weight's shape {tuple(shape)} and the base record's "
            f"{tuple(base_shape)} do not give a fan-in to compare: both must have rank 2 or "
            "more (out_features, in_features, ...), the same rank"
        )

    def fan_in(dims: tuple[int, ...]) -> int:
        return dims[0] * math.prod(dims[2:]) if transposed else math.prod(dims[1:])

    return math.sqrt(fan_in(base_shape) / fan_in(shape))


def _stored_transposed(module: nn.Module) -> bool:
    """Whether ``module`` stores its weight ``(in, out, ...)``: a transposed convolution, or
    Hugging Face's ``Conv1D`` (GPT-2's layers), known by its name so that this module needs
    no import of ``transformers``."""
    kind = type(module)
    hf_conv1d = kind.__name__ == "Conv1D" and kind.__module__.startswith("transformers")
    return isinstance(module, nn.modules.conv._ConvTransposeNd) or hf_conv1d


def _find_readout(fm: FSLRModule, inputs: Inputs | None) -> str:
    """The readout module's name: the wrapper's ``readout=`` name, or the module the probe's
    finder sees compute the output of one forward on ``inputs`` (``readout="auto"``)."""
    model, named = fm.module, fm.options.readout
    if named is None:
        raise NoReadoutError(
            "scale_readout scales the readout layer, and the wrapper was built with "
            "readout=None: wrap with with_fslr(..., readout='auto') or name the readout module"
        )
    if named != "auto":
        readout_module(model, named)  # a clear error for a wrong name
        return named
    if inputs is None:
        raise ValueError(
            "scale_readout needs an example batch to find the readout layer "
            "(readout='auto'): pass inputs=one training or probe batch, or wrap with "
            "with_fslr(..., readout='head') naming it"
        )
    found, _ = find_readout(
        model, inputs, fm.options.output_fn, forward_seed=fm.options.forward_seed
    )
    if found is None:
        raise NoReadoutError(
            "scale_readout found no readout layer: the model output is not one module's "
            "output (computed after the last layer, or by a module called more than once); "
            "name it with with_fslr(..., readout='head')"
        )
    return found


def scale_readout(
    fm: FSLRModule | nn.Module, base: FSLRRecord, inputs: Inputs | None = None
) -> float:
    r"""Multiply the readout layer's weight by muP's scale :math:`\sqrt{n_\text{base} / n}`,
    once, before training: FLeRM on muP's readout (module docstring).

    Then drive the model with ``FLeRM(..., match="features_all")``: through the small readout,
    output matching would ask every upstream tensor to move the features further than the
    base's. On the transfer matrix of docs/reproduction.md (36 cells: 13 of the matrix, 5
    held out, 7 of other budgets and data, 11 under a cosine schedule; Adam, 8x width, set
    points every 10 steps) that pair was within 2% of re-tuned standard training on 29 and
    below muP at the transferred rate on 20; muP stayed ahead on the conv nets without
    BatchNorm, the PreNorm transformers, most cosine cells and short runs.

    Args:
        fm: the scaled model's :func:`~fslr_func.with_fslr` wrapper (also under
            ``torch.compile`` or ``DDP``).
        base: the base run's record; its ``shapes`` give :math:`n_\text{base}`.
        inputs: one example batch, as the model takes it, to find the readout layer when the
            wrapper's ``readout`` is ``"auto"`` (a forward without gradients, which leaves the
            buffers, BatchNorm's statistics, and the random streams as they were).

    Returns:
        :math:`c`, the factor applied (1.0 where the fan-in is the base's: nothing changes).

    Raises:
        NoReadoutError: no readout layer (``readout=None``, or none found on ``inputs``).
        ValueError: ``inputs`` missing with ``readout="auto"``; a readout weight the base record
            has no shape for, of rank below 2, tied to another tensor (GPT-2's head and
            embedding: both would shrink), computed by a parametrization; or a model already
            scaled.

    Examples:
        >>> import torch, fslr_func as ff
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 64), torch.nn.Linear(64, 2))
        >>> base = ff.FSLRRecord(meta={"shapes": {"1.weight": [2, 16]}})
        >>> ff.scale_readout(ff.with_fslr(net, readout="1"), base)
        0.5
    """
    if not isinstance(base, FSLRRecord):
        raise TypeError(
            f"base must be an FSLRRecord (FSLRRecord.load(path)), got {type(base).__name__}"
        )
    fm = fslr_module_of(fm)
    name = _find_readout(fm, inputs)
    module = fm.module.get_submodule(name)
    if hasattr(module, READOUT_SCALE_MARK):
        raise ValueError(
            f"scale_readout already scaled {name!r} of this model (by "
            f"{getattr(module, READOUT_SCALE_MARK):.4g}): it multiplies the weights, so a "
            "second call would scale them again; call it once, on the freshly initialised "
            "model (a checkpoint of a scaled run, once loaded, holds the scaled weights and "
            "says so: when resuming, call it before load_state_dict, or not at all)"
        )
    weight = module._parameters.get("weight")
    if not isinstance(weight, nn.Parameter):
        raise ValueError(
            f"the readout {name!r} has no weight parameter of its own (a parametrization such "
            "as weight_norm computes it, or it has none): scale_readout cannot scale it"
        )
    if tied(fm.module, weight):
        raise ValueError(
            f"the readout weight {name}.weight is tied to another tensor (a head sharing the "
            "embedding's weight): scaling it would scale that tensor too"
        )
    # the record's names read as this model's (a record made under DDP's module., a
    # checkpoint wrapper's or torch.compile's names)
    bare = [n.removeprefix(fm.name_prefix) for n, _ in fm.module.named_parameters()]
    as_model = recorded_names(base.shapes, bare)
    shapes = {as_model.get(n, n): s for n, s in base.shapes.items()}
    base_shape = shapes.get(f"{name}.weight")
    if base_shape is None:
        raise ValueError(
            f"the base record has no shape for the readout weight {name}.weight (shapes "
            f"recorded: {sorted(base.shapes)[:5]}): record the base run with this version's "
            "Recorder, on a model whose readout has the same name"
        )
    scale = readout_width_scale(
        tuple(weight.shape), base_shape, transposed=_stored_transposed(module)
    )
    with torch.no_grad():
        weight.mul_(scale)
    setattr(module, READOUT_SCALE_MARK, scale)
    return scale
