"""Layer 3, what a run leaves on disk: :class:`FSLRRecord` (a versioned JSON time series of
FSLRs, with its metadata) and atomic file writes.
"""

from .atomic import atomic_write_text, write_json
from .record import FSLRRecord

__all__ = ["FSLRRecord", "atomic_write_text", "write_json"]
