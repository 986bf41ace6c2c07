"""Test settings: hypothesis profiles, one torch thread, the float64 fixture; the models the
older test files import from here live in ``tests/cases.py``."""

from __future__ import annotations

import os

import pytest
import torch
from cases import (  # noqa: F401 (re-exported for the test files that import them from here)
    MLP,
    AttentionBlock,
    ConvNet,
    DictOutput,
    ResMLP,
    random_delta,
)
from hypothesis import HealthCheck, settings

# Hypothesis: a fast profile by default, a thorough one in CI (.ci/run sets HYPOTHESIS_PROFILE=ci).
# Both derandomised, so a run is reproducible; CI's 8x the examples reach the edge cases.
settings.register_profile("dev", max_examples=25, deadline=None, derandomize=True)
settings.register_profile(
    "ci",
    max_examples=200,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))
# One thread: on 2 shared cores, small ops run far faster without intra-op threading.
torch.set_num_threads(1)


@pytest.fixture
def double() -> None:
    """Run a test in float64 by default."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)
