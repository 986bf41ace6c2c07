"""Hugging Face ``Trainer`` callbacks: record a base run, or drive a scaled run with FLeRM.

Add one callback to the ``Trainer`` you already have; pass it your plain model, as usual::

    Trainer(model=model, args=args, train_dataset=train, callbacks=[FSLRCallback(probe)])
    Trainer(model=wide, args=args, train_dataset=train,
            callbacks=[FLeRMCallback("base/fslr_record.json", probe)])

The callbacks find the model, the optimiser (unwrapped from ``accelerate``) and the scheduler
the ``Trainer`` built, and attach through the optimiser's step hooks, so gradient
accumulation, clipping and mixed precision need nothing more. Probe batches are drawn from
``probe_dataset`` with the ``Trainer``'s own data collator and per-device batch size, in order
(``labels`` dropped, tensors moved to ``args.device``, ``use_cache=False``). The state
(controller and the wrapper's EMAs) is saved as ``fslr_state.pt`` (``FSLRCallback``) or
``flerm_state.pt`` (``FLeRMCallback``) in each checkpoint folder and loaded by
``resume_from_checkpoint`` (from ``output_dir/checkpoint-<step>``).
``FSLRCallback`` writes the record to ``output_dir/fslr_record.json`` at every checkpoint and
at the end. At each ``on_log`` the latest FSLRs (``fslr/<tensor>``) and FLeRM rates
(``flerm_lr/<tensor>``) are added to the logs and to ``state.log_history``. The ``Trainer``
puts the reporting callbacks of ``report_to`` (TensorBoard, W&B...) before yours, so they
report the logs before this callback adds to them: :func:`log_to_reporters` moves the FSLR
callbacks before them.

Examples:
    >>> from fslr_func.integrations.transformers import FSLRCallback
    >>> cb = FSLRCallback([{"input_ids": [1, 2, 3]}], every=50)
    >>> cb.session.options
    {'every': 50}
"""

from __future__ import annotations

import inspect
import io
import os
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch.utils.data import DataLoader, default_collate
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK
from transformers.trainer import TRAINER_STATE_NAME

from ..io.atomic import atomic_write_bytes
from .session import FLERM_STATE_FILE, STATE_FILE, DrivingCallback, RecordingCallback, Session

if TYPE_CHECKING:
    from transformers import Trainer

__all__ = ["FLeRMCallback", "FSLRCallback", "log_to_reporters", "logits"]


def logits(output: Any) -> Any:
    """A Hugging Face model output's ``logits`` (the output itself if it has none)."""
    return getattr(output, "logits", output)


def _out(args: TrainingArguments) -> str:
    return str(args.output_dir)


def log_to_reporters(trainer: Trainer) -> None:
    """Let the ``Trainer``'s reporters (``report_to``: TensorBoard, W&B...) report the FSLR
    callbacks' ``fslr/`` and ``flerm_lr/`` scalars.

    The ``Trainer`` calls its reporting callbacks before the ones you pass, and each reporter
    sends the logs on at once; this moves ``trainer``'s :class:`FSLRCallback` and
    :class:`FLeRMCallback` to just before the first reporter, so the logs they see carry the
    FSLR scalars. Call it once, after building the ``Trainer`` and before ``train()``.

    Raises:
        ValueError: ``trainer`` has no FSLR callback.

    Examples:
        >>> trainer.add_callback(FLeRMCallback(base, probes))  # doctest: +SKIP
        >>> log_to_reporters(trainer)  # doctest: +SKIP
    """
    callbacks = trainer.callback_handler.callbacks
    ours = [c for c in callbacks if isinstance(c, _Callback)]
    if not ours:
        raise ValueError("the Trainer has no FSLRCallback or FLeRMCallback to move")
    rest = [c for c in callbacks if not isinstance(c, _Callback)]
    reporters = tuple(INTEGRATION_TO_CALLBACK.values())
    first = next((i for i, c in enumerate(rest) if isinstance(c, reporters)), len(rest))
    callbacks[:] = rest[:first] + ours + rest[first:]
    for callback in ours:
        callback.before_reporters = True


_ROWS = (
    "probe_dataset rows must be like the training rows: dicts of the model's keyword "
    "arguments ({'input_ids': [...], ...}) that the Trainer's data collator takes"
)


