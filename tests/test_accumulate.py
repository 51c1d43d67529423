"""accumulate.Accumulator: partial sums per key on a grads-tier store (cpu and nvme)."""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest
import torch

from zero_offload.config import Config
from zero_offload.engine.step.accumulate import Accumulator
from zero_offload.store import make_store


@pytest.fixture(params=["cpu", "nvme"])
def accumulator(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Accumulator]:
    if request.param == "nvme":
        pytest.importorskip("zero_offload.io.swap")
    config = Config(nvme_paths=(str(tmp_path),))
    store = make_store(request.param, "gradient-accumulation", config, device=torch.device("cpu"),
                       capacity_bytes=1 << 20)
    acc = Accumulator(store)
    yield acc
    acc.close()


def micro_batches(n: int, numel: int = 1000, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(n)
    return [torch.randn(numel, generator=gen).to(dtype) for _ in range(n)]


def test_non_boundary_writes_and_boundary_returns_the_sum(accumulator: Accumulator) -> None:
    grads = micro_batches(3)
    expected = grads[2] + (grads[1] + grads[0])  # the order the engine always added in
    assert accumulator.add("k", grads[0].clone(), boundary=False) is None
    assert accumulator.add("k", grads[1].clone(), boundary=False) is None
    assert "k" in accumulator.store.keys()
    last = grads[2].clone()
    total = accumulator.add("k", last, boundary=True)
    assert total is last  # summed in place into the handed-over tensor
    assert torch.equal(total, expected)


def test_key_is_forgotten_after_the_boundary(accumulator: Accumulator) -> None:
    a, b, c = micro_batches(3, dtype=torch.bfloat16)
    accumulator.add("k", a.clone(), boundary=False)
    assert torch.equal(accumulator.add("k", b.clone(), boundary=True), b + a)
    # the next cycle starts from nothing: the old buffer is neither added nor cleared
    assert torch.equal(accumulator.add("k", c.clone(), boundary=True), c)
    accumulator.add("k", c.clone(), boundary=False)  # an allocated buffer is reused
    assert torch.equal(accumulator.add("k", a.clone(), boundary=True), a + c)
    # A drive slot stays for the next cycle; an adopted micro-batch tensor goes with the sum.
    assert accumulator.store.keys() == ([] if accumulator.store.addressable else ["k"])


@pytest.mark.parametrize("extra", [{"clip_grad_norm": 1.0}, {"precision": {"dtype": "fp16"}}, {}],
                         ids=["clipping", "fp16", "eager"])
def test_accumulated_gradients_are_held_once(extra: dict) -> None:
    """At the boundary the sum is handed on (held for the deferred step, or stepped at once);
    the resident accumulation store used to keep the last micro-batch's tensor beside it, so
    the gradients were retained twice (32768 bytes for an ideal of 16384)."""
    import zero_offload

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64, bias=False), torch.nn.Linear(64, 32, bias=False))
    engine = zero_offload.initialize(model, {"stage": 2, "tiers": {"grads": "cpu", "optimizer": "cpu"},
                                             "gradient_accumulation_steps": 2, **extra})
    for _ in range(4):
        engine.backward(engine(torch.randn(4, 32, dtype=engine.dtype)).float().pow(2).mean())
        engine.step()
    row = next(r for r in engine.memory_report(verbose=False)["rows"] if r["group"] == "gradients")
    engine.close()
    assert row["retained"] == (row["ideal"] if extra else 0)  # eager: each sum is consumed as it arrives


def test_keys_accumulate_independently(accumulator: Accumulator) -> None:
    a, b = micro_batches(2, numel=64), micro_batches(2, numel=4097)
    accumulator.add("a", a[0].clone(), boundary=False)
    accumulator.add("b", b[0].clone(), boundary=False)
    assert torch.equal(accumulator.add("b", b[1].clone(), boundary=True), b[1] + b[0])
    assert torch.equal(accumulator.add("a", a[1].clone(), boundary=True), a[1] + a[0])
    assert sorted(accumulator.store.keys()) == ([] if accumulator.store.addressable else ["a", "b"])


