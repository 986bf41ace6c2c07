"""The arguments of the ``fslr`` command: numbers (``2^k`` too), learning-rate ranges, the
accepted interval of every number option, and the sweep options' table.

Every value outside its interval ends in one line naming the option and the interval
(argparse's ``error: argument --lrs: ...``, exit status 2).

Examples:
    >>> parse_lrs("1e-3, 2^-4")
    (0.001, 0.0625)
    >>> value_range(2.0**-40, 1024.0)
    '[2^-40, 2^10]'
"""

from __future__ import annotations

import argparse
import math
import re
from typing import Any

from ..training.policies import POLICIES
from .configs import AXES, DATA, FLERM_INITS, MODELS, MODES, NORMS
from .train import OPTIMIZERS, SCHEDULES

__all__ = [
    "FLOAT_RANGES",
    "INT_RANGES",
    "LR_RANGE",
    "MAX_DEPTH",
    "MAX_VALUES",
    "MAX_WIDTH",
    "SCALE_RANGE",
    "SWEEP_OPTIONS",
    "check_modes_type",
    "in_range",
    "integer_type",
    "modes_type",
    "number",
    "parse_lrs",
    "real_type",
    "value_range",
]

_NUMBER = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?"


def number(text: str) -> float:
    """A float, or ``2^k`` / ``2**k``."""
    t = text.strip()
    m = re.fullmatch(rf"2\s*(?:\^|\*\*)\s*({_NUMBER})", t)
    try:
        value = 2.0 ** float(m.group(1)) if m else float(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text.strip()!r} is not a number") from None
    except OverflowError:  # 2^2000
        raise argparse.ArgumentTypeError(f"{text.strip()!r} is not a finite number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text.strip()!r} is not a finite number")
    return value


def parse_lrs(text: str) -> tuple[float, ...]:
    """Learning rates from the command line: a comma list of numbers or ``2^k`` and ranges.

    ``LO..HI`` is one learning rate per octave from ``LO`` up to ``HI``; ``LO..HI/N`` has ``N``
    per octave.

    Examples:
        >>> parse_lrs("1e-3, 2^-4")
        (0.001, 0.0625)
        >>> [f"{x:g}" for x in parse_lrs("2^-4..2^-2")]
        ['0.0625', '0.125', '0.25']
        >>> len(parse_lrs("2^-4..2^-2/2"))
        5
    """
    out: list[float] = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            raise argparse.ArgumentTypeError(f"empty item in {text!r}")
        if ".." in item:
            span, _, per = item.partition("/")
            lo_text, _, hi_text = span.partition("..")
            lo, hi = number(lo_text), number(hi_text)
            try:
                n = int(per) if per else 1
            except ValueError:
                raise argparse.ArgumentTypeError(
                    f"{per!r} in {item!r} is not a whole number of learning rates per octave"
                ) from None
            if lo <= 0 or hi < lo or n < 1:
                raise argparse.ArgumentTypeError(
                    f"range {item!r} needs 0 < LO <= HI and a positive count per octave"
                )
            k = 0
            while lo * 2.0 ** (k / n) <= hi * (1 + 1e-9):
                out.append(lo * 2.0 ** (k / n))
                k += 1
                if k > 10_000:
                    raise argparse.ArgumentTypeError(f"range {item!r} is too long")
        else:
            out.append(number(item))
    bad = [x for x in out if x <= 0]
    if bad:
        raise argparse.ArgumentTypeError(f"learning rates must be > 0, got {bad[0]:g}")
    return tuple(out)


LR_RANGE = (2.0**-40, 2.0**10)
"""Learning rates the command accepts (every sweep rate, ``fslr check --lr``)."""

SCALE_RANGE = (2.0**-6, 2.0**10)
"""Scale multipliers the command accepts."""

MAX_WIDTH = 2**13
"""Largest width (base width times scale) of a built-in model."""

MAX_DEPTH = 2**9
"""Largest number of blocks (base depth times scale) of a built-in model."""

MAX_VALUES = 256
"""Most learning rates or scales one sweep takes."""

INT_RANGES: dict[str, tuple[int, int]] = {
    "steps": (1, 10**6),
    "seeds": (1, 100),
    "width": (1, MAX_WIDTH),
    "depth": (1, MAX_DEPTH),
    "batch_size": (1, 2**16),
    "num_samples": (100, 10**6),
    "seq_len": (2, 2**12),
    "last": (1, 10**6),
    "samples": (1, 2**12),
    "warmup_samples": (1, 2**16),
    "every": (1, 10**6),
    "jobs": (1, 256),
    "seed": (0, 2**32 - 1),
}
"""Accepted range of every whole-number option, both ends included."""

