"""Stage 3 where the autograd graph crosses units, against torch.optim.AdamW (fp32, 1e-5 relative).

- A tensor passed through several units: T5's (and Switch Transformers') position bias is made by
  the first block and returned by every later one. Block units failed at the first backward with
  "unit ... is needed for backward again after its gradients were reduced" (the passed-through
  output's node is the first block's, whose gradient comes last).
- Gradient checkpointing on a tiny Llama and T5, reentrant and not.
"""
from __future__ import annotations

import copy
import warnings
from typing import Any, Callable

import pytest
import torch
from torch import nn

from _stage3_model import max_rel_err

LR, WD, STEPS = 1e-2, 0.01, 5
VOCAB, SEQ, DIM = 64, 8, 16
CPU = {"params": "cpu", "optimizer": "cpu", "grads": "cpu"}


def adamw_reference(model: nn.Module, batches: list[dict[str, torch.Tensor]],
                    loss_of: Callable[[Any], torch.Tensor]) -> tuple[list[float], dict[str, torch.Tensor]]:
    """torch.optim.AdamW on the whole batch; a parameter that got no gradient is stepped with a
    zero one, as the engine does."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=WD)
    losses = []
    for b in batches:
        loss = loss_of(model(**b))
        loss.backward()
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
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
