"""The step pipeline: Adam on each shard where its state lives, overlapped with backward and I/O.

Jobs (one per shard: its gradient and the scalars of this step) enter in gradient-arrival order.
A host kernel (the native CPU Adam, for the cpu and nvme tiers) runs on one worker thread so that
backward goes on while shards are stepped; a device kernel (torch's fused Adam) runs inline, since
the device queues it asynchronously anyway.

State that is not addressable (the nvme tier) passes through the staging ring (staging.py): its
prefetch thread reads the shards ahead in the predicted order (the previous step's), starting as
soon as the previous step ends and going on under forward and backward, as far as
config.pinned_budget_bytes allows; the worker waits only for the reads of the shard it steps, then
starts its write-back and moves on. Write-backs of the last shards are not waited for at the end of
the step: they overlap the next forward.
"""
from __future__ import annotations

import collections
import queue
import threading
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch

from zero_offload.engine.step.staging_ring import ALIGN_ELEMENTS, Region, StagingRing, span
from zero_offload.interrupts import forced_count, held_interrupts
from zero_offload.io.buffers import aligned_tensor
from zero_offload.optim.adamw import ADAMW
# AdamW's kernels and their scalars live with the optimizer (optim/adamw_kernels.py); the engine
# (shard_optimizer via the spec, bench, tests) keeps reaching them by these names here too.
from zero_offload.optim.adamw_kernels import DeviceAdam, HostAdam, Scalars
from zero_offload.optim.flat import NonFiniteUpdate
from zero_offload.optim.spec import OptimizerSpec
from zero_offload.store.base import Handle, Store


class StepKernel(Protocol):
    """A spec's kernel (OptimizerSpec.kernel): called with (master, grad, *the spec's other
    parts, scalars, lowp_out), or `segments` with a job's runs in place of the scalars; `host`
    says it steps host memory (and so runs on the worker thread)."""

    host: bool

    def __call__(self, *args: Any) -> None: ...

    def segments(self, *args: Any) -> None: ...


@dataclass
class Job:
    key: str
    numel: int
    grad: torch.Tensor | Callable[[], torch.Tensor]  # the gradient, or a function that loads it
    scalars: Scalars
    ready: Handle | None = None  # the gradient's own transfer (device → host), if any
    out: torch.Tensor | None = None  # filled: updated weights in the compute dtype
    out_owned: bool = False  # out is a fresh tensor (not the store's master): the receiver may keep it
    into: torch.Tensor | None = None  # write the updated weights here (a sub-shard's slice of its shard's)
    # None: `scalars` holds for the whole job (the common case). Else the (start, end, scalars)
    # of each run of elements stepped with one parameter group's hyperparameters and one step
    # count (param_groups.py, and parameters that skipped steps for want of a gradient); the
    # elements in no run (parameters without a gradient in this step) are not stepped.
    runs: tuple[tuple[int, int, Scalars], ...] | None = None
    # A speculative job (shard_optimizer's under clipping): its state parts are copied here, back
    # to back, before it is stepped, so that a step the clip coefficient changes can be redone.
    snapshot: torch.Tensor | None = None

    def segments(self) -> list[tuple[int, int, Scalars]]:
        """(start, end, scalars) of each run stepped, in order."""
        return [(0, self.numel, self.scalars)] if self.runs is None else list(self.runs)


def hands_over_master(resident: bool, out_dtype: torch.dtype) -> bool:
    """A resident fp32 master is itself the updated weights: the step hands it over and the
    receiver copies from it when it installs them (no second buffer of the weights held
    meanwhile). Any other shard's updated weights go to a buffer of their own."""
    return resident and out_dtype == torch.float32


