"""ZeroOffloadTrainer (zero_offload.hf): transformers' Trainer trained by the engine.

The oracle is a plain transformers.Trainer with the same TrainingArguments (AdamW torch, clipping
at max_grad_norm, accumulation 2 with an epoch whose last cycle is one micro-batch short, linear
warmup, weight decay on two parameter groups): the same logged losses, gradient norms, learning
rates and eval losses, and the same final weights, to fp32 tolerance. Before it, Trainer(model=
engine) failed ('Engine' object has no attribute 'to'), Trainer(optimizers=(engine.optimizer, s))
failed in accelerate's optimizer wrapping (state_dict), and Trainer's own optimizer on
engine.module was refused by the engine.
"""
from __future__ import annotations

import json
import os
import warnings
from typing import Any, Callable

import pytest
import torch

pytest.importorskip("transformers")

from transformers import LlamaForCausalLM, Trainer  # noqa: E402

from _hf import Tokens, logged, losses, max_relative_difference, tiny_llama, training_args  # noqa: E402
from zero_offload.config import ConfigError  # noqa: E402
from zero_offload.hf import ENGINE_DIR, ZeroOffloadTrainer  # noqa: E402
from zero_offload.hf.config import resolve  # noqa: E402

TRAIN, EVAL = Tokens(14, seed=0), Tokens(8, seed=1)  # 7 micro-batches of 2 per epoch: the last cycle is short
STAGE2_CPU = {"stage": 2, "tiers": {"optimizer": "cpu", "grads": "cpu"}}


def stage3_nvme(tmp: str, name: str = "nvme") -> dict[str, Any]:
    os.makedirs(os.path.join(tmp, name), exist_ok=True)
    return {"stage": 3, "tiers": {"params": "nvme", "optimizer": "nvme", "grads": "cpu"},
            "nvme_paths": [os.path.join(tmp, name)], "stage3": {"unit_modules": ["LlamaDecoderLayer"]}}


def stage1_nvme(tmp: str, name: str = "nvme") -> dict[str, Any]:
    os.makedirs(os.path.join(tmp, name), exist_ok=True)
    return {"stage": 1, "tiers": {"optimizer": "nvme", "grads": "cpu"}, "nvme_paths": [os.path.join(tmp, name)]}


# Each stage once, on a tier of its own: stage 0 all on the device (here the CPU), stage 1's
# optimizer on nvme, stage 2's on the CPU, stage 3's parameters and optimizer on nvme.
CONFIGS = {"stage0": lambda tmp, name="nvme": {"stage": 0}, "stage1-nvme": stage1_nvme,
           "stage2-cpu": lambda tmp, name="nvme": STAGE2_CPU, "stage3-nvme": stage3_nvme}


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory: pytest.TempPathFactory) -> Callable[[float], tuple[list[dict], dict]]:
    """The oracle, run once per max_grad_norm: a plain Trainer's log history and final weights."""
    runs: dict[float, tuple[list[dict], dict[str, torch.Tensor]]] = {}

    def run(max_grad_norm: float = 1.0) -> tuple[list[dict], dict[str, torch.Tensor]]:
        if max_grad_norm not in runs:
            model = tiny_llama()
            args = training_args(str(tmp_path_factory.mktemp("plain")), eval_strategy="steps", eval_steps=2,
                                 max_grad_norm=max_grad_norm)
            trainer = Trainer(model=model, args=args, train_dataset=TRAIN, eval_dataset=EVAL)
            trainer.train()
            runs[max_grad_norm] = (trainer.state.log_history,
                                   {k: v.detach().clone() for k, v in model.state_dict().items()})
        return runs[max_grad_norm]
    return run


# max_grad_norm=0: no clipping, and Trainer still logs the global norm (clip_grad_norm_ with
# max_norm=inf), which the overlapped step never formed: it was not logged.
@pytest.mark.parametrize("where,max_grad_norm", [("stage0", 1.0), ("stage1-nvme", 1.0), ("stage2-cpu", 1.0),
                                                 ("stage3-nvme", 1.0), ("stage3-nvme", 0.0)])
