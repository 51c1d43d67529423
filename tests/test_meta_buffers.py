"""Meta construction gives every buffer what an eager build holds: RoPE's inv_freq (computed in
the rotary embedding's constructor, never in a weights file) was all zeros after initialize, so
every Llama-family model built on the meta device trained without positional encoding (issue 20).
A buffer that cannot be computed is a one-line error at initialize, never zeros."""
from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import zero_offload
from zero_offload.engine.model import meta_buffers

CFG = {"stage": 3, "tiers": {"params": "cpu", "optimizer": "cpu", "grads": "cpu"},
       "optimizer": {"lr": 1e-2, "weight_decay": 0.0}}


def _cfg(*units: str) -> dict:
    return {**CFG, "stage3": {"unit_modules": list(units)}}


# ---- Hugging Face models ----
def _hf(kind: str) -> tuple[type, object, str]:
    transformers = pytest.importorskip("transformers")
    common = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=128)
    config_cls, model_cls, layer = {
        "llama": ("LlamaConfig", "LlamaForCausalLM", "LlamaDecoderLayer"),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", "Qwen2DecoderLayer"),
        "mistral": ("MistralConfig", "MistralForCausalLM", "MistralDecoderLayer")}[kind]
    return getattr(transformers, model_cls), getattr(transformers, config_cls)(**common), layer


def _rope_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    found = {n: b.detach().clone() for n, b in model.named_buffers() if "inv_freq" in n}
    assert found, [n for n, _ in model.named_buffers()]
    return found


def _first_loss(model: object, seed: int = 5) -> torch.Tensor:
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(seed))
    return model(input_ids=ids, labels=ids).loss.detach()


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
def test_hf_model_on_meta_from_saved_weights_matches_the_eager_build(tmp_path: object, kind: str) -> None:
    model_cls, config, layer = _hf(kind)
    torch.manual_seed(0)
    eager = model_cls(config)
    folder = os.path.join(str(tmp_path), "hf")
    eager.save_pretrained(folder)  # model.safetensors: inv_freq is non-persistent, not in it
    want_rope, want_loss = _rope_buffers(eager), _first_loss(eager)
    with torch.device("meta"):
        meta = model_cls(config)
    engine = zero_offload.initialize(meta, _cfg(layer), weights=folder)
    got_rope = _rope_buffers(meta)
    assert got_rope.keys() == want_rope.keys()
    for k, v in want_rope.items():
        assert torch.equal(got_rope[k], v), k  # was all zeros
    torch.testing.assert_close(_first_loss(engine), want_loss, rtol=1e-6, atol=1e-6)
    engine.backward(engine(input_ids=torch.arange(12).view(1, 12), labels=torch.arange(12).view(1, 12)).loss)
    assert engine.step()
    engine.close()


def test_hf_model_on_meta_with_an_init_function_gets_the_constructors_inv_freq() -> None:
    model_cls, config, layer = _hf("llama")
    want = _rope_buffers(model_cls(config))
    seen: list[str] = []

    def init(module: nn.Module) -> None:  # touches no buffer: the values are the constructor's
        seen.append(type(module).__name__)
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, 0.0, 0.02)

    with torch.device("meta"):
        meta = model_cls(config)
    engine = zero_offload.initialize(meta, _cfg(layer), init_fn=init)
    got = _rope_buffers(meta)
    for k, v in want.items():
        assert torch.equal(got[k], v) and got[k].device == engine.device, k
    assert "LlamaRotaryEmbedding" in seen  # as model.apply(init_fn) reaches it
    assert torch.isfinite(_first_loss(engine))
    engine.close()


# ---- plain torch ----
class Table(nn.Module):
    """A buffer its constructor computes from an argument it does not keep: not rebuildable."""

    def __init__(self, n: int, base: float = 100.0) -> None:
        super().__init__()
        self.proj = nn.Linear(n, n)
        self.register_buffer("freq", base ** (-torch.arange(n) / n), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x * self.freq)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = Table(4)
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.table(x)).pow(2).mean()


def _meta_net() -> Net:
    with torch.device("meta"):
        return Net()


def test_a_buffer_that_cannot_be_computed_is_a_one_line_error_naming_it(tmp_path: object) -> None:
    with pytest.raises(ValueError, match=r"buffer 'table.freq' \(Table\) of the meta-device model has no value: "
                                         r".*argument 'n' is not an attribute of the module or of one enclosing it\); set it in init_fn "
                                         r"\(which is called on that module\), or build that module off the meta "
                                         r"device$") as info:
        zero_offload.initialize(_meta_net(), _cfg("Table"))
    assert "\n" not in str(info.value)
    path = os.path.join(str(tmp_path), "w.pt")
    torch.save(Net().state_dict(), path)
    with pytest.raises(ValueError, match=r"buffer 'table.freq' \(Table\) .*: it is not in the weights, and its "
                                         r"module cannot be rebuilt .*; put it in the weights file, or build that "
                                         r"module off the meta device"):
        zero_offload.initialize(_meta_net(), _cfg("Table"), weights=path)


