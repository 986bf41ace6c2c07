"""PyTorch Lightning callbacks: record a base run, or drive a scaled run with FLeRM.

Add one callback to the ``lightning.Trainer`` you already have::

    Trainer(callbacks=[FSLRCallback(probe_loader)]).fit(module, train_loader)
    Trainer(callbacks=[FLeRMCallback("base/fslr_record.json", probe_loader)]).fit(...)

At ``on_train_start`` the callback wraps the ``LightningModule``, builds a Recorder or FLeRM
over the optimiser(s) and scheduler of ``configure_optimizers`` and attaches it through the
optimiser's step hooks (automatic optimisation with closures, gradient accumulation and
clipping need nothing more). Probe batches are ``module(batch)`` inputs from
``probe_dataset``: a ``DataLoader``, or a dataset batched like the training loader; each is
converted as Lightning converts a training batch (the precision plugin's ``convert_input``,
e.g. to bfloat16 under ``precision="bf16-true"``) and moved to the module's device. The
callback's ``state_dict`` goes into Lightning checkpoints and ``ckpt_path=`` resumes it.
FSLRs (``fslr/<tensor>``) and FLeRM's rates (``flerm_lr/<tensor>``) are logged with
``module.log_dict`` at ``on_train_batch_end``; ``FSLRCallback`` writes
``<default_root_dir>/fslr_record.json`` at the end of training.

Examples:
    >>> from fslr_func.integrations.lightning import FLeRMCallback
    >>> from fslr_func import FSLRRecord
    >>> base = FSLRRecord(steps=[0], fslr={"w": [1.0]}, meta={"base_lr": 0.1})
    >>> FLeRMCallback(base, [[0.0]], mode="periodic").session.options
    {'mode': 'periodic'}
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.utilities.apply_func import move_data_to_device
from torch.utils.data import DataLoader

from .session import DrivingCallback, RecordingCallback, Session

__all__ = ["FLeRMCallback", "FSLRCallback"]


class _ProbeBatches:
    """Re-iterable probe batches, each converted and moved as Lightning does a training batch
    (its precision plugin's ``convert_input``, then to the strategy's root device); the
    module's own batch-transfer hooks are left out: they expect training batches."""

    def __init__(self, loader: Iterable[Any], trainer: pl.Trainer) -> None:
        self.loader = loader
        self.trainer = trainer

    def __iter__(self) -> Iterator[Any]:
        for batch in self.loader:
            batch = self.trainer.precision_plugin.convert_input(batch)
            yield move_data_to_device(batch, self.trainer.strategy.root_device)


def _batch_size(loader: Any) -> int | None:
    """The training loader's batch size, for probe rows batched like its batches: its
    ``batch_size``, else its ``batch_sampler``'s (a bucketing sampler); ``None`` where it
    batches nothing (its items are batches: the probe set's are taken as they are). A
    ``batch_sampler`` that says no size gets rows one at a time, with a warning.

    Examples:
        >>> from torch.utils.data import DataLoader
        >>> _batch_size(DataLoader(range(8), batch_size=4))
        4
        >>> _batch_size(DataLoader(range(8), batch_size=None)) is None
        True
    """
    if (
        getattr(loader, "batch_size", None) is None
        and getattr(loader, "batch_sampler", None) is None
    ):
        return None
    size = getattr(loader, "batch_size", None) or getattr(
        getattr(loader, "batch_sampler", None), "batch_size", None
    )
    if isinstance(size, int) and size > 0:
        return size
    warnings.warn(
        "the training DataLoader's batch_sampler has no batch_size: probe rows are batched "
        "one at a time; pass probe_dataset as a DataLoader with the batch size to probe",
        RuntimeWarning,
        stacklevel=3,
    )
    return 1


class _Callback(pl.Callback):
    """Lightning's hooks over the session (the constructors: :mod:`.session`)."""

    probe_dataset: Iterable[Any]
    session: Session

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        probes = self.probe_dataset
        if not isinstance(probes, DataLoader):
            probes = DataLoader(probes, batch_size=_batch_size(trainer.train_dataloader))  # type: ignore[arg-type]
        optimizers = trainer.optimizers
        configs = trainer.lr_scheduler_configs
        scheduler = configs[0].scheduler if configs else None
        if self.session.base is not None and len(optimizers) != 1:
            raise ValueError(
                "FLeRMCallback drives one optimiser; with several, use fslr_func.FLeRM per "
                "optimiser (see docs/integrations.md)"
            )
        optimizer: Any = optimizers[0] if len(optimizers) == 1 else optimizers
        self.session.start(
            pl_module, optimizer, scheduler, _ProbeBatches(probes, trainer), trainer.global_step
        )

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        scalars = self.session.pop_scalars()
        if scalars:
            pl_module.log_dict(scalars)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.session.stop()

    def state_dict(self) -> dict[str, Any]:
        return self.session.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.session.load_state_dict(state_dict)


class FSLRCallback(RecordingCallback, _Callback):
    """Records the run's FSLRs into ``<default_root_dir>/fslr_record.json``.

    Args:
        probe_dataset: model inputs (a dataset or a ``DataLoader``), separate from training.
        fslr_options: options of :func:`fslr_func.with_fslr` (``samples``, ``seed``...).
        **recorder_options: options of :class:`fslr_func.Recorder`.
    """

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_end(trainer, pl_module)
        if trainer.is_global_zero:
            self.session.save_record(trainer.default_root_dir, final=True)


class FLeRMCallback(DrivingCallback, _Callback):
    """Sets the per-tensor learning rates with FLeRM from a base record (or a path to one).

    Args:
        base: the base run's :class:`~fslr_func.FSLRRecord` or a path to one.
        probe_dataset: model inputs (a dataset or a ``DataLoader``), separate from training.
        fslr_options: options of :func:`fslr_func.with_fslr`.
        **flerm_options: options of :class:`fslr_func.FLeRM`.
    """