def test_training_equals_a_plain_trainer_run_and_saves_for_from_pretrained(where: str, max_grad_norm: float,
                                                                          tmp_path: Any, plain_run: Any) -> None:
    config = CONFIGS[where](str(tmp_path))
    args = training_args(str(tmp_path / "out"), eval_strategy="steps", eval_steps=2, max_grad_norm=max_grad_norm)
    trainer = ZeroOffloadTrainer(model=tiny_llama(), args=args, train_dataset=TRAIN, eval_dataset=EVAL,
                                 zero_offload_config=config)
    trainer.train()
    history, weights = plain_run(max_grad_norm)
    ours = trainer.state.log_history
    assert trainer.state.global_step == 8  # 2 epochs x 4 updates (3 of two micro-batches, 1 of one)
    # without clipping the CPU step ran during backward, and the logged norms below come from it
    assert trainer.engine.runtime.shard_optimizer.eager == (max_grad_norm == 0)
    for key in ("loss", "grad_norm", "learning_rate", "eval_loss"):
        mine, theirs = logged(ours, key), logged(history, key)
        assert len(mine) == len(theirs) > 0, key
        assert mine == pytest.approx(theirs, rel=1e-5), key
    assert max_relative_difference(trainer.engine.consolidated_state_dict(), weights) < 1e-5

    trainer.save_model(str(tmp_path / "saved"))  # Hugging Face format, from the engine's weights
    assert {"config.json", "model.safetensors"} <= set(os.listdir(tmp_path / "saved"))
    ids = EVAL.ids[:2]
    with torch.no_grad():
        ours_logits = trainer.engine_model(input_ids=ids).logits  # through the engine (stage 3 gathers)
        loaded = LlamaForCausalLM.from_pretrained(str(tmp_path / "saved")).eval()
        assert torch.equal(ours_logits, loaded(input_ids=ids).logits)
        # generate after training, outside and inside engine.gathered (at stage 3 a forward inside the
        # block gave the block's units back twice: "the live budget was released more than it took")
        gen = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False)
        want = loaded.generate(ids[:1, :6], **gen)
        assert torch.equal(trainer.model.generate(ids[:1, :6], **gen), want)
        with trainer.engine.gathered():
            assert torch.equal(trainer.model.generate(ids[:1, :6], **gen), want)
        assert torch.equal(trainer.model.generate(ids[:1, :6], **gen), want)
    trainer.engine.close()


@pytest.mark.parametrize("where", ["stage0", "stage1-nvme", "stage3-nvme"])
def test_resume_from_checkpoint_equals_the_uninterrupted_run_bit_for_bit(where: str, tmp_path: Any) -> None:
    """With dropout (the RNG states matter), resumed mid-epoch from checkpoint-2 into a model
    built from another seed: the engine's checkpoint restores everything."""
    config = CONFIGS[where](str(tmp_path))
    common = dict(save_strategy="steps", save_steps=2, max_steps=4)
    first = ZeroOffloadTrainer(model=tiny_llama(attention_dropout=0.2), args=training_args(
        str(tmp_path / "a"), save_total_limit=3, **common), train_dataset=TRAIN, zero_offload_config=config)
    first.train()
    whole = first.engine.consolidated_state_dict()
    first.engine.close()
    ckpt = tmp_path / "a" / "checkpoint-2"
    assert {"trainer_state.json", "rng_state.pth", "scheduler.pt", ENGINE_DIR, "config.json",
            "model.safetensors"} <= set(os.listdir(ckpt))
    assert "optimizer.pt" not in os.listdir(ckpt)

    second = ZeroOffloadTrainer(model=tiny_llama(seed=1, attention_dropout=0.2), args=training_args(
        str(tmp_path / "b"), save_total_limit=1, **common), train_dataset=TRAIN,
        zero_offload_config=CONFIGS[where](str(tmp_path), "nvme2"))
    second.train(resume_from_checkpoint=str(ckpt))
    resumed = second.engine.consolidated_state_dict()
    # trainer_state.json brings the first two steps' log; the rest was logged by the resumed run
    assert len(losses(second.state.log_history)) == 4
    for key in ("loss", "grad_norm", "learning_rate"):
        assert logged(second.state.log_history, key) == logged(first.state.log_history, key)
    assert all(torch.equal(resumed[k], whole[k]) for k in whole)
    assert sorted(os.listdir(tmp_path / "b")) == ["checkpoint-4"]  # save_total_limit=1 rotated the others
    second.engine.close()


