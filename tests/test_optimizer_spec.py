"""The optimizer spec (optim/spec.py, optim/adamw.py) is the one source of an optimizer's state
bytes and part names, and of its hyperparameter checks: a second spec, defined here and nowhere in
the product (one fp32 state part, as plain SGD keeps), moves the ledger and the staging ring's and
sub-shards' arithmetic with it, and AdamW's figures stay the documented ones."""
from __future__ import annotations

import random
import threading
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import pytest
import torch

from zero_offload import ledger
from zero_offload.config import Config, ConfigError
from zero_offload.engine.step.pipeline import DeviceAdam, HostAdam, StateAccess
from zero_offload.engine.step.staging_ring import ALIGN_ELEMENTS as ALIGN, RegionState, StagingRing, aligned, span
from zero_offload.engine.step.subshards import subshard_limit
from zero_offload.optim.adamw import ADAMW, AdamWHyperparams
from zero_offload.optim.cpu_adam import CPUAdam
from zero_offload.optim.flat import adam_step_flat
from zero_offload.optim.registry import spec_for
from zero_offload.optim.spec import Kernels, OptimizerSpec, StatePart
from zero_offload.store import make_store
from zero_offload.store.base import Store


@dataclass(frozen=True)
class _ToyHyper:
    lr: float = 0.1


TOY = OptimizerSpec("toy", (StatePart("master"),), _ToyHyper, Kernels(host="no.such:Kernel", device="no.such:Kernel"))


def _store(tmp_path: Path) -> Store:
    cfg = Config(stage=1, tiers={"optimizer": "nvme", "grads": "cpu"}, nvme_paths=(str(tmp_path),))
    return make_store("nvme", "optimizer", cfg, device=torch.device("cpu"), rank=0, capacity_bytes=8 << 20)


def test_adamw_spec_is_master_m_v_of_four_bytes_each() -> None:
    assert ADAMW.part_names == ("master", "m", "v") and ADAMW.bytes_per_element == 12
    assert ADAMW.state_bytes(10) == 120 and ADAMW.state_numel(10) == 30
    assert spec_for("adamw") is ADAMW and spec_for("adam") is ADAMW
    assert ADAMW.kernel(False) is HostAdam and ADAMW.kernel(True) is DeviceAdam
    with pytest.raises(ValueError, match="optimizer 'sgd' is not one of adamw, adam"):
        spec_for("sgd")


@pytest.mark.parametrize("stage, totals", [(0, (96, 48)), (1, (64, 16)), (2, (48, 16)), (3, (32, 16))])
def test_the_ledger_counts_the_specs_bytes(stage: int, totals: tuple[int, int]) -> None:
    """P = 12, D = 3, bf16: weights 2 + gradients 2 + the toy's 4 bytes per parameter."""
    total, optimizer = totals
    got = ledger.ideal(12, 3, stage, "bf16", spec=TOY).as_dict()["per_device"]
    assert (got["total"], got["optimizer"]) == (total, optimizer)
    assert ledger.bytes_per_param("fp32", TOY) == {"weights": 4, "gradients": 4, "optimizer": 4}
    assert ledger.ideal(12, 3, stage, "bf16").as_dict()["per_device"]["total"] == [192, 96, 80, 64][stage]


def test_the_closed_forms_follow_the_spec() -> None:
    rng = random.Random(1)
    for _ in range(100):
        p, d = rng.randint(0, 10**9), rng.randint(1, 512)
        for stage in range(4):
            assert ledger.ideal(p, d, stage, "bf16", spec=TOY).total == ledger.formula(p, d, stage, TOY)
    assert ledger.formula(12, 3, 1, TOY) == 4 * 12 + Fraction(4 * 12, 3)  # (W+G)P + OP/D


def test_ring_and_subshard_arithmetic_follow_the_spec() -> None:
    assert span(1000, TOY) == aligned(1000) and span(1000) == aligned(3 * 1000)
    budget = 36 * 4 * ALIGN
    assert subshard_limit(budget) == 4 * ALIGN  # three sub-shards of AdamW's 12 bytes
    assert subshard_limit(budget, TOY) == 12 * ALIGN  # three of the toy's 4


