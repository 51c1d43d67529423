"""Train, through transformers' Trainer, a Llama whose training state (16P bytes) exceeds host RAM.

    python scripts/trainer_bigger_than_ram.py --dir /work/big --hidden 2048 --layers 30 --steps 3 --out big.json

A Hugging Face folder of random bf16 weights is written layer by layer (config.json, one
safetensors shard per layer, the index), so the model is never whole in memory, not even to make
it. `ZeroOffloadTrainer(model=folder)` then builds it on the meta device and streams its weights
into the nvme tier unit by unit; parameters and optimizer state live on the drive at stage 3 and
the Trainer runs its usual loop (bf16, clipping at 1.0, logging every step). It prints P, 16P
against the machine's RAM, the bytes on the drive, the drive traffic per step, each step's time
and the peak RSS (getrusage, the true high-water mark), and writes them as JSON (--out). The
folder and the nvme files are removed at the end unless --keep.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import time
from typing import Any

import psutil
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback, TrainingArguments

from _tokens import Tokens  # scripts/_tokens.py
from zero_offload.hf import ZeroOffloadTrainer

GB = 1e9


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", required=True, help="a directory on the drive: the folder and the nvme files go inside")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--intermediate", type=int, default=5632)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default=None, help="write the figures here as JSON")
    ap.add_argument("--keep", action="store_true", help="keep the model folder and the nvme files")
    a = ap.parse_args()
    if min(a.hidden, a.layers, a.intermediate, a.heads, a.vocab, a.seq, a.steps) < 1 or a.hidden % a.heads:
        ap.error("every size must be >= 1 and --heads must divide --hidden")
    os.makedirs(a.dir, exist_ok=True)
    return a


def llama_config(a: argparse.Namespace) -> LlamaConfig:
    return LlamaConfig(hidden_size=a.hidden, intermediate_size=a.intermediate, num_hidden_layers=a.layers,
                       num_attention_heads=a.heads, num_key_value_heads=a.heads, vocab_size=a.vocab,
                       max_position_embeddings=max(2048, a.seq), dtype="bfloat16")


def write_folder(config: LlamaConfig, folder: str) -> int:
    """Random bf16 weights, one shard per decoder layer (plus one for the rest), as transformers
    lays a sharded folder out; returns P. Norm weights are ones, the rest normal(0, 0.02)."""
    with torch.device("meta"):
        shapes = {n: p.shape for n, p in LlamaForCausalLM(config).named_parameters()}
    os.makedirs(folder, exist_ok=True)
    config.save_pretrained(folder)
    groups: dict[str, list[str]] = {}
    for name in shapes:
        part = name.split(".")
        key = f"layer{int(part[2]):05d}" if name.startswith("model.layers.") else "rest"
        groups.setdefault(key, []).append(name)
    g = torch.Generator().manual_seed(0)
    index: dict[str, str] = {}
    for i, (key, names) in enumerate(sorted(groups.items())):
        file = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file({n: (torch.ones(shapes[n]) if n.endswith("norm.weight") else
                       torch.randn(shapes[n], generator=g) * 0.02).to(torch.bfloat16) for n in names},
                  os.path.join(folder, file), metadata={"format": "pt"})
        index.update({n: file for n in names})
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": index}, f)
    return sum(s.numel() for s in shapes.values())


class StepClock(TrainerCallback):
    """Each optimizer step's wall time and the drive traffic since the last step."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.traffic: list[float] = []
        self._t = time.perf_counter()
        self._io = psutil.disk_io_counters()

    def on_step_begin(self, *args: Any, **kwargs: Any) -> None:
        if not self.times:  # the first step starts here: construction and set-up are not in it
            self._t, self._io = time.perf_counter(), psutil.disk_io_counters()

    def on_step_end(self, *args: Any, **kwargs: Any) -> None:
        now, io = time.perf_counter(), psutil.disk_io_counters()
        self.times.append(now - self._t)
        self.traffic.append((io.read_bytes + io.write_bytes - self._io.read_bytes - self._io.write_bytes) / GB)
        self._t, self._io = now, io
        print(f"  step {len(self.times)}: {self.times[-1]:.1f} s, {self.traffic[-1]:.1f} GB read+written", flush=True)


def du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def main() -> None:
    a = parse()
    folder, nvme = os.path.join(a.dir, "model"), os.path.join(a.dir, "nvme")
    os.makedirs(nvme, exist_ok=True)
    ram = psutil.virtual_memory().total
    config = llama_config(a)
    t0 = time.perf_counter()
    params = write_folder(config, folder)
    print(f"P = {params / 1e9:.2f} B parameters, 16P = {16 * params / GB:.1f} GB = {16 * params / ram:.2f}x host RAM "
          f"({ram / 2**30:.1f} GiB); folder written in {time.perf_counter() - t0:.0f} s ({du(folder) / GB:.1f} GB)")
    args = TrainingArguments(output_dir=os.path.join(a.dir, "out"), per_device_train_batch_size=1, max_steps=a.steps,
                             learning_rate=1e-4, max_grad_norm=1.0, bf16=True, logging_steps=1, save_strategy="no",
                             report_to=[], use_cpu=True, dataloader_num_workers=0, disable_tqdm=False, seed=0)
    clock = StepClock()
    zo = {"stage": 3, "tiers": {"params": "nvme", "optimizer": "nvme", "grads": "cpu"}, "nvme_paths": [nvme]}
    t0 = time.perf_counter()
    trainer = ZeroOffloadTrainer(model=folder, args=args, train_dataset=Tokens(a.steps, a.seq, a.vocab, seed=1),
                                 zero_offload_config=zo, callbacks=[clock])
    setup = time.perf_counter() - t0
    on_drive = du(nvme)
    print(f"engine built in {setup:.0f} s: {on_drive / GB:.1f} GB on the drive", flush=True)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    trainer.engine.close()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    figures = {"params": params, "sixteen_p_over_ram": 16 * params / ram, "ram_bytes": ram, "setup_s": setup,
               "bytes_on_drive": on_drive, "step_s": clock.times, "drive_gb_per_step": clock.traffic,
               "losses": losses, "peak_rss_bytes": peak, "peak_rss_over_ram": peak / ram,
               "host": _host()}
    print(f"peak RSS {peak / 2**30:.2f} GiB = {100 * peak / ram:.0f}% of RAM; steps {[round(t, 1) for t in clock.times]} s; "
          f"losses {[round(x, 3) for x in losses]}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(figures, f, indent=1)
    if not a.keep:
        shutil.rmtree(folder, ignore_errors=True)
        shutil.rmtree(nvme, ignore_errors=True)


def _host() -> str:
    with open("/proc/cpuinfo") as f:
        names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    return f"{names[0] if names else 'unknown CPU'}, {os.cpu_count()} cores"


if __name__ == "__main__":
    main()
