"""FLeRM variants measured on the transfer matrix (issue 23): prototypes built on the public
API (:class:`fslr_func.FLeRM`), selected by :attr:`SweepConfig.flerm_variant`.

Filled in below; :data:`VARIANTS` names them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["VARIANTS", "Variant"]


@dataclass(frozen=True)
class Variant:
    """A FLeRM variant: how its controller is made.

    Attributes:
        make: ``make(fm, optimizer, base, **flerm_kwargs) -> controller`` with FLeRM's
            ``step()`` context manager and ``history``.
        doc: one line for tables.
    """

    make: Callable[..., Any]
    doc: str


#: Variants by name.
VARIANTS: dict[str, Variant] = {}
