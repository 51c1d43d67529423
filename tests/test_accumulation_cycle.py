"""engine.end_accumulation_cycle(): a gradient-accumulation cycle cut short (Trainer's last cycle
of an epoch) is stepped at its last micro-batch, with the update torch's AdamW makes of the
gradient Trainer forms.

Trainer scales each micro-batch's loss by the cycle's item count (its mean over the whole cycle,
however many micro-batches the cycle has); ZeroOffloadAccelerator hands it to the engine times
gradient_accumulation_steps, which the engine's 1/gradient_accumulation_steps undoes. So the
reference steps AdamW on the gradient of the mean loss over each cycle's rows, a short cycle's too.
"""
from __future__ import annotations

from typing import Iterator

import pytest
import torch

import zero_offload
from zero_offload.engine.engine import EngineStateError
from _engine_model import batch, make_model

GAS, ROWS, LR = 3, 2, 1e-2
CYCLES = (3, 1, 2, 3)  # micro-batches per cycle: the second and third are cut short


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """One intra-op thread (and one CPU Adam thread, in config): the tiny model's ops are far too
    small to share, and on a busy machine threads that wait on each other cost seconds."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def config(stage: int, clip: float, overlap: bool = True) -> dict:
    tiers = {"optimizer": "cpu", "grads": "cpu", **({"params": "cpu"} if stage == 3 else {})}
    extra = {"stage3": {"unit_modules": ["TinyBlock"]}} if stage == 3 else {}
    return dict(stage=stage, tiers=tiers, gradient_accumulation_steps=GAS, clip_grad_norm=clip, overlap_step=overlap,
                optimizer={"lr": LR, "weight_decay": 0.01, "threads": 1}, **extra)


def micro_batches(cycle: int, k: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    x, y = batch(cycle, ROWS * k)
    return [(x[i * ROWS:(i + 1) * ROWS], y[i * ROWS:(i + 1) * ROWS]) for i in range(k)]


def reference(clip: float) -> tuple[dict[str, torch.Tensor], list[float]]:
    """AdamW on each cycle's mean-loss gradient; the final weights and the pre-clip norms."""
    model = make_model()
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    opt = torch.optim.AdamW(params.values(), lr=LR, weight_decay=0.01)
    norms = []
    for c, k in enumerate(CYCLES):
        x, y = batch(c, ROWS * k)
        model(x, y).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(params.values(), clip if clip else float("inf"))))
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in params.items()}, norms


# Without clipping the overlapped step forms no norm; the deferred one (overlap_step=False, as
# ZeroOffloadTrainer runs without clipping) forms it as clip_grad_norm_ does.
@pytest.mark.parametrize("stage,clip,overlap", [(0, 0.0, True), (1, 0.0, True), (2, 0.0, True), (3, 0.0, True),
                                                (2, 1.0, True), (3, 1.0, True), (1, 0.0, False)])
def test_a_short_cycle_steps_what_adamw_steps_on_the_cycles_mean_gradient(stage: int, clip: float,
                                                                          overlap: bool) -> None:
    engine = zero_offload.initialize(make_model(), config(stage, clip, overlap))
    norms = []
    for c, k in enumerate(CYCLES):
        for i, (x, y) in enumerate(micro_batches(c, k)):
            if i == k - 1 and k < GAS:
                engine.end_accumulation_cycle()
            assert engine.is_boundary == (i == k - 1)
            engine.backward(engine(x, y) / k * GAS)  # Trainer's loss (cycle mean), times GAS as the accelerator does
            engine.step()
        norms.append(engine.grad_norm)
    assert engine.global_steps == len(CYCLES)
    weights, ref_norms = reference(clip)
    ours = engine.consolidated_state_dict()
    for name, value in weights.items():
        assert torch.allclose(ours[name], value, rtol=1e-5, atol=1e-7), name
    if clip or not overlap:
        assert norms == pytest.approx(ref_norms, rel=1e-5)
    else:
        assert norms == [None] * len(CYCLES)
    engine.close()


def test_end_accumulation_cycle_after_backward_is_refused() -> None:
    engine = zero_offload.initialize(make_model(), config(2, 0.0))
    x, y = micro_batches(0, 1)[0]
    engine.backward(engine(x, y))
    with pytest.raises(EngineStateError, match=r"engine.end_accumulation_cycle called in phase backward"):
        engine.end_accumulation_cycle()
    engine.step()
    engine.end_accumulation_cycle()  # between micro-batches it applies to the next one
    assert engine.is_boundary
    engine.close()
