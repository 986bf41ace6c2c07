"""Reference models, offline data and a plain training loop for the paper's experiments.

Examples:
    >>> from fslr_func.experiments import ResMLP, Transformer, digits, train, last_mean
    >>> ResMLP(64, 10, width=16).readout.weight.shape
    torch.Size([10, 16])
"""

from fslr_func.experiments.data import (
    Split,
    batches,
    byte_batches,
    digits,
    lm_batches,
    mnist1d,
    pydoc_text,
    split_bytes,
    stdlib_source,
)
from fslr_func.experiments.models import BLOCK_RE, ResMLP, Transformer, block_index
from fslr_func.experiments.train import last_mean, lm_loss, train

__all__ = [
    "BLOCK_RE",
    "ResMLP",
    "Split",
    "Transformer",
    "batches",
    "block_index",
    "byte_batches",
    "digits",
    "last_mean",
    "lm_batches",
    "lm_loss",
    "mnist1d",
    "pydoc_text",
    "split_bytes",
    "stdlib_source",
    "train",
]