def test_a_ring_stages_the_specs_parts(tmp_path: Path) -> None:
    """One part per region: views, the region's length, and the read-ahead bytes flush reports."""
    store, n = _store(tmp_path), 1500
    for i, key in enumerate("ab"):
        store.allocate(key, TOY.state_numel(n), torch.float32)
        store.write(key, torch.arange(n, dtype=torch.float32) + 1000 * i).wait()
    ring = StagingRing(store, 2 * span(n, TOY), TOY)
    ring.plan([("a", n), ("b", n)])
    region = ring.acquire("a", n)
    (master,) = ring.views(region)
    assert torch.equal(master, torch.arange(n, dtype=torch.float32)) and region.length == span(n, TOY)
    ring.release(region)
    for _ in range(500):  # 'b' read ahead, never stepped
        b = ring._index.get("b")  # noqa: SLF001
        if b is not None and b.state is RegionState.PENDING and not ring._busy:  # noqa: SLF001
            break
        threading.Event().wait(0.01)
    assert ring.flush() == TOY.state_bytes(n) == 4 * n
    ring.close()
    store.close()


def test_state_access_splits_a_resident_shard_into_the_specs_parts() -> None:
    cfg = Config(stage=1, tiers={"optimizer": "cpu", "grads": "cpu"})
    store = make_store("cpu", "optimizer", cfg, device=torch.device("cpu"), rank=0, capacity_bytes=1 << 20)
    store.allocate("k", TOY.state_numel(8), torch.float32)
    assert len(StateAccess(store, 0, TOY).resident("k")) == 1
    store.allocate("j", ADAMW.state_numel(8), torch.float32)
    assert len(StateAccess(store, 0).resident("j")) == 3
    store.close()


@pytest.mark.parametrize("parts, message", [
    ((StatePart("m"), StatePart("master")), "its first state part must be the fp32 'master'"),
    ((StatePart("master"), StatePart("m", 2)), r"parts \['m'\] are not 4-byte"),
])
def test_a_spec_the_layout_cannot_hold_is_refused(parts: tuple[StatePart, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        OptimizerSpec("odd", parts, _ToyHyper, TOY.kernels)


def _refusal(call: object) -> str:
    with pytest.raises(ValueError) as err:
        call()  # type: ignore[operator]
    return str(err.value)


def test_one_check_one_wording_for_every_caller() -> None:
    """Config, CPUAdam and adam_step_flat refuse beta2 = 1 through the spec's one check, each
    naming the value its own way and the range the same way."""
    wording = "expected a finite number in [0.0, 1.0)"
    p = torch.zeros(4)
    assert _refusal(lambda: Config(optimizer={"betas": [0.9, 1.0]})).endswith(wording)
    assert _refusal(lambda: CPUAdam([torch.nn.Parameter(torch.zeros(2))], betas=(0.9, 1.0))).endswith(f"({wording})")
    assert _refusal(lambda: adam_step_flat(p, p.clone(), p.clone(), p.clone(), step=1, lr=0.1, beta1=0.9, beta2=1.0,
                                           eps=1e-8, weight_decay=0.0, decoupled=True)).endswith(f"({wording})")
    seen: list[tuple[str, object, str]] = []

    def fail(name: str, value: object, allowed: str) -> None:
        seen.append((name, value, allowed))
        raise ValueError(name)
    with pytest.raises(ValueError):
        AdamWHyperparams(lr=0.1, betas=(0.9, 1.0)).check(fail)
    assert seen == [("betas[1]", 1.0, wording)]


def test_eps_zero_is_torchs_for_kernels_and_refused_by_a_config() -> None:
    """The one difference between the two range tables, kept from before: torch.optim.Adam
    accepts eps = 0, so the drop-ins and kernels do; a training config does not."""
    def never(name: str, value: object, allowed: str) -> None:
        raise AssertionError(f"{name} = {value!r} refused: {allowed}")
    AdamWHyperparams(eps=0.0).check(never)
    with pytest.raises(ConfigError, match=r"'optimizer.eps' = 0 .*\(0.0, inf\)"):
        Config(optimizer={"eps": 0})
