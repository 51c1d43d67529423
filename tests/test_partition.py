"""Flat buffers split into equal shards; pieces map parameters to shards and back."""
from __future__ import annotations

import pytest
import torch

from zero_offload.partition import FlatLayout


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_shards_tile_the_flat_buffer_and_round_trip(world: int) -> None:
    torch.manual_seed(0)
    tensors = [torch.randn(s) for s in [(3, 5), (7,), (1,), (4, 4, 2), (13,)]]
    layout = FlatLayout.build([t.shape for t in tensors], world, align=4)
    assert layout.padded_numel % world == 0 and layout.shard_numel % 4 == 0
    assert layout.numel == sum(t.numel() for t in tensors) and layout.padding >= 0
    flat = layout.flatten(tensors)
    rebuilt = [torch.zeros_like(t) for t in tensors]
    for rank in range(world):
        shard = layout.shard_from(tensors, rank, torch.empty(layout.shard_numel))
        lo, hi = layout.shard_range(rank)
        assert torch.equal(shard, flat[lo:hi])
        layout.scatter_into(shard, rank, rebuilt)
    for a, b in zip(tensors, rebuilt):
        assert torch.equal(a, b)
    for view, t in zip(layout.views(flat), tensors):
        assert torch.equal(view, t)


def test_every_element_is_in_exactly_one_piece() -> None:
    layout = FlatLayout.build([(10,), (3,), (8,)], 3, align=1)
    covered = [0] * layout.numel
    for rank in range(3):
        for p in layout.pieces(rank):
            for i in range(p.numel):
                covered[layout.offsets[p.index] + p.param_offset + i] += 1
    assert covered == [1] * layout.numel


def test_bad_layout_input() -> None:
    with pytest.raises(ValueError, match="world size must be >= 1"):
        FlatLayout.build([(2,)], 0)
    layout = FlatLayout.build([(2,)], 2, align=1)
    with pytest.raises(ValueError, match="flat buffer has 3 elements, layout needs 2"):
        layout.views(torch.zeros(3))


@pytest.mark.parametrize("aligned", [False, True])
@pytest.mark.parametrize("scale", [1.0, 0.5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flatten_every_path_gives_the_same_padded_buffer(aligned: bool, scale: float, dtype: torch.dtype) -> None:
    """One native call (scale 1, not page-aligned), or a copy per tensor: the same values, the
    same zeros in the padding, the requested dtype, and a buffer of its own."""
    torch.manual_seed(0)
    tensors = [torch.randn(s) for s in [(3, 5), (7,), (2, 3)]]
    layout = FlatLayout.build([t.shape for t in tensors], 4, align=4)
    assert layout.padding > 0
    flat = layout.flatten(tensors, dtype=dtype, scale=scale, aligned=aligned)
    expected = torch.cat([(t * scale).reshape(-1) for t in tensors]).to(dtype)
    assert flat.dtype == dtype and flat.numel() == layout.padded_numel
    assert torch.equal(flat[:layout.numel], expected)
    assert torch.count_nonzero(flat[layout.numel:]) == 0
    assert all(flat.untyped_storage().data_ptr() != t.untyped_storage().data_ptr() for t in tensors)
    if aligned:
        assert flat.data_ptr() % 4096 == 0


@pytest.mark.parametrize("aligned,scale", [(True, 1.0), (True, 0.5), (False, 1.0), (False, 0.5)])
def test_flatten_refuses_a_tensor_of_the_wrong_size(aligned: bool, scale: float) -> None:
    """A (2,) tensor for a (2, 2) place was broadcast, or left uninitialized memory behind it,
    or gave a buffer shorter than the layout, depending on the path."""
    layout = FlatLayout.build([(3,), (2, 2)], 3, align=4)
    with pytest.raises(ValueError, match=r"FlatLayout.flatten: tensor 1 has 2 elements, its place in the layout is \(2, 2\)"):
        layout.flatten([torch.ones(3), torch.ones(2)], scale=scale, aligned=aligned)
    with pytest.raises(ValueError, match="FlatLayout.flatten: 1 tensors for a layout of 2"):
        layout.flatten([torch.ones(3)], scale=scale, aligned=aligned)
    with pytest.raises(ValueError, match="FlatLayout.shard_from: tensor 1 has 1 elements"):
        layout.shard_from([torch.ones(3), torch.ones(1)], 0, torch.empty(layout.shard_numel))
