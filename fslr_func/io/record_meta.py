"""What a record says about the run it came from: its metadata.

Every :class:`~fslr_func.io.record.FSLRRecord` carries :data:`META_KEYS` (filled with defaults
where unknown); :func:`optimizer_meta` and :func:`grouping_meta` describe an optimiser and a
grouping in JSON-able form, and FLeRM compares a base record's metadata with the scaled run's.

Examples:
    >>> default_meta()["estimator"] is None, "library_version" in default_meta()
    (True, True)
"""

from __future__ import annotations

import importlib.metadata
import math
import sys
from collections.abc import Mapping
from typing import Any

from ..stats.checks import is_real
from ..stats.estimator import Grouping

__all__ = [
    "META_KEYS",
    "default_meta",
    "grouping_meta",
    "is_learning_rate",
    "jsonable",
    "library_version",
    "optimizer_meta",
]

META_KEYS = (
    "base_lr",
    "optimizer",
    "optimizer_hparams",
    "estimator",
    "beta",
    "samples",
    "seed",
    "shapes",
    "model",
    "library_version",
    "schedule",
)
"""Metadata keys every record carries (missing ones are filled with defaults, mostly ``None``)."""


def library_version() -> str:
    """The running fslr_func's version: the package's own ``__version__`` (the code that
    runs, also where an editable install's metadata is stale), else the installed
    distribution's."""
    version = getattr(sys.modules.get("fslr_func"), "__version__", None)
    if version is not None:
        return str(version)
    try:
        return importlib.metadata.version("fslr_func")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def default_meta() -> dict[str, Any]:
    """Every key of :data:`META_KEYS` with its default (``None``, ``{}``, library version)."""
    return {
        "base_lr": None,
        "optimizer": None,
        "optimizer_hparams": {},
        "estimator": None,
        "beta": None,
        "samples": None,
        "seed": None,
        "shapes": {},
        "model": None,
        "library_version": library_version(),
        "schedule": None,
    }


def jsonable(obj: Any) -> Any:
    """Best-effort JSON-able copy (tuples -> lists, tensors/numpy -> numbers, others -> repr)."""
    if obj is None or isinstance(obj, (str, bool, int)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else repr(obj)
    if isinstance(obj, Mapping):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    tolist = getattr(obj, "tolist", None)  # torch.Tensor, numpy arrays and scalars
    if callable(tolist):
        return jsonable(tolist())
    return repr(obj)


def is_learning_rate(value: object) -> bool:
    """Whether ``value`` can be a record's ``base_lr``: a finite int or float ``> 0`` (no bool).

    Examples:
        >>> [is_learning_rate(v) for v in (1e-3, 0, float("nan"), True, "0.1")]
        [True, False, False, False, False]
    """
    return is_real(value) and float(value) > 0  # type: ignore[arg-type]


def optimizer_meta(optimizer: Any) -> dict[str, Any]:
    """Metadata describing a ``torch.optim`` optimiser, ready for ``FSLRRecord(meta=...)``.

    Args:
        optimizer: any object with ``defaults`` and ``param_groups`` (a ``torch.optim``
            optimiser).

    Returns:
        ``{"optimizer": class name, "optimizer_hparams": JSON-able defaults,
        "base_lr": lr_0}`` where ``lr_0`` is the ``initial_lr`` (set by schedulers) or,
        failing that, the ``lr`` of the first param group whose rate is not 0 (a group frozen
        at rate 0, an embedding say, is not the run's rate); ``None`` if every rate is 0.

    Examples:
        >>> import torch
        >>> opt = torch.optim.Adam([torch.zeros(2, requires_grad=True)], lr=0.01)
        >>> m = optimizer_meta(opt)
        >>> m["optimizer"], m["base_lr"], m["optimizer_hparams"]["betas"]
        ('Adam', 0.01, [0.9, 0.999])
        >>> frozen_first = torch.optim.SGD(
        ...     [{"params": [torch.zeros(2, requires_grad=True)], "lr": 0.0},
        ...      {"params": [torch.zeros(3, requires_grad=True)], "lr": 0.1}])
        >>> optimizer_meta(frozen_first)["base_lr"]
        0.1
    """
    rates = [
        float(lr)
        for g in getattr(optimizer, "param_groups", [])
        if (lr := g.get("initial_lr", g.get("lr"))) is not None
    ]
    base_lr = next((lr for lr in rates if lr != 0), None)
    defaults = dict(getattr(optimizer, "defaults", {}))
    defaults.pop("params", None)
    return {
        "optimizer": type(optimizer).__name__,
        "optimizer_hparams": jsonable(defaults),
        "base_lr": base_lr,
    }


def grouping_meta(grouping: Grouping) -> str:
    """``grouping`` as stored in ``record.meta["grouping"]``: a name as is, a callable marked.

    A callable grouping cannot be saved, so it is stored as ``"callable:"`` and its qualified
    name; FLeRM compares groupings by these strings.

    Examples:
        >>> def by_kernel(name, shape):
        ...     return None
        >>> grouping_meta("auto"), grouping_meta(by_kernel)
        ('auto', 'callable:by_kernel')
    """
    if isinstance(grouping, str):
        return grouping
    name = getattr(grouping, "__qualname__", None) or type(grouping).__qualname__
    return f"callable:{name}"
