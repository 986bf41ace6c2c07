"""The Hugging Face Trainer callbacks with the real ``transformers.Trainer`` in mixed precision
(bf16; fp16 with its GradScaler) and in fp32: record, FLeRM with a warm-up from 0 and gradient
accumulation, checkpoint and exact resume, logs; and logging to TensorBoard event files through
``log_fn``, read back."""

from __future__ import annotations

import importlib.util
import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from _device import DEVICE
from _scripts import load_script

from fslr_func.io.record import FSLRRecord

pytest.importorskip("transformers")


def example() -> Any:
    return load_script("examples/hf_trainer.py")


def check(tmp_path: Path, arch: str, precision: str = "bf16", lora: bool = False) -> None:
    full, resumed = example().main(
        str(tmp_path), steps=2, arch=arch, precision=precision, lora=lora, device=DEVICE.type
    )
    record = FSLRRecord.load(tmp_path / "base" / "fslr_record.json")
    assert record.steps == [1]  # the warm-up from 0 makes step 0 unmeasurable
    assert record.meta["sched_per_step"][0] == 0.0 and record.meta["sched_per_step"][1] > 0
    assert (tmp_path / "wide" / "checkpoint-1" / "flerm_state.pt").is_file()
    for a, b in zip(full.model.parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(a, b)
    logged = {k for entry in full.state.log_history for k in entry}
    assert any(k.startswith("flerm_lr/") for k in logged)
    assert any(k.startswith("fslr/") for k in logged)
    state = json.loads((tmp_path / "wide" / "checkpoint-2" / "trainer_state.json").read_text())
    assert state["global_step"] == 2


@pytest.mark.parametrize("precision", ["bf16", "fp16", "fp32"])
def test_trainer_gpt2_record_flerm_checkpoint_resume(tmp_path: Path, precision: str) -> None:
    check(tmp_path, "gpt2", precision)


def test_trainer_gpt2_peft_lora_rank_bf16_record_flerm_checkpoint_resume(tmp_path: Path) -> None:
    check(tmp_path, "gpt2", "bf16", lora=True)


@pytest.mark.slow
def test_trainer_llama_record_flerm_checkpoint_resume(tmp_path: Path) -> None:
    check(tmp_path, "llama")


def test_log_fn_writes_tensorboard_events_and_record_exports(tmp_path: Path) -> None:
    event_accumulator = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator"
    )
    from torch.utils.tensorboard import SummaryWriter

    import fslr_func as ff

    torch.manual_seed(0)
    fm = ff.with_fslr(torch.nn.Linear(4, 3), samples=2, seed=0)
    opt = torch.optim.SGD(fm.parameters(), lr=0.1)
    writer = SummaryWriter(str(tmp_path / "tb"))
    rec = ff.Recorder(
        fm, [torch.randn(8, 4)], optimizer=opt, warmup_samples=2, every=1,
        log_fn=lambda t, s: writer.add_scalars("fslr", s, t),
    )  # fmt: skip
    with rec.attach():
        for _ in range(3):
            opt.zero_grad()
            fm(torch.randn(8, 4)).square().mean().backward()
            opt.step()
    writer.close()
    tb = tmp_path / "tb"
    runs = sorted({str(p.parent.relative_to(tb)) for p in tb.rglob("events.out.tfevents.*")})
    assert runs == [".", "fslr_fslr/bias", "fslr_fslr/weight"]
    acc = event_accumulator.EventAccumulator(str(tb / runs[2]))
    acc.Reload()
    events = acc.Scalars("fslr")
    assert [e.step for e in events] == [0, 1, 2]
    assert [e.value for e in events] == pytest.approx(rec.record.fslr["weight"], rel=1e-6)
    rec.record.to_csv(tmp_path / "r.csv")
    lines = (tmp_path / "r.csv").read_text().splitlines()
    assert lines[0] == "step,sched,fslr/weight,fslr/bias,lr/weight,lr/bias" and len(lines) == 4
    assert [r["step"] for r in rec.record.to_rows()] == [0, 1, 2]
    if importlib.util.find_spec("pandas") is None:
        with pytest.raises(ImportError, match="pip install pandas"):
            rec.record.to_pandas()