def updated_buffer(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A fresh buffer for one shard's updated weights. On the host it is page-aligned, so that a
    stage-3 update goes from it to the params tier's drive directly (an unaligned tensor is first
    copied through the swap store's bounce buffers), and pinned where CUDA is, so that its upload
    is asynchronous."""
    if device.type != "cpu":
        return torch.empty(numel, dtype=dtype, device=device)
    # Small pages: the buffer lives on as the parameters' storage (stages 0-2), and a huge page's
    # rounding would add up to 2 MiB to each.
    return aligned_tensor(numel, dtype, pin=torch.cuda.is_available(), huge_pages=False)


def nonfinite_step(job: Job, optimizer: str = ADAMW.title) -> NonFiniteUpdate:
    """The one-line error for a shard whose update left Inf/NaN weights. Raised before the job is
    handed over or its region released: its step count and compute copy stay as they were, and a
    staged (nvme) shard is not written back, so the drive keeps the previous state; a resident
    master and moments (cpu, device) were updated in place and stay non-finite, so every later
    step fails too until a checkpoint is loaded."""
    steps = sorted({s.step for _, _, s in job.segments()}) or [job.scalars.step]
    lrs = sorted({s.lr for _, _, s in job.segments()}) or [job.scalars.lr]
    return NonFiniteUpdate(
        f"step {'/'.join(map(str, steps))}: the {optimizer} update of optimizer shard {job.key!r} left Inf or NaN "
        f"weights (lr {'/'.join(f'{lr:g}' for lr in lrs)}; an lr or gradient too large for fp32); the shard "
        "was not handed over: lower the lr or clip the gradients, and load a checkpoint to go on")


class StateAccess:
    """Hands out a shard's state parts (the spec's: master first): the store's own tensors, or a region of the staging
    ring (staging.py) that the prefetch thread reads ahead into."""

    def __init__(self, store: Store, budget_bytes: int = 0, spec: OptimizerSpec = ADAMW) -> None:
        self.store = store
        self.budget_bytes = budget_bytes
        self.spec = spec  # the optimizer's state parts: what a shard's (master, ...) are
        self.max_numel = 0
        self.total_span = 0  # ring elements every shard together takes: the ring never needs more
        self._ring: StagingRing | None = None

    def add(self, numel: int) -> None:
        """A shard was registered (before any step: a larger one replaces the ring)."""
        self.max_numel = max(self.max_numel, numel)
        self.total_span += span(numel, self.spec)
        if self._ring is not None and self._ring.capacity < span(self.max_numel, self.spec):
            ring, self._ring = self._ring, None
            ring.close()

    def _capacity(self) -> int:
        """fp32 elements: the budget, at most every shard plus a wrap's slack, and at least the
        largest shard (the least that works; three -- one stepping, one writing, one reading --
        is what overlaps, and a smaller budget is warned about)."""
        largest = span(self.max_numel, self.spec)
        budget = self.budget_bytes // 4 // ALIGN_ELEMENTS * ALIGN_ELEMENTS
        if budget < 3 * largest:
            warnings.warn(f"pinned_budget_bytes = {self.budget_bytes} holds fewer than three of the largest "
                          f"optimizer shard ({4 * largest} bytes of {' + '.join(self.spec.part_names)}): NVMe reads and writes will "
                          "not overlap the optimizer step; raise it, or use smaller buckets / units", stacklevel=3)
        return max(largest, min(budget, self.total_span + largest))

    def ring(self) -> StagingRing:
        if self._ring is None:
            self._ring = StagingRing(self.store, self._capacity(), self.spec)
        return self._ring

    def check(self, key: str) -> None:
        """Raise if the drive holds an older copy of `key` than its last update (see staging.py)."""
        if self._ring is not None:
            self._ring.check(key)

    def rewritten(self, key: str) -> None:
        if self._ring is not None:
            self._ring.rewritten(key)

    @property
    def staging_bytes(self) -> int:
        return 0 if self._ring is None else self._ring.nbytes

    def resident(self, key: str) -> tuple[torch.Tensor, ...] | None:
        """The shard's parts (master first) as views of the store's own tensor, or None when it is not addressable."""
        state = self.store.view(key)
        return None if state is None else state.view(len(self.spec.parts), -1).unbind(0)

    def plan(self, shards: list[tuple[str, int]]) -> None:
        """Start reading these shards ahead, in this (predicted stepping) order."""
        staged = [(k, n) for k, n in shards if self.resident(k) is None]
        if staged:
            self.ring().plan(staged)

    def acquire(self, key: str, numel: int) -> tuple[tuple[torch.Tensor, ...], Region | None]:
        """The shard's tensors, ready to step, and its ring region (None when resident)."""
        views = self.resident(key)
        if views is not None:
            return views, None
        ring = self.ring()
        region = ring.acquire(key, numel)
        return ring.views(region), region

    def release(self, region: Region | None) -> None:
        if region is not None:
            if self._ring is None:  # a bug of ours: refused, not an AttributeError (nor gone under -O)
                raise RuntimeError("StateAccess.release: a staging region outlived its ring")
            self._ring.release(region)

    def flush(self, *, after_error: bool = False) -> int:
        """Finish every transfer in flight and forget what the ring holds; return the bytes that
        were read ahead and never stepped. One transaction (interrupts held): a flush split by a
        Ctrl-C left the ring FLUSHING for good, and the next step waited for ever for its reads."""
        with held_interrupts():
            return 0 if self._ring is None else self._ring.flush(after_error=after_error)

    def close(self, *, after_error: bool = False) -> None:
        if self._ring is not None:
            ring, self._ring = self._ring, None
            ring.close(after_error=after_error)


