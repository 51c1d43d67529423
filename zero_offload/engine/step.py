"""The step pipeline: Adam on each shard where its state lives, overlapped with backward and I/O.

Jobs (one per shard: its gradient and the scalars of this step) enter in gradient-arrival order.
A host kernel (the native CPU Adam, for the cpu and nvme tiers) runs on one worker thread so that
backward goes on while shards are stepped; a device kernel (torch's fused Adam) runs inline, since
the device queues it asynchronously anyway.

State that is not addressable (the nvme tier) passes through a ring of staging sets (at least
three, more as config.pinned_budget_bytes allows): while shard i is stepped, shards i+1 .. i+k are
being read (predicted from the previous step's order; the first ones already during forward) and
shard i-1 is being written. A set is reused only after its previous write completed; the writes of the
last shards are not waited for at the end of the step, so they overlap the next forward. A set
that still holds a key is that shard's newest copy, so nothing ever reads behind a pending write.
The set handed out for the shard being stepped is never taken for a prefetch until it is released.
"""
from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from typing import Callable

import torch

from zero_offload.optim.flat import adam_step_flat
from zero_offload.store.base import Handle, Store

PARTS = ("master", "m", "v")


@dataclass
class Scalars:
    """The per-shard scalars of one update (fixed when the job is submitted)."""

    step: int
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    decoupled: bool
    grad_scale: float = 1.0


@dataclass
class Job:
    key: str
    numel: int
    grad: torch.Tensor | Callable[[], torch.Tensor]  # the gradient, or a function that loads it
    scalars: Scalars
    ready: Handle | None = None  # the gradient's own transfer (device → host), if any
    out: torch.Tensor | None = None  # filled: updated weights in the compute dtype
    out_owned: bool = False  # out is a fresh tensor (not the store's master): the receiver may keep it


class HostAdam:
    """The CPU Adam (native when built) stepping a shard in host memory."""

    host = True

    def __init__(self, threads: int = 0) -> None:
        self.threads = threads

    def __call__(self, master: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
                 s: Scalars, lowp_out: torch.Tensor | None) -> None:
        adam_step_flat(master, grad, m, v, step=s.step, lr=s.lr, beta1=s.beta1, beta2=s.beta2, eps=s.eps,
                       weight_decay=s.weight_decay, decoupled=s.decoupled, grad_scale=s.grad_scale,
                       lowp_out=lowp_out, threads=self.threads or None)


class DeviceAdam:
    """torch's fused Adam/AdamW kernel on the tensors' own device."""

    host = False

    def __call__(self, master: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
                 s: Scalars, lowp_out: torch.Tensor | None) -> None:
        g = grad.float()
        if s.grad_scale != 1.0:
            g = g * s.grad_scale
        step = torch.tensor(float(s.step), device=master.device)
        fused = torch._fused_adamw_ if s.decoupled else torch._fused_adam_
        fused([master], [g], [m], [v], [], [step], lr=s.lr, beta1=s.beta1, beta2=s.beta2,
              weight_decay=s.weight_decay, eps=s.eps, amsgrad=False, maximize=False)
        if lowp_out is not None:
            lowp_out.copy_(master)


@dataclass
class _Set:
    """One staging set: buffers for master, m, v, the key they hold, and transfers in flight."""

    buffers: tuple[torch.Tensor, ...]
    key: str | None = None
    stepping: bool = False  # handed out by acquire() and not yet released: never reused meanwhile
    reads: list[Handle] = field(default_factory=list)
    writes: list[Handle] = field(default_factory=list)

    def settle(self) -> None:
        for h in self.reads + self.writes:
            h.wait()
        self.reads, self.writes = [], []


