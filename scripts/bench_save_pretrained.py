"""Benchmark: save a Llama whose weights exceed 4 GB in Hugging Face format, streamed from nvme.

    python scripts/bench_save_pretrained.py                      # 2.19B parameters in bf16: 4.4 GB
    python scripts/bench_save_pretrained.py --layers 2 --hidden 256 --intermediate 512 --vocab 1000  # a smoke run

The model is built on the meta device (nothing allocated; RoPE's inv_freq is a meta buffer too,
which the engine zeroes: it is not persistent, so not saved), then initialized at stage 3 with
parameters and optimizer state on nvme under --nvme-path: the engine materializes it unit by unit
(one decoder layer, or the root's embeddings + norm + lm_head) straight into the drive. Only the
last --trainable-layers decoder layers train (the others are frozen): their fp32 master shards and
moments are on nvme too, so the save reads both kinds of state, masters for trainable parameters
and compute-copy shards for frozen ones, without writing 12 bytes per parameter of optimizer state
for the whole model. Then `zero_offload.hf.save_pretrained(engine, out)` writes config.json and the
weights (model.safetensors, or shards of --max-shard-size).

Printed: the model's size, the output's size, the save's wall time, the largest unit, and the
process's peak RSS during the save, measured by a thread that samples psutil's RSS every 2 ms
from just before the save to its end (with the RSS at its start, so the growth is the save's
own), and getrusage's lifetime maximum before and after (it moves only if the save set a new
high-water mark). The goal: a peak of at most 1.5 GB plus one unit. A few saved tensors are
checked against the engine's values; the drive files and the output are removed at the end
unless --keep.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import threading
import time

import psutil
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import zero_offload  # noqa: E402
from zero_offload.hf import save_pretrained  # noqa: E402

GB = 10 ** 9
GiB = 2 ** 30
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=5632)
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="the model's dtype and the compute dtype")
    ap.add_argument("--trainable-layers", type=int, default=2, help="the last N decoder layers train; the rest frozen")
    ap.add_argument("--nvme-path", default=None, help="a directory on the drive (default: a temporary one in /work)")
    ap.add_argument("--out", default=None, help="where the model is saved (default: inside the nvme folder)")
    ap.add_argument("--max-shard-size", default="50GB", help="as save_pretrained's (default: transformers' 50GB)")
    ap.add_argument("--keep", action="store_true", help="keep the saved model")
    a = ap.parse_args()
    if min(a.hidden, a.intermediate, a.layers, a.heads, a.vocab) < 1 or a.hidden % a.heads:
        ap.error("sizes must be >= 1 and --heads must divide --hidden")
    if not 0 <= a.trainable_layers <= a.layers:
        ap.error("--trainable-layers must be between 0 and --layers")
    return a


def build(a: argparse.Namespace) -> torch.nn.Module:
    """The Llama on the meta device, in the chosen dtype; all but the last layers frozen."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=a.hidden, intermediate_size=a.intermediate, num_hidden_layers=a.layers,
                         num_attention_heads=a.heads, num_key_value_heads=a.heads, vocab_size=a.vocab,
                         tie_word_embeddings=False)
    default = torch.get_default_dtype()
    torch.set_default_dtype(DTYPES[a.dtype])
    try:
        with torch.device("meta"):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    model.requires_grad_(False)
    for layer in model.model.layers[a.layers - a.trainable_layers:]:
        layer.requires_grad_(True)
    if a.trainable_layers == 0:
        model.model.norm.requires_grad_(True)  # the engine needs something to train
    return model


def check_disk(path: str, need: int) -> None:
    free = shutil.disk_usage(path).free
    if free < need * 1.1:
        sys.exit(f"{path} has {free / GB:.1f} GB free; this run needs about {need / GB:.1f} GB")


