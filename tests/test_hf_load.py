"""zero_offload.hf.from_pretrained: a Hugging Face folder into an engine, the model built on the
meta device and its weights streamed unit by unit through transformers' own load-time conversion.

Before it, `initialize(meta_model, weights=folder)` read the stored names as they are: a Mixtral
folder (experts stored one module each, held fused) or a ViT folder (old names) failed with
"weights file ... has no tensor 'model.layers.0.mlp.gate.weight'". Each case here saves an eager
model, loads the folder at stage 3 with parameters on nvme, and holds the engine to the eager
model: the first loss, then one torch.optim.AdamW step's second loss.
"""
from __future__ import annotations

import json
import os
from typing import Any, Callable, Collection

import pytest
import torch
from torch import nn

import zero_offload

transformers = pytest.importorskip("transformers")
from zero_offload.hf import from_pretrained  # noqa: E402
from zero_offload.hf.load import ConvertedWeights  # noqa: E402

VOCAB = 128
LR, WD = 1e-2, 0.01
COMMON = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=VOCAB)


def _cfg(tmp: Any, stage: int = 3) -> dict:
    tiers = {"params": "nvme", "optimizer": "cpu", "grads": "cpu"} if stage == 3 else \
        {"params": "device", "optimizer": "cpu", "grads": "cpu"}
    return {"stage": stage, "tiers": tiers, "nvme_paths": [str(tmp)], "optimizer": {"lr": LR, "weight_decay": WD}}


def _tokens(step: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(step))
    return {"input_ids": ids, "labels": ids}


def _images(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {"pixel_values": torch.randn(2, 3, 16, 16, generator=g), "labels": torch.randint(0, 5, (2,), generator=g)}


def _llama() -> nn.Module:
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON, num_key_value_heads=2,
                                                                  tie_word_embeddings=True))


def _mixtral() -> nn.Module:
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        **COMMON, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.0))


def _neox() -> nn.Module:
    return transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
        **COMMON, tie_word_embeddings=False, hidden_dropout=0.0, attention_dropout=0.0))


def _eager(make: Callable[[], nn.Module]) -> nn.Module:
    torch.manual_seed(0)
    return make().eval()  # eval: as from_pretrained returns it (the configs' dropout is off anyway)