def _load_state(path: str) -> dict[str, Any]:
    """The FSLR state a checkpoint saved, or a ``ValueError`` naming the file if it cannot
    be read (cut short by a full disk, written by something else)."""
    try:
        state = torch.load(path, weights_only=True)  # tensors and plain values: no code runs
    except Exception as err:  # torch's own errors name no file (EOFError, OSError, pickle's)
        raise ValueError(
            f"{path!r} cannot be read ({type(err).__name__}: {err}): resume from another "
            f"checkpoint, or delete that file to resume with the FSLR state started afresh"
        ) from err
    if not isinstance(state, dict):
        raise ValueError(
            f"{path!r} holds a {type(state).__name__}, not the FSLR state this callback saves: "
            "resume from another checkpoint, or delete that file to start the state afresh"
        )
    return state


def _probe_collate(collate: Any) -> Any:
    """The Trainer's ``collate`` for probe rows (the ``DataLoader``'s default without one),
    saying what probe rows must be when it fails on them."""
    collate = collate or default_collate

    def collate_probe_rows(rows: list[Any]) -> Any:
        try:
            return collate(rows)
        except (TypeError, ValueError, KeyError, AttributeError) as err:
            raise TypeError(f"{_ROWS}; collating them failed: {type(err).__name__}: {err}") from err

    return collate_probe_rows


class _ProbeInputs:
    """Re-iterable probe batches: collated dicts without ``labels``, their tensors on the
    Trainer's device (as it moves a training batch), ``use_cache=False``. An encoder-decoder
    model (T5, BART) derives its decoder's inputs from ``labels``: where a batch has labels
    but no ``decoder_input_ids``, they are made from the labels as the model makes them
    (``prepare_decoder_input_ids_from_labels``) before the labels are dropped."""

    def __init__(
        self,
        loader: DataLoader[Any],
        use_cache: bool,
        device: torch.device,
        decoder_inputs: Callable[..., torch.Tensor] | None = None,
    ) -> None:
        self.loader = loader
        self.use_cache = use_cache
        self.device = device
        self.decoder_inputs = decoder_inputs

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for batch in self.loader:
            if not isinstance(batch, Mapping) or not set(batch) - {"labels"}:
                made = f"keys {sorted(batch)}" if isinstance(batch, Mapping) else type(batch)
                raise TypeError(_ROWS + f" (the Trainer's data collator made {made})")
            inputs = {
                k: v.to(self.device) if isinstance(v, torch.Tensor) else v
                for k, v in batch.items()
                if k != "labels"
            }
            labels = batch.get("labels")
            if (
                self.decoder_inputs is not None
                and isinstance(labels, torch.Tensor)
                and "decoder_input_ids" not in inputs
                and "decoder_inputs_embeds" not in inputs
            ):
                inputs["decoder_input_ids"] = self.decoder_inputs(labels=labels.to(self.device))
            if self.use_cache:
                inputs["use_cache"] = False
            yield inputs


