"""Stage 3 where the autograd graph crosses units, against torch.optim.AdamW (fp32, 1e-5 relative).

- A parameter read outside the forward of the module that registers it: a GPT whose head is
  `F.linear(x, self.wte.weight)` in the root's forward, with size-chosen units (a DeepSpeed config,
  as imported), so the embedding is a unit of its own. It failed in forward with torch's "size
  mismatch ... vec (0)". Now the recording passes find the read (hooks.ReadWatch), gather the
  unit with the module reading it, in forward and in its backward, at D = 1 and D = 2. Also a
  module returning its own weight, and PEFT's DoRA layer, which reads its adapters' weights.
- A tensor passed through several units: T5's (and Switch Transformers') position bias is made by
  the first block and returned by every later one. Block units failed at the first backward with
  "unit ... is needed for backward again after its gradients were reduced" (the passed-through
  output's node is the first block's, whose gradient comes last).
- A root returning, beside its loss, what its inner units computed (CLIPModel's pooled outputs):
  that output's gradient comes after the root's own parameter (logit_scale) reported, and was
  refused as "unit '<root>' is needed for backward again"; its gradient reaches none of them.
- A reversible layer (Reformer's) that runs its modules again in a backward method of its own:
  one line names the units that work (torch failed inside layer_norm), and they train.
- Gradient checkpointing on a tiny Llama and T5, reentrant and not.
"""
from __future__ import annotations

import copy
import warnings
from typing import Any, Callable

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from _dist import run_ranks
from _stage3_model import max_rel_err

LR, WD, STEPS = 1e-2, 0.01, 5
VOCAB, SEQ, DIM = 64, 8, 16
CPU = {"params": "cpu", "optimizer": "cpu", "grads": "cpu"}
BLOCK_ELEMENTS = 2 * DIM + 2 * 4 * DIM * DIM + 5 * DIM  # one MLPBlock: a unit by size; the model is larger


class MLPBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln, self.fc, self.out = nn.LayerNorm(DIM), nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out(F.gelu(self.fc(self.ln(x))))


class PositionTable(nn.Module):
    """Returns its weight (a parameter as a module's output: its reader must gather it)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(SEQ, DIM) * 0.1)

    def forward(self) -> torch.Tensor:
        return self.weight


class FunctionalHeadGPT(nn.Module):
    """The peer benchmark's GPT (shared/peer/ds_e2e.py) without attention (see _stage3_model.py):
    the head ties the embedding by reading its weight in the root's forward; `head` runs it as
    is or under a (reentrant) checkpoint. The position table returns its weight. `watched` notes,
    per forward, whether the engine's read watch was on."""

    def __init__(self, head: str = "plain") -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, DIM), PositionTable()
        self.blocks = nn.ModuleList(MLPBlock() for _ in range(2))
        self.ln_f = nn.LayerNorm(DIM)
        self.head = head
        self.watched: list[bool] = []

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.ln_f(x), self.wte.weight)  # tied head

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        mode = torch.overrides._get_current_function_mode()
        self.watched.append(type(mode).__name__ == "ReadWatch")
        # Hugging Face's `self.dtype`: metadata of a released unit, no read of its weights.
        assert next(p.dtype for p in self.blocks[-1].parameters() if p.is_floating_point()) == torch.float32
        x = self.wte(idx) + self.wpe()[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        if self.head == "plain":
            logits = self.logits(x)
        else:
            logits = checkpoint(self.logits, x, use_reentrant=self.head == "reentrant")
        return F.cross_entropy(logits.view(-1, VOCAB), targets.reshape(-1))


def gpt_batch(step: int, rows: int) -> dict[str, torch.Tensor]:
    data = torch.randint(0, VOCAB, (rows, SEQ + 1), generator=torch.Generator().manual_seed(step))
    return {"idx": data[:, :-1], "targets": data[:, 1:]}


def deepspeed_config(bucket_elements: int, rows: int) -> dict[str, Any]:
    """A DeepSpeed ZeRO-3 config as users bring it: no unit_modules; the prefetch bucket size
    (our unit_bytes) puts the embedding in a unit of its own."""
    return {"train_micro_batch_size_per_gpu": rows, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
            "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                                  "offload_optimizer": {"device": "cpu"},
                                  "stage3_prefetch_bucket_size": bucket_elements}}