class PeakRSS:
    """The highest RSS sampled every `interval` seconds while the block runs."""

    def __init__(self, interval: float = 0.002) -> None:
        self.process, self.interval, self.peak, self.samples = psutil.Process(), interval, 0, 0
        self._done = threading.Event()

    def _run(self) -> None:
        while not self._done.is_set():
            self.peak = max(self.peak, self.process.memory_info().rss)
            self.samples += 1
            time.sleep(self.interval)

    def __enter__(self) -> "PeakRSS":
        self.start = self.process.memory_info().rss
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()
        self.peak = max(self.peak, self.process.memory_info().rss)


def maxrss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def folder_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))


def verify(engine: zero_offload.Engine, out: str) -> list[str]:
    """A few saved tensors (one of each kind: frozen, trainable, the root's) equal the engine's values."""
    from safetensors import safe_open

    index = os.path.join(out, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            where = json.load(f)["weight_map"]
    else:
        with safe_open(os.path.join(out, "model.safetensors"), "pt") as f:
            where = {k: "model.safetensors" for k in f.keys()}
    layers = engine.module.config.num_hidden_layers
    keys = ["model.layers.0.mlp.down_proj.weight", f"model.layers.{layers - 1}.self_attn.q_proj.weight",
            "model.norm.weight"]
    values = engine.export_state_dict(keys)
    for k in keys:
        with safe_open(os.path.join(out, where[k]), "pt") as f:
            if not torch.equal(f.get_tensor(k), values[k]):
                raise SystemExit(f"saved {k} differs from the engine's value")
    return keys


def main() -> None:
    a = parse()
    root = a.nvme_path or tempfile.mkdtemp(prefix="bench_save_", dir="/work")
    nvme = os.path.join(root, "nvme")
    out = a.out or os.path.join(root, "saved")
    os.makedirs(nvme, exist_ok=True)
    model = build(a)
    elem = torch.empty((), dtype=DTYPES[a.dtype]).element_size()
    params = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    check_disk(root, 2 * params * elem + 12 * trainable)
    config = {"stage": 3, "tiers": {"params": "nvme", "optimizer": "nvme", "grads": "cpu"}, "nvme_paths": [nvme],
              "precision": {"dtype": a.dtype}, "pinned_budget_bytes": 256 * 2 ** 20,
              "stage3": {"unit_modules": ["LlamaDecoderLayer"], "live_budget_bytes": 2 * GiB}}
    t0 = time.perf_counter()
    engine = zero_offload.initialize(model, config)
    init_s = time.perf_counter() - t0
    unit = max(engine.runtime.units, key=lambda u: u.nbytes)
    try:
        before = maxrss()
        t0 = time.perf_counter()
        with PeakRSS() as rss:
            save_pretrained(engine, out, max_shard_size=a.max_shard_size)
        save_s = time.perf_counter() - t0
        after = maxrss()
        checked = verify(engine, out)
        goal = 1.5 * GB + unit.nbytes
        figures = {
            "parameters": params, "trainable parameters": trainable, "dtype": a.dtype,
            "model bytes (weights)": params * elem, "output bytes": folder_bytes(out),
            "output files": sorted(os.listdir(out)),
            "largest unit": f"{unit.name or '<root>'}: {unit.nbytes} bytes",
            "initialize seconds": round(init_s, 1), "save seconds": round(save_s, 1),
            "RSS at the save's start": rss.start, "peak RSS during the save (psutil, 2 ms samples)": rss.peak,
            "growth during the save": rss.peak - rss.start, "RSS samples": rss.samples,
            "getrusage maxrss before / after the save": [before, after],
            "goal (1.5 GB + largest unit)": int(goal), "peak within goal": rss.peak <= goal,
            "checked against the engine": checked,
        }
        sizes = {"model bytes (weights)", "output bytes", "RSS at the save's start", "growth during the save",
                 "peak RSS during the save (psutil, 2 ms samples)", "goal (1.5 GB + largest unit)"}
        width = max(len(k) for k in figures)
        for k, v in figures.items():
            print(f"{k:<{width}}  {f'{v / GB:.3f} GB ({v} bytes)' if k in sizes else v}")
    finally:
        engine.close()
        if not a.keep:
            shutil.rmtree(out, ignore_errors=True)
        if a.nvme_path is None and not a.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
