"""The conformance zoo's models: tiny, random architectures from transformers config classes, a
plain-torch GPT whose head reads the embedding functionally (the peer's), a PEFT LoRA model and
gradient-checkpointed variants; with their data, their loss and the torch.optim.AdamW oracle.

Every model is built seeded (so two builds are identical), with dropout off and router noise off,
so a run is a function of its weights and data alone. transformers and peft are test
dependencies: the package itself never imports them.
"""
from __future__ import annotations

import contextlib
import copy
import importlib.util
import os
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn
from torch.nn import functional as F

VOCAB, SEQ, ROWS = 128, 12, 2
Batch = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Case:
    """One architecture: how to build it (seeded), a micro-batch of `rows` rows for a step, and
    its loss; `meta_build` builds the same class on the meta device. `fresh`: every copy is a new
    seeded build, not a deep copy (a deep copy drops a parameter's hooks, makes a ScriptModule's
    parameters non-leaf, and refuses the legacy weight_norm)."""
    name: str
    build: Callable[[], nn.Module]
    batch: Callable[[int, int], Batch]
    loss: Callable[[Callable[..., Any], Batch], torch.Tensor]
    meta_build: Callable[[], nn.Module] | None = None
    fresh: bool = False


def _gen(step: int) -> torch.Generator:
    return torch.Generator().manual_seed(1000 + step)


def tokens_lm(step: int, rows: int) -> Batch:
    ids = torch.randint(0, VOCAB, (rows, SEQ), generator=_gen(step))
    return {"input_ids": ids, "labels": ids.clone()}


def tokens_seq2seq(step: int, rows: int) -> Batch:
    g = _gen(step)
    return {"input_ids": torch.randint(2, VOCAB, (rows, 8), generator=g),
            "labels": torch.randint(2, VOCAB, (rows, 4), generator=g)}


def tokens_mlm(step: int, rows: int) -> Batch:
    """A quarter of the tokens replaced by the mask id (3); the loss is on those only."""
    g = _gen(step)
    ids = torch.randint(5, VOCAB, (rows, SEQ), generator=g)
    masked = torch.rand(rows, SEQ, generator=g) < 0.25
    masked[:, 0] = True  # every row has a masked token
    return {"input_ids": torch.where(masked, torch.full_like(ids, 3), ids),
            "labels": torch.where(masked, ids, torch.full_like(ids, -100))}


def images(size: int, labels: int) -> Callable[[int, int], Batch]:
    def make(step: int, rows: int) -> Batch:
        g = _gen(step)
        return {"pixel_values": torch.randn(rows, 3, size, size, generator=g),
                "labels": torch.randint(0, labels, (rows,), generator=g)}
    return make


def hf_loss(fwd: Callable[..., Any], batch: Batch) -> torch.Tensor:
    return fwd(**batch).loss


def peer_loss(fwd: Callable[..., Any], batch: Batch) -> torch.Tensor:
    return fwd(batch["input_ids"], batch["labels"])


def split(batch: Batch, rank: int, world: int) -> Batch:
    """This rank's rows of a global batch."""
    rows = next(iter(batch.values())).shape[0] // world
    return {k: v[rank * rows:(rank + 1) * rows] for k, v in batch.items()}


# ----------------------------------------------------------------------------- the peer's GPT

def _peer_script() -> str | None:
    """../shared/peer/ds_e2e.py beside the repository (or one level up, from a worktree)."""
    here = os.path.dirname(os.path.abspath(__file__))
    for up in ("..", os.path.join("..", "..")):
        path = os.path.normpath(os.path.join(here, "..", up, "shared", "peer", "ds_e2e.py"))
        if os.path.isfile(path):
            return path
    return None