class StepPipeline:
    """Runs jobs in order, on a worker thread for a host kernel, inline for a device kernel."""

    def __init__(self, kernel: StepKernel, access: StateAccess, out_dtype: torch.dtype,
                 planned: Callable[[], list[tuple[str, int]]],
                 on_done: Callable[[Job], None] | None = None) -> None:
        """`on_done`, if given, receives each job as soon as it is stepped, on the thread that
        stepped it (the worker, for a host kernel); the job's `out` is dropped afterwards, so
        updated shards are not all held until the end of the step."""
        self.kernel = kernel
        self.access = access
        self.out_dtype = out_dtype
        self.planned = planned  # the shards' predicted stepping order: what to read ahead
        self.on_done = on_done
        self.done: list[Job] = []
        self._error: BaseException | None = None
        # submit() runs in backward's gradient hooks, where every interpreted line is paid with
        # caches the compute has just flushed: a job is submitted by one C call, its append to
        # `_jobs`, so a Ctrl-C lands before or after it, never between a count and the job (that
        # left drain() waiting for a job that never came). `_queue` only wakes the worker; a
        # wake-up an interrupt kept from being sent is sent by the next wait (_wait_until).
        self._jobs: collections.deque[Job] = collections.deque()
        self._queue: queue.SimpleQueue[bool | None] = queue.SimpleQueue()
        self._idle = threading.Condition()
        self._running = False  # the worker is stepping a job it took from `_jobs` (under _idle)
        self._finished = 0
        self._handed = 0  # jobs of `done` handed to drain's `each` so far
        # The first job of the last drain whose hand-over failed or was interrupted: its state
        # moved on, but its step count or compute copy may not have followed.
        self.failed_hand_over: str | None = None
        # A job that an interrupt (not an error) left inside its pass: its state may or may not
        # have moved on, and its count did not. Kept until its state is rewritten (a load).
        self.unsure: str | None = None
        # The first Ctrl-C that came while drain() waited, held until the step is finished (see
        # _take_done); drain(defer_interrupt=True) leaves it here for take_interrupt().
        self._interrupt: BaseException | None = None
        self._failure: BaseException | None = None  # the first failure of the drain in progress
        self._worker: threading.Thread | None = None
        if kernel.host:
            self._worker = threading.Thread(target=self._loop, name="zero-offload-step", daemon=True)
            self._worker.start()

    def submit(self, job: Job) -> None:
        """Step `job` (on the worker for a host kernel). Called from one thread at a time: the
        one running backward."""
        if self._worker is None:
            self._run_noting(job)
        else:
            self._jobs.append(job)  # submitted (see __init__)
            self._queue.put(True)

    @property
    def _submitted(self) -> int:
        """Jobs submitted so far: finished, being stepped, or waiting."""
        return self._finished + self._running + len(self._jobs)

    def _busy(self) -> bool:
        """Whether a submitted job is not finished yet (under _idle)."""
        return self._running or bool(self._jobs)

    def _wait_until(self, done: Callable[[], bool]) -> None:
        """Wait on _idle (held) until `done()`; the worker is woken first, in case an interrupt
        came between a job's submission and its wake-up."""
        if self._jobs:
            self._queue.put(True)
        while not done():
            self._idle.wait()

    def _wait_idle(self) -> None:
        """Until the worker has finished every job submitted so far."""
        if self._worker is None:
            return
        with self._idle:
            self._wait_until(lambda: not self._busy())

    def prefetch(self) -> None:
        """Start reading the coming step's state ahead, in the predicted order (after a step,
        and at the forward of a boundary micro-batch; the prefetch thread does the waiting)."""
        if self._worker is not None and self._error is None:
            self.access.plan(self.planned())

    def quiesce(self, *, overwriting: bool = False) -> None:
        """Wait until the worker is idle and no transfer is in flight (before touching the store).
        `overwriting`: the caller rewrites the state (a checkpoint load), so an earlier failed
        write-back is not raised here; it stays reported for each shard until rewritten."""
        self._wait_idle()
        self.access.flush(after_error=overwriting)

    def drain(self, each: Callable[[Job], None] | None = None, *, defer_interrupt: bool = False) -> list[Job]:
        """Wait for every submitted job; return them in completion order (and forget them).
        `each(job)`, if given, runs on this thread as soon as each job is done, while the worker
        steps the rest: a step() after backward installs the shards stepped during backward
        while the worker finishes the last ones. Write-backs may still be in flight
        (StateAccess waits for them before any reuse). A Ctrl-C while waiting lets every job
        finish first (_take_done); it is raised then, or with `defer_interrupt` kept for
        take_interrupt(), so that the caller finishes its own part of the step before it."""
        try:
            self._take_done(each)
        finally:  # `each` may raise: the jobs still in flight finish before anything is forgotten
            self._wait_idle()
            done, self.done = self.done, []
            if each is not None and self._handed < len(done):  # stepped, never handed (an interrupt above)
                self.failed_hand_over = self.failed_hand_over or done[self._handed].key
            err, self._error = self._error, None
            if err is not None:  # reported even when `each` raised too (that error is its context)
                self.access.flush(after_error=True)
                if not isinstance(err, Exception):
                    self._interrupt = None  # a second interrupt: it is `err`
                    raise err  # an interrupt stays an interrupt
                failed = RuntimeError(f"the optimizer step failed: {err}")
                if self._interrupt is not None and not defer_interrupt:  # the Ctrl-C still reaches the user
                    raise self.take_interrupt() from failed  # type: ignore[misc]
                raise failed from err  # (a deferred Ctrl-C stays held: the failure is agreed first)
        if self._interrupt is not None and not defer_interrupt:
            raise self.take_interrupt()  # type: ignore[misc]
        return done

    def take_interrupt(self) -> BaseException | None:
        """The Ctrl-C a finished drain held back, once (None if there was none)."""
        exc, self._interrupt = self._interrupt, None
        return exc

    def settle(self, each: Callable[[Job], None] | None, exc: BaseException) -> None:
        """After `exc` interrupted the step outside drain (while jobs were being submitted): the
        worker skips what it has not begun, and every job it did step is handed to `each`."""
        before = self.failed_hand_over  # of the drain `exc` interrupted, if it was one
        self._stop(exc)
        try:
            self.drain(each)
        except BaseException:  # noqa: BLE001 -- `exc` itself, or what it left behind: `exc` is raised
            pass
        self.failed_hand_over = before or self.failed_hand_over

    def _take_done(self, each: Callable[[Job], None] | None) -> None:
        """Hand each finished job to `each` as it finishes, until every submitted one has or one
        failed. After a failure every job that finished before it is handed over, whatever the
        timing: the worker steps in order and skips the jobs after a failed one. When `each`
        itself fails, the worker is stopped the same way (the jobs not yet begun keep their
        state and step count), every job it did step is still handed over (their state has
        moved on: their step counts must follow), and the first error is raised.

        An interrupt (Ctrl-C) while waiting does not stop the worker: the shards still queued have
        their gradients, so the step is finished on every one of them and handed over, and the
        interrupt is held for drain() to raise once it is, so that every shard ends the step at
        the same count. A second interrupt stops the worker as a failure does, and so does the
        first one to reach this wait when it is a second Ctrl-C that ended the Engine's hold
        (interrupts.forced_count: the first was held, never raised here)."""
        self._handed, self.failed_hand_over, self._interrupt, self._failure = 0, None, None, None
        forced = forced_count()
        while True:
            try:
                self._take_all(each)
                break
            except BaseException as exc:  # an interrupt while waiting: `each`'s own are caught
                if self._interrupt is None and self._failure is None and forced_count() == forced:
                    self._interrupt = exc  # the first: finish the step, then raise it
                    continue
                self._failure = self._failure or exc
                self._stop(exc)
                break
        self._wait_idle()  # the job in flight when `each` failed or the wait was interrupted
        self._failure = self._hand_over(len(self.done), each, self._failure)
        if self._failure is not None:
            raise self._failure

    def _take_all(self, each: Callable[[Job], None] | None) -> None:
        """Hand jobs to `each` as they finish, until every submitted one has or one failed."""
        while True:
            with self._idle:
                if self._worker is not None:
                    self._wait_until(lambda: self._handed < len(self.done) or not self._busy()
                                     or self._error is not None)
                end = len(self.done)
                last = not self._busy() or self._error is not None
            self._failure = self._hand_over(end, each, self._failure)
            if last:
                return

    def _stop(self, exc: BaseException) -> None:
        """The worker skips every job it has not begun (they keep their state and step count)."""
        with self._idle:
            self._error = self._error or exc

    def _hand_over(self, end: int, each: Callable[[Job], None] | None,
                   failure: BaseException | None) -> BaseException | None:
        """Hand `done[_handed:end]` to `each`, counting each job as handed before `each` runs, so
        that an interrupt between two jobs neither skips nor repeats one (one inside `each` is a
        failed hand-over, like an error)."""
        while self._handed < end:
            job = self.done[self._handed]
            try:  # counted inside the try: an interrupt just after is a failed hand-over, not a skipped job
                self._handed += 1
                if each is not None:
                    each(job)
            except BaseException as exc:
                self.failed_hand_over = self.failed_hand_over or job.key
                if failure is None:
                    failure = exc
                    self._stop(exc)
        return failure

    def close(self) -> None:
        """Stop the worker first (it may still touch the staging ring), then the ring's transfers and thread."""
        if self._worker is not None:
            self._queue.put(None)
            self._worker.join()
            self._worker = None
        self.access.close(after_error=self._error is not None)
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError(f"the optimizer step failed: {err}") from err

    def _loop(self) -> None:
        while self._queue.get() is not None:  # a wake-up (None: close)
            while (job := self._take()) is not None:
                try:
                    if self._error is None:
                        self._run(job)
                except BaseException as exc:  # surfaced by drain() on the caller's thread
                    with self._idle:
                        if not isinstance(exc, Exception):
                            self.unsure = self.unsure or job.key
                        self._error = self._error or exc  # the first error (a hand-over may have failed first)
                finally:
                    with self._idle:
                        self._running = False
                        self._finished += 1
                        self._idle.notify_all()

    def _take(self) -> Job | None:
        """The worker's next job, marked as being stepped in the same locked block (so a wait
        never sees it neither queued nor running); None when there is none."""
        with self._idle:
            if not self._jobs:
                return None
            self._running = True
            return self._jobs.popleft()

    def _step(self, job: Job, tensors: tuple[torch.Tensor, ...], out: torch.Tensor | None) -> None:
        """The kernel over the job: its runs of parameter groups, if it has several."""
        try:
            if job.runs is not None:
                self.kernel.segments(*tensors, job.segments(), out)
            else:
                self.kernel(*tensors, job.scalars, out)
        except NonFiniteUpdate as exc:
            raise nonfinite_step(job, self.access.spec.title) from exc

    def _run_noting(self, job: Job) -> None:
        """`_run` inline; an interrupt inside it leaves the job unsure (see `unsure`)."""
        try:
            self._run(job)
        except BaseException as exc:
            if not isinstance(exc, Exception):
                self.unsure = self.unsure or job.key
            raise

    def _run(self, job: Job) -> None:
        (master, *others), staged = self.access.acquire(job.key, job.numel)
        if job.snapshot is not None:
            for part, saved in zip((master, *others), job.snapshot.view(1 + len(others), -1).unbind(0)):
                saved.copy_(part)
        if job.ready is not None:
            job.ready.wait()
        grad = job.grad() if callable(job.grad) else job.grad
        # The kernel's arguments: master, the gradient, then the spec's other parts in its order
        # (AdamW's m and v), whatever the optimizer keeps.
        tensors = (master, grad, *others)
        if job.into is None and hands_over_master(staged is None, self.out_dtype):
            self._step(job, tensors, None)
            job.out, job.out_owned = master, False
        else:
            # The kernel writes the updated weights into a buffer of their own in the same pass
            # (an fp32 copy too: a staged master's ring region is reused once released).
            out = job.into if job.into is not None else updated_buffer(job.numel, self.out_dtype, master.device)
            self._step(job, tensors, out)
            job.out, job.out_owned = out, True
        self.access.release(staged)
        job.grad = torch.empty(0)  # the gradient is consumed: free it now, not at drain()
        try:
            if self.on_done is not None:
                self.on_done(job)
                job.out = None
        finally:  # stepped, whatever the hand-over did: its step count must follow its state
            self.done.append(job)