@pytest.mark.parametrize("moved", [True, False])
def test_report_to_tensorboard_reports_fslr_after_log_to_reporters(
    tmp_path: Path, moved: bool
) -> None:
    event_accumulator = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator"
    )
    import transformers

    from fslr_func.integrations.transformers import FSLRCallback, log_to_reporters

    ex = example()
    callback = FSLRCallback(ex.dataset(8, offset=10_000), every=1, warmup_samples=4)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, learning_rate=1e-3,
        logging_steps=1, report_to=["tensorboard"],
        use_cpu=DEVICE.type == "cpu", disable_tqdm=True, save_strategy="no",
    )  # fmt: skip
    trainer = transformers.Trainer(
        model=ex.build("gpt2", 16), args=args, train_dataset=ex.dataset(8),
        data_collator=transformers.default_data_collator, callbacks=[callback],
    )  # fmt: skip
    if moved:
        log_to_reporters(trainer)
        names = [type(c).__name__ for c in trainer.callback_handler.callbacks]
        assert names.index("FSLRCallback") < names.index("TensorBoardCallback")
        trainer.train()
    else:
        with pytest.warns(RuntimeWarning, match=r"log_to_reporters\(trainer\)"):
            trainer.train()
    acc = event_accumulator.EventAccumulator(str(next(tmp_path.rglob("events.out.tfevents.*"))))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    expected = "train/fslr/transformer.h.0.mlp.c_fc.weight"
    assert ("train/loss" in tags) and ((expected in tags) == moved)
    if moved:
        logged = [e["fslr/transformer.h.0.mlp.c_fc.weight"] for e in trainer.state.log_history
                  if "loss" in e]  # fmt: skip
        assert [e.value for e in acc.Scalars(expected)] == pytest.approx(logged, rel=1e-6)


def test_an_empty_probe_dataset_is_refused_when_the_callback_is_built() -> None:
    pytest.importorskip("lightning")
    from fslr_func.integrations import lightning
    from fslr_func.integrations.transformers import FLeRMCallback, FSLRCallback

    base = FSLRRecord(steps=[0], fslr={"w": [1.0]}, meta={"base_lr": 0.1})
    for build in (
        lambda: FSLRCallback([]),
        lambda: FLeRMCallback(base, []),
        lambda: lightning.FSLRCallback(torch.zeros(0, 4)),
        lambda: lightning.FLeRMCallback(base, []),
    ):
        with pytest.raises(ValueError, match="probe_dataset is empty"):
            build()


@pytest.mark.parametrize(
    ("rows", "says"),
    [
        ([torch.arange(8)] * 4, r"collator made keys \[\]"),  # tensors: vars() gives {}
        ([list(range(8))] * 4, "collating them failed: TypeError"),
        ([{"labels": list(range(8))}] * 4, r"collator made keys \['labels'\]"),
    ],
)
def test_probe_rows_that_are_not_model_inputs_are_named_as_such(
    tmp_path: Path, rows: list[Any], says: str
) -> None:
    # before: the model's "You have to specify either input_ids or inputs_embeds", or the
    # collator's "vars() argument must have __dict__ attribute", at the first probe
    import transformers

    from fslr_func.integrations.transformers import FSLRCallback

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=8)
    train = [{"input_ids": list(range(8)), "labels": list(range(8))}] * 4
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=4, report_to=[],
        use_cpu=DEVICE.type == "cpu", disable_tqdm=True, save_strategy="no",
    )  # fmt: skip
    trainer = transformers.Trainer(
        model=transformers.GPT2LMHeadModel(config), args=args, train_dataset=train,
        data_collator=transformers.default_data_collator, callbacks=[FSLRCallback(rows)],
    )  # fmt: skip
    with pytest.raises(
        TypeError, match=rf"probe_dataset rows must be like the training rows.*{says}"
    ):
        trainer.train()


