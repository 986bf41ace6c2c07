"""Fallbacks when torch.func cannot trace a module: say so once, keep the user's run going.

The probe falls back from :func:`torch.func.vmap` to a loop and from :func:`torch.func.vjp`
to plain autograd; :func:`fslr_func.probe.exact` from :func:`torch.func.jvp` to a double vjp. Each
fallback gives the same result more slowly, so it warns once per model class and kind of
fallback, never per step.

Examples:
    >>> import warnings, torch
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     for _ in range(3):
    ...         warn_once(torch.nn.Identity(), "doc-example", "falling back")
    >>> len(caught)
    1
"""

from __future__ import annotations

import warnings

from torch import nn

__all__ = ["first_line", "warn_once"]

_warned: set[tuple[str, str]] = set()


def warn_once(model: nn.Module, key: str, message: str) -> None:
    """Warn (``RuntimeWarning``) once per model class and kind of event ``key``."""
    tag = (type(model).__qualname__, key)
    if tag not in _warned:
        _warned.add(tag)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def first_line(err: BaseException) -> str:
    """``"TypeName: first line of the message"`` (at most 200 characters), for warnings."""
    lines = str(err).splitlines()
    return f"{type(err).__name__}: {lines[0][:200] if lines else ''}"
