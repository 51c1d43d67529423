"""A model built on the meta device starts as its eager build would, or initialize refuses it.

Before: a transformers model built under `torch.device("meta")` and given no weights trained at
stage 3 from all-zero norm weights (logits 0, loss exactly ln(vocab), no warning), its linear
layers at torch's kaiming init instead of the model's own normal(0, initializer_range); a plain
module with a parameter and no reset_parameters started at zero. And zero_offload.hf.from_pretrained
refused folders transformers loads exactly: Gemma 3's embed_scale, Swin v2's relative_coords_table
and Falcon-H1's mup_vector ("cannot be rebuilt"), Marian's unsaved sinusoidal positions (a
KeyError). Now the model's own `_init_weights` initializes, unit by unit (materialize.py).

"As its eager build" is checked as: a tensor the eager build makes the same under two seeds (a
norm's ones, a bias's zeros, Marian's sinusoid, every buffer) is equal; a random one has the
eager one's spread (the random numbers themselves differ: the eager build draws every
constructor's numbers before its init).
"""
from __future__ import annotations

import math
import os
import warnings
from typing import Any, Callable

import pytest
import torch
from torch import nn

import zero_offload

transformers = pytest.importorskip("transformers")
import _zoo_models as zoo  # noqa: E402
from zero_offload.hf import from_pretrained  # noqa: E402

T = transformers
V = 128
CFG = {"stage": 3, "tiers": {"params": "cpu", "optimizer": "cpu", "grads": "cpu"}, "optimizer": {"lr": 1e-2}}


def _gemma3() -> nn.Module:
    return T.Gemma3ForCausalLM(T.Gemma3TextConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, sliding_window=16, max_position_embeddings=64))


def _swinv2() -> nn.Module:
    return T.Swinv2ForImageClassification(T.Swinv2Config(
        image_size=16, patch_size=2, embed_dim=8, depths=[1, 1], num_heads=[2, 2], window_size=2, num_labels=5,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, drop_path_rate=0.0))


def _falcon_h1() -> nn.Module:
    return T.FalconH1ForCausalLM(T.FalconH1Config(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8, mamba_d_state=8,
        mamba_n_groups=1, mamba_chunk_size=8, max_position_embeddings=64))


def _marian() -> nn.Module:
    return T.MarianMTModel(T.MarianConfig(
        vocab_size=V, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64, dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0, pad_token_id=V - 1, decoder_start_token_id=V - 1))


NEW: dict[str, Callable[[], nn.Module]] = {"gemma3": _gemma3, "swinv2": _swinv2, "falcon_h1": _falcon_h1,
                                           "marian": _marian}
# The zoo's transformers architectures: the constructor its meta_build wraps (_zoo_models._on_meta).
ZOO = {name: case.meta_build.__closure__[0].cell_contents for name, case in zoo.CASES.items()
       if case.meta_build is not None}
ALL = {**NEW, **ZOO}


