"""make_buckets: large parameters in backward order, small ones held back into a bucket of their
own at the end (at most one bucket's worth), every parameter exactly once."""
from __future__ import annotations

import torch
from torch import nn

from zero_offload.engine.buckets.grads import SMALL_MAX, make_buckets


def _named(*sizes: int) -> list[tuple[str, nn.Parameter]]:
    return [(f"p{i}", nn.Parameter(torch.zeros(n))) for i, n in enumerate(sizes)]


def _names(named: list[tuple[str, nn.Parameter]], bucket_bytes: int) -> list[list[str]]:
    return [b.names for b in make_buckets(named, bucket_bytes, world=1)]


def test_weights_alone_and_biases_together_at_the_end() -> None:
    # Backward order of two residual blocks: out.bias, out.weight, fc.bias, fc.weight, ...
    named = _named(64, 16384, 256, 16384, 64, 16384, 256, 16384)
    assert _names(named, 65536) == [["p1"], ["p3"], ["p5"], ["p7"], ["p0", "p2", "p4", "p6"]]


def test_small_means_under_a_sixteenth_of_a_bucket_and_under_one_mib() -> None:
    # 4 KiB buckets: a 1 KiB parameter is not small (a sixteenth is 256 B), a 128 B one is.
    assert _names(_named(256, 32, 256), 4096) == [["p0", "p2"], ["p1"]]
    # Huge buckets (a DeepSpeed-style 1 GB): a 4 MiB weight matrix stays in order.
    big = SMALL_MAX // 4 * 4  # 4 MiB of fp32
    assert _names(_named(big, 512, big), 1 << 30) == [["p0", "p2"], ["p1"]]


def test_at_most_one_bucket_of_small_parameters_is_held_back() -> None:
    # A hundred 1 KiB parameters, 64 KiB buckets: all are small (a sixteenth is 4 KiB), but only
    # 64 KiB of them may wait for the end of backward; the rest stay in backward order.
    named = _named(*[256] * 100)
    buckets = make_buckets(named, 65536, world=1)
    held = buckets[-1].names
    assert held == [f"p{i}" for i in range(64)]
    order = [n for b in buckets for n in b.names]
    assert sorted(order) == sorted(n for n, _ in named) and len(order) == 100
    assert [n for b in buckets[:-1] for n in b.names] == [f"p{i}" for i in range(64, 100)]


def test_edge_cases_and_determinism() -> None:
    assert make_buckets([], 4096, world=1) == []
    assert _names(_named(8, 8, 8), 4096) == [["p0", "p1", "p2"]]  # all small: one bucket
    assert _names(_named(2048, 2048), 4096) == [["p0"], ["p1"]]  # all large, each fills a bucket
    named = _named(64, 16384, 256, 16384)
    first = [(b.names, b.layout.padded_numel) for b in make_buckets(named, 65536, world=3)]
    again = [(b.names, b.layout.padded_numel) for b in make_buckets(named, 65536, world=3)]
    assert first == again  # every rank builds the same buckets from the same model
