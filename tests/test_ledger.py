"""The ledger against the seed's twelve-parameter table and its closed forms."""
from __future__ import annotations

import json
import random
import subprocess
import sys
from fractions import Fraction

import pytest

from zero_offload import ledger

# ../shared/seeds/000_fded82e56b66d4f1.txt: P = 12, D = 3, mixed precision (2 + 2 + 12 bytes).
SEED_TABLE = {
    0: {"weights": 24, "gradients": 24, "optimizer": 144, "total": 192},
    1: {"weights": 24, "gradients": 24, "optimizer": 48, "total": 96},
    2: {"weights": 24, "gradients": 8, "optimizer": 48, "total": 80},
    3: {"weights": 8, "gradients": 8, "optimizer": 48, "total": 64},
}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_seed_table_exactly(stage: int, precision: str) -> None:
    assert ledger.ideal(12, 3, stage, precision).as_dict()["per_device"] == SEED_TABLE[stage]


def test_closed_forms_for_random_p_and_d() -> None:
    rng = random.Random(0)
    for _ in range(200):
        p, d = rng.randint(0, 10**12), rng.randint(1, 4096)
        for stage in range(4):
            assert ledger.ideal(p, d, stage, "bf16").total == ledger.formula(p, d, stage)
    p, d = 7, 3  # not divisible: the ideal keeps the exact fraction
    assert ledger.ideal(p, d, 3).total == Fraction(16 * 7, 3)


def test_fp32_convention_is_4_4_12_with_a_separate_master() -> None:
    led = ledger.ideal(10, 1, 0, "fp32").as_dict()["per_device"]
    assert led == {"weights": 40, "gradients": 40, "optimizer": 120, "total": 200}
    assert ledger.ideal(12, 3, 1, "fp32").as_dict()["per_device"]["total"] == 4 * 12 + 4 * 12 + 12 * 4


def test_offload_moves_bytes_between_columns_and_machine_totals() -> None:
    led = ledger.ideal(12, 3, 3, "bf16", {"params": "nvme", "grads": "cpu", "optimizer": "nvme"})
    d = led.as_dict()
    assert d["per_device"]["total"] == 64
    assert d["per_rank_by_tier"]["device"]["total"] == 0
    assert d["per_rank_by_tier"]["cpu"] == {"weights": 0, "gradients": 8, "optimizer": 0, "total": 8}
    assert d["per_rank_by_tier"]["nvme"] == {"weights": 8, "gradients": 0, "optimizer": 48, "total": 56}
    assert d["machine"] == {"cpu": 24, "nvme": 168}
    # Stage 0 offload keeps a full replica per rank: the machine holds D copies.
    assert ledger.ideal(12, 3, 0, "bf16", {"optimizer": "cpu"}).as_dict()["machine"]["cpu"] == 3 * 144


def test_bad_ledger_input_names_the_argument() -> None:
    with pytest.raises(ValueError, match="dp must be"):
        ledger.ideal(12, 0, 1)
    with pytest.raises(ValueError, match="stage must be"):
        ledger.ideal(12, 3, 4)
    with pytest.raises(ValueError, match="precision 'fp8'"):
        ledger.ideal(12, 3, 1, "fp8")


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zero_offload.cli", *args], capture_output=True, text=True, timeout=120)


def test_estimate_cli_json_reproduces_the_seed() -> None:
    out = _cli("estimate", "--params", "12", "--dp", "3", "--json")
    assert out.returncode == 0, out.stderr
    stages = json.loads(out.stdout)["stages"]
    assert {int(s): v["per_device"] for s, v in stages.items()} == SEED_TABLE


def test_estimate_cli_counts_the_named_optimizers_state() -> None:
    """Lion keeps master + m (8 bytes per parameter): the seed's closed forms with O = 8 instead of 12,
    (2+2+8)P, 4P + 8P/D, 2P + 10P/D, 12P/D at P = 12, D = 3."""
    out = _cli("estimate", "--params", "12", "--dp", "3", "--optimizer", "lion", "--json")
    assert out.returncode == 0, out.stderr
    stages = json.loads(out.stdout)["stages"]
    assert {int(s): v["per_device"]["total"] for s, v in stages.items()} == {0: 144, 1: 80, 2: 64, 3: 48}
    table = _cli("estimate", "--params", "12", "--dp", "3", "--stage", "0", "--optimizer", "lion")
    assert "2+2+8 bytes/param" in table.stdout and "optimizer (master+m)" in table.stdout, table.stdout


def test_estimate_cli_table_names_what_is_excluded() -> None:
    out = _cli("estimate", "--params", "12", "--dp", "3")
    assert out.returncode == 0, out.stderr
    assert "192 B" in out.stdout and "64 B" in out.stdout
    for word in ("activations", "padding", "communication", "not peak memory"):
        assert word in out.stdout


def test_estimate_cli_model_on_meta_device() -> None:
    out = _cli("estimate", "--model", "examples/models.py:gpt_small", "--stage", "3", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["params"] == 29_479_936  # the peer's 29.5M GPT, tied head counted once
    assert data["stages"]["3"]["per_device"]["total"] == 16 * 29_479_936


@pytest.mark.parametrize("args,needle", [
    (["estimate"], "exactly one of --params"),
    (["estimate", "--params", "12", "--dp", "0"], "--dp 0"),
    (["estimate", "--model", "nosuchfile.py:f"], "no such file"),
    (["estimate", "--model", "examples/models.py:nothing"], "no callable 'nothing'"),
    (["estimate", "--params", "12", "--stage", "1", "--params-tier", "cpu"], "needs --stage 3"),
])
def test_estimate_cli_errors_are_one_line(args: list[str], needle: str) -> None:
    out = _cli(*args)
    assert out.returncode == 2
    assert needle in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr
