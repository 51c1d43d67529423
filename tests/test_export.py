"""The model streamed out of the engine in Hugging Face format (engine/state/export.py, hf/save.py).

The oracles: transformers' from_pretrained (and PEFT's PeftModel.from_pretrained) must load what
we write and give the trained engine's logits exactly; transformers' own save_pretrained of the
same model gives the key set, config.json and index metadata we must match; safetensors'
reader checks the files; consolidated_state_dict gives the values. Before this, save_model built
the whole model in RAM (consolidated_state_dict) and handed it to save_pretrained, and a PEFT
model's save wrote every base weight too.
"""
from __future__ import annotations

import json
import os
import threading
import time
from typing import Any, Callable

import pytest
import torch

pytest.importorskip("transformers")

from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import LlamaForCausalLM  # noqa: E402

import zero_offload  # noqa: E402
from _hf import Tokens, tiny_llama, training_args  # noqa: E402
from zero_offload.engine.state import export  # noqa: E402
from zero_offload.engine.state.export import ExportError, SafetensorsWriter, Spec, split_files  # noqa: E402
from zero_offload.hf import ZeroOffloadTrainer, save_pretrained  # noqa: E402

UNITS = {"unit_modules": ["LlamaDecoderLayer"]}  # the default unit choice for PEFT is fixed elsewhere


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def stage3_nvme(tmp: str, name: str = "nvme") -> dict[str, Any]:
    os.makedirs(os.path.join(tmp, name), exist_ok=True)
    return {"stage": 3, "tiers": {"params": "nvme", "optimizer": "nvme", "grads": "cpu"},
            "nvme_paths": [os.path.join(tmp, name)], "stage3": UNITS, "optimizer": {"lr": 1e-2}}


def trained(model: torch.nn.Module, config: dict[str, Any], steps: int = 2, seed: int = 0) -> zero_offload.Engine:
    engine = zero_offload.initialize(model, config)
    ids = Tokens(4, seed=seed).ids
    for _ in range(steps):
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    return engine


def saved_tensors(directory: str) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(directory, name)))
    return out


# ---- the safetensors writer -----------------------------------------------------------------

def test_streamed_files_are_read_back_by_safetensors_bit_for_bit(tmp_path: Any) -> None:
    """Headers first, bytes appended: every dtype, a scalar, an empty tensor, a non-contiguous one."""
    g = torch.Generator().manual_seed(0)
    tensors = {"a.f32": torch.randn(3, 5, generator=g), "b.bf16": torch.randn(7, generator=g).bfloat16(),
               "c.f16": torch.randn(2, 2, generator=g).half(), "d.i64": torch.arange(5), "e.bool": torch.rand(6) > 0.5,
               "f.scalar": torch.tensor(2.5), "g.empty": torch.empty(0, 3), "h.u8": torch.arange(9, dtype=torch.uint8),
               "i.t": torch.randn(4, 3, generator=g).t(), "j.f64": torch.randn(3, dtype=torch.float64, generator=g)}
    entries = [(k, Spec(v.shape, v.dtype)) for k, v in tensors.items()]
    parts = split_files(entries, 40)
    files = [(name, [(k, Spec(tensors[k].shape, tensors[k].dtype)) for k in part])
             for name, part in zip(export.file_names(len(parts)), parts)]
    writer = SafetensorsWriter(str(tmp_path), files, {"format": "pt"})
    writer.begin()
    for k, v in tensors.items():
        writer.take(k, v)
    writer.finish()
    assert not any(name.endswith(".safetensors") for name in os.listdir(tmp_path))  # not before publish
    writer.publish()
    back = saved_tensors(str(tmp_path))
    assert sorted(back) == sorted(tensors)
    for k, v in tensors.items():
        assert back[k].dtype == v.dtype and back[k].shape == v.shape and torch.equal(back[k], v), k
    for name, _ in files:
        with open(tmp_path / name, "rb") as f:
            assert int.from_bytes(f.read(8), "little") % 8 == 0  # the data starts aligned
        with safe_open(str(tmp_path / name), "pt") as f:
            assert f.metadata() == {"format": "pt"}
    with pytest.raises(RuntimeError, match="out of the planned order"):
        SafetensorsWriter(str(tmp_path / "x"), files, {}).take("b.bf16", tensors["b.bf16"])


