"""Demonstration (a): train a GPT whose training state (16P bytes) is larger than host RAM.

    python scripts/bigger_than_ram.py --nvme-dir /work --width 4096 --layers 13 --steps 3 --out demo.json

The model is built on the meta device (nothing allocated), then Stage3Runtime materializes it
unit by unit (one Linear or LayerNorm at a time, by the init function below) straight
into the NVMe tier: compute-copy shards in the params store, master shard + moments in the
optimizer store. Training then streams each unit NVMe -> RAM for forward and again for backward,
and the optimizer steps shard by shard from NVMe. It prints P, 16P against the machine's RAM, the
peak RSS (getrusage, the true high-water mark) and the per-step time breakdown from the trace,
and writes the same figures as JSON (--out). The NVMe files are removed at the end.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time

import psutil
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
from models import GPT  # noqa: E402

from zero_offload import trace  # noqa: E402
from zero_offload.config import Config  # noqa: E402
from zero_offload.engine.model.materialize import default_init  # noqa: E402
from zero_offload.engine.stage3.runtime import Stage3Runtime  # noqa: E402

GiB = 2**30


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nvme-dir", required=True, help="a directory on the drive; a temporary folder is made inside")
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=13)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default=None, help="write the figures here as JSON")
    a = ap.parse_args()
    if min(a.width, a.layers, a.heads, a.seq, a.batch) < 1 or a.steps < 0 or a.width % a.heads:
        ap.error("--width/--layers/--heads/--seq/--batch must be >= 1, --steps >= 0, --heads must divide --width")
    if not os.path.isdir(a.nvme_dir) or not os.access(a.nvme_dir, os.W_OK):
        ap.error(f"--nvme-dir {a.nvme_dir}: not a writable directory")
    if a.out:
        try:
            open(a.out, "a").close()
        except OSError as e:
            ap.error(f"--out {a.out}: {e.strerror}")
    return a


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def init(module: torch.nn.Module) -> None:
    """reset_parameters, with GPT-2's 0.02 embedding scale (N(0, 1) makes the tied head's logits huge)."""
    if isinstance(module, torch.nn.Embedding):
        torch.nn.init.normal_(module.weight, 0.0, 0.02)
    else:
        default_init(module)


def step_breakdown(spans: list[trace.Span]) -> dict[str, float]:
    out = trace.breakdown(spans)
    fetch_s, hidden = trace.hidden_fraction(spans, "transfer", "compute", name_prefix="fetch")
    out["parameter fetch"] = fetch_s
    out["parameter fetch hidden (fraction)"] = hidden
    return out


def main() -> None:
    a = parse()
    ram = psutil.virtual_memory().total
    with torch.device("meta"):
        model = GPT(vocab=256, d_model=a.width, n_layer=a.layers, n_head=a.heads, seq=a.seq)
    p = sum(t.numel() for t in model.parameters())
    print(f"P = {p / 1e9:.3f} B parameters; 16P = {16 * p / GiB:.1f} GiB = {16 * p / ram:.2f} x host RAM "
          f"({ram / GiB:.1f} GiB)", flush=True)
    with tempfile.TemporaryDirectory(prefix="zo-bigger-", dir=a.nvme_dir) as nvme:
        # Units are the blocks' Linear/LayerNorm children (unit_bytes below a whole block): smaller
        # shards keep the gathered bytes small.
        fc = 4 * a.width * a.width * 4
        cfg = Config(stage=3, tiers={"params": "nvme", "optimizer": "nvme", "grads": "cpu"}, nvme_paths=[nvme],
                     stage3={"unit_bytes": fc + 4 * a.width * 4, "live_budget_bytes": int(3.5 * fc),
                             "prefetch_depth": 2},
                     optimizer={"lr": 1e-4, "weight_decay": 0.01})
        t0 = time.perf_counter()
        rt = Stage3Runtime(model, cfg, torch.device("cpu"), init_fn=init)
        init_s = time.perf_counter() - t0
        print(f"materialized {len(rt.units)} units onto NVMe in {init_s:.1f} s; peak RSS so far "
              f"{peak_rss() / GiB:.2f} GiB", flush=True)
        gen = torch.Generator().manual_seed(0)
        tracer = trace.enable(True)
        steps = []
        for step in range(a.steps):
            tracer.clear()
            x = torch.randint(0, 256, (a.batch, a.seq), generator=gen)
            t = time.perf_counter()
            loss = model(x, torch.roll(x, -1, 1))
            rt.begin_backward(True)
            loss.backward()
            rt.end_backward()
            rt.step()
            wall = time.perf_counter() - t
            parts = step_breakdown(tracer.spans)
            steps.append({"step": step, "loss": loss.item(), "seconds": wall, "breakdown": parts,
                          "peak_rss": peak_rss()})
            print(f"step {step}: loss {loss.item():.4f}, {wall:.1f} s, "
                  f"{a.batch * a.seq / wall:.1f} tokens/s, breakdown "
                  + ", ".join(f"{k} {v:.2f}" for k, v in parts.items()), flush=True)
        trace.enable(False)
        stats = rt.stats()
        disk = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(nvme) for f in fs)
        rt.close()
    result = {"P": p, "16P_bytes": 16 * p, "ram_bytes": ram, "16P_over_ram": 16 * p / ram,
              "peak_rss_bytes": peak_rss(), "peak_rss_over_ram": peak_rss() / ram, "init_seconds": init_s,
              "nvme_bytes": disk, "steps": steps, "stage3": stats, "config": cfg.to_dict()}
    print(f"peak RSS {peak_rss() / GiB:.2f} GiB = {100 * peak_rss() / ram:.1f}% of RAM; NVMe files "
          f"{disk / GiB:.1f} GiB (removed)")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