def _oracle(model: nn.Module, batch: Callable[[int], dict]) -> list[float]:
    """The eager model's first loss, then its loss after one torch.optim.AdamW step."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    first = model(**batch(0)).loss
    first.backward()
    opt.step()
    with torch.no_grad():
        return [float(first), float(model(**batch(1)).loss)]


def _engine_losses(engine: Any, batch: Callable[[int], dict]) -> list[float]:
    first = engine(**batch(0)).loss
    engine.backward(first)
    engine.step()
    with torch.no_grad():
        return [float(first), float(engine(**batch(1)).loss)]


def _check(folder: str, want: list[float], batch: Callable[[int], dict], tmp: Any, stage: int = 3,
           **kw: Any) -> Any:
    engine = from_pretrained(folder, _cfg(tmp, stage), **kw)
    try:
        got = _engine_losses(engine, batch)
        assert got == pytest.approx(want, rel=1e-5, abs=1e-6), (got, want)
    finally:
        engine.close()
    return engine


def _write_state_dict(model: nn.Module, folder: str) -> None:
    """The folder in the module's own names and layout (what a plain safetensors save of the
    state dict writes): config.json and model.safetensors."""
    from safetensors.torch import save_file

    model.config.save_pretrained(folder)
    seen: set[int] = set()
    tensors = {}
    for k, v in model.state_dict().items():
        if id(v) not in seen:  # a tied weight once
            seen.add(id(v))
            tensors[k] = v.detach().clone().contiguous()
    save_file(tensors, os.path.join(folder, "model.safetensors"))


def _stored_names(folder: str) -> list[str]:
    from safetensors import safe_open

    names: list[str] = []
    for f in sorted(os.listdir(folder)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(folder, f), "pt") as h:
                names += list(h.keys())
    return names


def test_llama_rope_and_tied_head_from_a_sharded_folder(tmp_path: Any) -> None:
    """inv_freq (non-persistent, never stored) as the eager build computes it; the tied head one
    object with the embeddings; a folder of several shards and an index."""
    eager = _eager(_llama)
    folder = str(tmp_path / "llama")
    eager.save_pretrained(folder, max_shard_size="20KB")
    assert os.path.isfile(os.path.join(folder, "model.safetensors.index.json"))
    assert len(set(json.load(open(os.path.join(folder, "model.safetensors.index.json")))["weight_map"].values())) > 2
    rope = eager.model.rotary_emb.inv_freq.clone()
    want = _oracle(eager, _tokens)
    engine = from_pretrained(folder, _cfg(tmp_path))
    try:
        model = engine.module
        assert model.lm_head.weight is model.model.embed_tokens.weight
        assert torch.equal(model.model.rotary_emb.inv_freq.cpu(), rope)
        got = _engine_losses(engine, _tokens)
        assert got == pytest.approx(want, rel=1e-5, abs=1e-6), (got, want)
    finally:
        engine.close()


def test_mixtral_folder_in_the_modules_layout_loads_too(tmp_path: Any) -> None:
    """A folder holding the fused names as they are (a plain save of the state dict) needs no conversion."""
    eager = _eager(_mixtral)
    folder = str(tmp_path / "fused")
    _write_state_dict(eager, folder)
    assert "model.layers.0.mlp.experts.gate_up_proj" in _stored_names(folder)
    _check(folder, _oracle(eager, _tokens), _tokens, tmp_path)


def test_gpt_neox_embed_out_is_renamed(tmp_path: Any) -> None:
    eager = _eager(_neox)
    folder = str(tmp_path / "neox")
    eager.save_pretrained(folder)
    assert "embed_out.weight" in _stored_names(folder)
    _check(folder, _oracle(eager, _tokens), _tokens, tmp_path)


def _dinov2() -> nn.Module:
    return transformers.Dinov2ForImageClassification(transformers.Dinov2Config(
        image_size=16, patch_size=4, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, mlp_ratio=2,
        use_swiglu_ffn=True, num_labels=5, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def test_dinov2_one_stored_tensor_chunked_into_two(tmp_path: Any) -> None:
    """One to many: Dinov2's SwiGLU stores mlp.weights_in, which transformers chunks into the
    module's gate_proj and up_proj (and renames its attention projections)."""
    eager = _eager(_dinov2)
    folder = str(tmp_path / "dinov2")
    eager.save_pretrained(folder)
    stored = _stored_names(folder)
    assert "dinov2.encoder.layer.0.mlp.weights_in.weight" in stored
    assert "dinov2.encoder.layer.0.mlp.up_proj.weight" not in stored
    _check(folder, _oracle(eager, _images), _images, tmp_path, model_class=transformers.AutoModelForImageClassification)


def test_stage_2_loads_the_converted_folder(tmp_path: Any) -> None:
    """At stages 0-2 the whole model is on the device anyway: transformers' from_pretrained loads it."""
    eager = _eager(_mixtral)
    folder = str(tmp_path / "mixtral")
    eager.save_pretrained(folder)
    _check(folder, _oracle(eager, _tokens), _tokens, tmp_path, stage=2)


def test_a_missing_stored_tensor_is_initialized_and_named_as_transformers_does(tmp_path: Any) -> None:
    """A tensor the folder lacks: transformers' from_pretrained initializes it by the model's
    _init_weights and reports it; this was a KeyError. The tensors it holds are loaded as they
    are (a module's _init_weights runs for its missing weight and leaves its loaded bias, if any)."""
    from safetensors.torch import load_file, save_file

    folder = str(tmp_path / "llama")
    _eager(_llama).save_pretrained(folder)
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, path)
    with pytest.warns(UserWarning, match=f"from_pretrained: 1 tensors of LlamaForCausalLM are not in {folder} and are "
                                         r"initialized by the model's own _init_weights \(the first: "
                                         r"'model.layers.1.mlp.up_proj.weight'\)"):
        engine = from_pretrained(folder, _cfg(tmp_path))
    try:
        state = engine.consolidated_state_dict()
    finally:
        engine.close()
    for k, v in tensors.items():
        assert torch.equal(state[k], v), k
    drawn = state["model.layers.1.mlp.up_proj.weight"]
    assert 0.015 < float(drawn.std()) < 0.025  # LlamaConfig's initializer_range, 0.02


def _edited_mixtral_folder(tmp_path: Any, edit: Callable[[dict], Any]) -> str:
    """The eager Mixtral's save_pretrained folder with `edit` applied to its stored tensors."""
    from safetensors.torch import load_file, save_file

    folder = str(tmp_path / "mixtral")
    _eager(_mixtral).save_pretrained(folder)
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)
    return folder