def test_files_are_split_as_huggingface_hub_splits_a_state_dict() -> None:
    from huggingface_hub import split_torch_state_dict_into_shards

    state = {f"t{i}": torch.empty(n) for i, n in enumerate([10, 30, 5, 25, 25, 1, 40, 3])}  # x 4 bytes
    entries = [(k, Spec(v.shape, v.dtype)) for k, v in state.items()]
    for limit in (160, 200, 400, 10 ** 6):
        theirs = split_torch_state_dict_into_shards(state, max_shard_size=limit,
                                                    filename_pattern="model{suffix}.safetensors")
        ours = split_files(entries, limit)
        names = export.file_names(len(ours))
        assert {n: part for n, part in zip(names, ours)} == theirs.filename_to_tensors, limit
    # A tensor larger than the limit is alone in its file (huggingface_hub too; here in streamed order).
    assert split_files(entries, 110) == [["t0"], ["t1"], ["t2"], ["t3"], ["t4", "t5"], ["t6"], ["t7"]]


# ---- stage 3 on nvme, D = 1 --------------------------------------------------------------------

@pytest.mark.parametrize("tied,max_shard_size", [(True, "20KB"), (False, None)])
def test_stage3_nvme_save_loads_in_from_pretrained_with_the_engines_logits(tied: bool, max_shard_size: str | None,
                                                                            tmp_path: Any) -> None:
    engine = trained(tiny_llama(tie_word_embeddings=tied), stage3_nvme(str(tmp_path)))
    ids = Tokens(2, seed=5).ids
    with torch.no_grad():
        ours = engine(input_ids=ids).logits
    out = str(tmp_path / "saved")
    save_pretrained(engine, out, **({} if max_shard_size is None else {"max_shard_size": max_shard_size}))
    reference = str(tmp_path / "reference")  # what transformers writes for the same model
    tiny_llama(tie_word_embeddings=tied).save_pretrained(reference, **(
        {} if max_shard_size is None else {"max_shard_size": max_shard_size}))

    files = sorted(os.listdir(out))
    assert [f for f in files if "safetensors" not in f] == ["config.json", "generation_config.json"]
    with open(os.path.join(out, "config.json")) as a, open(os.path.join(reference, "config.json")) as b:
        assert json.load(a) == json.load(b)
    values, theirs = saved_tensors(out), saved_tensors(reference)
    assert sorted(values) == sorted(theirs)  # the names transformers saves: a tied lm_head.weight once
    assert ("lm_head.weight" in values) is not tied
    full = engine.consolidated_state_dict()
    for k, v in values.items():
        assert v.dtype == theirs[k].dtype and torch.equal(v, full[k].to(v.dtype)), k
    if max_shard_size is None:
        assert "model.safetensors" in files and "model.safetensors.index.json" not in files
    else:
        shards = [f for f in files if f.startswith("model-")]
        assert len(shards) > 2 and "model.safetensors" not in files
        with open(os.path.join(out, "model.safetensors.index.json")) as a, \
                open(os.path.join(reference, "model.safetensors.index.json")) as b:
            index, their_index = json.load(a), json.load(b)
        assert index["metadata"] == their_index["metadata"]  # total_size, total_parameters
        assert sorted(index["weight_map"]) == sorted(their_index["weight_map"])
        assert set(index["weight_map"].values()) == set(shards)
        for shard in shards:  # at most max_shard_size, unless one tensor is larger
            with safe_open(os.path.join(out, shard), "pt") as f:
                sizes = [f.get_slice(k).get_shape() for k in f.keys()]
            nbytes = sum(torch.Size(s).numel() * 4 for s in sizes)
            assert nbytes <= 20_000 or len(sizes) == 1
    with torch.no_grad():
        loaded = LlamaForCausalLM.from_pretrained(out).eval()
        assert torch.equal(loaded(input_ids=ids).logits, ours)
    if tied:
        assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    engine.close()


def test_a_bf16_engine_saves_the_fp32_masters_of_an_fp32_model(tmp_path: Any) -> None:
    config = {**stage3_nvme(str(tmp_path)), "precision": {"dtype": "bf16"}}
    engine = trained(tiny_llama(), config, steps=1)
    save_pretrained(engine, str(tmp_path / "saved"))
    values, full = saved_tensors(str(tmp_path / "saved")), engine.consolidated_state_dict()
    assert all(v.dtype == torch.float32 and torch.equal(v, full[k]) for k, v in values.items())
    with open(tmp_path / "saved" / "config.json") as f:
        assert json.load(f)["dtype"] == "float32"  # the model's dtype, not the engine's compute dtype
    engine.close()


def test_a_second_save_into_the_same_folder_leaves_no_stale_weights_file(tmp_path: Any) -> None:
    engine = trained(tiny_llama(), {"stage": 0}, steps=1)
    out = str(tmp_path / "saved")
    save_pretrained(engine, out, max_shard_size="20KB")
    save_pretrained(engine, out)  # one file now: the old shards and index would shadow it or be left over
    assert sorted(f for f in os.listdir(out) if "safetensors" in f) == ["model.safetensors"]
    save_pretrained(engine, out, max_shard_size="20KB")  # and back: an old model.safetensors would win
    assert "model.safetensors" not in os.listdir(out) and "model.safetensors.index.json" in os.listdir(out)
    assert LlamaForCausalLM.from_pretrained(out) is not None
    engine.close()


