"""Stage 3's default unit choice (engine/stage3/policy.py) on the models people bring: one unit per
block of a layer stack, wrappers (PEFT) descended through, an MoE layer's per-expert modules kept
in one unit (so ranks that route their tokens to different experts gather the same units), the
report of a unit whose root never runs, and stage3.leaf_modules (DeepSpeed's leaf_module.classes)."""
from __future__ import annotations

import warnings

import re
from typing import Callable

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import zero_offload
from _dist import run_ranks
from _stage3_model import max_rel_err
from zero_offload.config import Config, ConfigError, Stage3Config
from zero_offload.engine.stage3.policy import plan_units

CPU_TIERS = {"params": "cpu", "optimizer": "cpu", "grads": "cpu"}


# ---- Hugging Face models (tiny, random) ----

def _llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=128))


def _peft_llama(task: str | None = None) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = _llama()
    torch.manual_seed(1)
    return get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                            **({"task_type": task} if task else {})))


def _t5() -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    return T5ForConditionalGeneration(T5Config(d_model=32, d_ff=64, d_kv=8, num_layers=2, num_decoder_layers=2,
                                               num_heads=4, vocab_size=128, decoder_start_token_id=0, pad_token_id=0))


def _vit() -> nn.Module:
    from transformers import ViTConfig, ViTForImageClassification

    return ViTForImageClassification(ViTConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                               num_attention_heads=4, image_size=16, patch_size=4, num_labels=3))


def _bert() -> nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    return BertForMaskedLM(BertConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      vocab_size=128, max_position_embeddings=32))


def _mixtral() -> nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    return MixtralForCausalLM(MixtralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                            num_local_experts=4, num_experts_per_tok=2))


def _switch() -> nn.Module:
    """SwitchTransformers keeps one module per expert (SwitchTransformersExperts, a ModuleDict with
    a forward that calls only the experts its router chose), unlike Mixtral's fused 3-D tensors."""
    from transformers import SwitchTransformersConfig, SwitchTransformersForConditionalGeneration

    return SwitchTransformersForConditionalGeneration(SwitchTransformersConfig(
        d_model=32, d_ff=64, d_kv=8, num_layers=2, num_decoder_layers=2, num_heads=4, num_experts=4, vocab_size=128,
        encoder_sparse_step=1, decoder_sparse_step=1, expert_capacity=64, router_jitter_noise=0.0, dropout_rate=0.0,
        decoder_start_token_id=0, pad_token_id=0))


def _nllb_moe() -> nn.Module:
    from transformers import NllbMoeConfig, NllbMoeForConditionalGeneration

    return NllbMoeForConditionalGeneration(NllbMoeConfig(
        d_model=32, encoder_ffn_dim=64, decoder_ffn_dim=64, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, num_experts=4, vocab_size=128,
        max_position_embeddings=64, encoder_sparse_step=1, decoder_sparse_step=1, expert_capacity=64,
        dropout=0.0, attention_dropout=0.0, moe_token_dropout=0.0, encoder_layerdrop=0.0, decoder_layerdrop=0.0))


_LLAMA = ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm", "lm_head"]
_PEFT = ["base_model.model." + n for n in _LLAMA]
_ENC_DEC = ["shared", "encoder.block.0", "encoder.block.1", "encoder.final_layer_norm", "decoder.block.0",
            "decoder.block.1", "decoder.final_layer_norm"]  # the LM head is tied to `shared`: its user
# model -> (units with the default config, the units that hold experts: reduced once their inputs'
# gradient is complete). The old rule took the largest subtrees under unit_bytes: ['model',
# 'lm_head'] for Llama, the never-running LoraModel ['base_model'] for PEFT, ['vit', 'classifier']...
_EXPECTED: dict[str, tuple[Callable[[], nn.Module], list[str], list[str]]] = {
    "llama": (_llama, _LLAMA, []),
    "peft": (_peft_llama, _PEFT, []),
    "peft-causal-lm": (lambda: _peft_llama("CAUSAL_LM"), _PEFT, []),
    "t5": (_t5, _ENC_DEC, []),
    "vit": (_vit, ["vit.embeddings", "vit.layers.0", "vit.layers.1", "vit.layernorm", "classifier"], []),
    "bert": (_bert, ["bert.embeddings", "bert.encoder.layer.0", "bert.encoder.layer.1", "cls.predictions"], []),
    "mixtral": (_mixtral, _LLAMA, []),  # fused experts: one module, nothing routed between modules
    "switch": (_switch, _ENC_DEC, ["encoder.block.0", "encoder.block.1", "decoder.block.0", "decoder.block.1"]),
    "nllb-moe": (_nllb_moe, ["model.shared", "model.encoder.layers.0", "model.encoder.layers.1",
                             "model.encoder.layer_norm", "model.decoder.layers.0", "model.decoder.layers.1",
                             "model.decoder.layer_norm"],
                 ["model.encoder.layers.0", "model.encoder.layers.1", "model.decoder.layers.0",
                  "model.decoder.layers.1"]),
}


