"""What a sweep trains: :class:`Task`, and the built-in tasks of the ``fslr`` command.

A task is a model family indexed by scale, its training and probe batches and its loss.
:func:`builtin_task` makes the one a :class:`~fslr_func.experiments.configs.SweepConfig`
describes (the paper's ResMLP or transformer on offline data) out of module-level functions
and :func:`functools.partial`, so that it can be sent to worker processes.

Examples:
    >>> import torch
    >>> from fslr_func.experiments import batches
    >>> x, y = torch.randn(64, 6), torch.randint(0, 3, (64,))
    >>> task = Task(name="tiny-mlp", build=lambda scale, seed: torch.nn.Linear(6, 3),
    ...             train_batches=lambda seed: batches(x, y, 16, seed),
    ...             probe_batches=lambda seed: (b for b, _ in batches(x, y, 16, seed + 99)))
    >>> next(iter(task.probe_batches(0))).shape, task.loss_fn.__name__
    (torch.Size([16, 6]), 'cross_entropy')
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..probe.functional import Inputs, OutputFn
from ..training.policies import Policy
from .configs import CONV_MODELS, DATA_SEEDS, ConfigError, SweepConfig
from .data import Split, batches, digits, digits_aug, lm_batches, mnist1d, pydoc_text, split_bytes
from .models import ResConvNet, ResMLP, Transformer
from .train import LossFn, lm_loss

__all__ = ["Batches", "Task", "builtin_task"]

_PROBE_SEED_OFFSET = 1_000_003

Batches = Callable[[int], Iterable[tuple[Any, Tensor]]]
"""``batches(seed)`` -> endless iterable of ``(inputs, target)``."""


@dataclass(frozen=True)
class Task:
    """What a sweep trains: a model family indexed by scale, its data and its loss.

    Attributes:
        name: identifies the task in the cache fingerprint: change it when the model or the
            data change, or cached runs of the old task are reused.
        build: ``build(scale, seed) -> nn.Module``; torch's global RNG is seeded with ``seed``
            just before the call, so initialisation is reproducible.
        train_batches: ``train_batches(seed)`` -> endless iterable of ``(inputs, target)``.
        probe_batches: ``probe_batches(seed)`` -> endless iterable of probe inputs, separate
            from the training batches (FSLR probes).
        loss_fn: ``loss_fn(output, target)``, cross-entropy by default.
        policy: FLeRM policy (``"identity"`` for width/init scale, ``"share_blocks"`` for
            depth, or a callable); ``None``: the config's axis decides.
        evaluate: optional ``evaluate(model) -> float`` run after training (e.g. test loss).
        output_fn: maps the model output to the tensor whose FSLRs are measured.

    With ``jobs > 1`` the task is sent to worker processes: its callables must be picklable
    (module-level functions or :func:`functools.partial` of them, not lambdas).
    """

    name: str
    build: Callable[[float, int], nn.Module]
    train_batches: Batches
    probe_batches: Callable[[int], Iterable[Inputs]]
    loss_fn: LossFn = F.cross_entropy
    policy: str | Policy | None = None
    evaluate: Callable[[nn.Module], float] | None = None
    output_fn: OutputFn | None = None


def _build_resmlp(
    config: SweepConfig, in_features: int, classes: int, scale: float, seed: int
) -> nn.Module:
    return ResMLP(in_features, classes, **config.model_kwargs(scale))


def _build_resconv(config: SweepConfig, classes: int, scale: float, seed: int) -> nn.Module:
    kw = config.model_kwargs(scale)
    one_d = config.data == "mnist1d"
    return ResConvNet(
        (1, 40) if one_d else (1, 8, 8),
        classes,
        batchnorm=config.model == "resconv_bn",
        stride=2 if one_d else 1,
        **kw,
    )


def _split(config: SweepConfig) -> Split:
    """The classification data set of ``config`` (generated or loaded here)."""
    seed = DATA_SEEDS.get(config.data) if config.data_seed is None else config.data_seed
    if config.data == "mnist1d":
        assert seed is not None
        return mnist1d(num_samples=config.num_samples, seed=seed)
    if config.data == "digits_aug":
        assert seed is not None
        return digits_aug(num_samples=config.num_samples, seed=seed)
    return digits()


def _build_transformer(config: SweepConfig, scale: float, seed: int) -> nn.Module:
    kw = config.model_kwargs(scale)
    return Transformer(
        d_model=kw["width"],
        n_heads=kw["width"] // 16,
        d_ff=4 * kw["width"],
        depth=kw["depth"],
        seq_len=config.seq_len,
        norm=config.norm,
        init_scale=kw["init_scale"],
    )


def _probe_inputs(train_batches: Batches, seed: int) -> Iterator[Any]:
    """The inputs of the training batches of another seed: probes apart from ``seed``'s batches.

    Examples:
        >>> x, y = torch.arange(8.0).unsqueeze(1), torch.arange(8)
        >>> probe = next(_probe_inputs(functools.partial(batches, x, y, 4), 0))
        >>> torch.equal(probe, next(batches(x, y, 4, _PROBE_SEED_OFFSET))[0])
        True
    """
    return (inputs for inputs, _ in train_batches(seed + _PROBE_SEED_OFFSET))


@torch.no_grad()
def _evaluate(inputs: Tensor, target: Tensor, loss_fn: LossFn, model: nn.Module) -> float:
    """The loss of ``model`` on one held-out batch, in eval mode (its mode restored after)."""
    was = model.training
    model.eval()
    try:
        return float(loss_fn(model(inputs), target))
    finally:
        model.train(was)


def builtin_task(config: SweepConfig) -> Task:
    """The :class:`Task` of a built-in config: its model family on its data (loaded here).

    ResMLP on ``mnist1d`` (generated locally, ``config.num_samples`` samples), ``digits`` or
    ``digits_aug``; the conv nets on the same (1-D on ``mnist1d``, its 40 positions halved by a
    stride-2 input convolution; 2-D on the 8x8 digits); the transformer on Python's
    documentation as bytes (``text``). ``evaluate`` is the loss on
    the held-out split; ``policy`` is the config's FLeRM policy (:attr:`SweepConfig.policy`).
    Picklable, so it can be sent to worker processes.

    Raises:
        ConfigError: for an invalid config, or a batch larger than the training set.

    Examples:
        >>> from fslr_func.experiments.configs import SweepConfig
        >>> task = builtin_task(SweepConfig(data="digits", width=16))
        >>> task.name, task.build(2, 0).width
        ('resmlp/digits', 32)
    """
    config.validate()
    bs = config.batch_size
    build: Callable[[float, int], nn.Module]
    train_batches: Batches
    loss_fn: LossFn
    if config.model == "transformer":
        train_bytes, test_bytes = split_bytes(pydoc_text())
        x_test, y_test = next(lm_batches(test_bytes, 32, config.seq_len, generator=0))
        build = functools.partial(_build_transformer, config)
        train_batches = functools.partial(lm_batches, train_bytes, bs, config.seq_len)
        loss_fn = lm_loss
    else:
        split = _split(config)
        x, y = split.x_train, split.y_train
        if bs > len(y):  # pragma: no cover - validate() checks it from the data set's known size
            raise ConfigError(
                "batch_size", f"must be at most the {len(y)} training samples, got {bs}"
            )
        x_test, y_test = split.x_test, split.y_test
        if config.model in CONV_MODELS:
            build = functools.partial(_build_resconv, config, split.num_classes)
        else:
            build = functools.partial(_build_resmlp, config, split.in_features, split.num_classes)
        train_batches = functools.partial(batches, x, y, bs)
        loss_fn = F.cross_entropy
    return Task(
        name=config.task_name,
        build=build,
        train_batches=train_batches,
        probe_batches=functools.partial(_probe_inputs, train_batches),
        loss_fn=loss_fn,
        policy=config.policy,
        evaluate=functools.partial(_evaluate, x_test, y_test, loss_fn),
    )