def adamw_reference(model: nn.Module, batches: list[dict[str, torch.Tensor]],
                    loss_of: Callable[[Any], torch.Tensor]) -> tuple[list[float], dict[str, torch.Tensor]]:
    """torch.optim.AdamW on the whole batch (a parameter that got no gradient is not stepped, as
    the engine does not step it)."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=WD)
    losses = []
    for b in batches:
        loss = loss_of(model(**b))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def train_engine(engine: Any, batches: list[dict[str, torch.Tensor]], loss_of: Callable[[Any], torch.Tensor],
                 rank: int = 0, world: int = 1) -> list[float]:
    """This rank's rows of each batch; returns the global mean losses."""
    from zero_offload import comm

    losses = []
    for b in batches:
        part = {k: v.chunk(world)[rank] for k, v in b.items()}
        loss = loss_of(engine(**part))
        engine.backward(loss)
        engine.step()
        losses.append(float(comm.all_reduce_(loss.detach().reshape(1).clone())[0]) / world)
    return losses


def check_matches(losses: list[float], weights: dict[str, torch.Tensor], want_losses: list[float],
                  want: dict[str, torch.Tensor], tag: str) -> None:
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, want_losses))
    worst, err = max_rel_err(weights, want)
    assert loss_err <= 1e-5 and err <= 1e-5, f"{tag}: loss rel err {loss_err:.2e}, {worst} rel err {err:.2e}"


def _functional_head(rank: int, world: int, head: str = "plain", frozen: bool = False) -> None:
    import zero_offload

    rows = 4
    torch.manual_seed(0)
    model = FunctionalHeadGPT(head)
    model.wte.weight.requires_grad_(not frozen)
    ref = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the DeepSpeed keys that do nothing here are named in a warning
        engine = zero_offload.initialize(model, deepspeed_config(BLOCK_ELEMENTS, rows))
    rt = engine.runtime
    assert "wte" in [u.name for u in rt.units] and "blocks.0" in [u.name for u in rt.units]
    batches = [gpt_batch(s, rows * world) for s in range(STEPS)]
    losses = train_engine(engine, batches, lambda loss: loss, rank, world)
    weights, stats = rt.consolidated_state_dict(), rt.stats()  # every rank: the full weights
    engine.close()
    want_losses, want = adamw_reference(ref, batches, lambda loss: loss)
    check_matches(losses, weights, want_losses, want, f"D={world}")
    # Both reads are recorded against the model's forward, the innermost call in progress.
    assert sorted(u.name for u in rt.units_of(model)) == ["wpe", "wte"], rt.units_of(model)
    # The first pass finds the reads, the second records the order with them acquired at the
    # model's entry (both watched); later passes follow that record, unwatched, prefetching.
    assert model.watched == [True, True] + [False] * (STEPS - 2), model.watched
    assert stats["rerecorded_passes"] == 0 and stats["read_elsewhere"] == 2, stats


def test_head_reading_the_embedding_weight_trains_like_adamw_at_d2() -> None:
    run_ranks(_functional_head, 2, timeout=150)


@pytest.mark.parametrize("head,frozen", [("plain", False), ("plain", True), ("checkpoint", False)])
def test_head_reading_the_embedding_weight_trains_like_adamw(head: str, frozen: bool) -> None:
    """Also with the embedding frozen (its unit then waits for the end of backward), and with the
    head under a checkpoint, where backward reads the weight again when it recomputes."""
    _functional_head(0, 1, head, frozen)


def test_a_unit_held_across_the_forward_does_not_hide_the_last_block_from_the_lookahead() -> None:
    """The tied embedding stays gathered from the model's entry to its head, and the head reads
    it after the last block: the lookahead window counted that held unit, released the last block
    at the end of forward and fetched it again first thing in backward (12.6 MB per step on the
    peer's GPT, the default units' only extra read beside unit_modules). Kept now: once per step.
    So is the block before it (blocks.0 of two): the final norm's unit, 1/67 of a block, came
    between them and the backward and took the window's second place, where the root holding it
    (unit_modules) took none; a unit under 1/16 of the one released no longer counts."""
    import zero_offload

    torch.manual_seed(0)
    model = FunctionalHeadGPT()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = zero_offload.initialize(model, deepspeed_config(BLOCK_ELEMENTS, 4))
    rt = engine.runtime
    batches = [gpt_batch(s, 4) for s in range(STEPS)]
    train_engine(engine, batches[:3], lambda loss: loss)  # recording passes, then one that follows
    before = list(rt.prefetcher.fetches)
    train_engine(engine, batches[3:], lambda loss: loss)
    per_unit = {u.name: (rt.prefetcher.fetches[u.index] - before[u.index]) / (STEPS - 3) for u in rt.units}
    engine.close()
    assert per_unit["blocks.1"] == 1 and per_unit["blocks.0"] == 1, per_unit


