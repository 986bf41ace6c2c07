"""The readout layer: the leaf module whose output *is* the model output, found during the
probe's forward (:class:`ReadoutFinder`) or named by the user (:func:`readout_module`), and the
roles its tensors play in the estimators (:func:`readout_roles`: the row-independent variants
of the paper's readout appendix).

Examples:
    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    >>> with ReadoutFinder(model) as finder:
    ...     out = model(torch.randn(5, 3))
    >>> finder.find(out)
    '2'
"""

from __future__ import annotations

import difflib
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from ..stats.estimator import ReadoutRole
from .functional import (
    Inputs,
    ModuleTensors,
    OutputFn,
    as_output_tensor,
    compiled_inner,
    model_forward,
)

__all__ = [
    "ReadoutFinder",
    "find_readout",
    "readout_module",
    "readout_roles",
    "rows_independent",
    "tied",
]


class ReadoutFinder:
    """Finds the readout layer: the leaf module that computed the model output.

    Forward hooks on the leaf modules remember each output during one forward; the module
    whose output is the very tensor the model returns (after ``output_fn``) is the readout. A
    readout weight that is tied to another tensor (GPT-2's head and embedding) is not given the
    row-independent estimator, since the independence argument needs the weight to act only
    in the readout; for the same reason a module called more than once in the forward is not
    a readout, nor is one whose output a forward hook of the user's replaces (``o @ mix``).
    Whether the model's output units are each a function of one row of the readout found is
    :func:`rows_independent`'s question.
    TorchScript submodules take no hooks: they are run but never found (name a scripted
    readout with ``readout=``).
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._seen: list[tuple[str, Tensor]] = []
        self._handles: list[Any] = []

    def __enter__(self) -> ReadoutFinder:
        for name, module in self.model.named_modules():
            # TorchScript modules refuse hooks (and their children are TorchScript modules
            # too): a scripted submodule runs as it is, and is never found as the readout.
            if isinstance(module, torch.jit.ScriptModule):
                continue
            if next(module.children(), None) is None:
                # Before the user's hooks: a hook that returns a new tensor (mixing the
                # outputs, a temperature) makes the model output another function of the
                # module's rows, so the module is not the readout.
                hook = module.register_forward_hook(self._hook(name), prepend=True)
                self._handles.append(hook)
        return self

    def _hook(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if isinstance(output, Tensor):
                self._seen.append((name, output))

        return hook

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def find(self, output: Tensor) -> str | None:
        """Name of the module that computed ``output``, or ``None``; forgets what it saw.

        The first module, in the order of the forward, to return the very tensor: modules after
        it that return their input unchanged (``nn.Identity``, as timm's classifier heads end
        with, ``nn.Flatten`` of a 2-d output, ``nn.Dropout`` in eval mode) pass the readout's
        output on, and are not the readout. A module that ran more than once in the forward
        (one layer applied at every depth, a weight-shared recurrence) is not a readout either:
        its tensors act before the output too, so rows of its weight are not independent, and
        the readout estimators would be biased (like a weight tied to another tensor). A
        module without a ``weight`` or ``bias`` of its own (an activation) is not a readout.
        """
        found = next((name for name, t in self._seen if t is output), None)
        calls = sum(name == found for name, _ in self._seen)
        self._seen.clear()
        if found is None or calls != 1:
            return None
        # An activation ending the model (``Sequential(Linear, Tanh)``), or a model computing
        # the output from raw parameters of its own (``x @ self.w``, with no submodules), has
        # no weight or bias for the readout estimators: there is no readout layer.
        return found if _own_tensors(self.model.get_submodule(found)) else None


def readout_module(model: nn.Module, name: str) -> nn.Module:
    """The submodule ``name`` given as ``readout=``.

    Raises:
        ValueError: no such module, with the closest leaf-module names; or a module without a
            ``weight`` or ``bias`` tensor of its own (an activation, a container, the model
            itself), which no readout estimator could use, with the modules that have one.
    """
    try:
        module = model.get_submodule(name)
    except AttributeError as err:
        names = [n for n, m in model.named_modules() if _own_tensors(m)]
        close = difflib.get_close_matches(name, names, n=3)
        raise ValueError(
            f"readout={name!r} is not a module of the model"
            + (f"; did you mean {close}?" if close else "")
        ) from err
    if not _own_tensors(module):
        names = [n for n, m in model.named_modules() if _own_tensors(m)]
        raise ValueError(
            f"readout={name!r} is a {type(module).__name__} without a weight or bias tensor of "
            "its own, so its tensors could not get the readout estimators: name the layer "
            f"that computes the model output (modules with one: {names[-3:]}), or pass "
            "readout='auto' to find it"
        )
    return module


def _own_tensors(module: nn.Module) -> bool:
    """Whether ``module`` has a ``weight`` or ``bias`` tensor of its own: a parameter, a
    buffer, a parametrized tensor or a plain tensor attribute (legacy ``weight_norm``), found
    without computing it (a spectral norm's power iteration would update its buffers)."""
    own = {n for n, _ in module.named_parameters(recurse=False)}
    own |= {n for n, _ in module.named_buffers(recurse=False)}
    return any(
        a in own
        or parametrize.is_parametrized(module, a)
        or isinstance(vars(module).get(a), Tensor)
        for a in ("weight", "bias")
    )


def tied(model: nn.Module, tensor: Tensor) -> bool:
    """Whether ``tensor`` is not exactly one of ``model``'s parameters: shared under another
    name too (GPT-2's head and embedding), or no parameter at all (a tensor computed from
    one, as legacy ``weight_norm`` sets).

    Examples:
        >>> model = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5))
        >>> tied(model, model[1].weight)
        False
        >>> model[1].weight = model[0].weight
        >>> tied(model, model[1].weight)
        True
    """
    return sum(p is tensor for _, p in model.named_parameters(remove_duplicate=False)) != 1


def find_readout(
    model: nn.Module,
    inputs: Inputs,
    output_fn: OutputFn | None = None,
    *,
    forward_seed: int | None = None,
) -> tuple[str | None, int]:
    """The readout module :class:`ReadoutFinder` sees compute the output of one forward on
    ``inputs``, and the size of the output's last dim (``None`` where no module's output is
    the model's).

    The forward is the probe's (:func:`~fslr_func.probe.functional.model_forward`, without
    gradients): it leaves no trace, its inputs and buffers copies (a forward that scales its
    input in place, BatchNorm's running statistics), the random streams as they were (dropout;
    ``forward_seed`` as the probe's), and a ``torch.compile`` wrapper's original module runs
    eagerly (no graph compiled for it), its names with the wrapper's prefix.

    Examples:
        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
        >>> find_readout(model, torch.randn(5, 3))
        ('1', 2)
    """
    inner, prefix = compiled_inner(model)
    tensors = ModuleTensors.of(model)
    state = {**tensors.trainable, **tensors.constants()}
    cuda = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    with torch.no_grad(), torch.random.fork_rng(devices=cuda), ReadoutFinder(inner) as finder:
        raw = model_forward(model, state, inputs, output_fn, forward_seed=forward_seed)
        out = as_output_tensor(raw, output_fn)
        found = finder.find(out)
    return (None if found is None else prefix + found), (out.shape[-1] if out.dim() else 1)


def readout_roles(
    model: nn.Module,
    module_name: str | None,
    trainable: Mapping[str, Tensor],
    num_outputs: int,
    *,
    named: bool = False,
) -> dict[str, ReadoutRole]:
    """Map the readout module's own weight/bias names to ``"weight"``/``"bias"``.

    Only parameters of the right shape (weight ``(K, d)``, bias ``(K,)`` with ``K`` the size
    of the output's last dim) that are not tied elsewhere are candidates; the probe keeps
    them only where the output's units pass :func:`rows_independent`. A module the user
    ``named`` whose weight is not ``(K, d)`` is warned of; one found by ``readout="auto"``
    (a head stored as ``(in, out)``, an ``nn.Embedding`` at the end) is not: its tensors
    get the tensor-normal estimator, as for any layer.
    """
    if module_name is None:
        return {}
    module = readout_module(model, module_name)
    prefix = f"{module_name}." if module_name else ""
    roles: dict[str, ReadoutRole] = {}
    weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
    w_name, b_name = prefix + "weight", prefix + "bias"
    untied = isinstance(weight, Tensor) and not tied(model, weight)
    if isinstance(weight, Tensor) and w_name in trainable and untied and weight.dim() == 2:
        if weight.shape[0] == num_outputs:
            roles[w_name] = "weight"
        elif named:
            warnings.warn(
                f"readout={module_name!r} has a weight of shape {tuple(weight.shape)}, but the "
                f"model output has {num_outputs} entries on its last dim: it does not compute "
                "the output, or stores its weight as (in, out), so its tensors get the "
                "tensor-normal estimator, not the readout's; name the layer that computes the "
                "output with a weight of shape (outputs, inputs), or pass readout='auto'",
                RuntimeWarning,
                stacklevel=2,
            )
    if isinstance(bias, Tensor) and b_name not in trainable:  # named first elsewhere: BERT's
        # MLM head registers its decoder's bias as cls.predictions.bias too
        b_name = next((n for n, p in model.named_parameters() if p is bias), b_name)
    if isinstance(bias, Tensor) and b_name in trainable and bias.shape == (num_outputs,):
        roles[b_name] = "bias"
    return roles


def rows_independent(
    output_of: Callable[[Mapping[str, Tensor]], Tensor],
    params: Mapping[str, Tensor],
    roles: Mapping[str, ReadoutRole],
) -> bool:
    """Whether each unit of the model output depends on its own row of the readout tensors
    that would get ``roles`` alone, as the readout estimators assume: the output is computed
    twice more, with the even rows of those tensors moved and with the odd rows moved, and
    each time the units of the other half must come out bit for bit the same. (Moving row 0
    alone proved nothing where the forward never reads it otherwise: a tied embedding reading
    ``head.weight`` with no token 0 in the batch, a square head stored as ``(in, out)`` whose
    input unit 0 is dead.) The rows move by at least 1 and by a sixteenth of the tensor's
    largest entry, which no 16-bit float rounds away.

    It fails where anything mixes the units: a head that normalises them in its own forward
    (``log_softmax`` inside the module), an in-place change of the head's output after it
    (``o -= o.mean(-1, keepdim=True)``), an ``output_fn`` that mixes them, or the weight read
    elsewhere in the forward too (an embedding tied to it by reading ``head.weight``). Where
    the output cannot be told apart from itself (two forwards at the same point differ:
    randomness the forward seed does not fix, such as a module's own generator), nothing is
    concluded and the estimators are kept, as before the check; so they are where the extra
    forwards raise.

    Args:
        output_of: the model output (after ``output_fn``) with the given parameters replaced,
            each call on fresh copies of the buffers and with the same torch random draws.
        params: the parameters the probe measured at (name -> tensor).
        roles: the readout tensors' roles (:func:`readout_roles`), by name.

    Examples:
        >>> head = torch.nn.Linear(4, 5)
        >>> x = torch.randn(3, 4)
        >>> def out(moved):
        ...     return torch.func.functional_call(head, dict(moved), (x,))
        >>> params, roles = dict(head.named_parameters()), {"weight": "weight", "bias": "bias"}
        >>> rows_independent(out, params, roles)
        True
        >>> rows_independent(lambda m: out(m).log_softmax(-1), params, roles)
        False
    """
    try:
        with torch.no_grad():
            before = output_of({})
            if before.dim() == 0 or before.shape[-1] == 1:
                return True
            units = before.shape[-1]
            steps = {  # per row, computed on the device (no host read)
                name: (params[name].detach().abs().amax() / 16).clamp(min=1.0)
                for name in roles
                if params[name].dim() >= 1 and params[name].shape[0] == units
            }
            for half, other in (
                (slice(0, None, 2), slice(1, None, 2)),
                (slice(1, None, 2), slice(0, None, 2)),
            ):
                moved: dict[str, Tensor] = {}
                for name, amount in steps.items():
                    tensor = params[name].detach()
                    step = torch.zeros_like(tensor)
                    step[half] = amount
                    moved[name] = tensor + step
                after = output_of(moved)
                if after.shape != before.shape or not torch.equal(
                    after[..., other], before[..., other]
                ):
                    return not torch.equal(output_of({}), before)  # not reproducible: cannot tell
            return True
    except Exception:  # a forward that cannot run again outside the probe: cannot tell
        return True
