"""Train a GPT-style model with ZeRO stage 3, parameters and optimizer state on any tier.

    python examples/train_gpt.py --params-tier nvme --optimizer-tier nvme --trace out.json

The data is small bundled text: this repository's own Python sources, read as bytes (vocab 256),
cut into random windows. At the end it prints the memory report and the time breakdown measured
from the trace: compute, parameter fetches and how much of their time was hidden behind compute,
collectives, the optimizer step. `--trace out.json` saves the timeline (open it in
https://ui.perfetto.dev). NVMe tiers use `--nvme-dir` (default: a temporary directory, removed at
the end).
"""
from __future__ import annotations

import argparse
import glob
import os
import sys
import tempfile
import time

import torch
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import GPT, gpt_init  # noqa: E402

import zero_offload  # noqa: E402
from zero_offload import trace  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--params-tier", choices=["device", "cpu", "nvme"], default="nvme")
    ap.add_argument("--optimizer-tier", choices=["device", "cpu", "nvme"], default="nvme")
    ap.add_argument("--nvme-dir", default=None, help="directory on the drive (default: a temporary one)")
    ap.add_argument("--budget-mib", type=float, default=64.0, help="stage3.live_budget_bytes in MiB")
    ap.add_argument("--prefetch", type=int, default=2, help="stage3.prefetch_depth")
    ap.add_argument("--resident-mib", type=float, default=1.0,
                    help="stage3.resident_bytes in MiB: smaller units (here the embeddings) stay gathered")
    ap.add_argument("--trace", default=None, help="write a Chrome/Perfetto trace here")
    return ap.parse_args()


def corpus() -> torch.Tensor:
    files = sorted(glob.glob(os.path.join(ROOT, "zero_offload", "**", "*.py"), recursive=True))
    data = b"".join(open(f, "rb").read() for f in files)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def windows(data: torch.Tensor, batch: int, seq: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    starts = torch.randint(0, data.numel() - seq - 1, (batch,), generator=gen)
    rows = torch.stack([data[s:s + seq + 1] for s in starts.tolist()])
    return rows[:, :-1], rows[:, 1:]


def config(a: argparse.Namespace, nvme_dir: str) -> dict:
    return {"stage": 3, "precision": {"dtype": a.precision},
            "tiers": {"params": a.params_tier, "optimizer": a.optimizer_tier, "grads": a.optimizer_tier},
            "nvme_paths": [nvme_dir] if "nvme" in (a.params_tier, a.optimizer_tier) else [],
            "optimizer": {"lr": a.lr, "weight_decay": 0.1},
            "stage3": {"unit_modules": ["Block"], "live_budget_bytes": int(a.budget_mib * 2**20),
                       "prefetch_depth": a.prefetch, "resident_bytes": int(a.resident_mib * 2**20)}}


def groups(model: torch.nn.Module) -> list[dict]:
    """The usual recipe: weight decay on matrices and embeddings only, not on biases and norms."""
    named = list(model.named_parameters())
    return [{"params": [n for n, p in named if p.dim() >= 2]},
            {"params": [n for n, p in named if p.dim() < 2], "weight_decay": 0.0}]


def breakdown(spans: list[trace.Span], wall: float, after_ns: int) -> str:
    """Seconds per category, and the share of parameter-fetch time that overlapped compute: over
    all steps, and after step 1 (which records the order and so fetches everything on demand)."""
    cats = trace.breakdown(spans)
    fetch_s, hidden = trace.hidden_fraction(spans, "transfer", "compute", name_prefix="fetch")
    later = [s for s in spans if s.start_ns >= after_ns]
    later_s, later_hidden = trace.hidden_fraction(later, "transfer", "compute", name_prefix="fetch")
    lines = [f"time breakdown over {wall:.2f} s of training (from the trace; categories overlap):"]
    lines += [f"  {cat:10} {sec:8.3f} s" for cat, sec in cats.items()]
    n = sum(1 for s in spans if s.cat == "transfer" and s.name.startswith("fetch"))
    lines.append(f"  parameter fetches: {fetch_s:.3f} s, {100 * hidden:.1f}% hidden behind compute "
                 f"(steps 2+: {later_s:.3f} s, {100 * later_hidden:.1f}% hidden)")
    lines.append(f"  per fetched unit: fetch {1e3 * fetch_s / max(n, 1):.1f} ms, compute "
                 f"{1e3 * cats.get('compute', 0.0) / max(n, 1):.1f} ms (hiding needs compute >= fetch)")
    return "\n".join(lines)


def main() -> None:
    a = parse()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="zo-nvme-", dir=a.nvme_dir) as nvme_dir:
        model = GPT(vocab=256, d_model=a.width, n_layer=a.layers, n_head=a.heads, seq=a.seq)
        model.apply(gpt_init)
        n_params = sum(p.numel() for p in model.parameters())
        engine = zero_offload.initialize(model, config(a, nvme_dir), param_groups=groups(model))
        print(f"GPT: {a.layers} layers, width {a.width}, seq {a.seq}: P = {n_params / 1e6:.2f} M; "
              f"params on {a.params_tier}, optimizer on {a.optimizer_tier}")
        data, gen = corpus(), torch.Generator().manual_seed(0)
        tracer = trace.enable(True)
        start = time.perf_counter()
        bar = tqdm(range(a.steps), unit="step")
        after_first = 0
        for step in bar:
            t0 = time.perf_counter()
            x, y = windows(data, a.batch, a.seq, gen)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            bar.set_postfix(loss=f"{loss.item():.3f}", tok_s=f"{x.numel() / (time.perf_counter() - t0):.0f}")
            after_first = after_first or time.perf_counter_ns()
        wall = time.perf_counter() - start
        trace.enable(False)
        print(f"{a.steps} steps, {a.steps * a.batch * a.seq / wall:.0f} tokens/s, final loss {loss.item():.3f}")
        engine.memory_report()
        print(breakdown(tracer.spans, wall, after_first))
        if a.trace:
            tracer.save(a.trace)
            print(f"trace: {a.trace} ({len(tracer.spans)} spans; open in https://ui.perfetto.dev)")
        engine.close()


if __name__ == "__main__":
    main()