class _Callback(TrainerCallback):
    """The Trainer's hooks over the session (the constructors: :mod:`.session`)."""

    default_fslr_options: ClassVar[Mapping[str, Any]] = {"output_fn": logits}
    state_file: ClassVar[str] = STATE_FILE  # in every checkpoint-<step> folder
    before_reporters = False
    probe_dataset: Iterable[Any]
    session: Session

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: torch.nn.Module | None = None,
        optimizer: Any = None,
        lr_scheduler: Any = None,
        train_dataloader: Any = None,
        **kwargs: Any,
    ) -> None:
        if model is None or optimizer is None:
            raise RuntimeError("the Trainer passed no model or optimizer to the callback")
        if args.report_to and not self.before_reporters:
            warnings.warn(
                f"the Trainer's reporters ({', '.join(args.report_to)}) run before "
                f"{type(self).__name__} and will not report fslr/ and flerm_lr/ (they are in "
                "state.log_history): call fslr_func.integrations.transformers."
                "log_to_reporters(trainer) before trainer.train()",
                RuntimeWarning,
                stacklevel=2,
            )
        loader: DataLoader[Any] = DataLoader(
            self.probe_dataset,  # type: ignore[arg-type]
            batch_size=args.per_device_train_batch_size,
            collate_fn=_probe_collate(getattr(train_dataloader, "collate_fn", None)),
        )
        use_cache = "use_cache" in inspect.signature(model.forward).parameters
        decoder_inputs = getattr(model, "prepare_decoder_input_ids_from_labels", None)
        if state.global_step > 0:
            self._resume(os.path.join(_out(args), f"checkpoint-{state.global_step}"), state)
        self.session.start(
            model,
            optimizer,
            lr_scheduler,
            _ProbeInputs(loader, use_cache, args.device, decoder_inputs),
            step=state.global_step,
        )

    def _resume(self, folder: str, state: TrainerState) -> None:
        """Load the FSLR state of the checkpoint ``state`` was resumed from, if ``folder``
        (``output_dir/checkpoint-<step>``) is that checkpoint: the callback is not told the
        path given to ``resume_from_checkpoint``, so the folder's ``trainer_state.json`` must
        hold the resumed ``state``'s log history (another run's checkpoint of the same step
        would otherwise lend its FSLR state)."""
        # a driving callback's state, which earlier versions saved under the recording one's name
        named = [self.state_file] + ([STATE_FILE] if self.state_file != STATE_FILE else [])
        path = next(
            (p for n in named if os.path.isfile(p := os.path.join(folder, n))),
            os.path.join(folder, self.state_file),
        )
        why = f"{folder!r} has no {self.state_file}"
        if os.path.isfile(path):
            saved = os.path.join(folder, TRAINER_STATE_NAME)
            ours = os.path.isfile(saved) and (
                TrainerState.load_from_json(saved).log_history == state.log_history
            )
            loaded = _load_state(path) if ours else {}
            recorders = self.state_file != STATE_FILE and "record" in loaded.get("controller", {})
            if ours and not recorders:
                self.session.load_state_dict(loaded)
                return
            why = (
                f"{path!r} holds a recording callback's state, not this one's"
                if recorders
                else f"{folder!r} is not the checkpoint resumed from (its {TRAINER_STATE_NAME} "
                "differs)"
            )
        warnings.warn(
            f"resuming at step {state.global_step}, but {why}: the FSLR state starts afresh. "
            "The callback reads it from output_dir/checkpoint-<step>: resume from a checkpoint "
            "in the Trainer's output_dir",
            RuntimeWarning,
            stacklevel=3,
        )

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        folder = os.path.join(_out(args), f"checkpoint-{state.global_step}")
        if os.path.isdir(folder):
            buffer = io.BytesIO()  # serialised first: a failed save leaves the old file whole
            torch.save(self.session.state_dict(), buffer)
            atomic_write_bytes(os.path.join(folder, self.state_file), buffer.getvalue())

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, Any] | None = None,
        **kw: Any,
    ) -> None:
        scalars = self.session.pop_scalars()
        if logs is not None:
            logs.update(scalars)
        if state.log_history:
            state.log_history[-1].update(scalars)

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        self.session.stop()


class FSLRCallback(RecordingCallback, _Callback):
    """Records the Trainer's run into an FSLR record (``output_dir/fslr_record.json``).

    Args:
        probe_dataset: examples of model inputs (a dataset the Trainer's collator takes),
            separate from the training set.
        fslr_options: options of :func:`fslr_func.with_fslr` (``samples``, ``seed``...);
            ``output_fn`` defaults to the output's ``logits``.
        **recorder_options: options of :class:`fslr_func.Recorder` (``every``,
            ``warmup_samples``, ``start_step``, ``base_lr``, ``meta``).

    Attributes:
        session: the :class:`~fslr_func.integrations.session.Session`; ``session.record()``
            is the record once training has begun.
    """

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        super().on_save(args, state, control, **kw)
        self.session.save_record(_out(args))

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        super().on_train_end(args, state, control, **kw)
        self.session.save_record(_out(args), final=True)


class FLeRMCallback(DrivingCallback, _Callback):
    """Sets the Trainer's per-tensor learning rates with FLeRM from a base record.

    Its state goes into each checkpoint folder as ``flerm_state.pt`` (``fslr_state.pt`` in
    earlier versions, still read), beside an :class:`FSLRCallback`'s ``fslr_state.pt``.

    The Trainer's scheduler (warm-up from 0 included) multiplies the matched rates; FLeRM's set
    point waits for the first step with a non-zero rate.

    Args:
        base: the base run's :class:`~fslr_func.FSLRRecord`, or a path to one (the
            ``fslr_record.json`` an :class:`FSLRCallback` wrote).
        probe_dataset: examples of model inputs, separate from the training set.
        fslr_options: options of :func:`fslr_func.with_fslr`; use the base run's estimator
            and grouping.
        **flerm_options: options of :class:`fslr_func.FLeRM` (``policy``, ``mode``,
            ``every``, ``warmup_samples``, ``start_step``, ``min_fslr``).
    """

    state_file: ClassVar[str] = FLERM_STATE_FILE