def test_the_embedding_read_inside_a_reentrant_checkpoint_and_outside_it_is_the_known_clear_error() -> None:
    """A reentrant checkpoint's backward is an autograd pass of its own: the weight's gradient is
    reported from the head alone, then again from the embedding (as for any module used inside
    and outside one; tests/test_stage3_units.py)."""
    with pytest.raises(RuntimeError, match="unit 'wte' is needed for backward again .* use use_reentrant=False"):
        _functional_head(0, 1, "reentrant")


class _ReadInsideBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.table = nn.Embedding(VOCAB, DIM), ReadsTable()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.table(self.emb(idx), self.emb.weight).pow(2).mean()


class ReadsTable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        return self.proj(x) @ table.t()


def test_a_read_that_does_not_fit_the_budget_names_the_parameter_the_reader_and_the_fix() -> None:
    """The embedding is read inside another unit's forward, and both do not fit the budget."""
    import zero_offload

    model = _ReadInsideBlock()
    budget = VOCAB * DIM * 4  # the embedding's unit alone, or any other one
    engine = zero_offload.initialize(model, {"stage": 3, "tiers": CPU, "stage3": {
        "unit_modules": ["Embedding", "ReadsTable"], "live_budget_bytes": budget}})
    with pytest.raises(RuntimeError, match=r"^stage 3: parameter 'emb.weight' \(unit 'emb'\) is read in the forward "
                                           r"of module 'table', outside its unit's module, .* raise the budget.*"
                                           r"stage3.unit_modules$"):
        engine(torch.randint(0, VOCAB, (2, SEQ)))
    engine.close()