@pytest.mark.parametrize("shard", ["20KB", None], ids=["sharded", "one-file"])
def test_a_save_that_fails_part_way_leaves_the_earlier_save_as_it_was(tmp_path: Any, shard: str | None,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Files are written aside and renamed into place only once all are complete: a full disk
    (or a crash) in the middle of a save over an earlier one neither truncates nor mixes it."""
    engine = trained(tiny_llama(), {"stage": 0}, steps=1)
    out = str(tmp_path / "saved")
    kwargs = {} if shard is None else {"max_shard_size": shard}
    save_pretrained(engine, out, **kwargs)
    before = {name: (tmp_path / "saved" / name).read_bytes() for name in os.listdir(out)}
    ids = Tokens(4, seed=1).ids
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()  # new weights: a save now changes the files
    take, calls = export.SafetensorsWriter.take, []

    def full_disk(self: Any, key: str, value: torch.Tensor) -> None:
        calls.append(key)
        if len(calls) == 5:
            raise OSError(28, "No space left on device")
        take(self, key, value)
    monkeypatch.setattr(export.SafetensorsWriter, "take", full_disk)
    with pytest.raises(OSError, match="No space left on device"):
        save_pretrained(engine, out, **kwargs)
    after = {name: (tmp_path / "saved" / name).read_bytes() for name in os.listdir(out)}
    assert after == before  # the earlier save, byte for byte, and no .partial file left
    monkeypatch.setattr(export.SafetensorsWriter, "take", take)
    save_pretrained(engine, out, **kwargs)
    assert {name for name in os.listdir(out)} == set(before)
    assert any((tmp_path / "saved" / name).read_bytes() != data for name, data in before.items())
    engine.close()


def test_bad_keys_and_sizes_are_refused_in_one_line(tmp_path: Any) -> None:
    engine = zero_offload.initialize(tiny_llama(), {"stage": 0})
    with pytest.raises(KeyError, match="not tensors of the model's state_dict: \\['nope'\\]"):
        engine.save_safetensors(str(tmp_path), ["nope"])
    with pytest.raises(ValueError, match="max_shard_size must be a positive number of bytes"):
        engine.save_safetensors(str(tmp_path), max_shard_size=0)
    with pytest.raises(ValueError, match="max_shard_size='5 parsecs'"):
        save_pretrained(engine, str(tmp_path), max_shard_size="5 parsecs")
    model = tiny_llama()
    model._hf_peft_config_loaded = True  # adapters loaded through transformers (needs peft >= 0.22 to make)
    with pytest.raises(NotImplementedError, match="wrap the model with peft.get_peft_model"):
        save_pretrained(engine, str(tmp_path), model=model)
    engine.close()


def test_a_model_transformers_saves_converted_is_saved_by_transformers_with_a_warning(tmp_path: Any) -> None:
    """Mixtral's fused experts are saved one expert at a time by transformers (its weight
    conversions), which the streamed save cannot write: transformers' own save, from the whole
    state dict, said in a warning; from_pretrained still gives the engine's logits."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    config = MixtralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=128, num_local_experts=2)
    engine = trained(MixtralForCausalLM(config), {"stage": 0}, steps=1)
    ids = Tokens(2, seed=5).ids
    with pytest.warns(UserWarning, match="weight conversions"):
        save_pretrained(engine, str(tmp_path / "saved"))
    assert any(".experts.0." in k for k in saved_tensors(str(tmp_path / "saved")))  # transformers' layout
    with torch.no_grad():
        loaded = MixtralForCausalLM.from_pretrained(str(tmp_path / "saved")).eval()
        assert torch.equal(loaded(input_ids=ids).logits, engine(input_ids=ids).logits)
    engine.close()


# ---- memory: the model is never whole in RAM ------------------------------------------------

def peak_rss_during(fn: Callable[[], None]) -> tuple[int, int]:
    """(RSS just before, highest RSS sampled while fn runs), sampled every millisecond by a thread."""
    import psutil

    process, peak, done = psutil.Process(), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], process.memory_info().rss)
            time.sleep(0.001)

    before = process.memory_info().rss
    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        fn()
    finally:
        done.set()
        thread.join()
    return before, max(peak[0], process.memory_info().rss)