def test_an_unexpected_stored_layout_is_one_line_naming_the_tensor_and_the_folder(tmp_path: Any) -> None:
    """One expert stored with another shape: transformers' stacking of the experts fails, and
    the error is ours, naming the fused tensor, the stored ones and the folder."""
    key = "model.layers.1.block_sparse_moe.experts.2.w1.weight"
    folder = _edited_mixtral_folder(tmp_path, lambda t: t.update({key: t[key][:-1].clone()}))
    with pytest.raises(ValueError, match=f"weights file {folder}: cannot build 'model.layers.1.mlp.experts.gate_up_proj'"
                                         r" from 'model\.layers\.1\.block_sparse_moe\.experts\.0\.w1\.weight' and 7 more"):
        from_pretrained(folder, _cfg(tmp_path))


def test_one_expert_missing_is_a_shape_error_naming_the_fused_tensor(tmp_path: Any) -> None:
    folder = _edited_mixtral_folder(tmp_path, lambda t: t.pop("model.layers.0.block_sparse_moe.experts.3.w2.weight"))
    with pytest.raises(ValueError, match=f"weights file {folder}: 'model.layers.0.mlp.experts.down_proj' has shape "
                                         r"\(3, 32, 64\), the model expects \(4, 32, 64\)"):
        from_pretrained(folder, _cfg(tmp_path))


def test_the_plan_maps_each_module_name_to_its_stored_tensors(tmp_path: Any) -> None:
    """What the source reads for one fused tensor: every expert's w1 and w3 of its layer, no more."""
    folder = str(tmp_path / "mixtral")
    _eager(_mixtral).save_pretrained(folder)
    with torch.device("meta"):
        meta = _mixtral()
    source = ConvertedWeights(meta, folder)
    job = source.jobs["model.layers.0.mlp.experts.gate_up_proj"]
    assert sorted(k for _, k in job.sources) == sorted(
        f"model.layers.0.block_sparse_moe.experts.{e}.{w}.weight" for e in range(4) for w in ("w1", "w3"))
    assert set(source.names()) == {n for n, _ in meta.named_parameters()}  # tied none; buffers none stored
    assert source.unused == []


# ---- the core's seam, without transformers ----
class _Doubled:
    """A WeightSource of our own: every tensor produced on request (the stored value doubled)."""

    def __init__(self, stored: dict[str, torch.Tensor], where: str) -> None:
        self.stored, self.where, self.asked = stored, where, []

    def names(self) -> Collection[str]:
        return self.stored.keys()

    def read(self, name: str) -> torch.Tensor:
        self.asked.append(name)
        return self.stored[name] * 2


def test_initialize_takes_a_weight_source(tmp_path: Any) -> None:
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    source = _Doubled({k: v.detach().clone() for k, v in eager.state_dict().items()}, "my source")
    with torch.device("meta"):
        meta = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    engine = zero_offload.initialize(meta, _cfg(tmp_path), weights=source)
    try:
        state = engine.consolidated_state_dict()
        assert sorted(source.asked) == sorted(eager.state_dict())
        for k, v in eager.state_dict().items():
            assert torch.equal(state[k], v * 2), k
    finally:
        engine.close()
    del source.stored["2.bias"]
    with torch.device("meta"):
        meta = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    with pytest.raises(KeyError, match="weights file my source has no tensor '2.bias'"):
        zero_offload.initialize(meta, _cfg(tmp_path), weights=source)


def test_a_tied_weight_stored_under_its_other_name(tmp_path: Any) -> None:
    """A tied head stored as lm_head.weight only (the embeddings' name absent): the tied
    parameter takes it, as transformers' loader ties it."""
    from safetensors.torch import load_file, save_file

    eager = _eager(_llama)
    folder = str(tmp_path / "llama")
    eager.save_pretrained(folder)
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    tensors["lm_head.weight"] = tensors.pop("model.embed_tokens.weight")
    save_file(tensors, path)
    _check(folder, _oracle(eager, _tokens), _tokens, tmp_path)


