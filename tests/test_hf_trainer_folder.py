"""ZeroOffloadTrainer given a Hugging Face folder, or an engine from zero_offload.hf.from_pretrained.

The Trainer took a built model only, so a model larger than host RAM could not go through it:
passing from_pretrained's `engine.module` failed with "a gradient arrived outside
engine.backward()", passing the engine with "'Engine' object has no attribute '_modules'". Now a
folder is built on the meta device and streamed into the tiers unit by unit at stage 3 (loaded by
transformers below it), and an engine is taken as it is when what it cannot change matches
TrainingArguments. Both train as the built-model path does; eval, save and resume work.
"""
from __future__ import annotations

import os
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from transformers import LlamaForCausalLM  # noqa: E402

from _hf import Tokens, logged, max_relative_difference, tiny_llama, training_args  # noqa: E402
from zero_offload.config import ConfigError  # noqa: E402
from zero_offload.hf import ZeroOffloadTrainer, from_pretrained  # noqa: E402

TRAIN, EVAL = Tokens(8, seed=0), Tokens(4, seed=1)


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _folder(tmp: Any) -> str:
    path = os.path.join(str(tmp), "model")
    tiny_llama().save_pretrained(path)
    return path


def _config(tmp: Any, stage: int) -> dict[str, Any]:
    nvme = os.path.join(str(tmp), "nvme")
    os.makedirs(nvme, exist_ok=True)
    if stage == 3:
        return {"stage": 3, "tiers": {"params": "nvme", "optimizer": "nvme", "grads": "cpu"}, "nvme_paths": [nvme]}
    return {"stage": stage, "tiers": {"optimizer": "cpu", "grads": "cpu"}}


def _run(model: Any, tmp: Any, stage: int, name: str, **overrides: Any) -> tuple[ZeroOffloadTrainer, list[float]]:
    args = training_args(os.path.join(str(tmp), name), max_steps=4, eval_strategy="steps", eval_steps=2, **overrides)
    trainer = ZeroOffloadTrainer(model=model, args=args, train_dataset=TRAIN, eval_dataset=EVAL,
                                 zero_offload_config=_config(os.path.join(str(tmp), name), stage))
    trainer.train()
    return trainer, logged(trainer.state.log_history, "loss") + logged(trainer.state.log_history, "eval_loss")


@pytest.mark.parametrize("stage", [2, 3])
def test_a_folder_trains_as_the_built_model_does_and_saves_for_from_pretrained(stage: int, tmp_path: Any) -> None:
    folder = _folder(tmp_path)
    built, want = _run(tiny_llama(), tmp_path, stage, "built")
    weights = built.engine.consolidated_state_dict()
    built.engine.close()
    ours, got = _run(folder, tmp_path, stage, "folder")
    assert got == pytest.approx(want, rel=1e-6) and len(got) == 6  # 4 losses, 2 evaluations
    assert max_relative_difference(ours.engine.consolidated_state_dict(), weights) < 1e-6
    if stage == 3:
        assert ours.engine.runtime.params_store is not None  # streamed into the tiers, never built whole
    ours.save_model(str(tmp_path / "saved"))
    ids = EVAL.ids[:2]
    with torch.no_grad():
        mine = ours.engine_model(input_ids=ids).logits
        theirs = LlamaForCausalLM.from_pretrained(str(tmp_path / "saved"))(input_ids=ids).logits
    assert torch.equal(mine, theirs)
    ours.engine.close()


def test_a_folder_resumes_from_its_checkpoint_as_the_uninterrupted_run(tmp_path: Any) -> None:
    folder = _folder(tmp_path)
    whole, want = _run(folder, tmp_path, 3, "whole")
    final = whole.engine.consolidated_state_dict()
    whole.engine.close()
    first, _ = _run(folder, tmp_path, 3, "first", save_strategy="steps", save_steps=2)
    first.engine.close()
    args = training_args(str(tmp_path / "first"), max_steps=4, eval_strategy="steps", eval_steps=2,
                         save_strategy="steps", save_steps=2)
    again = ZeroOffloadTrainer(model=folder, args=args, train_dataset=TRAIN, eval_dataset=EVAL,
                               zero_offload_config=_config(tmp_path / "again", 3))
    again.train(resume_from_checkpoint=str(tmp_path / "first" / "checkpoint-2"))
    assert max_relative_difference(again.engine.consolidated_state_dict(), final) == 0
    again.engine.close()