class _PassThroughBlock(nn.Module):
    """The issue's reproduction: the first block makes `pb`, every later block returns it as it came."""

    def __init__(self, first: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.bias = nn.Linear(8, 8) if first else None

    def forward(self, h: torch.Tensor, pb: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if pb is None:
            pb = self.bias(h)
        return self.lin(h) + pb, pb


class _PassThroughNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_PassThroughBlock(i == 0) for i in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pb = None
        for block in self.blocks:
            x, pb = block(x, pb)
        return x.pow(2).mean()


@pytest.mark.parametrize("frozen", [False, True], ids=["trainable", "frozen-lin"])
def test_an_output_passed_through_later_blocks_does_not_gather_them_again(frozen: bool) -> None:
    """With a frozen weight in each block, the blocks' inputs are watched too (their aliases are
    what is passed through)."""
    import zero_offload

    torch.manual_seed(0)
    model = _PassThroughNet()
    if frozen:
        for b in model.blocks:
            b.lin.bias.requires_grad_(False)
    ref = copy.deepcopy(model)
    engine = zero_offload.initialize(model, {"stage": 3, "tiers": CPU, "optimizer": {"lr": LR, "weight_decay": WD},
                                             "stage3": {"unit_modules": ["_PassThroughBlock"]}})
    batches = [{"x": torch.randn(4, 8, generator=torch.Generator().manual_seed(s))} for s in range(STEPS)]
    losses = train_engine(engine, batches, lambda loss: loss)
    weights, stats = engine.consolidated_state_dict(), engine.runtime.stats()
    engine.close()
    check_matches(losses, weights, *adamw_reference(ref, batches, lambda loss: loss), "pass-through")
    # Three gathers per pass (forward) and three for backward: none of a released block again.
    assert stats["on_demand_fetches"] <= 6 * STEPS and stats["rerecorded_passes"] == 0, stats


def _t5_like(kind: str) -> tuple[nn.Module, str]:
    transformers = pytest.importorskip("transformers")
    sizes = dict(vocab_size=VOCAB, d_model=16, d_kv=4, d_ff=32, num_layers=2, num_decoder_layers=2, num_heads=2,
                 relative_attention_num_buckets=8, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    if kind == "t5":
        return transformers.T5ForConditionalGeneration(transformers.T5Config(**sizes)), "T5Block"
    cfg = transformers.SwitchTransformersConfig(**sizes, num_experts=2, expert_capacity=64, router_jitter_noise=0.0,
                                                encoder_sparse_step=1, decoder_sparse_step=1)
    return transformers.SwitchTransformersForConditionalGeneration(cfg), "SwitchTransformersBlock"


def _seq2seq_batch(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {"input_ids": torch.randint(1, VOCAB, (2, 7), generator=g),
            "labels": torch.randint(1, VOCAB, (2, 5), generator=g)}


@pytest.mark.parametrize("units", ["block", "size"])
@pytest.mark.parametrize("kind", ["t5", "switch"])
def test_t5_position_bias_passed_through_blocks_trains_like_adamw(kind: str, units: str) -> None:
    """Block units (the failing case), and units chosen by size (each Linear; no unit_modules)."""
    import zero_offload

    model, block = _t5_like(kind)
    model.train()
    ref = copy.deepcopy(model)
    stage3 = {"unit_modules": [block]} if units == "block" else {"unit_bytes": 1024}
    engine = zero_offload.initialize(model, {"stage": 3, "tiers": CPU, "stage3": stage3,
                                             "optimizer": {"lr": LR, "weight_decay": WD}})
    assert len(engine.runtime.units) > 4
    batches = [_seq2seq_batch(s) for s in range(4)]
    losses = train_engine(engine, batches, lambda out: out.loss)
    weights = engine.consolidated_state_dict()
    engine.close()
    check_matches(losses, weights, *adamw_reference(ref, batches, lambda out: out.loss), f"{kind} {units}")


class _PooledRoot(nn.Module):
    """CLIP's shape in plain torch: the root owns a parameter (CLIP's logit_scale) read by the
    loss, and also returns a tensor its own forward computed from an inner unit's output (the
    pooled output), whose gradient comes after the root's parameter has reported."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])
        self.head = nn.Linear(8, 4)
        self.scale = nn.Parameter(torch.tensor(0.5))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = x
        for layer in self.layers:
            h = torch.tanh(layer(h))
        pooled = h[:, 0:6].sum(-1, keepdim=True) * h  # computed here, from the last layer's output
        return (self.head(pooled) * self.scale.exp()).pow(2).mean(), pooled


def _clip() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    return transformers.CLIPModel(transformers.CLIPConfig(
        text_config=dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, max_position_embeddings=8),
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                           image_size=8, patch_size=4), projection_dim=8))


@pytest.mark.parametrize("kind", ["plain", "clip"])
def test_a_root_returning_what_inner_units_computed_beside_its_loss_trains_like_adamw(kind: str) -> None:
    """The default units: the root's unit (its own parameter) is reduced when that parameter
    reports, and the gradient of the pooled output comes later. That output was taken for a need
    of the root's weights: "unit '<root>' is needed for backward again after its gradients were
    reduced", on CLIPModel and on the plain model alike. Its gradient reaches none of them."""
    import zero_offload

    model = _PooledRoot() if kind == "plain" else _clip()
    ref = copy.deepcopy(model)
    engine = zero_offload.initialize(model, {"stage": 3, "tiers": CPU, "optimizer": {"lr": LR, "weight_decay": WD}})
    if kind == "plain":
        batches = [{"x": torch.randn(4, 8, generator=torch.Generator().manual_seed(s))} for s in range(STEPS)]
        loss_of: Callable[[Any], torch.Tensor] = lambda out: out[0]
    else:
        gens = [torch.Generator().manual_seed(s) for s in range(STEPS)]
        batches = [{"input_ids": torch.randint(0, VOCAB, (2, 6), generator=g),
                    "pixel_values": torch.randn(2, 3, 8, 8, generator=g), "return_loss": True} for g in gens]
        loss_of = lambda out: out.loss
    losses = train_engine(engine, batches, loss_of) if kind == "plain" else _train_clip(engine, batches)
    weights = engine.consolidated_state_dict()
    engine.close()
    want_losses, want = adamw_reference(ref, batches, loss_of)
    # Softmax is invariant to a key bias: its true gradient is zero, the computed one rounding noise,
    # which Adam scales up to lr-sized steps in either implementation (see _zoo_models.NOISE).
    # In CLIP's text tower every query and key gradient is rounding noise too: its pooled position
    # (no token of this vocabulary is its eos id) is 0, which the causal mask lets attend to itself only.
    noise = [k for k in want if k.endswith("k_proj.bias") or (k.startswith("text_model.") and
                                                               (".q_proj." in k or ".k_proj." in k))]
    check_matches(losses, {k: v for k, v in weights.items() if k not in noise}, want_losses,
                  {k: v for k, v in want.items() if k not in noise}, kind)


def _train_clip(engine: Any, batches: list[dict[str, Any]]) -> list[float]:
    """train_engine at D = 1 for a batch that holds a flag (CLIP's return_loss) beside tensors."""
    losses = []
    for b in batches:
        loss = engine(**b).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _reformer() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    return transformers.ReformerModelWithLMHead(transformers.ReformerConfig(
        vocab_size=VOCAB, hidden_size=16, num_attention_heads=2, attention_head_size=8, feed_forward_size=32,
        attn_layers=["local", "local"], axial_pos_embds=False, is_decoder=True, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, local_attention_probs_dropout_prob=0.0, local_attn_chunk_length=4,
        max_position_embeddings=16, pad_token_id=0))


def test_a_reversible_layer_running_its_modules_in_its_own_backward_trains_with_the_default_units() -> None:
    """Reformer's layers are reversible: their backward recomputes the attention and the feed-forward
    from the layer's outputs in a method of its own (backward_pass), so the layer's forward, around
    which its unit is gathered, does not run then. With the default units torch failed inside
    layer_norm ("weight of shape [0]"), then one line refused it; now the modules that run there
    gather the layer's unit around their own calls (said once) and the model trains as under
    AdamW, as it does with the units the line names."""
    import zero_offload

    for stage3 in ({}, {"unit_modules": ["ReformerAttention", "ChunkReformerFeedForward"]}):
        model = _reformer()
        ref = copy.deepcopy(model)
        engine = zero_offload.initialize(model, {"stage": 3, "tiers": CPU, "stage3": stage3,
                                                 "optimizer": {"lr": LR, "weight_decay": WD}})
        batches = [_reformer_batch(s) for s in range(3)]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            losses = train_engine(engine, batches, lambda out: out.loss)
        said = [str(w.message) for w in caught if str(w.message).startswith("stage 3:")]
        assert len(said) == (0 if stage3 else 1)
        assert all("ran while its unit 'reformer.encoder.layers.1' was not gathered" in m and
                   "unit_modules=['ReformerAttention', 'ChunkReformerFeedForward']" in m for m in said)
        weights = engine.consolidated_state_dict()
        engine.close()
        check_matches(losses, weights, *adamw_reference(ref, batches, lambda out: out.loss), "reformer")



def _reformer_batch(step: int) -> dict[str, torch.Tensor]:
    """Its sequence a multiple of the local attention's chunk length (4), as Reformer requires."""
    ids = torch.randint(1, VOCAB, (2, 8), generator=torch.Generator().manual_seed(step))
    return {"input_ids": ids, "labels": ids}


def _tiny_llama() -> tuple[nn.Module, str]:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, tie_word_embeddings=True)), "LlamaDecoderLayer"


def _causal_batch(step: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(step))
    return {"input_ids": ids, "labels": ids}


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("kind", ["llama", "t5"])
def test_gradient_checkpointing_trains_like_adamw(kind: str, reentrant: bool) -> None:
    """Hugging Face checkpoints each layer's forward inside its hooks. T5's blocks then also pass a
    leaf on (the cross-attention's zero position bias, made to require grad)."""
    import zero_offload

    model, block = _tiny_llama() if kind == "llama" else _t5_like("t5")
    model.train()
    ref = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # renamed activation_checkpointing_enable in v6
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    engine = zero_offload.initialize(model, {"stage": 3, "tiers": CPU, "optimizer": {"lr": LR, "weight_decay": WD},
                                             "stage3": {"unit_modules": [block]}})
    batches = [(_causal_batch if kind == "llama" else _seq2seq_batch)(s) for s in range(3)]
    losses = train_engine(engine, batches, lambda out: out.loss)
    weights = engine.consolidated_state_dict()
    engine.close()
    check_matches(losses, weights, *adamw_reference(ref, batches, lambda out: out.loss), f"{kind} {reentrant}")


def test_peft_dora_reading_its_adapters_weights_trains_like_adamw() -> None:
    """PEFT's DoRA layer reads its base layer's and adapters' weights in its own forward (the
    weight norm); with units chosen by size each of those Linears is a unit of its own. It failed
    in forward with an IndexError from torch."""
    peft = pytest.importorskip("peft")
    import zero_offload

    model, _ = _tiny_llama()
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                                                       init_lora_weights=False, use_dora=True))
    model.train()
    ref = copy.deepcopy(model)
    engine = zero_offload.initialize(model, {"stage": 3, "tiers": CPU, "optimizer": {"lr": LR, "weight_decay": WD},
                                             "stage3": {"unit_bytes": 600}})
    batches = [_causal_batch(s) for s in range(3)]
    losses = train_engine(engine, batches, lambda out: out.loss)
    weights, stats = engine.consolidated_state_dict(), engine.runtime.stats()
    engine.close()
    check_matches(losses, weights, *adamw_reference(ref, batches, lambda out: out.loss), "DoRA")
    assert stats["read_elsewhere"] > 0 and stats["rerecorded_passes"] == 0, stats
