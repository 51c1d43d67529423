"""Test tiers: each test carries the markers of what it needs, read off the test itself, so no
list beside the tests goes stale:

- `dist`: it starts gloo ranks (`run_ranks`) or a launcher (`torchrun`);
- `hf`: its module uses transformers (or the zoo, built on it);
- `native`: it tests the native library's kernels, loader or I/O engine (NATIVE);
- `slow`: its module took over SLOW_SECONDS in a measured run of the whole suite (SLOW).

`make test-fast` runs the tests that are none of dist, hf and slow (the inner loop); `make test`
runs everything, and CI runs `make test`.
"""
from __future__ import annotations

import inspect
from functools import lru_cache
from types import ModuleType
from typing import Iterator

import pytest
import torch

NATIVE = {"test_adam_fidelity", "test_aio", "test_cpu_adam", "test_emulated_avx512", "test_flat_adam",
          "test_native_loader", "test_nonfinite_step", "test_swap"}
# Modules whose tests took more than SLOW_SECONDS together (pytest --durations=0, session 17,
# 2-core machine): what `make test-fast` leaves out beside dist and hf.
SLOW_SECONDS = 10
SLOW = {"test_engine_matrix", "test_emulated_avx512", "test_interrupt_sweep", "test_lifecycle_faults",
        "test_native_loader", "test_stage3_matrix"}

_MARKERS = {"dist": "starts gloo ranks or a launcher", "hf": "uses transformers", "native": "tests the native library",
            "slow": f"its module takes over {SLOW_SECONDS} s"}


def pytest_configure(config: pytest.Config) -> None:
    for name, meaning in _MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {meaning}")


@lru_cache(maxsize=None)
def _module_source(module: ModuleType) -> str:
    try:
        return inspect.getsource(module)
    except (OSError, TypeError):
        return ""


def _function_source(item: pytest.Item) -> str:
    try:
        return inspect.getsource(item.function)  # type: ignore[attr-defined]
    except (AttributeError, OSError, TypeError):
        return ""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:  # noqa: ARG001
    for item in items:
        module = getattr(item, "module", None)
        if module is None:
            continue
        name = module.__name__.rpartition(".")[2]
        source, body = _module_source(module), _function_source(item)
        if "run_ranks(" in body or "torchrun" in body:
            item.add_marker(pytest.mark.dist)
        if "transformers" in source or "_zoo_models" in source:
            item.add_marker(pytest.mark.hf)
        if name in NATIVE:
            item.add_marker(pytest.mark.native)
        if name in SLOW:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """One intra-op thread for a module of tiny models (`pytestmark = pytest.mark.usefixtures(
    "one_thread")`): their ops are far too small to share, and on a busy machine threads that wait
    on each other cost seconds per step."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