def test_the_fix_the_error_names_works_and_inits_are_not_overwritten() -> None:
    def init(module: nn.Module) -> None:
        if isinstance(module, Table):
            module.freq.copy_(100.0 ** (-torch.arange(4) / 4))
        if isinstance(module, nn.BatchNorm1d):
            module.running_var.fill_(2.0)  # the rebuilt constructor's 1.0 must not win

    model = _meta_net()
    engine = zero_offload.initialize(model, _cfg("Table"), init_fn=init)
    assert torch.equal(model.table.freq, Net().table.freq)
    assert torch.equal(model.bn.running_var, torch.full((4,), 2.0))
    assert torch.equal(model.bn.running_mean, torch.zeros(4)) and int(model.bn.num_batches_tracked) == 0
    engine.backward(engine(torch.randn(3, 4)))
    assert engine.step()
    engine.close()


def test_batchnorm_statistics_come_from_the_weights_or_its_constructor(tmp_path: object) -> None:
    """Persistent buffers the weights hold are loaded from them; without weights a BatchNorm's
    running_var is its constructor's ones (it was zeros)."""
    class Plain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin, self.bn = nn.Linear(4, 4), nn.BatchNorm1d(4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.bn(self.lin(x)).sum()

    with torch.device("meta"):
        model = Plain()
    engine = zero_offload.initialize(model, _cfg("Linear"), init_fn=lambda m: None)
    assert torch.equal(model.bn.running_var, torch.ones(4)) and torch.equal(model.bn.running_mean, torch.zeros(4))
    engine.close()

    sd = Plain().state_dict()
    sd["bn.running_mean"], sd["bn.running_var"], sd["bn.num_batches_tracked"] = \
        torch.arange(4.0), torch.full((4,), 3.0), torch.tensor(17)
    path = os.path.join(str(tmp_path), "w.safetensors")
    zero_offload.engine.model.weights_files.save_safetensors(sd, path)
    with torch.device("meta"):
        model = Plain()
    engine = zero_offload.initialize(model, _cfg("Linear"), weights=path)
    for k in ("running_mean", "running_var", "num_batches_tracked"):
        assert torch.equal(getattr(model.bn, k), sd[f"bn.{k}"]), k
    engine.close()

    sd["bn.running_mean"] = torch.zeros(5)
    zero_offload.engine.model.weights_files.save_safetensors(sd, path)
    with torch.device("meta"):
        model = Plain()
    with pytest.raises(ValueError, match=r"buffer 'bn.running_mean' has shape \(5,\), the model expects \(4,\)"):
        zero_offload.initialize(model, _cfg("Linear"), weights=path)


def test_rebuilding_is_bounded_and_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    """A module too large to build again, or one whose constructor builds something else from its
    attributes, is not used: its buffer is named instead."""
    class Grown(nn.Module):
        def __init__(self, n: int) -> None:
            super().__init__()
            self.n = n
            self.lin = nn.Linear(n, n)
            self.register_buffer("ids", torch.arange(n))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x).sum()

    with torch.device("meta"):
        model = Grown(4)
    model.n = 5  # changed after construction: built again it would not be this module
    with pytest.raises(ValueError, match=r"buffer 'ids' \(Grown\) .*differs in 'buffer ids'"):
        zero_offload.initialize(model, _cfg("Linear"))
    monkeypatch.setattr(meta_buffers, "REBUILD_MAX_NUMEL", 10)
    with torch.device("meta"):
        model = Grown(4)
    with pytest.raises(ValueError, match=r"buffer 'ids' \(Grown\) .*it would allocate 24 elements, over the 10"):
        zero_offload.initialize(model, _cfg("Linear"))
    monkeypatch.undo()
    with torch.device("meta"):
        model = Grown(4)
    state = torch.get_rng_state()
    built, why = meta_buffers.rebuild(model, {})
    assert why == "" and torch.equal(built.ids, torch.arange(4))
    assert torch.equal(torch.get_rng_state(), state)  # its Linear's init drew nothing from the user's RNG
    engine = zero_offload.initialize(model, _cfg("Linear"), init_fn=lambda m: None)
    assert torch.equal(model.ids, torch.arange(4))
    engine.close()


def test_a_buffer_shared_by_two_modules_stays_one_tensor() -> None:
    class Rope(nn.Module):
        def __init__(self, dim: int) -> None:
            super().__init__()
            self.dim = dim
            self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, dim, 2) / dim), persistent=False)

    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
            self.rope = Rope(4)
            self.a.register_buffer("shared", self.rope.inv_freq, persistent=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x)).sum()

    with torch.device("meta"):
        model = Two()
    engine = zero_offload.initialize(model, _cfg("Linear"), init_fn=lambda m: None)
    assert torch.equal(model.rope.inv_freq, Rope(4).inv_freq)
    assert model.a.shared is model.rope.inv_freq
    engine.close()


@pytest.mark.parametrize("stage", [0, 2])
def test_a_meta_buffer_below_stage_3_is_our_one_line_error(stage: int) -> None:
    """Real parameters and a buffer left on the meta device: below stage 3 the model is moved
    whole, and torch's "Cannot copy out of meta tensor" came out of model.to()."""
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    model[1].register_buffer("extra", torch.empty(3, device="meta"))
    with pytest.raises(zero_offload.ConfigError, match=r"^initialize: buffer '1.extra' is on the meta device .*use stage 3"):
        zero_offload.initialize(model, {"stage": stage})