def peer_classes() -> Any | None:
    """The peer's own GPT class (build_model_classes of ds_e2e.py), when its file is here."""
    path = _peer_script()
    if path is None:
        return None
    spec = importlib.util.spec_from_file_location("zoo_ds_e2e_peer", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build_model_classes()


class _PeerBlock(nn.Module):
    """The peer's Block, rebuilt (same modules, names and maths) for a clone without ../shared."""

    def __init__(self, d: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.ln1, self.qkv, self.proj = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.ln2, self.fc, self.fc2 = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        h = self.n_head
        q, k, v = (z.view(b, t, h, c // h).transpose(1, 2) for z in self.qkv(self.ln1(x)).split(c, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.fc2(F.gelu(self.fc(self.ln2(x))))


class PeerGPT(nn.Module):
    """The peer's GPT, rebuilt: its head is `F.linear(x, self.wte.weight)`, a tie read
    functionally in the root's forward, not through a module."""

    def __init__(self, vocab: int, seq: int, d: int, n_layer: int, n_head: int) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList([_PeerBlock(d, n_head) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(d)

    @torch.no_grad()
    def init_weights(self) -> None:
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
                if isinstance(m, nn.Linear):
                    nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)  # tied head
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))


PEER_SIZES = dict(vocab=VOCAB, seq=SEQ, d=32, n_layer=2, n_head=4)


def build_peer(cls: Any = None) -> nn.Module:
    """The peer's class when its file is found, else the rebuilt one; seeded, as ds_e2e.py does."""
    cls = cls or peer_classes() or PeerGPT
    torch.manual_seed(0)
    model = cls(**PEER_SIZES)
    model.init_weights()
    return model


# ----------------------------------------------------------------------------- transformers models

def _seeded(make: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        torch.manual_seed(0)
        return make()
    return build


def _on_meta(make: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        with torch.device("meta"):
            return make()
    return build


def _decoder(kind: str) -> Callable[[], nn.Module]:
    import transformers

    common = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64)
    if kind == "llama":
        return lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    if kind == "qwen3":
        return lambda: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common, head_dim=8))
    if kind == "mistral":
        return lambda: transformers.MistralForCausalLM(transformers.MistralConfig(**common, sliding_window=None))
    if kind == "mixtral":  # fused 3-D experts (one Parameter holds every expert), top-2 of 4
        return lambda: transformers.MixtralForCausalLM(transformers.MixtralConfig(
            **common, num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.0))
    raise ValueError(kind)


def _gpt2() -> nn.Module:
    import transformers

    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))  # the head is tied through lm_head


def _t5() -> nn.Module:
    import transformers

    return transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
        relative_attention_num_buckets=8, dropout_rate=0.0, decoder_start_token_id=0))


def _switch() -> nn.Module:
    """One module per expert (SwitchTransformersExperts is a ModuleDict of 8), top-1 routing: with
    16 and 8 tokens per sparse layer some experts get none in a step."""
    import transformers

    return transformers.SwitchTransformersForConditionalGeneration(transformers.SwitchTransformersConfig(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=32, num_layers=2, num_sparse_encoder_layers=1,
        num_decoder_layers=2, num_sparse_decoder_layers=1, num_heads=4, num_experts=8, expert_capacity=64,
        router_jitter_noise=0.0, dropout_rate=0.0, relative_attention_num_buckets=8, decoder_start_token_id=0))


