"""A tiny float64 MLP under ``with_fslr``, its probe batches and its training backward: the
shared set-up of the hook and step-handling tests, on the test device (``tests/_device.py``)."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from _device import DEVICE
from torch import Tensor, nn

import fslr_func as ff


def model(seed: int = 0, width: int = 10) -> ff.FSLRModule:
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(6, width), nn.Tanh(), nn.Linear(width, 3)).to(
        DEVICE, torch.float64
    )
    return ff.with_fslr(net, samples=4, seed=1, strategy="loop")


def stream(seed: int = 0) -> Iterator[Tensor]:
    g = torch.Generator().manual_seed(seed)
    while True:
        yield torch.randn(8, 6, generator=g, dtype=torch.float64).to(DEVICE)


def backward(fm: ff.FSLRModule, t: int) -> None:
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(100 + t), dtype=torch.float64).to(
        DEVICE
    )
    fm(x).square().mean().backward()
