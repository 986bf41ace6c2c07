"""Resident-set figures of this process, shared by the benchmarks that measure peak memory."""

from __future__ import annotations


def status_mib(field: str) -> float:
    """A field of /proc/self/status (``VmRSS``, ``VmHWM``) in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return float(line.split()[1]) / 1024
    raise RuntimeError(f"{field} not in /proc/self/status")