def _bert() -> nn.Module:
    import transformers

    return transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def _vit() -> nn.Module:
    import transformers

    return transformers.ViTForImageClassification(transformers.ViTConfig(
        image_size=16, patch_size=4, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, num_labels=5, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def _resnet() -> nn.Module:
    import transformers

    return transformers.ResNetForImageClassification(transformers.ResNetConfig(
        embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic", num_labels=5))


def _lora() -> nn.Module:
    """PEFT LoRA (r = 4) on q_proj and v_proj of a tiny Llama: the base weights are frozen."""
    import peft

    base = _decoder("llama")()
    cfg = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    return peft.get_peft_model(base, cfg)


def _checkpointed(reentrant: bool) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        model = _decoder("llama")()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # 5.x: an alias of activation_checkpointing_enable
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        return model
    return make


def _cases() -> dict[str, Case]:
    dec = {k: _decoder(k) for k in ("llama", "qwen3", "mistral", "mixtral")}
    out = [Case(k, _seeded(dec[k]), tokens_lm, hf_loss, _on_meta(dec[k])) for k in dec]
    out += [
        Case("gpt2", _seeded(_gpt2), tokens_lm, hf_loss, _on_meta(_gpt2)),
        Case("peer_gpt", build_peer, tokens_lm, peer_loss),
        Case("t5", _seeded(_t5), tokens_seq2seq, hf_loss, _on_meta(_t5)),
        Case("switch", _seeded(_switch), tokens_seq2seq, hf_loss, _on_meta(_switch)),
        Case("bert", _seeded(_bert), tokens_mlm, hf_loss, _on_meta(_bert)),
        Case("vit", _seeded(_vit), images(16, 5), hf_loss, _on_meta(_vit)),
        Case("resnet", _seeded(_resnet), images(32, 5), hf_loss, _on_meta(_resnet)),
        Case("lora_llama", _seeded(_lora), tokens_lm, hf_loss),
        Case("llama_ckpt_reentrant", _seeded(_checkpointed(True)), tokens_lm, hf_loss),
        Case("llama_ckpt_nonreentrant", _seeded(_checkpointed(False)), tokens_lm, hf_loss),
    ]
    return {c.name: c for c in out}


CASES = _cases()
ARCHITECTURES = tuple(CASES)  # the transformers and peer models (tests/_zoo_patterns.py adds the plain-torch patterns)
_EAGER: dict[str, nn.Module] = {}


def eager(name: str) -> nn.Module:
    """A fresh copy of the case's eager model: built once per process, then deep-copied (ties kept),
    or built anew each time for a `fresh` case."""
    if CASES[name].fresh:
        return CASES[name].build()
    if name not in _EAGER:
        _EAGER[name] = CASES[name].build()
    return copy.deepcopy(_EAGER[name])


# ----------------------------------------------------------------------------- the oracle

@dataclass(frozen=True)
class Hyper:
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    clip: float = 0.0


# An element whose oracle gradient is this small against the step's gradient RMS (but not exactly
# zero) is rounding noise: its true gradient is zero (a key bias: softmax is invariant to it), and
# Adam normalizes noise into steps of order lr, so two correct implementations (another Adam kernel,
# another summation order) move it apart by up to 2 lr per step. Real gradients here are at least
# ~1e-5 of the RMS; key-bias noise is 1e-11 to 1e-9 of it.
NOISE = 1e-7


@dataclass
class Reference:
    """The oracle's run: its losses, final state dict (fp32 masters for bf16), the parameters that
    got no gradient at some step, and per parameter the elements whose gradient was noise."""
    losses: list[float]
    state: dict[str, torch.Tensor]
    no_grad: set[str]
    noise: dict[str, torch.Tensor]
    hyper: Hyper
    steps: int


def reference(name: str, steps: int, rows: int, hyper: Hyper, dtype: torch.dtype = torch.float32,
              world: int = 1) -> Reference:
    """torch.optim.AdamW on an identical copy over the global batch of `rows` x `world` rows, its
    loss the mean of each rank's loss on its rows, as data parallelism (DDP, ZeRO) defines it (a
    load-balancing loss is not a mean over tokens). bf16: the usual mixed-precision loop, a bf16
    model stepped through fp32 master copies."""
    case, model = CASES[name], eager(name)
    model = model if dtype == torch.float32 else model.to(dtype)  # .to(float32) would make complex weights real
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    masters = [p.detach().float().clone().requires_grad_(True) for _, p in named] if dtype != torch.float32 \
        else [p for _, p in named]
    opt = torch.optim.AdamW(masters, lr=hyper.lr, betas=hyper.betas, eps=hyper.eps, weight_decay=hyper.weight_decay)
    losses, no_grad, noise = [], set(), {}
    slots, ranks_states = _state_slots(model), _states_per_rank(model, world)
    for step in range(steps):
        batch = _cast(case.batch(step, rows * world), dtype)
        loss = sum(_on_rank(model, ranks_states, r, lambda: case.loss(model, split(batch, r, world)), slots)
                   for r in range(world)) / world
        loss.backward()
        no_grad |= {n for n, p in named if p.grad is None}
        _mark_noise(named, noise)
        if dtype != torch.float32:
            for (_, p), m in zip(named, masters):
                m.grad, p.grad = (None if p.grad is None else p.grad.float()), None
        if hyper.clip:
            torch.nn.utils.clip_grad_norm_(masters, hyper.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if dtype != torch.float32:
            with torch.no_grad():
                for (_, p), m in zip(named, masters):
                    p.copy_(m)
        losses.append(float(loss.detach()))
    _on_rank(model, ranks_states, 0, lambda: None, slots)  # rank 0's are what its state dict holds
    master_of = {id(p): m for (_, p), m in zip(named, masters)}  # every name of a tied parameter
    state = {k: master_of.get(id(v), v).detach().clone() for k, v in model.state_dict(keep_vars=True).items()}
    first = {id(p): n for n, p in reversed(list(model.named_parameters()))}
    by_key = {k: noise[first[id(v)]] for k, v in model.state_dict(keep_vars=True).items()
              if first.get(id(v)) in noise}  # a tied parameter's every name
    return Reference(losses, state, no_grad, by_key, hyper, steps)


def _states_per_rank(model: nn.Module, world: int) -> list[dict[int, torch.Tensor]] | None:
    """Each rank's own copy of what a forward may edit, at D > 1: the buffers and the frozen
    parameters. Ranks do not synchronize buffers (docs/limits.md, as DDP with
    broadcast_buffers=False), so a buffer that a forward updates (BatchNorm's statistics,
    spectral_norm's vectors, an EMA, QAT's observers), or a frozen parameter (a momentum
    teacher's), is updated on each rank by that rank's forward alone; None at D = 1. Keyed by the
    id of the model's own tensor, so ties stay tied."""
    if world == 1:
        return None
    slots = _state_slots(model)
    originals = {id(t): t for _, _, _, t in slots}
    return [{key: _clone_like(t) for key, t in originals.items()} for _ in range(world)]


def _state_slots(model: nn.Module) -> list[tuple[nn.Module, str, str, torch.Tensor]]:
    """(module, "_buffers" or "_parameters", name, tensor) of every buffer and frozen parameter."""
    out = [(m, "_buffers", k, b) for m in model.modules() for k, b in m._buffers.items() if b is not None]
    return out + [(m, "_parameters", k, p) for m in model.modules() for k, p in m._parameters.items()
                  if p is not None and not p.requires_grad]


def _clone_like(t: torch.Tensor) -> torch.Tensor:
    return nn.Parameter(t.detach().clone(), requires_grad=False) if isinstance(t, nn.Parameter) else t.clone()


def _on_rank(model: nn.Module, ranks_states: list[dict[int, torch.Tensor]] | None, rank: int,
             run: Callable[[], Any], slots: list[tuple[nn.Module, str, str, torch.Tensor]] | None = None) -> Any:
    """`run()` with the model's buffers and frozen parameters bound to `rank`'s own tensors
    (replaced, not copied into: autograd may have saved another rank's for its backward)."""
    if ranks_states is not None:
        for m, where, k, t in slots:
            getattr(m, where)[k] = ranks_states[rank][id(t)]
    return run()


def _mark_noise(named: list[tuple[str, nn.Parameter]], noise: dict[str, torch.Tensor]) -> None:
    grads = [p.grad.float() for _, p in named if p.grad is not None]
    if not grads:
        return
    rms = torch.cat([g.flatten() for g in grads]).pow(2).mean().sqrt()
    for n, p in named:
        if p.grad is not None:
            g = p.grad.float().abs()
            small = (g > 0) & (g <= NOISE * rms)
            if small.any():
                noise[n] = noise[n] | small if n in noise else small


def _cast(batch: Batch, dtype: torch.dtype) -> Batch:
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in batch.items()}


def train(engine: Any, name: str, steps: range, rows: int, rank: int = 0, world: int = 1,
          dtype: torch.dtype = torch.float32) -> list[float]:
    """The engine's loop on this rank's rows of each global batch; the losses of this rank."""
    case, losses = CASES[name], []
    for step in steps:
        batch = _cast(split(case.batch(step, rows * world), rank, world), dtype)
        loss = case.loss(engine, batch)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return losses


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    return float((got - want).norm() / want.norm().clamp_min(1e-12)) if want.numel() else 0.0


def compare(got: dict[str, torch.Tensor], ref: Reference, tol: float) -> list[str]:
    """Every tensor of the oracle's state dict by relative norm error (integers exactly). Noise
    elements (see NOISE) are held to the most two correct Adam runs can part them by, 2 lr a
    step, and must stay under 1% of the elements, so masking cannot hide a model."""
    bad = []
    for k, v in ref.state.items():
        if k not in got:
            bad.append(f"{k}: missing")
        elif tuple(got[k].shape) != tuple(v.shape):
            bad.append(f"{k}: shape {tuple(got[k].shape)} != {tuple(v.shape)}")
        elif v.is_complex():  # as (real, imag) pairs, as AdamW steps it
            bad += _compare_float(k, torch.view_as_real(got[k]).double(), torch.view_as_real(v).double(),
                                  None, ref, tol)
        elif not v.is_floating_point():
            if not torch.equal(got[k].to(v.dtype), v):
                bad.append(f"{k}: {got[k].tolist()} != {v.tolist()}")
        else:
            bad += _compare_float(k, got[k].double(), v.double(), ref.noise.get(k), ref, tol)
    masked = sum(int(m.sum()) for m in ref.noise.values())
    if masked > 0.01 * sum(v.numel() for v in ref.state.values()):
        bad.append(f"{masked} noise elements: more than 1% of the model")
    return bad


def _compare_float(k: str, got: torch.Tensor, want: torch.Tensor, noise: torch.Tensor | None, ref: Reference,
                   tol: float) -> list[str]:
    if noise is None:
        e = rel_err(got, want)
        return [f"{k}: rel err {e:.2e}"] if e > tol else []
    out = []
    if (~noise).any() and (e := rel_err(got[~noise], want[~noise])) > tol:
        out.append(f"{k}: rel err {e:.2e} ({int(noise.sum())} noise elements apart)")
    bound = 2 * ref.hyper.lr * ref.steps
    if (d := float((got[noise] - want[noise]).abs().max())) > bound:
        out.append(f"{k}: noise elements {d:.2e} apart, over 2 lr x steps = {bound:.2e}")
    return out


@contextlib.contextmanager
def quiet() -> Any:
    """The warnings our DeepSpeed on-ramp gives for inert keys, and transformers' deprecations."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
