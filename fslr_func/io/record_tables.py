"""A record as a table: one flat row per recorded step, as dicts, CSV text or a pandas
``DataFrame`` (``FSLRRecord.to_rows``, ``to_csv``, ``to_pandas``).

Examples:
    >>> from fslr_func.io.record import FSLRRecord
    >>> rec = FSLRRecord(steps=[0], fslr={"w": [0.5]}, lrs={"w": [0.1]})
    >>> table_rows(rec)
    [{'step': 0, 'sched': 1.0, 'fslr/w': 0.5, 'lr/w': 0.1}]
    >>> csv_text(rec).split()
    ['step,sched,fslr/w,lr/w', '0,1.0,0.5,0.1']
"""

from __future__ import annotations

import csv
import io
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

__all__ = ["Table", "columns", "csv_text", "data_frame", "table_rows"]


class Table(Protocol):
    """The parts of a record a table reads."""

    @property
    def steps(self) -> Sequence[int]: ...

    @property
    def sched(self) -> Sequence[float]: ...

    @property
    def fslr(self) -> Mapping[str, Sequence[float | None]]: ...

    @property
    def lrs(self) -> Mapping[str, Sequence[float]]: ...


def columns(record: Table) -> list[str]:
    """The table's columns, also for a record without rows: ``step``, ``sched``,
    ``fslr/<name>`` of every tensor, ``lr/<name>`` of every tensor with rates.

    Examples:
        >>> from fslr_func.io.record import FSLRRecord
        >>> columns(FSLRRecord(fslr={"w": []}))
        ['step', 'sched', 'fslr/w']
    """
    return ["step", "sched", *(f"fslr/{n}" for n in record.fslr), *(f"lr/{n}" for n in record.lrs)]


def table_rows(record: Table) -> list[dict[str, float | None]]:
    """One flat dict per recorded step: ``step``, ``sched``, ``fslr/<name>`` (``None`` where
    unknown), ``lr/<name>``."""
    return [
        {
            "step": step,
            "sched": record.sched[i],
            **{f"fslr/{n}": v[i] for n, v in record.fslr.items()},
            **{f"lr/{n}": v[i] for n, v in record.lrs.items()},
        }
        for i, step in enumerate(record.steps)
    ]


def csv_text(record: Table) -> str:
    """:func:`table_rows` as CSV: a header row, then one row per step (an unknown FSLR is an
    empty cell)."""
    rows = table_rows(record)
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=columns(record))
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()


def data_frame(record: Table) -> Any:
    """:func:`table_rows` as a ``pandas.DataFrame`` indexed by ``step`` (unknown: NaN).

    Raises:
        ImportError: pandas is not installed (``pip install pandas``).
    """
    try:
        import pandas as pd
    except ImportError as err:
        raise ImportError(
            "FSLRRecord.to_pandas needs pandas: pip install pandas (or use to_rows/to_csv)"
        ) from err
    # float columns throughout: a tensor unknown at every row is NaN, not an object column
    frame = pd.DataFrame(table_rows(record), columns=columns(record), dtype=float)
    frame["step"] = frame["step"].astype("int64")
    return frame.set_index("step")