@pytest.mark.parametrize("name", list(_EXPECTED))
def test_default_units_are_the_blocks_of_each_layer_stack(name: str) -> None:
    make, units, routed = _EXPECTED[name]
    torch.manual_seed(0)
    plan = plan_units(make(), Stage3Config(), 4)
    assert [u.name for u in plan.units] == units
    assert [u.name for i, u in enumerate(plan.units) if i in plan.routed] == routed


def test_an_moe_layer_larger_than_unit_bytes_stays_one_unit() -> None:
    """Below a block, the module that owns the experts is one unit whatever its size: split by
    size, the old rule made a unit of each expert (and of the router)."""
    torch.manual_seed(0)
    plan = plan_units(_switch(), Stage3Config(unit_bytes=4096), 4)
    names = [u.name for u in plan.units]
    assert "encoder.block.0.layer.1.mlp" in names and "encoder.block.0.layer.0.SelfAttention.q" in names
    assert not [n for n in names if ".experts" in n or ".router" in n]
    ff = {"encoder": 1, "decoder": 2}  # the index of the feed-forward layer in a block
    assert [u.name for i, u in enumerate(plan.units) if i in plan.routed] == [
        f"{part}.block.{b}.layer.{ff[part]}.mlp" for part in ("encoder", "decoder") for b in (0, 1)]