def test_load_best_model_at_end_restores_the_best_checkpoint(tmp_path: Any) -> None:
    """A learning rate so large that the second evaluation is worse: the end loads checkpoint-2."""
    args = training_args(str(tmp_path), max_steps=4, learning_rate=0.5, eval_strategy="steps", eval_steps=2,
                         save_strategy="steps", save_steps=2, load_best_model_at_end=True)
    trainer = ZeroOffloadTrainer(model=tiny_llama(), args=args, train_dataset=TRAIN, eval_dataset=EVAL,
                                 zero_offload_config=STAGE2_CPU)
    trainer.train()
    first, second = logged(trainer.state.log_history, "eval_loss")
    assert first < second and trainer.state.best_model_checkpoint.endswith("checkpoint-2")
    assert trainer.evaluate()["eval_loss"] == first
    trainer.engine.close()


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_half_precision_computes_in_the_engines_dtype_with_fp32_master_weights(dtype: str, tmp_path: Any,
                                                                               plain_run: Any) -> None:
    """bf16=True / fp16=True: the engine's compute copy is in that dtype (no autocast), the master
    fp32; the first four losses (the same learning rates before them) follow the fp32 run's to
    half-precision rounding (3e-5 here). fp16's default loss scale overflows no step here."""
    args = training_args(str(tmp_path), max_steps=4, **{dtype: True})
    trainer = ZeroOffloadTrainer(model=tiny_llama(), args=args, train_dataset=TRAIN, zero_offload_config=STAGE2_CPU)
    trainer.train()
    half = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    assert trainer.engine.dtype == half == next(trainer.model.parameters()).dtype
    assert all(v.dtype == torch.float32 for v in trainer.engine.consolidated_state_dict().values())
    assert len(logged(trainer.state.log_history, "grad_norm")) == 4 and trainer.engine.skipped_steps == 0
    assert losses(trainer.state.log_history) == pytest.approx(losses(plain_run()[0])[:4], rel=1e-3)
    trainer.engine.close()


def test_an_fp16_overflow_skips_the_step_and_the_scheduler_as_trainer_does(tmp_path: Any) -> None:
    """A loss scale of 2^20 overflows: the engine skips those updates (grad_norm logged as inf, as
    Trainer's GradScaler run logs it) and Trainer does not step the scheduler after them, so the
    learning rates are the schedule's at the count of applied updates."""
    from transformers import get_linear_schedule_with_warmup

    args = training_args(str(tmp_path), max_steps=4, fp16=True)
    config = {**STAGE2_CPU, "precision": {"initial_scale_power": 20, "hysteresis": 1}}
    trainer = ZeroOffloadTrainer(model=tiny_llama(), args=args, train_dataset=TRAIN, zero_offload_config=config)
    trainer.train()
    norms = logged(trainer.state.log_history, "grad_norm")
    skipped = [n == float("inf") for n in norms]
    assert trainer.engine.skipped_steps == sum(skipped) and 0 < sum(skipped) < 4
    reference = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=args.learning_rate)
    schedule, lrs = get_linear_schedule_with_warmup(reference, args.warmup_steps, args.max_steps), []
    for skip in skipped:
        lrs.append(schedule.get_last_lr()[0])
        if not skip:
            reference.step()
            schedule.step()
    assert logged(trainer.state.log_history, "learning_rate") == pytest.approx(lrs, rel=1e-12)
    trainer.engine.close()


def _ds_config(tmp: str) -> dict[str, Any]:
    """A DeepSpeed ZeRO-3 NVMe config as the transformers docs write it, "auto" values and all."""
    os.makedirs(os.path.join(tmp, "nvme"), exist_ok=True)
    offload = {"device": "nvme", "nvme_path": os.path.join(tmp, "nvme"), "pin_memory": True}
    return {
        "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                  "weight_decay": "auto"}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                     "warmup_num_steps": "auto"}},
        "zero_optimization": {"stage": 3, "offload_optimizer": offload, "offload_param": offload,
                              "overlap_comm": True, "contiguous_gradients": True, "reduce_bucket_size": "auto",
                              "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
                              "stage3_gather_16bit_weights_on_model_save": True},
        "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 100,
        "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
    }


