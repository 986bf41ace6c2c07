"""Layer 3, what a run leaves on disk: :class:`FSLRRecord` (a versioned JSON time series of
FSLRs, with its metadata) and atomic file writes.
"""