def test_peft_lora_llama_with_the_default_units_trains_like_adamw() -> None:
    """get_peft_model's PeftModel calls the model inside its LoraModel directly: the one unit the
    old rule chose (base_model, the LoraModel) was never gathered, and the embedding read its
    empty weight ("RuntimeError: 'weight' must be 2-D")."""
    ids = [torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(s)) for s in range(3)]
    ref = _peft_llama()
    trainable = {n for n, p in ref.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    for x in ids:
        ref(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    start = {k: v.clone() for k, v in _peft_llama().state_dict().items()}
    engine = zero_offload.initialize(_peft_llama(), {"stage": 3, "tiers": CPU_TIERS, "optimizer": {"lr": 1e-2}})
    assert [u.name for u in engine.runtime.units] == _PEFT
    for x in ids:
        engine.backward(engine(input_ids=x, labels=x).loss)
        engine.step()
    got = engine.consolidated_state_dict()
    engine.close()
    want = {k: v.detach() for k, v in ref.state_dict().items()}
    worst, err = max_rel_err(got, want)
    assert err <= 1e-5, (worst, err)
    moved = {k for k in want if not torch.equal(want[k], start[k])}
    assert moved and all("lora_" in k for k in moved)  # only the adapters trained (lora_B starts at 0)


# ---- a unit whose root never runs ----

class _Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


class _Wrapper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = _Inner()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


class _CallsPast(nn.Module):
    """Calls its child's child directly, past the child's forward (as PeftModel does)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.wrapper, self.head = _Wrapper(), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.wrapper.inner(x)).pow(2).mean()


def _engine(model: nn.Module, **stage3: object) -> object:
    return zero_offload.initialize(model, {"stage": 3, "tiers": CPU_TIERS, "stage3": stage3})


def test_a_unit_whose_root_never_runs_is_gathered_around_the_modules_that_run() -> None:
    """The wrapper's unit was never gathered and fc read its empty weight: torch failed inside
    F.linear; then the first forward stopped there in one line. Now the module that runs gathers
    the unit around its own calls, says so once in one line (naming the units that would gather
    less often), and trains as torch does; the units the line names, and the default choice
    (which descends through the wrapper), train too."""
    ref = _CallsPast()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.01)
    xs = [torch.randn(3, 8, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    for x in xs:
        ref(x).backward()
        opt.step()
        opt.zero_grad()
    for stage3, units in (({"unit_modules": ["_Wrapper"]}, ["<root>", "wrapper"]),
                          ({"unit_modules": ["_Inner"]}, ["<root>", "wrapper.inner"]),
                          ({}, ["wrapper.inner.fc", "head"])):
        engine = _engine(_CallsPast(), **stage3)
        assert [u.name for u in engine.runtime.units] == units
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for x in xs:
                engine.backward(engine(x))
                assert engine.step()
        said = [str(w.message) for w in caught if "stage 3:" in str(w.message)]
        if stage3.get("unit_modules") == ["_Wrapper"]:
            assert len(said) == 1 and "\n" not in said[0]
            assert said[0].startswith("stage 3: 'wrapper.inner.fc' (Linear) ran while its unit 'wrapper' was not "
                                      "gathered") and "stage3.unit_modules=['_Inner']" in said[0]
        else:
            assert said == []
        got = engine.consolidated_state_dict()
        engine.close()
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-7, msg=k)


# ---- mixture of experts, one module per expert, top-1 routing, at D = 2 ----

D, E = 16, 4


class _Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class _MoE(nn.Module):
    """Top-1: each token goes to the expert of its highest router logit, scaled by that
    probability; an expert no token reached is not called. So that a test says which expert is
    idle on which rank: `banned` experts get no token, and with `spread` the first tokens go one
    to each other expert. `counts` records the tokens per expert, per call."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(D, E)
        self.experts = nn.ModuleList(_Expert() for _ in range(E))
        self.banned: tuple[int, ...] = ()
        self.spread = False
        self.counts: list[list[int]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, D)
        logits = self.router(flat)
        allowed = [e for e in range(E) if e not in self.banned]
        if self.banned:
            mask = torch.ones(E, dtype=torch.bool)
            mask[allowed] = False
            logits = logits.masked_fill(mask, float("-inf"))
        probs = F.softmax(logits, dim=-1)
        choice = probs.argmax(dim=-1)
        if self.spread:
            choice[:len(allowed)] = torch.tensor(allowed)
        weight = probs.gather(1, choice[:, None])
        out = torch.zeros_like(flat)
        self.counts.append([int((choice == e).sum()) for e in range(E)])
        for e, expert in enumerate(self.experts):
            rows = (choice == e).nonzero().flatten()
            if len(rows):
                out = out.index_add(0, rows, expert(flat[rows]) * weight[rows])
        return out.reshape(x.shape)


class _MoEBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln, self.moe = nn.LayerNorm(D), _MoE()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.moe(self.ln(x))


class _MoENet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(D, D)
        self.blocks = nn.ModuleList(_MoEBlock() for _ in range(2))
        self.head = nn.Linear(D, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h).pow(2).mean()

    def ban(self, rank: int) -> None:
        """Rank 0 sends no token to expert 3 of block 0, rank 1 some to every expert of block 0
        (so that block's parameters all get a gradient on rank 1 only); no rank sends one to
        expert 2 of block 1."""
        first, second = self.blocks[0].moe, self.blocks[1].moe
        first.banned, first.spread = ((3,), False) if rank == 0 else ((), True)
        second.banned, second.spread = (2,), rank == 1


STEPS, ROWS = 3, 16


def _moe_batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(ROWS, D, generator=torch.Generator().manual_seed(100 * step + rank))


def _moe_reference(world: int) -> tuple[dict[str, torch.Tensor], set[str]]:
    """torch.optim.AdamW on the whole batch (the mean of the ranks' losses, each with its own
    routing), and the parameters that got a gradient in some steps only: Adam steps those with a
    zero gradient in the engine (no gradient at all is the same as torch with weight_decay 0)."""
    ref = _MoENet()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)
    seen: dict[str, list[bool]] = {n: [] for n, _ in ref.named_parameters()}
    for step in range(STEPS):
        loss = 0.0
        for rank in range(world):
            ref.ban(rank)
            loss = loss + ref(_moe_batch(step, rank)) / world
        loss.backward()
        for n, p in ref.named_parameters():
            seen[n].append(p.grad is not None)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {k: v.detach() for k, v in ref.state_dict().items()}, {n for n, s in seen.items() if len(set(s)) > 1}


def _train_moe(rank: int, world: int, stage3: dict) -> tuple[object, _MoENet]:
    model = _MoENet()
    engine = zero_offload.initialize(model, {"stage": 3, "tiers": CPU_TIERS, "stage3": stage3,
                                             "optimizer": {"lr": 1e-2, "weight_decay": 0.0}})
    model.ban(rank)
    for step in range(STEPS):
        engine.backward(engine(_moe_batch(step, rank)))
        engine.step()
    return engine, model


def _moe_default_units(rank: int, world: int) -> None:
    want, intermittent = _moe_reference(world)
    expert = sum(p.numel() for p in _Expert().parameters()) * 4
    for stage3, units in (({}, ["inp", "blocks.0", "blocks.1", "head"]),
                          ({"unit_bytes": expert}, ["inp", "blocks.0.ln", "blocks.0.moe", "blocks.1.ln", "blocks.1.moe",
                                                    "head"])):  # too small for a block: the MoE layer, whole
        engine, model = _train_moe(rank, world, stage3)
        names = [u.name for u in engine.runtime.units]
        got = engine.runtime.consolidated_state_dict()  # every rank's (a collective): before any assertion
        engine.close()
        assert names == units
        counts = [torch.tensor(b.moe.counts).amin(0).tolist() for b in model.blocks]  # each expert's fewest
        assert counts[0][3] == 0 if rank == 0 else min(counts[0]) > 0, counts  # routed apart: idle on rank 0 only
        assert counts[1][2] == 0 and (rank == 0 or min(counts[1][:2] + counts[1][3:]) > 0), counts
        assert "blocks.0.moe.experts.3.fc1.weight" not in intermittent  # it gets rank 1's gradient every step
        worst, err = max_rel_err({k: v for k, v in got.items() if k not in intermittent},
                                 {k: v for k, v in want.items() if k not in intermittent})
        assert err <= 1e-5, (stage3, worst, err)


def test_moe_with_an_expert_idle_on_one_rank_trains_like_adamw_with_the_default_units() -> None:
    """Top-1 routing sends each rank's tokens to different experts, and an expert reached on one
    rank only: per-expert units (the old rule, with a block larger than unit_bytes) made ranks
    gather different units ("ranks gather different units next"), and a block unit was reduced
    when its last expert reported on one rank and after backward on the other ("ranks reduce
    different units next")."""
    run_ranks(_moe_default_units, 2, timeout=150)


def _moe_per_expert_units(rank: int, world: int) -> None:
    model = _MoENet()
    engine = zero_offload.initialize(model, {"stage": 3, "tiers": CPU_TIERS, "stage3": {"unit_modules": ["_Expert"]}})
    model.ban(rank)
    try:
        with pytest.raises(RuntimeError) as err:
            engine.backward(engine(_moe_batch(0, rank)))
    finally:
        engine.close()
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("stage 3: ranks gather different units next"), msg
    # rank 0 skips expert 3 of block 0 (no token) for block 1's expert 0, rank 1 runs it
    assert msg.endswith("; both are items of 'blocks.0.moe.experts' and 'blocks.1.moe.experts': if a router picks "
                        "them by token (experts), make the module holding them one unit: "
                        "stage3.leaf_modules=['_MoE']"), msg
    want, intermittent = _moe_reference(world)
    engine, _ = _train_moe(rank, world, {"unit_modules": ["_Expert"], "leaf_modules": ["_MoE"]})  # the fix it names
    names = [u.name for u in engine.runtime.units]
    got = engine.runtime.consolidated_state_dict()
    engine.close()
    assert names == ["<root>", "blocks.0.moe", "blocks.1.moe"]
    worst, err = max_rel_err({k: v for k, v in got.items() if k not in intermittent},
                             {k: v for k, v in want.items() if k not in intermittent})
    assert err <= 1e-5, (worst, err)


def test_per_expert_units_are_refused_naming_leaf_modules_which_fixes_them() -> None:
    run_ranks(_moe_per_expert_units, 2, timeout=150)


def _nllb_moe_ranks(rank: int, world: int) -> None:
    """NLLB-MoE (one module per expert, top-2 routing with a capacity) at D = 2 with the default
    units: each rank's tokens take their own experts. It must train and match AdamW on every
    parameter whose gradient comes in every step or in none (see _moe_reference)."""
    def batch(step: int, r: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(10 * step + r)
        return {"input_ids": torch.randint(3, 128, (2, 8), generator=g),
                "labels": torch.randint(3, 128, (2, 6), generator=g)}
    def make() -> nn.Module:
        torch.manual_seed(0)
        model = _nllb_moe()
        # A key bias's true gradient is exactly zero (softmax ignores a shift): Adam would amplify
        # its rounding noise, which differs between two correct summation orders (_engine_model.py).
        for n, p in model.named_parameters():
            p.requires_grad_(not n.endswith("k_proj.bias"))
        return model
    ref = make()
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.0)
    seen: dict[str, set[bool]] = {n: set() for n, _ in ref.named_parameters()}
    for step in range(STEPS):
        (sum(ref(**batch(step, r)).loss for r in range(world)) / world).backward()
        for n, p in ref.named_parameters():
            seen[n].add(p.grad is not None)
        opt.step()
        opt.zero_grad(set_to_none=True)
    engine = zero_offload.initialize(make(), {"stage": 3, "tiers": CPU_TIERS,
                                              "optimizer": {"lr": 1e-2, "weight_decay": 0.0}})
    names = [u.name for u in engine.runtime.units]
    for step in range(STEPS):
        engine.backward(engine(**batch(step, rank)).loss)
        engine.step()
    got = engine.runtime.consolidated_state_dict()
    engine.close()
    assert names == _EXPECTED["nllb-moe"][1]
    want = {k: v.detach() for k, v in ref.state_dict().items() if len(seen.get(k, ())) < 2}
    assert any(".experts." in k for k in want)
    worst, err = max_rel_err({k: got[k] for k in want}, want)
    # Routers' gradients are tiny where an expert is far from chosen, and Adam's step is about
    # lr x their sign: the summation order's rounding shows at 1e-4 there (1e-6 elsewhere).
    assert err <= 1e-3, (worst, err)


def test_nllb_moe_trains_at_d2_with_the_default_units() -> None:
    run_ranks(_nllb_moe_ranks, 2, timeout=200)


# ---- stage3.leaf_modules: the config field and DeepSpeed's leaf_module.classes ----

def test_leaf_modules_keep_a_whole_subtree_in_one_unit_and_are_checked() -> None:
    model = _MoENet()
    plan = plan_units(model, Stage3Config(leaf_modules=("_MoEBlock",), unit_bytes=64), 4)
    assert [u.name for u in plan.units] == ["inp", "blocks.0", "blocks.1", "head"]
    with pytest.raises(ConfigError, match="'stage3.leaf_modules' names class '_Moe', but the model has no module"):
        plan_units(model, Stage3Config(leaf_modules=("_Moe",)), 4)
    with pytest.raises(ConfigError, match="'stage3.leaf_modules' names class 'ModuleList', a container whose forward"):
        plan_units(model, Stage3Config(leaf_modules=("ModuleList",)), 4)
    with pytest.raises(ConfigError, match="'stage3.leaf_modules' = 'MoE' is invalid: expected a list of module class"):
        Config(stage=3, stage3={"leaf_modules": "MoE"})


def test_deepspeed_leaf_module_classes_map_to_leaf_modules() -> None:
    ds = {"zero_optimization": {"stage": 3, "leaf_module": {
        "classes": ["transformers.models.switch_transformers.modeling_switch_transformers."
                    "SwitchTransformersSparseMLP", "MoE"]}}}
    assert Config.from_deepspeed(ds).stage3.leaf_modules == ("SwitchTransformersSparseMLP", "MoE")
    assert Config.from_deepspeed({"zero_optimization": {"stage": 3, "leaf_module": {"classes": "MoE"}}}
                                 ).stage3.leaf_modules == ("MoE",)
    for zero, error in (({"stage": 2, "leaf_module": {"classes": ["MoE"]}},
                         "zero_optimization.leaf_module.classes apply only to stage 3"),
                        ({"stage": 3, "leaf_module": {"classes": ["MoE"], "names": ["model.layers.0.mlp"]}},
                         "not supported by zero_offload: zero_optimization.leaf_module.names"),
                        ({"stage": 3, "leaf_module": {"classes": [3]}},
                         "'zero_optimization.leaf_module.classes' = [3] is invalid: expected a list of module")):
        with pytest.raises(ConfigError, match=re.escape(error)):
            Config.from_deepspeed({"zero_optimization": zero})