class StateAccess:
    """Hands out a shard's (master, m, v): the store's own tensors, or staging sets it reads into."""

    def __init__(self, store: Store, budget_bytes: int = 0) -> None:
        self.store = store
        self.budget_bytes = budget_bytes
        self.shards = 0  # how many shards exist (the ring never needs more sets than that + 2)
        self.depth = 3
        self._sets: list[_Set] = []
        self._turn = 0
        self._retired: list[_Set] = []
        self.max_numel = 0

    @property
    def lookahead(self) -> int:
        """Shards read ahead of the one being stepped: all sets but that one and the one writing."""
        return self.depth - 2

    def resident(self, key: str) -> tuple[torch.Tensor, ...] | None:
        views = tuple(self.store.view(f"{key}.{p}") for p in PARTS)
        return None if any(v is None for v in views) else views  # type: ignore[return-value]

    def _take(self, numel: int) -> _Set:
        if not self._sets or self._sets[0].buffers[0].numel() < numel:
            self._retired += self._sets  # one may still be stepping; flush() waits for its writes
            n = max(numel, self.max_numel)
            self.depth = max(3, min(self.shards + 2, self.budget_bytes // max(12 * n, 1)))
            self._sets = [_Set(tuple(self.store.staging_buffer(n, torch.float32) for _ in PARTS))
                          for _ in range(self.depth)]
        s = self._sets[self._turn % self.depth]
        self._turn += 1
        if s.stepping:  # the shard being stepped may sit anywhere in the ring (a hit from an
            s = self._sets[self._turn % self.depth]  # earlier step): take the next set instead
            self._turn += 1
        s.settle()
        s.key = None
        return s

    def prefetch(self, key: str, numel: int) -> None:
        if any(s.key == key for s in self._sets) or self.resident(key) is not None:
            return
        for old in self._retired:  # a retired set may still be writing this shard back
            if old.key == key:
                old.settle()
                old.key = None
        s = self._take(numel)
        s.key = key
        s.reads = [self.store.read(f"{key}.{p}", b[:numel]) for p, b in zip(PARTS, s.buffers)]

    def acquire(self, key: str, numel: int) -> tuple[tuple[torch.Tensor, ...], _Set | None]:
        """The shard's tensors, ready to step. A set that still holds `key` (prefetched, or written
        back last step and not reused since) is the newest copy: no read is needed, only its
        pending transfers must end before the step modifies the buffers."""
        views = self.resident(key)
        if views is not None:
            return views, None
        hit = next((s for s in self._sets if s.key == key), None)
        if hit is None:
            self.prefetch(key, numel)
            hit = next(s for s in self._sets if s.key == key)
        hit.settle()
        hit.stepping = True
        return tuple(b[:numel] for b in hit.buffers), hit

    def release(self, key: str, numel: int, staged: _Set | None) -> None:
        if staged is not None:
            staged.stepping = False
            staged.writes = [self.store.write(f"{key}.{p}", b[:numel]) for p, b in zip(PARTS, staged.buffers)]

    def flush(self, *, after_error: bool = False) -> None:
        """Finish every transfer in flight and forget what the sets hold (their data may be stale).

        After a failed job a set may hold a half-updated shard: forgetting it is what keeps the
        next step reading the store's copy; transfer errors then are already being reported."""
        for s in self._sets + self._retired:
            try:
                s.settle()
            except Exception:
                if not after_error:
                    raise
                s.reads, s.writes = [], []
            s.key, s.stepping = None, False
        self._retired = []


class StepPipeline:
    """Runs jobs in order, on a worker thread for a host kernel, inline for a device kernel."""

    def __init__(self, kernel: HostAdam | DeviceAdam, access: StateAccess, out_dtype: torch.dtype,
                 predict_next: Callable[[str | None, int], list[tuple[str, int]]],
                 on_done: Callable[[Job], None] | None = None) -> None:
        """`on_done`, if given, receives each job as soon as it is stepped, on the thread that
        stepped it (the worker, for a host kernel); the job's `out` is dropped afterwards, so
        updated shards are not all held until the end of the step."""
        self.kernel = kernel
        self.access = access
        self.out_dtype = out_dtype
        self.predict_next = predict_next
        self.on_done = on_done
        self.done: list[Job] = []
        self._error: BaseException | None = None
        self._queue: queue.Queue[Job | str | None] = queue.Queue()
        self._worker: threading.Thread | None = None
        if kernel.host:
            self._worker = threading.Thread(target=self._loop, name="zero-offload-step", daemon=True)
            self._worker.start()

    def submit(self, job: Job) -> None:
        if self._worker is None:
            self._run(job)
        else:
            self._queue.put(job)

    def prefetch_first(self) -> None:
        """Start reading the first shards of the coming step (called at forward time)."""
        if self._worker is not None:
            self._queue.put("prefetch")

    def quiesce(self) -> None:
        """Wait until the worker is idle and no transfer is in flight (before touching the store)."""
        if self._worker is not None:
            self._queue.join()
        self.access.flush()

    def drain(self) -> list[Job]:
        """Wait for every submitted job; return them in completion order (and forget them).
        Write-backs may still be in flight (StateAccess waits for them before any reuse)."""
        if self._worker is not None:
            self._queue.join()
        if self._error is not None:
            err, self._error = self._error, None
            self.done = []
            self.access.flush(after_error=True)
            raise RuntimeError(f"the optimizer step failed: {err}") from err
        done, self.done = self.done, []
        return done

    def close(self) -> None:
        """Stop the worker first (it may still touch the staging sets), then finish the transfers."""
        if self._worker is not None:
            self._queue.put(None)
            self._worker.join()
            self._worker = None
        self.access.flush(after_error=self._error is not None)
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError(f"the optimizer step failed: {err}") from err

    def _loop(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                if self._error is None and job == "prefetch":
                    for key, numel in self.predict_next(None, self.access.lookahead):
                        self.access.prefetch(key, numel)
                elif self._error is None:
                    self._run(job)
            except BaseException as exc:  # surfaced by drain() on the caller's thread
                self._error = exc
            finally:
                self._queue.task_done()

    def _run(self, job: Job) -> None:
        (master, m, v), staged = self.access.acquire(job.key, job.numel)
        for key, numel in self.predict_next(job.key, self.access.lookahead):
            self.access.prefetch(key, numel)
        if job.ready is not None:
            job.ready.wait()
        grad = job.grad() if callable(job.grad) else job.grad
        if self.out_dtype == torch.float32:
            self.kernel(master, grad, m, v, job.scalars, None)
            job.out = master.clone() if staged is not None else master
            job.out_owned = staged is not None
        else:
            pin = master.device.type == "cpu" and torch.cuda.is_available()  # so the upload is async
            job.out = torch.empty(job.numel, dtype=self.out_dtype, device=master.device, pin_memory=pin)
            job.out_owned = True
            self.kernel(master, grad, m, v, job.scalars, job.out)
        self.access.release(job.key, job.numel, staged)
        job.grad = torch.empty(0)  # the gradient is consumed: free it now, not at drain()
        if self.on_done is not None:
            self.on_done(job)
            job.out = None
        self.done.append(job)
