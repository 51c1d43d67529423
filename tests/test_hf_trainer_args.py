"""TrainingArguments that ZeroOffloadTrainer honours or refuses, each in one line, none ignored.

`torch_compile=True` was silently ignored (the engine's modules ran uncompiled), and every
`optim` but AdamW was refused although the engine steps Lion too. The oracle for Lion is a plain
Trainer stepping the paper's Lion (written here in torch) through `optimizer_cls_and_kwargs`,
with Trainer's own parameter groups, as bitsandbytes' 32-bit Lion that `optim="lion_32bit"` names.
"""
from __future__ import annotations

from typing import Any, Iterable

import pytest
import torch

pytest.importorskip("transformers")

from transformers import Trainer  # noqa: E402

from _hf import Tokens, logged, max_relative_difference, tiny_llama, training_args  # noqa: E402
from zero_offload.config import ConfigError  # noqa: E402
from zero_offload.hf import ZeroOffloadTrainer  # noqa: E402

TRAIN = Tokens(8, seed=0)


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


class _Lion(torch.optim.Optimizer):
    """The paper's Lion with decoupled decay (Chen et al. 2023): c = b1*m + (1-b1)*g;
    p <- p*(1 - lr*wd) - lr*sign(c); m <- b2*m + (1-b2)*g."""

    def __init__(self, params: Iterable[Any], lr: float, betas: tuple[float, float], weight_decay: float) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # noqa: ARG002
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                m = self.state[p].setdefault("m", torch.zeros_like(p))
                c = m * b1 + p.grad * (1 - b1)
                p.mul_(1 - group["lr"] * group["weight_decay"]).add_(torch.sign(c), alpha=-group["lr"])
                m.mul_(b2).add_(p.grad, alpha=1 - b2)


@pytest.mark.parametrize("optim", ["lion_32bit", "paged_lion_32bit"])
def test_lion_trains_as_the_papers_lion_under_a_plain_trainer(optim: str, tmp_path: Any) -> None:
    overrides = dict(max_steps=4, learning_rate=1e-3, adam_beta2=0.99, max_grad_norm=1.0)
    plain = Trainer(model=tiny_llama(), args=training_args(str(tmp_path / "plain"), **overrides),
                    train_dataset=TRAIN,
                    optimizer_cls_and_kwargs=(_Lion, {"lr": 1e-3, "betas": (0.9, 0.99), "weight_decay": 0.1}))
    plain.train()
    ours = ZeroOffloadTrainer(model=tiny_llama(), args=training_args(str(tmp_path / "ours"), optim=optim,
                                                                     **overrides),
                              train_dataset=TRAIN, zero_offload_config={"stage": 2})
    assert ours.zero_offload_config.optimizer.name == "lion"
    ours.train()
    assert logged(ours.state.log_history, "loss") == pytest.approx(logged(plain.state.log_history, "loss"), rel=1e-5)
    want = {k: v.detach() for k, v in plain.model.state_dict().items()}
    assert max_relative_difference(ours.engine.consolidated_state_dict(), want) < 1e-5
    ours.engine.close()


def test_torch_compile_is_refused_in_one_line(tmp_path: Any) -> None:
    with pytest.raises(ConfigError, match=r"^TrainingArguments\(torch_compile=True\): the engine runs the model's "
                                          r"modules through its own hooks"):
        ZeroOffloadTrainer(model=tiny_llama(), args=training_args(str(tmp_path), torch_compile=True),
                           train_dataset=TRAIN)


@pytest.mark.parametrize("optim", ["sgd", "adafactor", "lion_8bit", "adamw_8bit"])
def test_an_optimizer_the_engine_does_not_step_is_refused_in_one_line(optim: str, tmp_path: Any) -> None:
    with pytest.raises(ConfigError, match=rf"^TrainingArguments.optim = '{optim}': the engine steps one of "):
        ZeroOffloadTrainer(model=tiny_llama(), args=training_args(str(tmp_path), optim=optim), train_dataset=TRAIN)