def test_trainer_save_model_at_stage3_on_nvme_holds_about_one_unit(tmp_path: Any) -> None:
    """24 blocks of 3.9 MB (fp32): the whole model is 94 MB; a save that builds the state dict
    first (as before) grows the process by about twice that, the streamed one by a few units."""
    from transformers import LlamaConfig

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=256, intermediate_size=1024, num_hidden_layers=24,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=128))
    model_bytes = sum(p.numel() * 4 for p in model.parameters())
    trainer = ZeroOffloadTrainer(model=model, args=training_args(str(tmp_path / "out")), train_dataset=Tokens(2),
                                 zero_offload_config=stage3_nvme(str(tmp_path)))
    unit = max(u.nbytes for u in trainer.engine.runtime.units)
    before, peak = peak_rss_during(lambda: trainer.save_model(str(tmp_path / "saved")))
    assert peak - before < 4 * unit + 24 * 2 ** 20, (peak - before, unit, model_bytes)
    loaded = saved_tensors(str(tmp_path / "saved"))
    assert sum(v.numel() * 4 for v in loaded.values()) == model_bytes
    trainer.engine.close()


# ---- PEFT ----------------------------------------------------------------------------------------

def test_trainer_saves_only_the_lora_adapters_in_pefts_format(tmp_path: Any, monkeypatch: Any) -> None:
    """LoRA on a frozen base at stage 3, base on nvme: save_model writes PEFT's files and key
    names, reads no unit of the frozen base, and PeftModel.from_pretrained onto a fresh base
    gives the trained engine's logits."""
    from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict

    from zero_offload.engine.stage3.unit import Unit

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    trainer = ZeroOffloadTrainer(model=get_peft_model(tiny_llama(), lora), args=training_args(
        str(tmp_path / "out"), max_steps=3, warmup_steps=0), train_dataset=Tokens(8),
        zero_offload_config=stage3_nvme(str(tmp_path)))
    trainer.train()
    ids = Tokens(2, seed=5).ids
    with torch.no_grad():
        ours = trainer.engine_model(input_ids=ids).logits
    reads: list[str] = []
    read_shard = Unit.read_shard
    monkeypatch.setattr(Unit, "read_shard", lambda self, key: reads.append(key) or read_shard(self, key))
    out = str(tmp_path / "saved")
    trainer.save_model(out)
    assert reads == []  # the base's frozen shards were never read; the adapters come from the masters
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(out))
    assert "model.safetensors" not in os.listdir(out)
    values = load_file(os.path.join(out, "adapter_model.safetensors"))
    assert sorted(values) == sorted(get_peft_model_state_dict(get_peft_model(tiny_llama(), lora)))
    with torch.no_grad():
        base = tiny_llama()
        plain = base(input_ids=ids).logits
        loaded = PeftModel.from_pretrained(base, out).eval()
        assert torch.equal(loaded(input_ids=ids).logits, ours)
        assert not torch.equal(plain, ours)  # the adapters did train
    trainer.engine.close()


# ---- D = 2 -----------------------------------------------------------------------------------------

def _two_ranks(rank: int, world: int, out: str) -> None:
    """Each rank trains on its own batches; every rank saves (a collective), rank 0 writes and
    checks; then failures on one rank raise on both instead of leaving one in a gather."""
    for name, config in (("stage3", stage3_nvme(out, f"nvme{rank}")),
                         ("stage2", {"stage": 2, "tiers": {"optimizer": "cpu", "grads": "cpu"}})):
        engine = trained(tiny_llama(tie_word_embeddings=True), config, seed=rank)
        ids = Tokens(2, seed=5).ids
        with torch.no_grad():
            ours = engine(input_ids=ids).logits
        saved = os.path.join(out, name)
        save_pretrained(engine, saved, max_shard_size="20KB")
        if rank == 0:
            assert len([f for f in os.listdir(saved) if f.startswith("model-")]) > 2
            with torch.no_grad():
                assert torch.equal(LlamaForCausalLM.from_pretrained(saved).eval()(input_ids=ids).logits, ours)
        engine.close()
    engine = trained(tiny_llama(), stage3_nvme(out, f"nvme{rank}-b"), steps=1)
    blocked = os.path.join(out, "a-file")
    if rank == 0:
        open(blocked, "w").close()
    with pytest.raises(ExportError if rank else FileExistsError):  # rank 0 cannot make the folder
        engine.save_safetensors(blocked)
    master, calls = engine.runtime.shard_optimizer.master, [0]

    def failing(key: str) -> torch.Tensor:
        calls[0] += 1
        if rank == 1 and calls[0] == 2:
            raise OSError("drive gone")
        return master(key)

    engine.runtime.shard_optimizer.master = failing  # rank 1's second read fails mid-stream
    with pytest.raises(OSError if rank else ExportError, match="drive gone"):
        engine.save_safetensors(os.path.join(out, "failed"))
    engine.close()


def test_two_ranks_gather_every_unit_and_rank_0_writes(tmp_path: Any) -> None:
    from _dist import run_ranks

    run_ranks(_two_ranks, 2, timeout=240, out=str(tmp_path))
