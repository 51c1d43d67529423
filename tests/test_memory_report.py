"""The memory report's named rows account for every byte retained beyond the ledger's ideal.

For weights and optimizer state, retained - ideal must equal the sum of the rows named for that
group (padding, NVMe slot rounding); the held gradients' difference is their padding where the
ledger counts what is held (stages 0, 2 and 3 with a deferred step); at stage 3 the frozen
parameters are a row of their own, not weights. TinyLM (a tied head, a frozen gain, biases of odd
sizes) at D = 1 and D = 3, so buckets and units are padded and shards are uneven. A review found
the padding row on the last rank only, and stage 3's padding, frozen bytes and params-tier slot
rounding unnamed.
"""
from __future__ import annotations

import tempfile

from typing import Any

import pytest
import torch

from _dist import run_ranks

NAMED = {"weights": ("padding (weights)", "NVMe slot rounding (params)"),
         "optimizer": ("padding (optimizer state)", "NVMe slot rounding (optimizer state)"),
         "gradients": ("padding (gradients held)", "NVMe slot rounding (gradients)")}


def _check(report: dict, tag: str, grads_counted: bool) -> None:
    rows = {r["group"]: r for r in report["rows"] if r["retained"] or r["ideal"]}
    for group, names in NAMED.items():
        if group == "gradients" and not grads_counted:
            continue
        named = sum(report["other"].get(n, 0) for n in names)
        diff = rows[group]["retained"] - rows[group]["ideal"]
        assert abs(diff - named) < 1e-6, f"{tag} {group}: retained - ideal = {diff}, named rows {named}: {report['table']}"


def _rank(rank: int, world: int, nvme: bool) -> None:
    import zero_offload
    from _engine_model import batch, make_model

    with tempfile.TemporaryDirectory() as d:
        for stage in (0, 1, 2, 3):
            tier = "nvme" if nvme else "cpu"
            tiers = {"optimizer": tier, "grads": tier, **({"params": tier} if stage == 3 else {})}
            cfg = dict(stage=stage, tiers=tiers, bucket_bytes=6000, clip_grad_norm=1.0,  # grads held to the step
                       nvme_paths=[d] if nvme else [], **({"stage3": {"unit_modules": ["TinyBlock"]}} if stage == 3 else {}))
            engine = zero_offload.initialize(make_model(), cfg)
            x, y = batch(0, 2)
            engine.backward(engine(x, y))
            report = engine.memory_report(verbose=False)
            tag = f"D={world} stage={stage} tier={tier} rank={rank}"
            _check(report, tag, grads_counted=stage != 1)
            # frozen_gain, 32 fp32 elements: at stage 3 padded to a multiple of 16 x D and sharded;
            # at stages 0-2 whole on every rank (a review: that row was missing there)
            padded = -(-32 // (16 * world)) * 16 * world if stage == 3 else 32 * world
            assert report["other"]["frozen parameters (not in the ledger)"] == 4 * padded // world, tag
            assert ("live budget (stage 3)" in report["limits"]) == (stage == 3), tag
            assert "live budget (stage 3)" not in report["other"], tag
            engine.step()
            _check(engine.memory_report(verbose=False), tag + " after step", grads_counted=False)
            engine.close()


@pytest.mark.parametrize("world, nvme", [(1, True), (3, False)])
def test_named_rows_account_for_retained_minus_ideal(world: int, nvme: bool) -> None:
    run_ranks(_rank, world, timeout=180, nvme=nvme)


@pytest.mark.parametrize("stage", [1, 3])
def test_the_table_puts_each_figure_under_its_own_heading(stage: int) -> None:
    """The process RSS was printed under 'limits (configured, not held)' at stage 3, and a
    gradients row below its ideal had no word of why (a review)."""
    import zero_offload

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    tiers = {"optimizer": "cpu", "grads": "cpu", **({"params": "cpu"} if stage == 3 else {})}
    engine = zero_offload.initialize(model, dict(stage=stage, tiers=tiers))
    engine.backward(engine(torch.randn(4, 64)).sum())
    engine.step()
    report = engine.memory_report(verbose=False)
    engine.close()
    sections: dict[str, list[str]] = {}
    heading = "rows"
    for line in report["table"].splitlines()[2:]:
        if not line.startswith("  "):
            heading = line
        else:
            sections.setdefault(heading, []).append(line.split()[0])
    assert sections["process (measured):"] == ["rss"]
    assert sections.get("limits (configured, not held):", []) == (["live"] if stage == 3 else [])
    assert len(report["notes"]) == 1 and "consumes each grad shard as it arrives" in report["notes"][0]
    assert ("stage 1 keeps only this rank's grad shard" in report["notes"][0]) == (stage == 1)


def _reserved(path: str) -> int:
    """Bytes the files under `path` hold on the drive (posix_fallocate reserves them)."""
    import os

    return sum(os.stat(os.path.join(d, f)).st_blocks * 512 for d, _, files in os.walk(path) for f in files)


@pytest.mark.parametrize("gas", [1, 2])
def test_gradient_files_reserve_the_drive_only_when_gradients_are_held(gas: int, tmp_path: Any) -> None:
    """With the overlapped step and no accumulation no gradient is ever held, yet the grads and
    accumulation swap files were each reserved as large as the state (33 MB on the drive for
    10 MB of optimizer state in a soak run)."""
    import zero_offload

    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 1024))  # 8.4 MB of fp32
    engine = zero_offload.initialize(model, dict(stage=2, tiers={"optimizer": "nvme", "grads": "nvme"},
                                                 nvme_paths=[str(tmp_path)], gradient_accumulation_steps=gas))
    for _ in range(gas):
        engine.backward(engine(torch.randn(4, 1024)).sum())
        engine.step()
    grads = sum(_reserved(str(d)) for d in tmp_path.iterdir() if "gradient" in d.name)
    state = 4 * sum(p.numel() for p in model.parameters())
    engine.close()
    assert (grads < state // 2) == (gas == 1), (grads, state)