def test_resume_never_takes_the_fslr_state_of_another_runs_checkpoint(tmp_path: Path) -> None:
    # Resuming run "a"'s checkpoint-1 into output_dir "b", which holds its own checkpoint-1:
    # the callback (not told the resume path) loaded b's FSLR state into a's run, silently.
    import transformers

    from fslr_func.integrations.transformers import FSLRCallback

    rows = [{"input_ids": [(3 * i + j) % 64 for j in range(8)]} for i in range(8)]
    train = [dict(r, labels=r["input_ids"]) for r in rows]

    def run(out: str, lr: float, resume: str | None = None) -> FSLRCallback:
        torch.manual_seed(0)
        # GPT-2's default dropout: a resumed run is exact only if drawing probe batches (a
        # DataLoader's seed at every pass) leaves the global RNG alone
        config = transformers.GPT2Config(
            n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=8
        )
        callback = FSLRCallback(rows[:4], every=1, warmup_samples=2, fslr_options={"seed": 0})
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / out), max_steps=2, per_device_train_batch_size=4,
            learning_rate=lr, logging_steps=1, save_steps=1, report_to=[],
            use_cpu=DEVICE.type == "cpu", disable_tqdm=True, seed=0,
        )  # fmt: skip
        transformers.Trainer(
            model=transformers.GPT2LMHeadModel(config), args=args, train_dataset=train,
            data_collator=transformers.default_data_collator, callbacks=[callback],
        ).train(resume_from_checkpoint=resume)  # fmt: skip
        return callback

    a, b = run("a", 1e-2), run("b", 1e-3)
    assert a.session.record().fslr != b.session.record().fslr
    with pytest.warns(RuntimeWarning, match="is not the checkpoint resumed from"):
        wrong = run("b", 1e-2, resume=str(tmp_path / "a" / "checkpoint-1"))
    fresh = wrong.session.record()  # started afresh: one new row, b's step-0 row not in it
    assert len(fresh) == 1 and fresh.at(0) != b.session.record().at(0)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*FSLR state starts afresh")
        right = run("a", 1e-2, resume=str(tmp_path / "a" / "checkpoint-1"))
    assert right.session.record().fslr == a.session.record().fslr

    # the state is written whole or not at all: a save that fails while serialising (a
    # stand-in for a crash or a full disk) used to leave a few hundred bytes in its place
    saved = tmp_path / "a" / "checkpoint-1" / "fslr_state.pt"
    before = saved.read_bytes()
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "a"), report_to=[])
    right.session.state_dict = lambda: {"unpicklable": lambda: 0}  # type: ignore[method-assign]
    with pytest.raises(Exception, match="pickle"):
        right.on_save(args, transformers.TrainerState(global_step=1), transformers.TrainerControl())
    assert saved.read_bytes() == before
    # a damaged state file is named, not torch.load's bare "Ran out of input"
    for damaged in (before[: len(before) // 2], b""):
        saved.write_bytes(damaged)
        with pytest.raises(ValueError, match=r"checkpoint-1/fslr_state\.pt' cannot be read"):
            run("a", 1e-2, resume=str(tmp_path / "a" / "checkpoint-1"))


@pytest.mark.parametrize("arch", ["t5", "bart"])
def test_an_encoder_decoder_probe_feeds_the_decoder_the_labels_shifted(
    tmp_path: Path, arch: str
) -> None:
    # The probe batches dropped `labels`, the decoder's only source of inputs: T5 raised at
    # the first probe; BART fell back to its encoder input shifted right, so the probe
    # measured another function than training's, silently
    import transformers

    from fslr_func.integrations.transformers import FSLRCallback

    torch.manual_seed(0)
    model = (
        transformers.T5ForConditionalGeneration(
            transformers.T5Config(
                num_layers=1, num_decoder_layers=1, d_model=16, d_kv=8, d_ff=32, num_heads=2,
                vocab_size=32, decoder_start_token_id=0, pad_token_id=0,
            )
        )
        if arch == "t5"
        else transformers.BartForConditionalGeneration(
            transformers.BartConfig(
                encoder_layers=1, decoder_layers=1, d_model=16, encoder_ffn_dim=32,
                decoder_ffn_dim=32, encoder_attention_heads=2, decoder_attention_heads=2,
                vocab_size=32, max_position_embeddings=32,
            )
        )
    )  # fmt: skip
    g = torch.Generator().manual_seed(0)
    rows = [
        {
            "input_ids": torch.randint(3, 32, (10,), generator=g).tolist(),
            "attention_mask": [1] * 10,
            "labels": torch.randint(3, 32, (6,), generator=g).tolist(),
        }
        for _ in range(8)
    ]
    shapes: list[tuple[int, ...]] = []
    model.get_decoder().register_forward_pre_hook(
        lambda m, a, kw: shapes.append(tuple(kw["input_ids"].shape)), with_kwargs=True
    )
    callback = FSLRCallback(rows[:4], every=1, warmup_samples=4, fslr_options={"seed": 0})
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, report_to=[],
        use_cpu=DEVICE.type == "cpu", disable_tqdm=True, save_strategy="no",
    )  # fmt: skip
    transformers.Trainer(
        model=model, args=args, train_dataset=rows, callbacks=[callback],
        data_collator=transformers.default_data_collator,
    ).train()  # fmt: skip
    assert callback.session.record().steps == [0, 1]
    assert set(shapes) == {(4, 6)}  # training's decoder inputs and the probe's: the labels'


class _RunsCode:
    """A pickle that runs code when loaded without ``weights_only``."""

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (print, ("code ran while loading",))


def test_a_state_file_that_would_run_code_is_refused_not_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The callback loaded ``fslr_state.pt`` with ``weights_only=False``: a checkpoint from
    elsewhere could run code at resume. Its states are tensors and plain values."""
    from fslr_func.integrations.transformers import _load_state

    path = tmp_path / "fslr_state.pt"
    torch.save({"evil": _RunsCode()}, path)
    with pytest.raises(ValueError, match=r"fslr_state\.pt' cannot be read"):
        _load_state(str(path))
    assert "code ran" not in capsys.readouterr().out


def test_flerm_and_a_recorder_on_one_trainer_save_and_resume_both(tmp_path: Path) -> None:
    """Both callbacks wrote ``checkpoint-<step>/fslr_state.pt``: FLeRM's state was lost, and at
    resume FLeRM was handed the Recorder's ("this FLeRM state lacks ...")."""
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from fslr_func.integrations.transformers import FLeRMCallback, FSLRCallback

    def rows(n: int, seed: int) -> list[dict[str, Any]]:
        ids = torch.randint(0, 50, (n, 8), generator=torch.Generator().manual_seed(seed))
        return [{"input_ids": r, "labels": r} for r in ids.tolist()]

    def run(width: int, out: Path, callbacks: list[Any], resume: str | None = None) -> Trainer:
        torch.manual_seed(0)
        config = GPT2Config(n_layer=1, n_embd=width, n_head=2, vocab_size=50, n_positions=8,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
        args = TrainingArguments(
            output_dir=str(out), max_steps=6, per_device_train_batch_size=4, learning_rate=1e-2,
            report_to=[], seed=0, disable_tqdm=True, use_cpu=DEVICE.type == "cpu",
            save_steps=3, logging_steps=1,
        )  # fmt: skip
        trainer = Trainer(
            model=GPT2LMHeadModel(config), args=args, train_dataset=rows(24, 0),
            data_collator=transformers.default_data_collator, callbacks=callbacks,
        )  # fmt: skip
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    probes = rows(8, 99)
    run(16, tmp_path / "base", [FSLRCallback(probes, every=1, warmup_samples=4)])
    record = tmp_path / "base" / "fslr_record.json"

    def both() -> list[Any]:
        return [
            FLeRMCallback(str(record), probes, warmup_samples=4, every=2),
            FSLRCallback(probes, every=2, warmup_samples=4),
        ]

    whole = run(32, tmp_path / "wide", both())
    checkpoint = tmp_path / "wide" / "checkpoint-3"
    assert (checkpoint / "fslr_state.pt").is_file() and (checkpoint / "flerm_state.pt").is_file()
    resumed = run(32, tmp_path / "wide", both(), resume=str(checkpoint))
    for a, b in zip(whole.model.parameters(), resumed.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # a FLeRM checkpoint of an earlier version, its state under the recorder's name, resumes
    (checkpoint / "fslr_state.pt").unlink()
    (checkpoint / "flerm_state.pt").rename(checkpoint / "fslr_state.pt")
    flerm = both()[:1]
    resumed = run(32, tmp_path / "wide", flerm, resume=str(checkpoint))
    for a, b in zip(whole.model.parameters(), resumed.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # a run checkpointed with the recording callback only, resumed with FLeRM added: FLeRM
    # finds no state of its own, and the recorder's is not one: it starts afresh, said once
    run(32, tmp_path / "recorded", both()[1:])
    with pytest.warns(RuntimeWarning, match="holds a recording callback's state"):
        run(32, tmp_path / "recorded", both(), resume=str(tmp_path / "recorded" / "checkpoint-3"))