def test_an_engine_from_from_pretrained_trains_as_the_folder_does(tmp_path: Any) -> None:
    """Its accumulation, clipping and weight-decay groups are fixed when it is built: built to
    match TrainingArguments (no weight decay, so one group is Trainer's), it trains as the folder."""
    folder = _folder(tmp_path)
    by_folder, want = _run(folder, tmp_path, 3, "folder", weight_decay=0.0)
    weights = by_folder.engine.consolidated_state_dict()
    by_folder.engine.close()
    engine = from_pretrained(folder, {**_config(tmp_path / "engine", 3), "clip_grad_norm": 1.0,
                                      "gradient_accumulation_steps": 2, "optimizer": {"weight_decay": 0.0}})
    ours, got = _run(engine, tmp_path, 3, "engine", weight_decay=0.0)
    assert ours.engine is engine
    assert got == pytest.approx(want, rel=1e-6)
    assert max_relative_difference(engine.consolidated_state_dict(), weights) < 1e-6
    engine.close()


def test_an_engine_built_otherwise_and_an_engines_module_are_refused_in_one_line(tmp_path: Any) -> None:
    folder = _folder(tmp_path)
    engine = from_pretrained(folder, _config(tmp_path, 3))  # no clipping, accumulation 1, weight decay 0.01
    args = training_args(str(tmp_path / "out"), max_steps=2)
    with pytest.raises(ConfigError, match=r"^ZeroOffloadTrainer\(model=engine\): the engine was built with "
                                          r"gradient_accumulation_steps=1 \(TrainingArguments want 2\); "
                                          r"clip_grad_norm=0.0 .*weight decay"):
        ZeroOffloadTrainer(model=engine, args=args, train_dataset=TRAIN)
    with pytest.raises(ConfigError, match=r"this model is already trained by an engine \(engine.module\); pass the "
                                          r"engine itself"):
        ZeroOffloadTrainer(model=engine.module, args=args, train_dataset=TRAIN)
    engine.close()


def test_from_pretrained_takes_the_trainers_deepspeed_json_with_training_args(tmp_path: Any) -> None:
    """The JSON the Trainer accepts ("auto" values) was refused by from_pretrained; with the
    TrainingArguments it resolves as the Trainer resolves it, and the engine it builds is then
    taken by the Trainer as it is."""
    import json

    folder = _folder(tmp_path)
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    offload = {"device": "nvme", "nvme_path": str(nvme)}
    ds = {"bf16": {"enabled": "auto"}, "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
          "train_micro_batch_size_per_gpu": "auto",
          "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                    "weight_decay": "auto"}},
          "zero_optimization": {"stage": 3, "offload_optimizer": offload,
                                "offload_param": {**offload, "max_in_cpu": 0}, "stage3_prefetch_bucket_size": "auto"}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    with pytest.raises(ConfigError, match=r"'auto' is the Hugging Face placeholder.*training_args=args"):
        from_pretrained(folder, str(path))
    args = training_args(str(tmp_path / "out"), max_steps=2, weight_decay=0.0)
    engine = from_pretrained(folder, str(path), training_args=args)
    c = engine.config
    assert (c.stage, c.gradient_accumulation_steps, c.clip_grad_norm, c.optimizer.lr) == (3, 2, 1.0, 1e-2)
    assert c.stage3.unit_bytes == int(0.9 * 32 * 32) * 4  # the hidden-size "auto", from the folder's config
    trainer = ZeroOffloadTrainer(model=engine, args=args, train_dataset=TRAIN)
    trainer.train()
    assert trainer.state.global_step == 2
    engine.close()