def test_stored_tensors_without_a_place_are_named_in_a_warning(tmp_path: Any) -> None:
    from safetensors.torch import load_file, save_file

    eager = _eager(_llama)
    folder = str(tmp_path / "llama")
    eager.save_pretrained(folder)
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    tensors["model.layers.0.mlp.extra.weight"] = torch.zeros(2)
    save_file(tensors, path)
    with pytest.warns(UserWarning, match="1 tensors of .* have no place in LlamaForCausalLM and are not read "
                                         r"\(the first: 'model.layers.0.mlp.extra.weight'\)"):
        engine = from_pretrained(folder, _cfg(tmp_path))
    engine.close()


class _Counting(dict):
    """The stored tensors' Mapping, counting each read."""

    def __init__(self, inner: Any) -> None:
        super().__init__()
        self.inner, self.reads = inner, {}

    def __getitem__(self, name: str) -> torch.Tensor:
        self.reads[name] = self.reads.get(name, 0) + 1
        return self.inner[name]

    def __contains__(self, name: object) -> bool:
        return name in self.inner

    def __iter__(self) -> Any:
        return iter(self.inner)

    def __len__(self) -> int:
        return len(self.inner)


def test_each_stored_tensor_is_read_once_in_module_order(tmp_path: Any, monkeypatch: Any) -> None:
    """Streaming: every stored tensor read once (Dinov2's weights_in once for its two module
    tensors), layer 0's before layer 1's."""
    import zero_offload.hf.load as load
    from zero_offload.engine.model.weights_files import open_weights

    folder = str(tmp_path / "dinov2")
    _eager(_dinov2).save_pretrained(folder, max_shard_size="30KB")
    seen: list[_Counting] = []
    monkeypatch.setattr(load, "open_weights", lambda path: seen.append(_Counting(open_weights(path))) or seen[-1])
    engine = from_pretrained(folder, _cfg(tmp_path), model_class=transformers.AutoModelForImageClassification)
    engine.close()
    reads = seen[0].reads
    assert sorted(reads) == sorted(seen[0].inner) and set(reads.values()) == {1}, {k: v for k, v in reads.items() if v != 1}
    order = [k for k in reads if ".layer." in k]
    assert max(i for i, k in enumerate(order) if ".layer.0." in k) < min(i for i, k in enumerate(order) if ".layer.1." in k)


CONVERTED = [  # (zoo case, model class, a name save_pretrained stores, the module's name for it)
    ("mixtral", None, "model.layers.0.block_sparse_moe.experts.3.w1.weight", "model.layers.0.mlp.experts.gate_up_proj"),
    ("vit", "AutoModelForImageClassification", "vit.encoder.layer.0.attention.attention.query.weight",
     "vit.layers.0.attention.q_proj.weight")]


@pytest.mark.parametrize("name,model_class,stored,held", CONVERTED, ids=[c[0] for c in CONVERTED])
def test_zoo_converted_models_train_as_adamw(name: str, model_class: str | None, stored: str, held: str,
                                             tmp_path: Any) -> None:
    """The conformance zoo's Mixtral and ViT, whose save_pretrained folders hold another layout
    than their modules (transformers reverses its conversion when saving: Mixtral's experts one
    module each, held fused 3-D; ViT's old attention names), through from_pretrained: three
    steps' losses and the final state dict are torch.optim.AdamW's on the eager copy (stage 3,
    parameters and optimizer on nvme)."""
    import _zoo_models as zoo

    folder = str(tmp_path / name)
    zoo.eager(name).save_pretrained(folder)
    names = _stored_names(folder)
    assert stored in names and held not in names and held in zoo.eager(name).state_dict()
    hyper = zoo.Hyper()
    ref = zoo.reference(name, 3, zoo.ROWS, hyper)
    config = {"stage": 3, "tiers": {"params": "nvme", "grads": "cpu", "optimizer": "nvme"}, "nvme_paths": [str(tmp_path)],
              "optimizer": {"lr": hyper.lr, "betas": list(hyper.betas), "eps": hyper.eps,
                            "weight_decay": hyper.weight_decay}}
    cls = getattr(transformers, model_class) if model_class else None
    with zoo.quiet():
        engine = from_pretrained(folder, config, model_class=cls)
    try:
        engine.module.train()  # as the zoo's eager copy (its dropout is off)
        losses = zoo.train(engine, name, range(3), zoo.ROWS)
        state = engine.consolidated_state_dict()
    finally:
        engine.close()
    assert losses == pytest.approx(ref.losses, rel=1e-5), (losses, ref.losses)
    bad = zoo.compare(state, ref, 1e-5)
    assert not bad, bad[:6]
