"""consolidated_state_dict is one algorithm for every stage (engine/runtime.py's `consolidate`, issue 23).

Both runtimes give the same dict for the same model: every state_dict key, the trainable
parameters in fp32 under each of their keys (a tied weight's second key too), the frozen
parameters and buffers in the dtypes the model had, and the same values.
"""
from __future__ import annotations

import pytest
import torch

import zero_offload
from _engine_model import make_model


def _consolidated(stage: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = make_model().to(torch.bfloat16)  # the model's own dtypes: bf16, the compute copy's fp32
    engine = zero_offload.initialize(model, dict(stage=stage, tiers={"optimizer": "cpu", "grads": "cpu"}))
    try:
        return engine.consolidated_state_dict()
    finally:
        engine.close()


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_stages_0_2_and_stage_3_consolidate_alike(stage: int) -> None:
    got, want = _consolidated(stage), _consolidated(3)
    assert list(got) == list(want)
    assert {k: v.dtype for k, v in got.items()} == {k: v.dtype for k, v in want.items()}
    assert all(torch.equal(got[k], want[k]) for k in got)
    trainable = {k for k, v in make_model().state_dict(keep_vars=True).items() if v.requires_grad}
    assert {k for k, v in want.items() if v.dtype == torch.float32} == trainable  # head.weight (tied) included
