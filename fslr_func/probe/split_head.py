r"""The probe's backward split at a linear readout: the readout's products by hand, one omega
sample at a time, and the rest of the model's backward batched over the samples.

When the model output is the output of one ``nn.Linear``, ``Y = H W^T + b`` (``H`` the
readout's input with its ``N`` rows, ``W`` of shape ``(V, d)``), the vjp of one omega sample
``C`` (the flat output's cotangent viewed as ``N x V``) is

.. math::

    \partial W = C^\top H, \qquad \partial b = \mathbf{1}^\top C, \qquad
    \partial H = C W ,

and every other tensor's gradient is the vjp of the model's body (everything before the
readout) applied to ``dH``. A language model's omega holds ``N V`` values (0.5 GB per sample
for Llama's 128k vocabulary at 1024 tokens): batching whole samples under vmap multiplies
that by the chunk, so the probe ran them one by one, paying the body's backward and the
statistics once per sample (on a GPU, thousands of small launches: 1.09x the sequential
method on the thin Llama of ``benchmarks/gpu.py``). Split, only ``dH`` (``N x d``) and the
readout's gradients are kept per sample; the omega lives one sample at a time in the loop
that computes the three products, and the body's backward and the statistics run once per
chunk of samples under vmap.

The split is exact (the same gradients, to float rounding of the products) and is taken only
where it is known to be: the readout found by an earlier probe of the same model and shapes
(:mod:`fslr_func.probe.forward_cache`) is a plain, untied ``nn.Linear``, called once, whose
output is the model output itself (checked on every forward, :class:`HeadCapture`). Any other
use of ``W`` or ``b`` in the body (a raw read of the weight elsewhere) is differentiated by the
body's vjp and added. :func:`fslr_func.probe.sampling.run_probe` takes it for one-process
probes with ``chunk_size=None`` on the vmap path whose omegas would not all fit one chunk.

Examples:
    >>> import torch
    >>> head = torch.nn.Linear(3, 5)
    >>> h, c = torch.randn(4, 3), torch.randn(4 * 5)
    >>> split = SplitHead(LinearHead("", "weight", "bias"), h, head.weight.detach(),
    ...                   {"weight", "bias"}, torch.float32)
    >>> dh, grads = split.readout_gradients(c)
    >>> (y := head(h.requires_grad_())).backward(c.view(4, 5))
    >>> torch.allclose(dh, h.grad), torch.allclose(grads["weight"], head.weight.grad)
    (True, True)
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from .readout import tied

__all__ = ["HeadCapture", "LinearHead", "SplitHead", "linear_head"]


@dataclass(frozen=True)
class LinearHead:
    """A readout the probe may split at: module and tensor names (relative to the model)."""

    module: str
    weight: str
    bias: str | None


def linear_head(model: nn.Module, module_name: str | None) -> LinearHead | None:
    """The readout ``module_name`` as a :class:`LinearHead`, or ``None`` where it is not a
    plain ``nn.Linear`` (a subclass with its own forward, a parametrized weight, a LoRA
    wrapper) or where its weight or bias is tied to another parameter.

    Examples:
        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
        >>> linear_head(model, "1")
        LinearHead(module='1', weight='1.weight', bias='1.bias')
        >>> linear_head(torch.nn.Sequential(torch.nn.Conv1d(1, 1, 3)), "0") is None
        True
    """
    if module_name is None:
        return None
    module = model.get_submodule(module_name)
    if (
        not isinstance(module, nn.Linear)
        or type(module).forward is not nn.Linear.forward
        or parametrize.is_parametrized(module)
    ):
        return None
    if any(tied(model, t) for t in (module.weight, module.bias) if t is not None):
        return None
    prefix = f"{module_name}." if module_name else ""
    bias = f"{prefix}bias" if module.bias is not None else None
    return LinearHead(module_name, f"{prefix}weight", bias)


class HeadCapture:
    """Forward hook on the readout: its input ``H`` and its output, for one forward.

    :meth:`output_is_head` tells whether the model output is the readout's output itself
    (not a copy, a cast, a slice or a sum with something else), the one case where the
    split's products are the model's vjp.
    """

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.calls: list[tuple[Any, Any]] = []
        self._handle: Any = None

    def __enter__(self) -> HeadCapture:
        self.calls.clear()
        # first, before the user's hooks: one that replaces the output fails output_is_head
        self._handle = self.module.register_forward_hook(self._hook, prepend=True)
        return self

    def _hook(self, module: nn.Module, args: Any, output: Any) -> None:
        self.calls.append((args, output))

    def __exit__(self, *exc: object) -> None:
        self._handle.remove()

    def output_is_head(self, output: Tensor) -> bool:
        """Whether ``output`` is the one output of the readout's one call, computed from a
        tensor input passed by position."""
        if len(self.calls) != 1:
            return False
        args, out = self.calls[0]
        return len(args) == 1 and isinstance(args[0], Tensor) and out is output

    @property
    def input(self) -> Tensor:
        """``H``, the readout's input of the captured call."""
        return self.calls[0][0][0]  # type: ignore[no-any-return]


@dataclass
class SplitHead:
    """The readout's part of one probe's vjp (the module docstring's three products).

    Attributes:
        head: the readout's names.
        inputs: ``H``, the readout's input in the probe's forward (detached).
        weight: ``W``'s value in that forward (detached).
        probed: which of the readout's tensor names the probe differentiates.
        dtype: the dtype of the model output: the products run in it, as the readout's
            forward did (under autocast, a bfloat16 output), and gradients come back in the
            dtypes of ``H`` and of the tensors.
    """

    head: LinearHead
    inputs: Tensor
    weight: Tensor
    probed: Collection[str]
    dtype: torch.dtype

    def __post_init__(self) -> None:
        self._rows = self.inputs.reshape(-1, self.inputs.shape[-1]).to(self.dtype)
        self._weight = self.weight.to(self.dtype)

    @property
    def cotangent_bytes(self) -> int:
        """Bytes of one sample's ``dH`` and probed readout gradients, kept until its chunk's
        body backward."""
        readout = sum(
            (self.weight.numel() if n == self.head.weight else self.weight.shape[0])
            for n in self.probed
        )
        return (self.inputs.numel() + readout) * self.dtype.itemsize

    def readout_gradients(self, cotangent: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """``dH`` and the probed readout tensors' gradients for one flat output cotangent."""
        c = cotangent.view(-1, self.weight.shape[0]).to(self.dtype)
        d_inputs = (c @ self._weight).view(self.inputs.shape).to(self.inputs.dtype)
        grads = {}
        if self.head.weight in self.probed:
            grads[self.head.weight] = (c.T @ self._rows).to(self.weight.dtype)
        if self.head.bias is not None and self.head.bias in self.probed:
            grads[self.head.bias] = c.sum(0).to(self.weight.dtype)
        return d_inputs, grads
