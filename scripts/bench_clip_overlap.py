"""The Trainer's step time under clipping: speculative overlapped step vs deferred vs no clipping.

    python scripts/bench_clip_overlap.py --rounds 3 --steps 8

Three ZeroOffloadTrainer runs of one tiny-vocabulary Llama at stage 2 (optimizer on the CPU),
interleaved round by round in a rotating order (these machines are noisy: only ratios within one
run compare):

- `no-clip`: max_grad_norm=0, the CPU step during backward (the norm is still formed and logged);
- `speculative`: max_grad_norm=M with speculative_step_bytes large enough for every shard: the
  step runs during backward as if unclipped, and is redone from its snapshots when it clips;
- `deferred`: max_grad_norm=M with no snapshots: the step waits for the norm after backward.

M is the median of the gradient norms a first run sees, so clipping triggers on some steps and
not on others. It prints each run's median step time (the first step of each run left out), the
ratios against `no-clip`, and how many steps the speculative run kept and redid.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PrinterCallback, TrainerCallback, TrainingArguments

from _tokens import Tokens  # scripts/_tokens.py
from zero_offload.hf import ZeroOffloadTrainer


class Clock(TrainerCallback):
    """Each step's time, and whether the speculative step redid it (its rollback count moved)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.redone: list[bool] = []
        self.rollbacks = lambda: 0
        self._t, self._seen = 0.0, 0

    def on_step_begin(self, *args: Any, **kwargs: Any) -> None:
        self._t = time.perf_counter()

    def on_step_end(self, *args: Any, **kwargs: Any) -> None:
        self.times.append(time.perf_counter() - self._t)
        now = self.rollbacks()
        self.redone.append(now > self._seen)
        self._seen = now


def model(a: argparse.Namespace) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(hidden_size=a.hidden, intermediate_size=4 * a.hidden, num_hidden_layers=a.layers,
                                        num_attention_heads=8, num_key_value_heads=8, vocab_size=512))


def run(a: argparse.Namespace, out: str, max_grad_norm: float,
        speculate: int) -> tuple[list[float], list[float], Any, list[bool]]:
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=a.batch, max_steps=a.steps, learning_rate=1e-3,
                             max_grad_norm=max_grad_norm, logging_steps=1, save_strategy="no", report_to=[],
                             use_cpu=True, disable_tqdm=True, dataloader_num_workers=0, seed=0)
    clock = Clock()
    trainer = ZeroOffloadTrainer(model=model(a), args=args, train_dataset=Tokens(a.steps * a.batch, a.seq, 512),
                                 callbacks=[clock], zero_offload_config={
                                     "stage": 2, "tiers": {"optimizer": "cpu", "grads": "cpu"},
                                     "speculative_step_bytes": speculate})
    trainer.remove_callback(PrinterCallback)  # the log lines; the norms are read from log_history
    clock.rollbacks = lambda: trainer.engine.runtime.shard_optimizer.rollbacks
    trainer.train()
    so = trainer.engine.runtime.shard_optimizer
    norms = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    stats = (so.speculated_steps, so.rollbacks)
    trainer.engine.close()
    return clock.times[1:], norms, stats, clock.redone[1:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    a = ap.parse_args()
    if min(a.rounds, a.steps - 1, a.hidden, a.layers, a.seq, a.batch) < 1:
        ap.error("--rounds, --hidden, --layers, --seq, --batch must be >= 1 and --steps >= 2")
    out = tempfile.mkdtemp(prefix="bench_clip_")
    _, norms, _, _ = run(a, os.path.join(out, "probe"), 0.0, 0)
    max_norm = statistics.median(norms)
    print(f"max_grad_norm = {max_norm:.4g}, the median of the norms {[round(n, 3) for n in norms]}")
    configs = {"no-clip": (0.0, 0), "speculative": (max_norm, 1 << 40), "deferred": (max_norm, 0)}
    times: dict[str, list[float]] = {k: [] for k in configs}
    split: dict[bool, list[float]] = {False: [], True: []}  # the speculative run's kept / redone steps
    names = list(configs)
    for r in range(a.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:  # each config in each position
            t, _, stats, redone = run(a, os.path.join(out, f"{name}{r}"), *configs[name])
            times[name] += t
            if name == "speculative":
                for step_time, again in zip(t, redone):
                    split[again].append(step_time)
            extra = f", kept {stats[0]}, redone {stats[1]}" if name == "speculative" else ""
            print(f"round {r} {name:12s} median {statistics.median(t):.3f} s/step{extra}", flush=True)
    base = statistics.median(times["no-clip"])
    for name in names:
        med = statistics.median(times[name])
        print(f"{name:12s} {med:.3f} s/step = {med / base:.3f}x no-clip")
    for again, label in ((False, "kept"), (True, "redone")):
        if split[again]:
            med = statistics.median(split[again])
            print(f"speculative steps {label:6s} {med:.3f} s/step = {med / base:.3f}x no-clip ({len(split[again])} steps)")


if __name__ == "__main__":
    main()
