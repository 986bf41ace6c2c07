r"""Ground truth: the linearised output change of each tensor's update, by forward-mode AD.

For a tensor ``W`` with update ``dW``, :func:`torch.func.jvp` gives ``J dW``, the first-order
change of all ``M`` outputs, and

.. math::

    \mathrm{FSLR}_W = \|J\,dW\|_\mathrm{RMS} = \sqrt{\tfrac{1}{M} \textstyle\sum_m (J\,dW)_m^2}.

One forward-mode pass per tensor: exact, and the reference every estimator is tested against.
Where forward-mode AD cannot run the model (ops without a forward-mode formula, such as
``weight_norm``'s fused kernel or ``spectral_norm``'s ``out=`` ops; autograd Functions without
``setup_context``/``jvp``; in-place updates of captured tensors), ``J dW`` is computed instead
by the double-vjp trick with plain autograd, :math:`J\,dW = \partial_u \langle J^\top u,
dW\rangle`, after one warning: the same number, two backward passes per tensor.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping
from contextlib import nullcontext

import torch
from torch import Tensor, nn
from torch.autograd import forward_ad
from torch.func import jvp

from ..stats.statistics import scale_exponent
from .connectivity import (
    CutFinder,
    cut_behind_message,
    cut_error,
    disconnected_output_error,
    partly_cut_message,
    reaches,
)
from .fallback import first_line, warn_once
from .functional import (
    Inputs,
    OutputFn,
    all_finite,
    as_output_tensor,
    check_inputs,
    check_output,
    evaluation_point,
    model_forward,
    nonfinite_fslr_error,
    substituted,
)
from .options import check_forward_seed


def _autograd_jvp(
    f: Callable[[Tensor], Tensor],
    primal: Tensor,
    tangent: Tensor,
    backward_context: Callable[[], contextlib.AbstractContextManager[None]] = nullcontext,
) -> Tensor:
    """``J tangent`` of ``f`` at ``primal`` with reverse-mode autograd only (double vjp).

    The backward passes run under ``backward_context()`` (entered after the forward): for
    activation checkpointing, which recomputes the forward inside them.
    """
    w = primal.detach().requires_grad_(True)
    with torch.enable_grad():
        out = f(w)
    with torch.enable_grad(), backward_context():
        if not out.requires_grad:
            return torch.zeros_like(out)
        u = torch.zeros_like(out, requires_grad=True)
        (g,) = torch.autograd.grad(out, w, u, create_graph=True, allow_unused=True)
        if g is None:  # the output does not depend on this tensor
            return torch.zeros_like(out)
        jd = None
        if g.requires_grad:
            (jd,) = torch.autograd.grad(g, u, tangent, allow_unused=True)
    if jd is None:
        raise RuntimeError(
            "the model's backward pass is not differentiable (an autograd Function with "
            "@once_differentiable, or a backward computed without grad), so exact cannot "
            "compute J dW without forward-mode AD; the probe (estimate, with_fslr) still works"
        )
    return jd.detach()


def exact(
    model: nn.Module,
    inputs: Inputs,
    delta: Mapping[str, Tensor],
    *,
    output_fn: OutputFn | None = None,
    params: Mapping[str, Tensor] | None = None,
    forward_seed: int | None = None,
    strict: bool = True,
) -> dict[str, Tensor]:
    """Exact per-tensor FSLR ``||J dW||_RMS`` of the update ``delta``.

    Args:
        model: any module; not mutated (buffers are cloned).
        inputs: a tensor, a tuple of positional arguments or a dict of keyword arguments.
        delta: parameter name -> update (names of ``named_parameters()``).
        output_fn: maps the model output to the tensor whose movement is measured.
        params: values to linearise at; defaults to the module's current parameters.
        forward_seed: run every forward under its own RNG seeded with this (the global state
            is restored after): with dropout, the same seed as the probe's measures the same
            function. ``None``: each forward draws from the global RNG.
        strict: refuse non-finite values with the errors below. ``False``, as a training
            run's probe (``with_fslr(..., estimator="exact")``): what cannot be measured reads
            NaN, which the wrapper's EMA leaves out and reports: every tensor where the inputs
            hold NaN, a tensor whose update holds NaN or Inf, a result that is not finite.

    Returns:
        Tensor name -> float64 scalar FSLR.

    Raises:
        ValueError: bad names or shapes, NaN or Inf in ``delta``, the inputs or the output
            (those only with ``strict``), an empty batch, or a forward that cuts measured
            tensors out of the graph (:mod:`fslr_func.probe.connectivity`): their FSLR would
            silently read 0.

    Examples:
        >>> model = torch.nn.Linear(3, 2, bias=False)
        >>> x = torch.eye(3)
        >>> delta = {"weight": torch.ones(2, 3)}
        >>> exact(model, x, delta)["weight"]  # every output moves by exactly 1
        tensor(1., dtype=torch.float64)
        >>> exact(model, torch.full((1, 3), float("nan")), delta, strict=False)["weight"]
        tensor(nan, dtype=torch.float64)
    """
    check_forward_seed(forward_seed)
    tensors, point = evaluation_point(model, delta, params, finite=strict)
    nan = torch.tensor(math.nan, dtype=torch.float64)
    result: dict[str, Tensor] = {}
    try:
        infinite = check_inputs(inputs)
    except ValueError:
        if strict:
            raise
        check_inputs(inputs, finite=False)  # a meta or empty batch is an error all the same
        return {n: nan.to(d.device) for n, d in delta.items()}  # NaN inputs: nothing measured
    if not strict:
        result = {n: nan.to(d.device) for n, d in delta.items() if not all_finite(d)}
        delta = {n: d for n, d in delta.items() if n not in result}

    use_jvp = True
    last_state: list[dict[str, Tensor]] = []
    depends: dict[str, bool] = {}
    output_finite: list[bool] = []  # not strict: whether the model output is finite

    def backward_context() -> contextlib.AbstractContextManager[None]:
        return substituted(model, last_state[0])

    for name, d in delta.items():

        def flat_output(w: Tensor, name: str = name) -> Tensor:
            state = {**point, **tensors.constants(), name: w}
            last_state[:] = [state]
            with CutFinder({name: w}) as cuts:
                raw = model_forward(model, state, inputs, output_fn, forward_seed=forward_seed)
                out = as_output_tensor(raw, output_fn).reshape(-1)
            if not depends:
                check_output(out, finite=strict)
                if not strict:
                    output_finite[:] = [all_finite(out)]
            # Under jvp a dependent output carries a tangent; under autograd, a graph to w.
            dual = forward_ad.unpack_dual(out).tangent  # type: ignore[no-untyped-call]
            depends[name] = dual is not None or reaches(out, w)
            if not depends[name] and name in cuts.used_without_grad:
                raise cut_error([name])
            if not depends[name] and name in cuts.behind_cut_activations:
                warn_once(model, "cut-behind", cut_behind_message([name]))
            if depends[name] and name in cuts.detached:
                warn_once(model, "partly-cut", partly_cut_message([name]))
            return out

        # J is linear: J dW = 2^-k J (2^k dW), with 2^k dW's largest entry in [1/2, 1), so
        # that neither the update cast to a half-precision model's dtype nor its tangent
        # overflows or underflows where the float64 result would not.
        primal, k = point[name], scale_exponent(d.to(torch.float64))
        direction = torch.ldexp(d.to(torch.float64), k).to(primal.dtype)
        if use_jvp:
            try:
                tangent = jvp(flat_output, (primal,), (direction,))[1]
            except (RuntimeError, NotImplementedError) as err:
                tangent = _autograd_jvp(flat_output, primal, direction, backward_context)
                use_jvp = False
                warn_once(
                    model,
                    "exact-autograd",
                    f"forward-mode AD (torch.func.jvp) failed for {type(model).__name__} "
                    f"({first_line(err)}); exact falls "
                    f"back to a double vjp with plain autograd (same result, two backward "
                    f"passes per tensor)",
                )
        else:
            tangent = _autograd_jvp(flat_output, primal, direction, backward_context)
        if output_finite == [False]:  # an Inf input, a diverged weight: nothing to measure
            return {**result, **{n: nan.to(v.device) for n, v in delta.items()}}
        if not strict and infinite and not all_finite(tangent):  # an Inf input reaches it
            result[name] = nan.to(primal.device)
            continue
        if use_jvp and not all_finite(tangent):
            # a forward-mode formula can overflow where the result does not: LayerNorm's
            # tangent holds rstd**3, past float16's maximum for an input spread of 0.02
            tangent = _autograd_jvp(flat_output, primal, direction, backward_context)
            warn_once(
                model,
                "exact-jvp-overflow",
                f"forward-mode AD overflowed in {primal.dtype} inside {type(model).__name__}'s "
                "forward; exact computes such tensors by a double vjp with plain autograd "
                "(same result, two backward passes per tensor)",
            )
        tangent = tangent.detach()  # an input with requires_grad gives J dW a graph to it
        result[name] = torch.ldexp(tangent.to(torch.float64).square().mean().sqrt(), -k)
        if not torch.isfinite(result[name]):
            if not strict:
                result[name] = nan.to(result[name].device)
                continue
            if infinite:  # else forward mode overflowed: the message below
                raise nonfinite_fslr_error([name], infinite)
            raise ValueError(
                f"J dW of {name!r} is not finite in the model's dtype {primal.dtype} even for "
                "the update scaled to a largest entry of 1 (forward mode and a double vjp "
                "both overflow): compute exact on a float32 copy of the model "
                "(copy.deepcopy(model).float())"
            )
    if not any(depends.values()) and (depends or strict):  # (not strict: all left out)
        raise disconnected_output_error()
    return result