@pytest.mark.parametrize("extra", [{"gradient_accumulation_steps": 2}, {"clip_grad_norm": 1.0}],
                         ids=["accumulation", "clipping"])
def test_flat_gradients_reach_an_nvme_grads_tier_without_bounce_copies(tmp_path: Path, extra: dict) -> None:
    """A bucket's flat gradient (host, several parameters) is page-aligned from its flatten on:
    the accumulation buffer and the gradients held for clipping go to the drive directly."""
    import zero_offload

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))  # one bucket of four
    engine = zero_offload.initialize(model, {"stage": 1, "tiers": {"grads": "nvme", "optimizer": "nvme"},
                                             "nvme_paths": [str(tmp_path)], **extra})
    try:
        for _ in range(4):
            engine.backward(engine(torch.randn(4, 8)).pow(2).sum())
            engine.step()
        stores = [engine.runtime.shard_optimizer.grad_store, engine.runtime.accumulator.store]
        assert sum(s.drive_traffic()[1] for s in stores) > 0
        assert [s.bounced_transfers for s in stores] == [0, 0]
    finally:
        engine.close()


def test_a_resident_tier_keeps_the_handed_over_tensor_instead_of_copying_it(accumulator: Accumulator) -> None:
    """On the cpu tier a partial sum stays in the tensor it arrived in (no copy on the thread
    running backward); a tensor that is part of a larger storage is copied, so the store never
    holds more bytes than it reports. The nvme tier has to write."""
    a, b, c = micro_batches(3)
    first = a.clone()
    accumulator.add("k", first, boundary=False)
    held = accumulator.store.view("k")
    if accumulator.store.tier == "nvme":
        assert held is None and accumulator.store.adopt("k", b.clone()) is False
        return
    assert held.data_ptr() == first.data_ptr()
    part = torch.cat([b, torch.zeros(8)])[:b.numel()]  # a view of a larger buffer: refused
    accumulator.add("k", part, boundary=False)
    assert accumulator.store.view("k").data_ptr() != part.data_ptr()
    assert accumulator.store.bytes_retained() == b.numel() * 4
    assert torch.equal(accumulator.add("k", c.clone(), boundary=True), c + (b + a))


def test_a_resident_store_refuses_to_adopt_a_tensor_of_another_shape_under_a_key() -> None:
    store = make_store("cpu", "grads", Config(), device=torch.device("cpu"), capacity_bytes=1 << 20)
    assert store.adopt("k", torch.zeros(16)) and store.bytes_retained() == 64
    with pytest.raises(ValueError, match="cannot adopt 8"):
        store.adopt("k", torch.zeros(8))


@pytest.mark.parametrize("stage, weights_per_bucket", [(1, 1), (1, 2), (3, 1)])
@pytest.mark.parametrize("extra", [{"gradient_accumulation_steps": 2}, {"clip_grad_norm": 1.0}],
                         ids=["accumulation", "clipping"])
def test_gradients_held_on_the_cpu_tier_are_not_copied(extra: dict, stage: int, weights_per_bucket: int) -> None:
    """Partial sums (accumulation) and the gradients held until the global norm is known
    (clipping) stay in the tensors backward produced (one weight per bucket) or the flat buffer
    of a bucket (two) or of a stage-3 unit: the grads stores never copy one."""
    import zero_offload

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False), torch.nn.Linear(64, 64, bias=False))
    engine = zero_offload.initialize(model, {"stage": stage, "tiers": {"grads": "cpu", "optimizer": "cpu"},
                                             "bucket_bytes": weights_per_bucket * 64 * 64 * 4, **extra})
    stores = [engine.runtime.shard_optimizer.grad_store, engine.runtime.accumulator.store]
    copies: list[str] = []
    for s in stores:
        s.write = lambda key, src, _w=s.write: copies.append(key) or _w(key, src)
    try:
        for _ in range(4):
            engine.backward(engine(torch.randn(4, 64)).pow(2).sum())
            engine.step()
        assert sum(s.peak_bytes() for s in stores) > 0 and copies == []
    finally:
        engine.close()
