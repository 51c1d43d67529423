"""Stage 3 through the public facade: a meta model from weights on disk, the consolidated state
dict loaded into the plain model, and checkpoint resume bit for bit."""
from __future__ import annotations

import os

import pytest
import torch

import zero_offload
from _stage3_model import batch, make_model
from zero_offload.config import ConfigError

CFG = {"stage": 3, "tiers": {"params": "cpu", "optimizer": "cpu", "grads": "cpu"},
       "stage3": {"unit_modules": ["Block3"], "live_budget_bytes": 30000},
       "optimizer": {"lr": 1e-2, "weight_decay": 0.01}}


def _meta_engine(weights: str) -> zero_offload.engine.engine.Engine:
    with torch.device("meta"):
        model = make_model()
    return zero_offload.initialize(model, CFG, weights=weights)


def _train(engine: object, steps: range) -> list[float]:
    losses = []
    for step in steps:
        x, y = batch(step, 4)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def test_meta_model_from_weights_resumes_bit_for_bit_and_consolidates(tmp_path: object) -> None:
    weights = os.path.join(str(tmp_path), "w.pt")
    torch.save(make_model().state_dict(), weights)
    straight = _meta_engine(weights)
    want = _train(straight, range(5))
    want_sd = straight.consolidated_state_dict()
    straight.close()

    first = _meta_engine(weights)
    got = _train(first, range(3))
    first.save_checkpoint(os.path.join(str(tmp_path), "ckpt"))
    first.close()
    resumed = _meta_engine(weights)
    resumed.load_checkpoint(os.path.join(str(tmp_path), "ckpt"))
    got += _train(resumed, range(3, 5))
    got_sd = resumed.consolidated_state_dict()
    resumed.close()

    assert got == want
    for k in want_sd:
        assert torch.equal(got_sd[k], want_sd[k]), k
    plain = make_model()
    plain.load_state_dict(got_sd)  # strict: every key of the plain model, right shapes
    assert torch.equal(plain.tok.weight, got_sd["tok.weight"]) and plain.head.weight is plain.tok.weight


def test_meta_model_below_stage_3_is_refused() -> None:
    with torch.device("meta"):
        model = make_model()
    with pytest.raises(ConfigError, match="parameters on the meta device"):
        zero_offload.initialize(model, {**CFG, "stage": 2, "tiers": {"optimizer": "cpu"}, "stage3": {}})
    with pytest.raises(ConfigError, match="init_fn and weights .* need stage 3"):
        zero_offload.initialize(make_model(), {"stage": 1}, weights="w.pt")