def _eager(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    with zoo.quiet():
        return ALL[name]().eval()


def _on_meta(name: str) -> nn.Module:
    with torch.device("meta"), zoo.quiet():
        return ALL[name]()


def _values(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and every buffer (non-persistent ones too), in fp32 on the CPU."""
    out = {n: p.detach().float().cpu().clone() for n, p in model.named_parameters()}  # a copy: the gathered data goes
    out.update({f"buffer {n}": b.detach().float().cpu().clone() for n, b in model.named_buffers()})
    return out


@pytest.mark.parametrize("name", sorted(ALL))
def test_a_meta_model_given_no_weights_starts_as_its_eager_build(name: str) -> None:
    want, other = _values(_eager(name)), _values(_eager(name, seed=1))
    model = _on_meta(name)
    engine = zero_offload.initialize(model, CFG)
    try:
        with engine.gathered():
            got = _values(model)
    finally:
        engine.close()
    assert got.keys() == want.keys()
    for k, w in want.items():
        g = got[k]
        if torch.equal(w, other[k]):  # not drawn: the same constant or formula in every build
            assert torch.equal(g, w), f"{name}: {k} is {g.flatten()[:4].tolist()}, the eager build's {w.flatten()[:4].tolist()}"
        else:
            assert not torch.equal(g, w) and g.std() > 0, f"{name}: {k} is not drawn"
            if w.numel() >= 64:
                ratio = float(g.std() / w.std())
                assert 0.7 < ratio < 1.4, f"{name}: {k} has std {float(g.std()):.4g}, the eager build's {float(w.std()):.4g}"


def test_a_meta_llama_no_longer_trains_from_zero_norms() -> None:
    """The issue's case: logits were all 0 and the first loss exactly ln(vocab)."""
    model = _on_meta("llama")
    engine = zero_offload.initialize(model, CFG)
    try:
        batch = zoo.tokens_lm(0, 2)
        out = engine(**batch)
        assert out.logits.abs().max() > 0 and float(out.loss.detach()) != pytest.approx(math.log(zoo.VOCAB), abs=1e-6)
        engine.backward(out.loss)
        assert engine.step()
    finally:
        engine.close()


class _Scaled(nn.Module):
    """A parameter with no reset_parameters: its constructor's ones are lost on the meta device."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.lin(x) * self.scale).sum()


def test_a_parameter_no_initializer_sets_is_refused_in_one_line() -> None:
    with torch.device("meta"):
        model = _Scaled()
    with pytest.raises(ValueError, match=r"^initialize: parameter 'scale' \(_Scaled\) of the meta-device model has no "
                                         r"initial value: _Scaled has no reset_parameters\(\) and no init_fn was given; "
                                         r"pass weights=, or an init_fn that sets it, or build the model off the meta "
                                         r"device$") as info:
        zero_offload.initialize(model, CFG)  # it started at zero
    assert "\n" not in str(info.value)
    with torch.device("meta"):
        model = _Scaled()
    with pytest.raises(ValueError, match=r"parameter 'scale' .*: neither init_fn sets it"):
        zero_offload.initialize(model, CFG, init_fn=lambda m: None)

    def init(module: nn.Module) -> None:
        if isinstance(module, _Scaled):
            module.scale.data.fill_(1.0)  # through .data too
    with torch.device("meta"):
        model = _Scaled()
    engine = zero_offload.initialize(model, CFG, init_fn=init)
    assert torch.equal(engine.consolidated_state_dict()["scale"], torch.ones(4))
    engine.close()


def test_a_container_init_spanning_units_writes_each_unit() -> None:
    """Falcon-H1's model-level _init_weights writes every layer's mup_vector; an init_fn on a
    container whose parameters span units was never called: now it is, once per unit, each call
    writing that unit's parameters (the others are meta stand-ins)."""
    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    class Root(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.two = Two()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.two.b(self.two.a(x)).sum()

    def init(module: nn.Module) -> None:
        if isinstance(module, Two):  # after the Linears' own init, as model.apply goes
            module.a.weight.fill_(0.5)
            module.b.bias.fill_(-1.0)

    with torch.device("meta"):
        model = Root()
    engine = zero_offload.initialize(model, {**CFG, "stage3": {"unit_modules": ["Linear"]}}, init_fn=init)
    state = engine.consolidated_state_dict()
    engine.close()
    assert torch.equal(state["two.a.weight"], torch.full((4, 4), 0.5))
    assert torch.equal(state["two.b.bias"], torch.full((4,), -1.0))
    assert state["two.b.weight"].std() > 0  # its reset_parameters


# ---- zero_offload.hf.from_pretrained ----
@pytest.mark.parametrize("name", sorted(ALL))
def test_from_pretrained_loads_what_transformers_loads(name: str, tmp_path: Any) -> None:
    """save_pretrained, then from_pretrained at stage 3: every parameter and buffer, the
    non-persistent ones and those save_pretrained leaves out included, is the eager model's;
    and no warning of missing tensors where transformers reports none."""
    eager = _eager(name)
    folder = os.path.join(str(tmp_path), name)
    with zoo.quiet():
        eager.save_pretrained(folder)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = from_pretrained(folder, CFG, model_class=type(eager))
    try:
        with engine.gathered():
            got = _values(engine.module)
    finally:
        engine.close()
    assert not [str(w.message) for w in caught if "from_pretrained" in str(w.message)]
    want = _values(eager)
    assert got.keys() == want.keys()
    differ = [k for k in want if not torch.equal(got[k], want[k])]
    assert not differ, f"{name}: {differ[:5]}"


def test_a_spanning_init_that_reads_another_units_values_is_refused_in_one_line() -> None:
    """A container's init that reads (not just the shape of) a parameter of another unit cannot
    run unit by unit: one line naming the module and the fix, not torch's meta-tensor error."""
    class Root(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x)).sum()

    def init(module: nn.Module) -> None:
        if isinstance(module, Root):
            module.b.weight.copy_(module.a.weight * 2)

    with torch.device("meta"):
        model = Root()
    with pytest.raises(RuntimeError, match=r"^initialize: the initialization of '<root>' \(Root\) raised .*; its "
                                           r"parameters span several stage-3 units .*: name the module in "
                                           r"stage3.unit_modules to make it one unit, or pass weights=$") as info:
        zero_offload.initialize(model, {**CFG, "stage3": {"unit_modules": ["Linear"]}}, init_fn=init)
    assert "\n" not in str(info.value)


class _Lacking:
    """A WeightSource of our own that lets what it lacks be initialized (init_missing)."""

    init_missing = True

    def __init__(self, stored: dict[str, torch.Tensor]) -> None:
        self.stored, self.where = stored, "my source"

    def names(self) -> Any:
        return self.stored.keys()

    def read(self, name: str) -> torch.Tensor:
        return self.stored[name]


def test_what_a_source_lacks_is_initialized_and_what_it_holds_is_kept() -> None:
    """A Linear whose weight the source lacks: its reset_parameters draws the weight and writes
    its bias too; the bias the source holds is put back (read again)."""
    stored = {"0.bias": torch.arange(4.0), "1.weight": torch.ones(2, 4), "1.bias": torch.zeros(2)}
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    engine = zero_offload.initialize(model, {**CFG, "stage3": {"unit_modules": ["Linear"]}}, weights=_Lacking(stored))
    state = engine.consolidated_state_dict()
    engine.close()
    for k, v in stored.items():
        assert torch.equal(state[k], v), k
    assert state["0.weight"].std() > 0 and not torch.isnan(state["0.weight"]).any()


def test_from_pretrained_keeps_a_loaded_bias_beside_a_missing_weight(tmp_path: Any) -> None:
    """transformers' _init_weights zeroes a Linear's bias when it draws its weight; the loaded
    bias is marked loaded (_is_hf_initialized) for the call and stays as stored."""
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    eager = T.LlamaForCausalLM(T.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=4, num_key_value_heads=2, attention_bias=True))
    folder = os.path.join(str(tmp_path), "llama")
    eager.save_pretrained(folder)
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    del tensors["model.layers.0.self_attn.q_proj.weight"]
    bias = "model.layers.0.self_attn.q_proj.bias"
    tensors[bias] = torch.arange(32.0)  # not the zeros _init_weights writes
    save_file(tensors, path)
    with pytest.warns(UserWarning, match="1 tensors of LlamaForCausalLM are not in"):
        engine = from_pretrained(folder, CFG)
    state = engine.consolidated_state_dict()
    engine.close()
    assert torch.equal(state[bias], tensors[bias])
    assert 0.01 < float(state["model.layers.0.self_attn.q_proj.weight"].std()) < 0.03


def _load_lacking_on_rank(rank: int, world: int, folder: str, out: str) -> None:
    torch.manual_seed(rank)  # each rank would draw its own values
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = from_pretrained(folder, CFG)
    with engine.gathered():
        value = engine.module.model.layers[0].mlp.up_proj.weight.detach().clone()
    engine.close()
    torch.save(value, os.path.join(out, f"rank{rank}.pt"))


def test_a_tensor_the_folder_lacks_is_rank_0s_on_every_rank(tmp_path: Any) -> None:
    """Initialized at random on each rank, a missing tensor would be a mix of the ranks' draws
    (each keeps its own shard): the unit that drew it is broadcast from rank 0, as a meta model's
    init is (before, only without weights), so two ranks hold what one process seeded as rank 0 draws."""
    from _dist import run_ranks
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    eager = T.LlamaForCausalLM(T.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=4, num_key_value_heads=2))
    folder = os.path.join(str(tmp_path), "llama")
    eager.save_pretrained(folder)
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    del tensors["model.layers.0.mlp.up_proj.weight"]
    save_file(tensors, path)
    _load_lacking_on_rank(0, 1, folder, str(tmp_path))
    alone = torch.load(os.path.join(str(tmp_path), "rank0.pt"))
    run_ranks(_load_lacking_on_rank, 2, folder=folder, out=str(tmp_path))
    first, second = (torch.load(os.path.join(str(tmp_path), f"rank{r}.pt")) for r in range(2))
    assert torch.equal(first, alone) and torch.equal(second, alone) and alone.std() > 0


