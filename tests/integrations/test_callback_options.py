"""The callbacks' options are checked when the callback is built, not when training starts:
misspelled names (with the close match), ranges, FLeRM's mode and policy, and a probe set the
callback can go through more than once."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

import fslr_func as ff
from fslr_func.integrations.session import DrivingCallback, RecordingCallback

PROBES = [{"input_ids": [1, 2, 3]}] * 4


def base() -> ff.FSLRRecord:
    record = ff.FSLRRecord(meta={"base_lr": 0.1})
    record.append(0, {"w": 1.0})
    return record


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"evry": 2}, TypeError, r"'evry' \(did you mean \['every'\]\?\)"),
        ({"fslr_options": {"sample": 4}}, TypeError, r"fslr_options has 'sample'.*'samples'"),
        ({"every": 0}, ValueError, "every must be"),
        ({"warmup_samples": -1}, ValueError, "warmup_samples must be"),
        ({"fslr_options": {"samples": 0}}, ValueError, "samples must be a positive integer"),
        ({"fslr_options": {"beta": 2.0}}, ValueError, r"beta must be in \[0, 1\)"),
        ({"fslr_options": {"estimator": "kronn"}}, ValueError, "unknown estimator 'kronn'"),
    ],
)
def test_a_recording_callbacks_bad_options_are_refused_when_it_is_built(
    options: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        RecordingCallback(PROBES, **options)


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"mode": "perodic"}, ValueError, "mode must be 'static' or 'periodic'"),
        ({"policy": "nope"}, ValueError, "unknown policy 'nope'"),
        ({"mode": "periodic", "every": 0}, ValueError, "every must be"),
        ({"base_lr": 0.1}, TypeError, "'base_lr', which FLeRM does not take"),
        ({"mode": "periodic", "every": None}, ValueError, "needs every=N"),
    ],
)
def test_a_driving_callbacks_bad_options_are_refused_when_it_is_built(
    options: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        DrivingCallback(base(), PROBES, **options)


@pytest.mark.parametrize("probes", [None, iter(PROBES), 3])
def test_a_probe_set_that_cannot_be_gone_through_again_is_refused(probes: Any) -> None:
    with pytest.raises(
        TypeError, match=r"probe_dataset must be .* a dataset, a list or a DataLoader"
    ):
        RecordingCallback(probes)


def test_good_options_are_taken() -> None:
    import torch
    from torch.utils.data import DataLoader, Dataset, TensorDataset

    class Rows(Dataset[dict[str, list[int]]]):  # map-style: no __iter__ of its own
        def __len__(self) -> int:
            return 4

        def __getitem__(self, i: int) -> dict[str, list[int]]:
            return {"input_ids": [1, 2, i]}

    class Stream(torch.utils.data.IterableDataset[dict[str, list[int]]]):
        """Its own iterator, started again at each ``__iter__`` (a common pattern)."""

        def __iter__(self) -> Stream:
            self.i = 0
            return self

        def __next__(self) -> dict[str, list[int]]:
            self.i += 1
            if self.i > 3:
                raise StopIteration
            return {"input_ids": [1, 2, self.i]}

    RecordingCallback(PROBES, every=2, warmup_samples=4, fslr_options={"samples": 4, "seed": 0})
    # the distributed wrapper's options, which with_fslr passes on
    RecordingCallback(PROBES, fslr_options={"distributed": True, "omega_draw": "local"})
    RecordingCallback(Stream())
    for probes in (TensorDataset(torch.randn(4, 3)), Rows(), DataLoader(Rows(), batch_size=2)):
        RecordingCallback(probes)
    DrivingCallback(base(), PROBES, mode="periodic", every=5, policy="share_blocks")


def test_lightning_batches_probe_rows_like_a_batch_sampler() -> None:
    """A training loader built with ``batch_sampler=`` has ``batch_size=None``: probe rows
    were batched one at a time, silently."""
    pytest.importorskip("lightning")
    import torch
    from torch.utils.data import BatchSampler, DataLoader, SequentialSampler

    from fslr_func.integrations.lightning import _batch_size

    rows = torch.arange(64.0).reshape(32, 2)
    sampler = BatchSampler(SequentialSampler(rows), batch_size=16, drop_last=False)
    assert _batch_size(DataLoader(rows, batch_sampler=sampler)) == 16
    assert _batch_size(DataLoader(rows, batch_size=8)) == 8
    with pytest.warns(RuntimeWarning, match="one at a time"):
        assert _batch_size(DataLoader(rows, batch_sampler=[[0, 1], [2, 3]])) == 1


def test_a_session_started_again_continues_only_where_the_trainer_continues() -> None:
    from fslr_func.integrations.session import Session

    def fresh() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model = torch.nn.Linear(3, 2)
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    def train(session: Session, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        for _ in range(2):
            opt.zero_grad()
            model(torch.randn(4, 3)).square().mean().backward()
            opt.step()

    probes = [torch.randn(4, 3)] * 8
    session = Session(None, fslr_options={"seed": 0}, options={"every": 1, "warmup_samples": 4})
    model, opt = fresh()
    session.start(model, opt, None, probes, step=0)
    train(session, model, opt)
    session.start(model, opt, None, probes, step=2)  # continues: the rows are kept
    train(session, model, opt)
    assert session.record().steps == [0, 1, 2, 3]
    # the trainer counts a step a GradScaler skipped, the controller does not: 5 >= 4
    session.start(model, opt, None, probes, step=5)
    assert session.record().steps == [0, 1, 2, 3]
    saved = session.state_dict()
    session.stop()
    # a checkpoint loaded between two fits (fit(ckpt_path=...)) is the next fit's, on a new
    # model object too: before, it went into the stopped controller and was dropped
    session.load_state_dict(saved)
    other, other_opt = fresh()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        session.start(other, other_opt, None, probes, step=4)
    assert session.record().steps == [0, 1, 2, 3]
    with pytest.warns(RuntimeWarning, match="started again on the same model at step 0"):
        session.start(other, other_opt, None, probes, step=0)  # trained over from step 0
    assert len(session.record()) == 0
    with pytest.warns(RuntimeWarning, match="started again on another model"):
        session.start(*fresh(), None, probes, step=0)


def test_exact_with_distributed_is_refused_when_the_callback_is_built() -> None:
    with pytest.raises(ValueError, match="estimator='exact' measures each process's own"):
        RecordingCallback(
            [torch.randn(2, 3)], fslr_options={"estimator": "exact", "distributed": True}
        )