def test_a_deepspeed_json_with_auto_values_works_unchanged(tmp_path: Any, plain_run: Any) -> None:
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(_ds_config(str(tmp_path))))
    args = training_args(str(tmp_path / "out"), max_steps=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = ZeroOffloadTrainer(model=tiny_llama(), args=args, train_dataset=TRAIN,
                                     zero_offload_config=str(path))
    # pointing at the user's line, not at ours
    assert [w.filename for w in caught if "DeepSpeed scheduler WarmupLR is not run" in str(w.message)] == [__file__]
    c = trainer.zero_offload_config
    assert (c.stage, c.tiers.params, c.tiers.optimizer) == (3, "nvme", "nvme")
    assert (c.optimizer.lr, c.optimizer.betas, c.optimizer.eps) == (1e-2, (0.9, 0.999), 1e-8)
    assert (c.gradient_accumulation_steps, c.clip_grad_norm, c.precision.dtype) == (2, 1.0, "fp32")
    assert c.bucket_bytes == 32 * 32 * 4 and c.stage3.unit_bytes == int(0.9 * 32 * 32) * 4  # hidden-size autos
    trainer.train()
    # The first 4 losses of the 8-step plain run: the updates before them used the same learning
    # rates (warmup 0, 0.5, then 1 x lr whatever the length of the linear decay after it).
    assert losses(trainer.state.log_history) == pytest.approx(losses(plain_run()[0])[:4], rel=1e-5)
    trainer.engine.close()


def test_deepspeed_values_that_differ_from_training_arguments_are_listed_in_one_error(tmp_path: Any) -> None:
    ds = _ds_config(str(tmp_path))
    ds["gradient_clipping"], ds["optimizer"]["params"]["lr"] = 0.5, 3e-4
    with pytest.raises(ConfigError, match=r"gradient_clipping=0.5 vs TrainingArguments max_grad_norm=1.0; "
                                          r"optimizer.params.lr=0.0003 vs TrainingArguments learning_rate=0.01;"):
        resolve(ds, training_args(str(tmp_path)))


def test_a_config_file_giving_a_key_twice_is_refused(tmp_path: Any) -> None:
    """json keeps the last of two equal keys silently: the first (perhaps the edited one) did nothing."""
    path = tmp_path / "ds_config.json"
    path.write_text('{"zero_optimization": {"stage": 2, "stage": 3}}')
    with pytest.raises(ConfigError, match=r"^zero_offload_config file .*ds_config.json gives the key 'stage' twice"):
        resolve(str(path), training_args(str(tmp_path)))


def test_a_zero_offload_config_takes_its_training_values_from_training_arguments(tmp_path: Any) -> None:
    args = training_args(str(tmp_path), bf16=True, learning_rate=3e-4, gradient_accumulation_steps=4)
    c = resolve({"stage": 2, "tiers": {"optimizer": "cpu"}}, args)
    assert (c.optimizer.lr, c.gradient_accumulation_steps, c.precision.dtype, c.clip_grad_norm) == (3e-4, 4, "bf16", 1.0)
    with pytest.raises(ConfigError, match=r"optimizer.lr=0.001 vs TrainingArguments learning_rate=0.0003"):
        resolve({"stage": 2, "optimizer": {"lr": 1e-3}}, args)
    # Trainer: max_grad_norm <= 0 is no clipping, its norm still logged: the overlapped step stays
    # on and forms it as the gradients arrive (it was turned off so that the deferred step would)
    for no_clip in (0.0, -1.0):
        c = resolve({"stage": 2}, training_args(str(tmp_path), max_grad_norm=no_clip))
        assert (c.clip_grad_norm, c.overlap_step, c.track_grad_norm) == (0.0, True, True)
    assert resolve({"stage": 2}, training_args(str(tmp_path))).overlap_step
    with pytest.raises(ConfigError, match=r"^TrainingArguments.max_grad_norm = None: Trainer needs a number "
                                          r"\(max_grad_norm=0 for no clipping\)$"):
        resolve({"stage": 2}, training_args(str(tmp_path), max_grad_norm=None))


def test_training_arguments_deepspeed_is_refused_in_one_line(tmp_path: Any) -> None:
    args = training_args(str(tmp_path))
    # Where the deepspeed package is installed TrainingArguments keeps the path (without it,
    # transformers itself refuses to build the arguments).
    args.deepspeed = str(tmp_path / "ds_config.json")
    with pytest.raises(ConfigError, match=r"^TrainingArguments\(deepspeed=...\) hands training to the deepspeed "
                                          r"package: pass the DeepSpeed JSON as ZeroOffloadTrainer\("
                                          r"zero_offload_config=...\) instead$"):
        ZeroOffloadTrainer(model=tiny_llama(), args=args, train_dataset=TRAIN)


@pytest.mark.parametrize("kwargs,message", [
    ({"optimizers": (torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0), None)}, r"optimizers=\.\.\."),
    ({"args_overrides": {"optim": "sgd"}}, r"TrainingArguments.optim = 'sgd'"),
])
def test_what_would_bypass_the_engine_is_refused(kwargs: dict, message: str, tmp_path: Any) -> None:
    args = training_args(str(tmp_path), **kwargs.pop("args_overrides", {}))
    with pytest.raises(ConfigError, match=message):
        ZeroOffloadTrainer(model=tiny_llama(), args=args, train_dataset=TRAIN, **kwargs)


