"""The Hugging Face Trainer tests' tiny Llama, synthetic token data and TrainingArguments.

Models are built eagerly (not on the meta device) from a LlamaConfig, seeded, so two calls give
the same weights; the data are random token ids with labels = input_ids (the model shifts them).
"""
from __future__ import annotations

from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

VOCAB, SEQ = 128, 16


def tiny_llama(seed: int = 0, **overrides: Any) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=VOCAB, **overrides)
    return LlamaForCausalLM(config)


class Tokens(torch.utils.data.Dataset):
    """`n` random sequences of token ids, labels the same ids."""

    def __init__(self, n: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def training_args(out: str, **overrides: Any) -> TrainingArguments:
    """AdamW (torch), clipping at 1.0, accumulation 2, linear warmup, weight decay (two param groups)."""
    kwargs: dict[str, Any] = dict(
        output_dir=out, per_device_train_batch_size=2, per_device_eval_batch_size=4, gradient_accumulation_steps=2,
        learning_rate=1e-2, weight_decay=0.1, max_grad_norm=1.0, lr_scheduler_type="linear", warmup_steps=2,
        optim="adamw_torch", num_train_epochs=2, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
        dataloader_num_workers=0, disable_tqdm=True, seed=0)
    kwargs.update(overrides)
    return TrainingArguments(**kwargs)


def losses(log_history: list[dict]) -> list[float]:
    return [h["loss"] for h in log_history if "loss" in h]


def logged(log_history: list[dict], key: str) -> list[float]:
    return [h[key] for h in log_history if key in h]


def max_relative_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Over the tensors of two state dicts with the same keys: max |a - b| / max |b| per tensor."""
    assert sorted(a) == sorted(b)
    return max(float((a[k].float() - b[k].float()).abs().max() / b[k].float().abs().max().clamp_min(1e-30))
               for k in b)
