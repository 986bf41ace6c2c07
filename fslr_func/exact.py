r"""Ground truth: the linearised output change of each tensor's update, by forward-mode AD.

For a tensor ``W`` with update ``dW``, :func:`torch.func.jvp` gives ``J dW``, the first-order
change of all ``M`` outputs, and

.. math::

    \mathrm{FSLR}_W = \|J\,dW\|_\mathrm{RMS} = \sqrt{\tfrac{1}{M} \textstyle\sum_m (J\,dW)_m^2}.

One forward-mode pass per tensor: exact, and the reference every estimator is tested against.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor, nn
from torch.func import jvp

from .functional import (
    Inputs,
    ModuleTensors,
    OutputFn,
    as_output_tensor,
    check_delta,
    model_forward,
)


def exact(
    model: nn.Module,
    inputs: Inputs,
    delta: Mapping[str, Tensor],
    *,
    output_fn: OutputFn | None = None,
    params: Mapping[str, Tensor] | None = None,
) -> dict[str, Tensor]:
    """Exact per-tensor FSLR ``||J dW||_RMS`` of the update ``delta``.

    Args:
        model: any module; not mutated (buffers are cloned).
        inputs: a tensor, a tuple of positional arguments or a dict of keyword arguments.
        delta: parameter name -> update (names of ``named_parameters()``).
        output_fn: maps the model output to the tensor whose movement is measured.
        params: values to linearise at; defaults to the module's current parameters.

    Returns:
        Tensor name -> float64 scalar FSLR.

    Example:
        >>> model = torch.nn.Linear(3, 2, bias=False)
        >>> x = torch.eye(3)
        >>> delta = {"weight": torch.ones(2, 3)}
        >>> exact(model, x, delta)["weight"]  # every output moves by exactly 1
        tensor(1., dtype=torch.float64)
    """
    tensors = ModuleTensors.of(model)
    check_delta(delta, tensors)
    point = dict(tensors.trainable)
    if params is not None:
        check_delta(params, tensors, what="params")
        point.update({n: p.detach() for n, p in params.items()})

    result = {}
    for name, d in delta.items():

        def flat_output(w: Tensor, name: str = name) -> Tensor:
            state = {**point, **tensors.constants(), name: w}
            out = model_forward(model, state, inputs, output_fn)
            return as_output_tensor(out, output_fn).reshape(-1)

        tangent = jvp(flat_output, (point[name],), (d.to(point[name].dtype),))[1]
        result[name] = tangent.to(torch.float64).square().mean().sqrt()
    return result
