"""Small models shared by the tests (float64 where a test checks an identity)."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, settings
from torch import Tensor, nn

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


class MLP(nn.Module):
    """Two hidden layers with tanh; the readout is ``out``."""

    def __init__(self, d_in: int = 5, width: int = 7, d_out: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(d_in, width)
        self.hidden = nn.Linear(width, width)
        self.out = nn.Linear(width, d_out)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(torch.tanh(self.hidden(torch.tanh(self.inp(x)))))


class ResMLP(nn.Module):
    """A residual MLP with a readout named ``readout``."""

    def __init__(self, d_in: int = 6, width: int = 8, depth: int = 2, d_out: int = 4) -> None:
        super().__init__()
        self.input = nn.Linear(d_in, width)
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.readout = nn.Linear(width, d_out)

    def forward(self, x: Tensor) -> Tensor:
        h = self.input(x)
        for block in self.blocks:
            h = h + torch.relu(block(h))
        return self.readout(h)


class ConvNet(nn.Module):
    """Conv2d (rank-4 weight), pooling and a linear readout."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, kernel_size=3, padding=1)
        self.head = nn.Linear(3, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.conv(x)).mean(dim=(2, 3)))


class AttentionBlock(nn.Module):
    """Single-head causal self-attention with a residual, then a linear readout."""

    def __init__(self, d: int = 6, vocab: int = 5) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.o = nn.Linear(d, d)
        self.readout = nn.Linear(d, vocab)

    def forward(self, x: Tensor) -> Tensor:
        a = nn.functional.scaled_dot_product_attention(
            self.q(x), self.k(x), self.v(x), is_causal=True
        )
        return self.readout(x + self.o(a))


class DictOutput(nn.Module):
    """Returns a dict, like many research models."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x: Tensor) -> dict[str, Tensor]:
        h = torch.tanh(self.body(x))
        return {"logits": self.head(h), "features": h}


def random_delta(model: nn.Module, seed: int = 0, scale: float = 1e-2) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        n: scale * torch.randn(p.shape, generator=g, dtype=p.dtype)
        for n, p in model.named_parameters()
    }


@pytest.fixture
def double() -> None:
    """Run a test in float64 by default."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)