# At D = 2: 6 sequences per rank, 3 micro-batches of 2 per epoch: each epoch's last cycle is short.
TRAIN_D2 = Tokens(12, seed=0)


def _d2_args(out: str, **overrides: Any) -> Any:
    return training_args(out, max_steps=4, eval_strategy="steps", eval_steps=2, **overrides)


def _d2_config(where: str) -> dict[str, Any]:
    if where == "stage1-cpu":
        return {"stage": 1, "tiers": {"optimizer": "cpu", "grads": "cpu"}}
    if where == "stage3-cpu":
        return {"stage": 3, "tiers": {"params": "cpu", "optimizer": "cpu", "grads": "cpu"},
                "stage3": {"unit_modules": ["LlamaDecoderLayer"]}}
    return CONFIGS[where]("")


def _plain_ddp(out: str) -> tuple[list[dict], dict[str, torch.Tensor]]:
    model = tiny_llama(attention_dropout=0.2)
    trainer = Trainer(model=model, args=_d2_args(os.path.join(out, "plain")), train_dataset=TRAIN_D2,
                      eval_dataset=EVAL)
    trainer.train()
    return trainer.state.log_history, model.state_dict()


def _assert_same_logs(ours: list[dict], theirs: list[dict], where: str, exact: bool = False) -> None:
    for key in ("loss", "grad_norm", "learning_rate", "eval_loss"):
        mine, others = logged(ours, key), logged(theirs, key)
        assert len(mine) == len(others) > 0, (where, key)
        assert mine == (others if exact else pytest.approx(others, rel=1e-5)), (where, key)