FLOAT_RANGES: dict[str, tuple[float, float]] = {
    "lr": LR_RANGE,
    "init_scale": (2.0**-20, 2.0**20),
    "weight_decay": (0.0, 10.0),
    "threshold": (1.0, 2.0**20),
}
"""Accepted range of every number option, both ends included (``threshold`` excludes 1)."""


def value_range(lo: float, hi: float) -> str:
    """``[lo, hi]`` as the messages show it (``2^k`` for powers of two).

    Examples:
        >>> value_range(2.0**-40, 1024.0), value_range(1, 100), value_range(0.0, 10.0)
        ('[2^-40, 2^10]', '[1, 100]', '[0, 10]')
        >>> value_range(2.0**-6, 0.5)
        '[2^-6, 2^-1]'
    """

    def show(x: float) -> str:
        k = math.log2(x) if x > 0 else 0.5
        if k.is_integer() and (k < 0 or k >= 10):
            return f"2^{int(k)}"
        return str(int(x)) if float(x).is_integer() else f"{x:g}"

    return f"[{show(lo)}, {show(hi)}]"


def in_range(value: float, lo: float, hi: float, what: str, text: str) -> None:
    """Refuse ``value`` outside ``[lo, hi]`` (``argparse.ArgumentTypeError`` naming both)."""
    if not lo <= value <= hi:
        raise argparse.ArgumentTypeError(f"{what} in {value_range(lo, hi)}, got {text!r}")


def accepted(parse: Any, what: str, lo: float, hi: float) -> Any:
    """``parse`` whose errors end with the accepted range."""

    def checked(text: str) -> Any:
        try:
            return parse(text)
        except argparse.ArgumentTypeError as err:
            if " in [" in str(err):
                raise
            raise argparse.ArgumentTypeError(
                f"{err}; accepted: {what} in {value_range(lo, hi)}"
            ) from None

    checked.__name__ = getattr(parse, "__name__", what)
    return checked


def values_in(text: str, what: str, lo: float, hi: float) -> tuple[float, ...]:
    """A comma list of numbers, each in ``[lo, hi]``, at most :data:`MAX_VALUES`."""
    values = tuple(number(item) for item in text.split(","))
    if len(values) > MAX_VALUES:
        raise argparse.ArgumentTypeError(f"at most {MAX_VALUES} {what}, got {len(values)}")
    for v in values:
        in_range(v, lo, hi, f"{what} must be", f"{v:g}")
    return values


scales_type = accepted(lambda text: values_in(text, "scales", *SCALE_RANGE), "scales", *SCALE_RANGE)
lrs_type = accepted(
    lambda text: values_in(",".join(repr(v) for v in parse_lrs(text)), "learning rates", *LR_RANGE),
    "learning rates",
    *LR_RANGE,
)


def integer_type(field: str) -> Any:
    """argparse type: a whole number in ``INT_RANGES[field]``."""
    lo, hi = INT_RANGES[field]

    def parse(text: str) -> int:
        try:
            value = int(text.strip(), 10)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text.strip()[:40]!r} is not a whole number"
            ) from None
        in_range(value, lo, hi, "must be a whole number", text.strip())
        return value

    parse.__name__ = field  # argparse names the type in its own messages
    return accepted(parse, "a whole number", lo, hi)


def real_type(field: str) -> Any:
    """argparse type: a number (or ``2^k``) in ``FLOAT_RANGES[field]``."""
    lo, hi = FLOAT_RANGES[field]

    def parse(text: str) -> float:
        value = number(text)
        in_range(value, lo, hi, "must be a number", text.strip())
        if field == "threshold" and value == 1.0:
            raise argparse.ArgumentTypeError("the factor must be > 1, got 1")
        return value

    parse.__name__ = field
    return accepted(parse, "a number", lo, hi)


def modes_type(text: str) -> tuple[str, ...]:
    """argparse type of ``--modes``: a comma list of the sweep modes."""
    modes = tuple(m.strip() for m in text.split(",") if m.strip())
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise argparse.ArgumentTypeError(
            f"choose from {', '.join(MODES)} (comma-separated), got {text!r}"
        )
    return modes


def check_modes_type(text: str) -> tuple[str, ...]:
    """argparse type of ``fslr check --modes``: a comma list of its modes."""
    from .check import CHECK_MODES  # (check imports the training loop: only when asked)

    modes = tuple(m.strip() for m in text.split(",") if m.strip())
    if not modes or any(m not in CHECK_MODES for m in modes):
        raise argparse.ArgumentTypeError(
            f"choose from {', '.join(CHECK_MODES)} (comma-separated), got {text!r}"
        )
    return modes


