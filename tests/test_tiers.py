"""The tier registry agrees with what each tier's store does, and with the names config accepts."""
from __future__ import annotations

import pytest
import torch

from zero_offload import config, ledger, tiers
from zero_offload.config import Config
from zero_offload.store import OPENERS, make_store


@pytest.mark.parametrize("record", tiers.REGISTRY, ids=lambda t: t.name)
def test_each_record_matches_its_store(record: tiers.Tier, tmp_path) -> None:
    store = make_store(record.name, "t", Config(nvme_paths=(str(tmp_path),)), device=torch.device("cpu"),
                       capacity_bytes=1 << 20)
    try:
        assert store.tier == record.name
        assert store.addressable == record.resident
    finally:
        store.close()


def test_names_and_lookups() -> None:
    assert tiers.TIERS == ("device", "cpu", "nvme") == config.TIERS == ledger.TIER_COLUMNS
    assert set(OPENERS) == set(tiers.REGISTRY)
    assert [tiers.from_deepspeed(d) for d in ("none", "cpu", "nvme", "gpu", 3)] == [*tiers.REGISTRY, None, None]
    assert [t.name for t in tiers.REGISTRY if t.off_device] == ["cpu", "nvme"]
    assert [t.name for t in tiers.REGISTRY if t.needs_nvme_paths] == ["nvme"]
    with pytest.raises(ValueError, match="unknown tier 'disk': expected device, cpu or nvme"):
        tiers.tier("disk")


def test_make_store_refusals_keep_their_wording() -> None:
    with pytest.raises(ValueError, match=r"^unknown tier 'disk' for g: expected device, cpu or nvme$"):
        make_store("disk", "g", Config(), device=torch.device("cpu"))
    with pytest.raises(ValueError, match=r"^tier 'nvme' for g needs config.nvme_paths$"):
        make_store("nvme", "g", Config(), device=torch.device("cpu"))