def _two_ranks(rank: int, world: int, out: str) -> None:
    """On each of two gloo ranks, as torchrun would start them: a plain Trainer (DDP), then
    ZeroOffloadTrainer at stages 0 to 3 (with evaluation and a checkpoint, then save_model);
    rank 0 compares. Each is then resumed from its mid-epoch checkpoint-3. Without the sampler
    sharding the data per rank, or with the module wrapped in DDP, the runs differ (or stage 3
    fails)."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", OMP_NUM_THREADS="1")
    _refuses_a_trainer_that_sees_one_process(out)
    history, plain = _plain_ddp(out)
    for where in ("stage0", "stage1-cpu", "stage2-cpu", "stage3-cpu"):
        path = os.path.join(out, where)
        ours = ZeroOffloadTrainer(model=tiny_llama(attention_dropout=0.2), train_dataset=TRAIN_D2, eval_dataset=EVAL,
                                  args=_d2_args(path, save_strategy="steps", save_steps=3),
                                  zero_offload_config=_d2_config(where))
        ours.train()
        assert torch.distributed.get_world_size() == 2
        weights = ours.engine.consolidated_state_dict()  # a collective; full on rank 0
        if rank == 0:
            _assert_same_logs(ours.state.log_history, history, where)
            assert max_relative_difference(weights, plain) < 1e-5, where
        _assert_saved_model_loads_with_the_same_logits(ours, os.path.join(path, "saved"), rank)
        _assert_resumes_bit_for_bit(ours, weights, rank, where)
        ours.engine.close()


def _refuses_a_trainer_that_sees_one_process(out: str) -> None:
    """Without use_cpu on a machine without a GPU, accelerate's state is one process per rank (as
    under torchrun): each rank would train on all the data and write every file. Refused; the
    next TrainingArguments with use_cpu=True sets accelerate's state up for both ranks again."""
    args = training_args(os.path.join(out, "one"), use_cpu=False)
    assert args.world_size == 1 and not torch.cuda.is_available()
    with pytest.raises(ConfigError, match=r"^the engine trains on 2 ranks \(the launcher's process group\) but "
                                          r"TrainingArguments sees 1, so .* set TrainingArguments\(use_cpu=True\)"):
        ZeroOffloadTrainer(model=tiny_llama(), args=args, train_dataset=TRAIN_D2, zero_offload_config=STAGE2_CPU)


def _assert_saved_model_loads_with_the_same_logits(trainer: ZeroOffloadTrainer, directory: str, rank: int) -> None:
    trainer.save_model(directory)  # a collective: rank 0 writes
    ids = EVAL.ids[:2]
    with torch.no_grad():
        ours = trainer.engine_model(input_ids=ids).logits  # at stage 3 a collective too
        if rank == 0:
            loaded = LlamaForCausalLM.from_pretrained(directory).eval()
            assert torch.equal(ours, loaded(input_ids=ids).logits), directory


def _assert_resumes_bit_for_bit(first: ZeroOffloadTrainer, weights: dict[str, torch.Tensor], rank: int,
                                where: str) -> None:
    checkpoint = os.path.join(first.args.output_dir, "checkpoint-3")
    second = ZeroOffloadTrainer(model=tiny_llama(seed=1, attention_dropout=0.2), train_dataset=TRAIN_D2,
                                eval_dataset=EVAL, args=_d2_args(first.args.output_dir + "-resumed"),
                                zero_offload_config=_d2_config(where))
    second.train(resume_from_checkpoint=checkpoint)
    resumed = second.engine.consolidated_state_dict()
    if rank == 0:
        _assert_same_logs(second.state.log_history, first.state.log_history, f"{where} resumed", exact=True)
        assert all(torch.equal(resumed[k], weights[k]) for k in weights), where
    second.engine.close()


def test_two_ranks_train_as_a_plain_ddp_trainer_does(tmp_path: Any) -> None:
    from _dist import run_ranks

    run_ranks(_two_ranks, 2, timeout=420, out=str(tmp_path))


def test_the_example_fine_tunes_saves_and_generates(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """examples/finetune_hf.py with tiny settings: its own tiny Llama and character tokenizer,
    the folder given to the Trainer at stage 3 on nvme, save_model, from_pretrained and generate.
    It put the source tree on sys.path (an installed package then ran without its native
    library) and deleted the output it had just printed; the output is kept now."""
    import importlib.util
    import sys

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "finetune_hf.py")
    spec = importlib.util.spec_from_file_location("finetune_hf", path)
    example = importlib.util.module_from_spec(spec)
    before = list(sys.path)
    spec.loader.exec_module(example)
    assert sys.path == before
    monkeypatch.chdir(tmp_path)  # the default --output is relative
    text = example.main(["--steps", "2", "--seq", "32", "--batch", "2", "--new-tokens", "4", "--prompt", "ab",
                         "--nvme-dir", str(tmp_path / "nvme")])
    assert text.startswith("ab") and len(text) >= 3
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(
        os.listdir(tmp_path / "finetune_hf_output" / "final"))
