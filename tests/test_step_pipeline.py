"""The step pipeline hands each finished job to the caller while the worker steps the rest."""
from __future__ import annotations

import threading

import pytest
import torch

from zero_offload.config import Config
from zero_offload.engine.step.pipeline import Job, Scalars, StateAccess, StepPipeline
from zero_offload.store import make_store

WAIT_S = 10.0  # a bound on every wait below: a broken hand-over fails instead of hanging CI


class _GatedKernel:
    """A host kernel that adds the gradient to the master; the job of shard `gated` waits until
    `gate` is set (by the caller's handling of an earlier job) and records whether it was."""

    host = True

    def __init__(self, gated: int) -> None:
        self.gated, self.gate, self.opened = gated, threading.Event(), None
        self.entered = threading.Event()  # the gated job has begun

    def __call__(self, master: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
                 s: Scalars, out: torch.Tensor | None) -> None:
        if master.numel() == self.gated:
            self.entered.set()
            self.opened = self.gate.wait(WAIT_S)
        master.add_(grad)
        if out is not None:
            out.copy_(master)


def _pipeline(kernel: _GatedKernel, sizes: list[int]) -> StepPipeline:
    cfg = Config(stage=1, tiers={"optimizer": "cpu", "grads": "cpu"})
    store = make_store("cpu", "optimizer", cfg, device=torch.device("cpu"))
    access = StateAccess(store)
    for i, n in enumerate(sizes):
        store.allocate(f"s{i}", 3 * n, torch.float32)
        store.write(f"s{i}", torch.zeros(3 * n)).wait()
        access.add(n)
    return StepPipeline(kernel, access, torch.float32, planned=lambda: [])


def _jobs(sizes: list[int]) -> list[Job]:
    s = Scalars(1, 0.1, 0.9, 0.999, 1e-8, 0.0, True)
    return [Job(f"s{i}", n, torch.full((n,), float(i + 1)), s) for i, n in enumerate(sizes)]


def test_drain_hands_over_each_job_before_the_last_one_is_stepped() -> None:
    sizes = [8, 16, 32]
    kernel = _GatedKernel(gated=32)  # the last job waits for the caller to have the first
    pipe = _pipeline(kernel, sizes)
    seen: list[str] = []

    def each(job: Job) -> None:
        seen.append(job.key)
        assert job.out is not None and torch.equal(job.out, torch.full((job.numel,), float(int(job.key[1:]) + 1)))
        kernel.gate.set()
    for job in _jobs(sizes):
        pipe.submit(job)
    done = pipe.drain(each)
    pipe.close()
    assert kernel.opened is True, "drain() waited for every job before handing any over"
    assert seen == ["s0", "s1", "s2"] and [j.key for j in done] == seen


def test_a_failing_handler_stops_the_step_but_every_stepped_job_is_handed_over() -> None:
    """A handler that fails (installing s0, say) fails the step: the worker skips what it has not
    begun, and every job it did step is still handed over (its state has moved on, its step count
    must follow: a review found them dropped), then the first error is raised as the step's."""
    sizes = [8, 16, 24]
    kernel = _GatedKernel(gated=16)  # s1 is begun before the failure and ends only after it
    seen: list[str] = []

    def fail(job: Job) -> None:
        seen.append(job.key)
        if job.key == "s0":
            assert kernel.entered.wait(WAIT_S)
        raise ValueError(f"handler refused {job.key}")
    pipe = _pipeline(kernel, sizes)

    def open_after_the_failure() -> None:
        for _ in range(int(WAIT_S / 0.001)):
            if pipe._error is not None:
                break
            threading.Event().wait(0.001)
        kernel.gate.set()
    opener = threading.Thread(target=open_after_the_failure)
    opener.start()
    for job in _jobs(sizes):
        pipe.submit(job)
    with pytest.raises(RuntimeError, match="the optimizer step failed: handler refused s0") as info:
        pipe.drain(fail)
    opener.join()
    assert isinstance(info.value.__cause__, ValueError)
    assert pipe._finished == 3  # nothing left in flight
    stepped = [f"s{i}" for i in range(len(sizes)) if pipe.access.store.view(f"s{i}")[0] != 0]
    assert stepped == seen == ["s0", "s1"]  # s1 was in flight: stepped, handed over; s2 skipped
    assert pipe.drain() == []  # nothing of the failed drain is handed over again
    pipe.submit(_jobs(sizes)[0])
    assert [j.key for j in pipe.drain()] == ["s0"]
    pipe.close()


class _FailingKernel(_GatedKernel):
    """Fails on the shard of `bad` elements; the shard before it is stepped only once `gate` is
    set, so the failure can come while the caller still handles earlier jobs."""

    def __init__(self, gated: int, bad: int) -> None:
        super().__init__(gated)
        self.bad = bad

    def __call__(self, master: torch.Tensor, *args: object) -> None:
        if master.numel() == self.bad:
            raise OSError("simulated kernel failure")
        super().__call__(master, *args)


def test_after_a_worker_failure_every_job_stepped_before_it_is_handed_over() -> None:
    """Whatever the timing, the caller gets exactly the jobs that finished before the failure (the
    worker steps in order and skips the rest), then the error; the next step starts clean."""
    sizes = [8, 16, 24, 32]
    kernel = _FailingKernel(gated=16, bad=24)
    pipe = _pipeline(kernel, sizes)
    seen: list[str] = []

    def each(job: Job) -> None:
        seen.append(job.key)
        kernel.gate.set()
    for job in _jobs(sizes):
        pipe.submit(job)
    with pytest.raises(RuntimeError, match="the optimizer step failed: simulated kernel failure"):
        pipe.drain(each)
    assert seen == ["s0", "s1"]
    pipe.submit(_jobs(sizes)[0])
    assert [j.key for j in pipe.drain()] == ["s0"]
    pipe.close()


class _InlineKernel(_GatedKernel):
    host = False  # a device kernel: run inline by submit(), no worker


def test_without_a_worker_drain_hands_over_every_job_in_order() -> None:
    sizes = [8, 16]
    kernel = _InlineKernel(gated=-1)
    pipe = _pipeline(kernel, sizes)
    seen: list[str] = []
    for job in _jobs(sizes):
        pipe.submit(job)
    done = pipe.drain(lambda job: seen.append(job.key))
    assert seen == ["s0", "s1"] and [j.key for j in done] == seen
    pipe.close()