def test_zero_offload_trainer_takes_a_meta_model_initialized_as_eager(tmp_path: Any) -> None:
    """The issue's other door: a meta model given to ZeroOffloadTrainer (no weights) trained
    from zero norms too."""
    from _hf import Tokens, training_args
    from zero_offload.hf import ZeroOffloadTrainer

    model = _on_meta("llama")
    with zoo.quiet():
        trainer = ZeroOffloadTrainer(model=model, args=training_args(str(tmp_path), max_steps=1),
                                     train_dataset=Tokens(4), zero_offload_config=CFG)
    try:
        with trainer.engine.gathered():
            assert torch.equal(model.model.norm.weight.detach(), torch.ones(32))
            assert 0.015 < float(model.model.layers[0].mlp.up_proj.weight.detach().std()) < 0.025
    finally:
        trainer.engine.close()


def _lora_on_meta() -> nn.Module:
    peft = pytest.importorskip("peft")
    with torch.device("meta"), zoo.quiet():
        return peft.get_peft_model(ZOO["llama"](), peft.LoraConfig(r=4, target_modules=["q_proj"]))


def test_an_adapter_added_to_a_meta_model_is_refused_unless_init_fn_initializes_it() -> None:
    """PEFT's LoRA layers, added after the Llama was built on the meta device, took the Llama's
    _init_weights: LoRA's B started at normal(0, 0.02), not at zero as in an eager build."""
    with pytest.raises(ValueError, match=r"^initialize: module 'base_model\.model\.model\.layers\.0\.self_attn\.q_proj"
                                         r"\.base_layer' \(Linear\) \(and \d+ more\) of the meta-device model is not one "
                                         r"its transformers model builds from its config \(added after construction"):
        zero_offload.initialize(_lora_on_meta(), CFG)

    def init(module: nn.Module) -> None:  # the adapters' own init: B (r = 4 inputs) at zero, A keeps its reset_parameters
        if isinstance(module, nn.Linear) and module.in_features == 4:
            nn.init.zeros_(module.weight)
    model = _lora_on_meta()
    engine = zero_offload.initialize(model, CFG, init_fn=init)
    state = engine.consolidated_state_dict()
    engine.close()
    b = [k for k in state if "lora_B" in k]
    assert b and all(torch.equal(state[k], torch.zeros_like(state[k])) for k in b)
    assert all(state[k].std() > 0 for k in state if "lora_A" in k)
    assert torch.equal(state["base_model.model.model.norm.weight"], torch.ones(32))  # the rest: the model's init


@pytest.mark.parametrize("name", ["gemma3", "swinv2", "falcon_h1"])
def test_weights_given_a_folder_compute_the_buffers_it_does_not_hold(name: str, tmp_path: Any) -> None:
    """initialize(meta_model, weights=folder) without from_pretrained: the non-persistent buffers
    (not in the folder) come from the model's _init_weights; they were "cannot be rebuilt"."""
    eager = _eager(name)
    folder = os.path.join(str(tmp_path), name)
    with zoo.quiet():
        eager.save_pretrained(folder)
    model = _on_meta(name)
    engine = zero_offload.initialize(model, CFG, weights=folder)
    try:
        with engine.gathered():
            got = _values(model)
    finally:
        engine.close()
    want = _values(eager)
    assert not [k for k in want if not torch.equal(got[k], want[k])]