SWEEP_OPTIONS: dict[str, tuple[str, dict[str, Any]]] = {
    "model": ("--model", {"choices": MODELS, "help": "model family"}),
    "axis": ("--axis", {"choices": AXES, "help": "what to scale (the smallest scale is the base)"}),
    "scales": (
        "--scales",
        {
            "type": scales_type,
            "metavar": "S,S,...",
            "help": f"scale multipliers in {value_range(*SCALE_RANGE)}, e.g. 1,2,4,8",
        },
    ),
    "lrs": (
        "--lrs",
        {
            "type": lrs_type,
            "metavar": "LRS",
            "help": "learning rates: comma list of numbers or 2^k, or LO..HI (one per octave), "
            f"LO..HI/N (N per octave), e.g. 2^-13..2^-5; each in {value_range(*LR_RANGE)}",
        },
    ),
    "steps": ("--steps", {"type": integer_type("steps"), "help": "optimiser steps per run"}),
    "seeds": (
        "--seeds",
        {"type": integer_type("seeds"), "help": "seeds per run (base records averaged)"},
    ),
    "data": (
        "--data",
        {
            "choices": sorted({d for ds in DATA.values() for d in ds}),
            "help": "mnist1d or digits (resmlp), text (transformer)",
        },
    ),
    "width": (
        "--width",
        {"type": integer_type("width"), "help": "base width (ResMLP units, d_model)"},
    ),
    "depth": ("--depth", {"type": integer_type("depth"), "help": "base number of residual blocks"}),
    "init_scale": (
        "--init-scale",
        {"type": real_type("init_scale"), "help": "base init scale of the block weights"},
    ),
    "batch_size": (
        "--batch-size",
        {"type": integer_type("batch_size"), "help": "training batch size"},
    ),
    "num_samples": (
        "--num-samples",
        {"type": integer_type("num_samples"), "help": "MNIST-1D samples generated (train + test)"},
    ),
    "seq_len": (
        "--seq-len",
        {"type": integer_type("seq_len"), "help": "transformer context length"},
    ),
    "norm": (
        "--norm",
        {
            "choices": NORMS,
            "help": "transformer norm placement: x + f(Norm(x)) (prenorm), Norm(x + f(x)) "
            "(postnorm) or x + Norm(f(x)) (prenormpostmod)",
        },
    ),
    "last": (
        "--last",
        {
            "type": integer_type("last"),
            "help": "a run's loss is the mean over its last LAST batches (not given: all of "
            "them when --steps is below the default)",
        },
    ),
    "samples": (
        "--samples",
        {"type": integer_type("samples"), "help": "omega samples per FSLR probe"},
    ),
    "warmup_samples": (
        "--warmup-samples",
        {
            "type": integer_type("warmup_samples"),
            "help": "omega samples of the EMA warm-up (paper: 40)",
        },
    ),
    "every": (
        "--every",
        {"type": integer_type("every"), "help": "base runs record FSLRs every EVERY steps"},
    ),
    "modes": ("--modes", {"type": modes_type, "help": "which modes to run, comma-separated"}),
    "strategy": (
        "--strategy",
        {
            "choices": ("vmap", "loop", "autograd", "auto"),
            "help": "probe strategy (auto: chosen from the model, device and shapes)",
        },
    ),
    "optimizer": (
        "--optimizer",
        {"choices": OPTIMIZERS, "help": "optimiser of every mode (sgd: momentum 0.9)"},
    ),
    "weight_decay": (
        "--weight-decay",
        {"type": real_type("weight_decay"), "help": "weight decay (decoupled for adamw)"},
    ),
    "schedule": (
        "--schedule",
        {"choices": SCHEDULES, "help": "learning-rate schedule (warmup_cosine: 10%% warm-up)"},
    ),
    "flerm_policy": (
        "--policy",
        {
            "choices": tuple(POLICIES),
            "help": "FLeRM's policy (default: share_blocks where the depth changes, else "
            "identity; equal and equal_all are the paper's ablations)",
        },
    ),
    "flerm_init": (
        "--flerm-init",
        {
            "choices": FLERM_INITS,
            "help": "FLeRM's models: the standard initialisation, or muP's initialisation and "
            "readout multiplier (FLeRM still sets every rate)",
        },
    ),
    "flerm_mode": (
        "--flerm-mode",
        {
            "choices": ("static", "periodic"),
            "help": "FLeRM sets the rates once after the warm-up (static, the paper's main "
            "results) or also every EVERY steps (periodic)",
        },
    ),
}
"""Config field -> (flag, argparse keyword arguments) of every sweep option."""
