"""Every tier refuses a transfer of the wrong size or dtype, naming the key (a review's finding:
the cpu tier broadcast a 1-element tensor into the whole key, the nvme tier reinterpreted an
int32 or bf16 tensor of the same byte count as float32)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from zero_offload.config import Config
from zero_offload.store import make_store


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
@pytest.mark.parametrize("bad", [torch.full((1,), 9.0), torch.arange(4, dtype=torch.int32),
                                 torch.ones(8, dtype=torch.bfloat16), torch.ones(5)],
                         ids=["one element", "int32 of the same bytes", "bf16 of the same bytes", "one too many"])
def test_a_transfer_of_another_size_or_dtype_is_refused(tier: str, bad: torch.Tensor, tmp_path: Path) -> None:
    store = make_store(tier, "checks", Config(nvme_paths=(str(tmp_path),)), device=torch.device("cpu"),
                       capacity_bytes=1 << 20)
    store.allocate("k", 4, torch.float32)
    store.write("k", torch.arange(4, dtype=torch.float32)).wait()
    with pytest.raises(ValueError, match=r"store \w+: key 'k' holds 4 x torch.float32, got a tensor of"):
        store.write("k", bad)
    with pytest.raises(ValueError, match=r"store \w+: key 'k' holds 4 x torch.float32, got a tensor of"):
        store.read("k", bad.clone())
    out = torch.empty(4)
    store.read("k", out).wait()
    assert torch.equal(out, torch.arange(4, dtype=torch.float32))  # nothing was overwritten
    store.close()


def test_nvme_peak_is_a_high_water_mark(tmp_path: Path) -> None:
    store = make_store("nvme", "peak", Config(nvme_paths=(str(tmp_path),)), device=torch.device("cpu"),
                       capacity_bytes=1 << 20)
    store.allocate("a", 1024, torch.float32)
    store.allocate("b", 1024, torch.float32)
    both = store.bytes_retained()
    store.free("b")
    assert store.bytes_retained() < both and store.peak_bytes() == both
    store.close()
