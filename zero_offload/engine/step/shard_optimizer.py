"""This rank's optimizer state, one shard per key, on the optimizer tier, and the step over it.

Stage 0-2 (buckets) and stage 3 (units) both hand their reduced gradient shards to one
ShardOptimizer, which owns the fp32 master shard and the moments in a store of the optimizer tier
and runs the step pipeline (step.py) over them.

Exactness with overlap. Stepping a shard while backward still runs is exact only when its update
does not depend on gradients that have not arrived yet. Plain Adam/AdamW qualifies: grad_ready
submits the shard at once (eager mode) and nothing is buffered. Global-norm clipping and the fp16
overflow check need every gradient first. We keep exactness by deferring, not speculating:
grad_ready keeps the shard's gradient in the grads tier and adds its squared norm to a running
sum as it arrives; finish_step all-reduces that one scalar, derives the overflow flag and the clip
coefficient, and only then submits the shards with grad_scale = coefficient / loss scale (the
unscale and the clip fused into the Adam pass, no extra sweep over the gradients).
Cost: the CPU Adam no longer overlaps backward (the nvme prefetch of the first shards still does),
and the gradient shards are held until the step (P/D x gradient bytes on the grads tier, as the
ledger counts for stage 2). Speculating and rolling back would keep the overlap but needs a second
copy of the optimizer state (12 B/param) or an inexact inverse update; we chose the deferral.

Parameters without a gradient (grad_ready's `missing` ranges) are not stepped, as torch's
optimizers skip a .grad of None. Each sub-shard keeps, beside its step count, the element ranges
that fell behind it (`lag`); a job over such ranges, or missing ones, is planned as runs of one
parameter group and one step count with the missing ranges left out (`_plan`: the runs of
parameter groups, generalized). The common case (one group, nothing behind, nothing missing)
builds nothing: one kernel call per job, as before.
"""
from __future__ import annotations

import bisect
import math
from typing import Any, Callable, Sequence

import torch

from zero_offload import comm
from zero_offload.config import Config
from zero_offload.engine.step.subshards import Assembly, SubShard, subshard_limit, split
from zero_offload.engine.step.precision import LossScaler, clip_coefficient
from zero_offload.engine.step.pipeline import Job, Scalars, StateAccess, StepPipeline
from zero_offload.io.buffers import aligned_tensor
from zero_offload.optim.registry import spec_for
from zero_offload.store import make_store
from zero_offload.store.resident import copy_async
from zero_offload.tiers import CPU, tier

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
Ranges = Sequence[tuple[int, int]]  # element ranges (lo, hi) of a shard, in order
Pieces = dict[str, list[tuple[str, int, int, int]]]  # a shard map: shard -> (name, param offset, shard offset, numel)


class HyperParams(torch.optim.Optimizer):
    """The `engine.optimizer`: param_groups that torch LR schedulers drive; it owns no tensors.

    `step()` only records that an update happened (schedulers check it); the update itself is
    ShardOptimizer.finish_step.
    """

    def __init__(self, config: Config, groups: list[dict] | None = None) -> None:
        """One param_group per entry of `groups` (each group's hyperparameters, param_groups.py),
        or a single group of the config's."""
        o = config.optimizer
        super().__init__([{"params": [], **g} for g in groups or [{}]],
                         dict(lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay))
        self._engine_stepping = False

    def step(self, closure: Callable[[], Any] | None = None) -> None:  # noqa: ARG002
        """Called by the engine's step (through the wrapper LR schedulers put on it, so they see
        an update happened); a loop ported from plain torch that calls it itself is told where
        the update is, instead of finding out at the next forward."""
        if not self._engine_stepping:
            raise RuntimeError("engine.optimizer.step(): the update is applied by engine.step() after "
                               "engine.backward(loss); engine.optimizer holds the hyperparameters for schedulers")

    def record_step(self) -> None:
        """The engine applied an update: step() through whatever wraps it (schedulers count it)."""
        self._engine_stepping = True
        try:
            self.step()
        finally:
            self._engine_stepping = False

    def state_dict(self) -> dict[str, Any]:
        """Refused: torch's answer here would hold no state at all ({'state': {}}), and a loop that
        saves it would lose the master and moments without a word."""
        raise RuntimeError("engine.optimizer.state_dict(): engine.optimizer holds the hyperparameters only; the "
                           "optimizer state (master shards, moments, step counts) is saved by "
                           "engine.save_checkpoint(dir)")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # noqa: ARG002
        raise RuntimeError("engine.optimizer.load_state_dict(): the optimizer state is restored by "
                           "engine.load_checkpoint(dir)")


class HandOverFailed(RuntimeError):
    """A step failed while a stepped shard was handed over (on some rank): that shard's master
    moved on, its step count or compute copy may not have. Training cannot go on from there."""


class ShardOptimizer:
    """Owns this rank's optimizer state (fp32 master shard + m + v) per key, on the optimizer tier, and steps it."""

    def __init__(self, config: Config, device: torch.device,
                 on_updated: Callable[[str, torch.Tensor, bool], None] | None = None, *,
                 capacity_bytes: int = 0, replicated: bool | None = None, stream_updates: bool = False) -> None:
        """`capacity_bytes` sizes NVMe files (optimizer state plus held gradients); `replicated`
        (default: stage 0) says every rank holds the same shards, so norms are not summed.
        `on_updated(key, shard, owned)` receives each updated shard: in finish_step, on the
        caller's thread, or with `stream_updates` as soon as the shard is stepped, on the step
        worker (the callback must then be thread-safe and issue no collective)."""
        self.config = config
        self.device = torch.device(device)
        self.on_updated = on_updated
        self.compute_dtype = DTYPES[config.precision.dtype]
        self.replicated = config.stage == 0 if replicated is None else replicated
        self.optimizer = HyperParams(config)
        self.scaler = LossScaler(config.precision)
        rank = comm.rank()
        cap = capacity_bytes or (1 << 30)
        self.store = make_store(config.tiers.optimizer, "optimizer", config, device=self.device, rank=rank,
                                capacity_bytes=cap)
        self.spec = spec_for(config.optimizer.name)  # its state parts, their bytes and its kernels
        kernel = self.spec.kernel(tier(config.tiers.optimizer).on_device)(config.optimizer.threads)
        # The grad shards a deferred step holds: a host kernel has them in host memory already (see
        # _to_kernel), so a device grads tier would upload each again and hand the CPU Adam a
        # device tensor; they stay on the host (the memory report counts them there).
        held_tier = CPU.name if kernel.host and tier(config.tiers.grads).on_device and self.device.type != "cpu" \
            else config.tiers.grads
        # Sized for the whole state only when a step holds gradients; the overlapped step never
        # does, so a drive then reserves a token file (it grows if ever needed).
        holds = not (config.overlap_step and config.clip_grad_norm == 0.0 and not self.scaler.enabled)
        self.grad_store = make_store(held_tier, "gradients", config, device=self.device, rank=rank,
                                     capacity_bytes=cap if holds else (1 << 20))
        self.kernel_device = self.device if not kernel.host else torch.device("cpu")
        self.access = StateAccess(self.store, config.pinned_budget_bytes, self.spec)
        # Only a host kernel streams: its callback runs on the worker. A device kernel runs inline
        # in backward's hooks, where waiting on a write would stall the CPU behind the GPU.
        self.stream_updates = stream_updates and on_updated is not None and kernel.host
        on_done = self._stream if self.stream_updates else None
        self.pipeline = StepPipeline(kernel, self.access, self.compute_dtype, self.planned, on_done)
        self.numel: dict[str, int] = {}
        self.subshards: dict[str, list[SubShard]] = {}  # shard -> its sub-shards (subshards.py)
        self._subshard: dict[str, SubShard] = {}  # sub-shard key -> sub-shard
        self._assembly = Assembly()
        self.group_runs: dict[str, list[tuple[int, int]]] = {}  # shard -> (start, param group) runs
        self.steps: dict[str, int] = {}
        # Adam steps each sub-shard has taken. They differ from their shard's (the least of them)
        # only after a step failed part way through a split shard: each part goes on from its own.
        self.sub_steps: dict[str, int] = {}
        # Parameters without a gradient are not stepped (as torch's optimizers skip a .grad of
        # None), so they fall behind: sub-shard key -> (lo, hi, k), element ranges (shard offsets)
        # whose step count is the sub-shard's minus k. Empty while every parameter has had a
        # gradient in every step.
        self.lag: dict[str, list[tuple[int, int, int]]] = {}
        self._pending: dict[str, tuple[int, list[tuple[int, int, int]]]] = {}  # sub-shard -> (count, lag) once its job is done
        self._missing: dict[str, Ranges] = {}  # held shards' element ranges without a gradient
        self.order: list[str] = []  # gradient-arrival order of the last step (predicts prefetches)
        self._arrived: list[str] = []
        self._held: set[str] = set()
        self._sq_norm = 0.0
        self._norms: list[torch.Tensor] = []  # the overlapped step's shard norms (config.track_grad_norm)
        self.eager = not holds
        # Under clipping (no loss scale), shards may be stepped during backward as if the clip
        # coefficient were 1, their state snapshotted first: kept when it is 1, redone from the
        # snapshots with it when it is not (speculate). Snapshot buffers by sub-shard, kept for reuse.
        self.speculation_bytes = config.speculative_step_bytes if (
            config.overlap_step and config.clip_grad_norm > 0 and not self.scaler.enabled) else 0
        self._snapshots: dict[str, torch.Tensor] = {}
        self.snapshot_bytes = 0  # host bytes the snapshots hold (kept for the next steps)
        self._speculated: list[str] = []
        self.speculated_steps = 0  # steps whose speculative updates were kept (statistics, benchmarks)
        self.rollbacks = 0  # steps that redid them with the clip coefficient
        self.last_grad_norm: float | None = None
        self.skipped_steps = 0
        self.steps_apart: str | None = None  # after a failed step: how its shards stand apart (finish_step)
        self._interrupt: BaseException | None = None  # a Ctrl-C held for the runtime (finish_step)

    # ---- registration ----
    def add_shard(self, key: str, master: torch.Tensor) -> None:
        if key in self.numel:
            raise KeyError(f"ShardOptimizer.add_shard: key {key!r} was already added")
        if master.dim() != 1:
            raise ValueError(f"ShardOptimizer.add_shard({key!r}): master must be 1-D, got shape {tuple(master.shape)}")
        n = master.numel()
        subs = split(key, n, None if self.store.addressable else subshard_limit(self.access.budget_bytes, self.spec))
        self._write_initial(subs, master.detach().reshape(-1))
        # Registered only once every slot is written: a failure (a full drive) leaves no half-added key.
        self.numel[key], self.steps[key], self.subshards[key] = n, 0, subs
        self.group_runs[key] = [(0, 0)]
        for sub in subs:
            self._subshard[sub.key] = sub
            self.sub_steps[sub.key] = 0
            self.access.add(sub.numel)
        self.order.append(key)

    def _write_initial(self, subs: list[SubShard], flat: torch.Tensor) -> None:
        """Each sub-shard's master (from `flat`), m and v (zeros) in a slot of its own; on failure
        the slots already made are freed again."""
        made: list[str] = []
        try:
            for sub in subs:
                self.store.allocate(sub.key, self.spec.state_numel(sub.numel), torch.float32)  # its parts back to back
                made.append(sub.key)
                # Page-aligned: an nvme tier writes it straight to the drive, not through bounce buffers.
                state = aligned_tensor(self.spec.state_numel(sub.numel), torch.float32)
                state[sub.numel:].zero_()
                state[:sub.numel].copy_(flat[sub.lo:sub.hi])
                self.store.write(sub.key, state).wait()
        except BaseException:
            for k in made:
                self.store.free(k)
            raise

    def set_groups(self, hyper: list[dict], group_runs: dict[str, list[tuple[int, int]]]) -> None:
        """Parameter groups (param_groups.py): each group's hyperparameters, and each shard's runs
        of one group, `(start offset, group index)`. Before the first step."""
        if set(group_runs) != set(self.numel):
            raise ValueError("ShardOptimizer.set_groups: the runs must name every shard, and only those")
        self.optimizer = HyperParams(self.config, hyper)
        self.group_runs = {k: list(v) for k, v in group_runs.items()}

    # ---- the step ----
    def grad_ready(self, key: str, grad: torch.Tensor, *, owned: bool = False, missing: Ranges = ()) -> None:
        """This rank's reduced gradient shard for `key`. `owned=True` hands the tensor over (the
        caller will not touch it again), which saves a copy on the CPU. `missing`: the shard's
        element ranges `(lo, hi)`, in order, of parameters that got no gradient (on any rank):
        they are not stepped, as torch's optimizers skip a parameter whose .grad is None."""
        if key not in self.numel:
            raise KeyError(f"ShardOptimizer.grad_ready: unknown key {key!r} (call add_shard first)")
        if grad.numel() != self.numel[key]:
            raise ValueError(f"ShardOptimizer.grad_ready({key!r}): gradient has {grad.numel()} elements, "
                             f"shard has {self.numel[key]}")
        if key in self._held or key in self._arrived:
            raise RuntimeError(f"ShardOptimizer.grad_ready({key!r}) called twice in one step")
        missing = _checked_ranges(key, missing, self.numel[key]) if missing else ()
        if self.eager and self.config.track_grad_norm:  # before the kernel may read it on the worker
            self._norms.append(torch.linalg.vector_norm(grad, dtype=torch.float32))
        grad, ready = self._to_kernel(grad.reshape(-1), owned)
        self._arrived.append(key)
        if self.eager:
            self._submit(key, grad, 1.0, ready, missing)
            return
        if missing:
            self._missing[key] = missing
        if ready is not None:
            ready.wait()
        self._sq_norm += float(torch.linalg.vector_norm(grad, dtype=torch.float32)) ** 2
        # `grad` is ours here (handed over, cloned or downloaded): a resident grads tier keeps it
        # as it is, with no copy on the thread running backward.
        if not self.grad_store.adopt(key, grad):
            if key not in self.grad_store.keys():
                self.grad_store.allocate(key, grad.numel(), grad.dtype)
            self.grad_store.write(key, grad).wait()
        self._held.add(key)
        if self._can_speculate(key):
            self._speculated.append(key)
            self._submit(key, self._held_loader(key), 1.0, missing=missing, speculative=True)

    def _can_speculate(self, key: str) -> bool:
        """Whether `key` may be stepped now as if unclipped: its snapshots fit speculation_bytes."""
        if not self.speculation_bytes:
            return False
        need = sum(4 * self.spec.state_numel(p.numel) for p in self.subshards[key] if p.key not in self._snapshots)
        return self.snapshot_bytes + need <= self.speculation_bytes

    def _snapshot(self, sub: SubShard) -> torch.Tensor:
        if sub.key not in self._snapshots:
            self._snapshots[sub.key] = aligned_tensor(self.spec.state_numel(sub.numel), torch.float32)
            self.snapshot_bytes += 4 * self.spec.state_numel(sub.numel)
        return self._snapshots[sub.key]

    def _roll_back(self, *, restore_copies: bool = False) -> None:
        """The speculative jobs are finished without handing them over (no step count moves), and
        their shards' state is put back from the snapshots: the clip coefficient is not 1, and
        the deferred submission steps them from where they were; or the backward failed, and
        with `restore_copies` the compute copies streamed during it are put back too."""
        self.pipeline.drain()
        self._assembly.abandon()
        self.pipeline.quiesce(overwriting=True)
        for key in self._speculated:
            for p in self.subshards[key]:
                self.store.write(p.key, self._snapshots[p.key]).wait()
                self.access.rewritten(p.key)
            if restore_copies and self.stream_updates and self.on_updated is not None:
                self.on_updated(key, self.master(key), True)
        self.rollbacks += 1

    def finish_step(self, *, defer_interrupt: bool = False) -> bool:
        """Complete the step of every shard that got a gradient; False if it was skipped (overflow).

        A step that fails on any rank fails on every rank (after the local work is finished or
        abandoned): a rank that went on alone would wait for ever in the collectives that follow
        (the all-gathers of the updated shards, the next forward's), or at stage 0 train on
        while its replica differs. An interrupt is not agreed on: it leaves at once.

        A Ctrl-C while the step waits for its shards is held until every shard is stepped (their
        gradients are all there), then raised, or with `defer_interrupt` kept for take_interrupt()
        so that the runtime finishes its own part of the step first. After a step that failed or
        was interrupted part way, `steps_apart` says which shards stand at which step (agreed
        by every rank when the failure is), or is None when they all stand at one."""
        error: Exception | None = None
        applied = True
        self.steps_apart = None
        try:  # a failed step must not leave this step's arrivals behind for the next one
            applied = self.eager or self._submit_held()
            if self.eager and self.config.track_grad_norm:
                self.last_grad_norm = self._eager_norm()
            if applied:
                self.pipeline.drain(self._completed, defer_interrupt=True)
        except Exception as exc:
            error = exc
        except BaseException as exc:  # an interrupt outside drain's waits, or a second one
            self.pipeline.settle(self._completed, exc)
            self.steps_apart = self.mixed_steps()
            raise
        finally:
            self._end_step()
        try:
            self._agree(error, self.pipeline.failed_hand_over)
        finally:  # an error is agreed on (and a runtime's collectives after it run) before the Ctrl-C
            self._interrupt = self.pipeline.take_interrupt()
        if applied:
            self.optimizer.record_step()
        if self._interrupt is not None and not defer_interrupt:
            raise self.take_interrupt()  # type: ignore[misc]
        return applied

    @property
    def failed_hand_over(self) -> str | None:
        """The first shard of the last finish_step or abandon_step whose hand-over failed or was
        interrupted (its master moved on, its step count or compute copy may not have); None if
        none did. Read after a step that raised, where no return value comes back."""
        return self.pipeline.failed_hand_over

    def take_interrupt(self) -> BaseException | None:
        """The Ctrl-C that finish_step(defer_interrupt=True) held back, once (None if none came)."""
        exc, self._interrupt = self._interrupt, None
        return exc

    def mixed_steps(self) -> str | None:
        """One line naming the shards at each step, when this rank's do not all stand at one
        (or a job was interrupted inside its update, stepped or not); None when they do."""
        unsure = self.pipeline.unsure
        if unsure is not None:
            return f"shard {unsure} was interrupted inside its update: its state may have moved on, its step count did not"
        by: dict[int, list[str]] = {}
        for key, n in self.sub_steps.items():
            by.setdefault(n, []).append(key)
        if len(by) <= 1:
            return None
        return ", ".join(f"{_listed(keys)} at step {n}" for n, keys in sorted(by.items(), reverse=True))

    def abandon_step(self) -> None:
        """After a backward that failed part way: the shards the worker was given are finished
        and handed over as after a failed step (their state has moved on: their step counts and
        compute copies follow); gradients held for a deferred step are forgotten."""
        try:
            if self._speculated:  # stepped as if unclipped: back to where they were, as every other shard
                self._roll_back(restore_copies=True)
            self.pipeline.drain(self._completed)
        finally:
            self._end_step()

    def _agree(self, error: Exception | None, lagging: str | None) -> None:
        """Raise this rank's error, or another rank's, on every rank; a HandOverFailed on every
        rank when a hand-over failed on any (`lagging`: the shard whose hand-over failed here).
        Every rank then also knows whether the shards, over all ranks, stand at one step."""
        failed = comm.first_failure(None if error is None else (error.__cause__ or error))
        if failed is None:
            return
        text = str(error) if error is not None else f"the optimizer step failed on rank {failed[0]}: {failed[1]}"
        counts = set(self.sub_steps.values())
        seen = comm.gather_objects((lagging, self.mixed_steps(), min(counts, default=0), max(counts, default=0)))
        self.steps_apart = _apart(seen)
        lag = next(((r, k) for r, (k, *_) in enumerate(seen) if k is not None), None)
        if lag is not None:  # reached by every rank: each knows that some rank failed
            raise HandOverFailed(f"{text} (while handing over shard {lag[1]} on rank {lag[0]})") from error
        if error is not None:
            raise error
        raise RuntimeError(text)

    def _completed(self, job: Job) -> None:
        """A job of this step is done (on the caller's thread, while the worker steps the rest):
        its sub-shard's step count (and lag), and `on_updated` once the whole shard is."""
        owner = self._subshard[job.key].owner
        count, lag = self._pending.pop(job.key, (job.scalars.step, None))
        self.sub_steps[job.key] = count
        if lag is not None:
            self._set_lag(job.key, lag)
        self.steps[owner] = min(self.sub_steps[sub.key] for sub in self.subshards[owner])
        if self.on_updated is not None and not self.stream_updates:
            done = self._updated(job)
            if done is not None:
                self.on_updated(*done)

    def _set_lag(self, sub: str, lag: list[tuple[int, int, int]]) -> None:
        if lag:
            self.lag[sub] = lag
        else:
            self.lag.pop(sub, None)

    def _eager_norm(self) -> float:
        """The global L2 norm of this step's gradients, from the shard norms taken as they arrived
        (as the deferred step forms it: float64 sums of squares, one all-reduce)."""
        total = torch.tensor([sum(float(n) ** 2 for n in self._norms)], dtype=torch.float64)
        if not self.replicated:
            comm.all_reduce_(total)
        return math.sqrt(float(total[0])) if math.isfinite(float(total[0])) else math.inf

    def _submit_held(self) -> bool:
        """Deferred mode: agree on the global norm, then step the held gradients (False: overflow)."""
        total = torch.tensor([self._sq_norm], dtype=torch.float64)
        if not self.replicated:
            comm.all_reduce_(total)
        scale = self.scaler.scale
        norm = math.sqrt(float(total[0])) / scale if math.isfinite(float(total[0])) else math.inf
        self.last_grad_norm = norm
        overflow = self.scaler.enabled and not math.isfinite(norm)
        self.scaler.update(overflow)
        if overflow:
            self.skipped_steps += 1
            return False
        factor = clip_coefficient(norm, self.config.clip_grad_norm) / scale
        ahead = set(self._speculated)
        if ahead and factor != 1.0:
            self._roll_back()
            ahead = set()
        elif ahead:
            self.speculated_steps += 1
        for key in self._arrived:
            if key not in ahead:  # a speculated shard stepped with factor 1 already: exactly this step
                self._submit(key, self._held_loader(key), factor, missing=self._missing.get(key, ()))
        return True

    def _submit(self, key: str, grad: torch.Tensor | Callable[[], torch.Tensor], grad_scale: float,
                ready: Any = None, missing: Ranges = (), speculative: bool = False) -> None:
        """One job per sub-shard of `key`; a split shard's sub-shards write into one assembled
        buffer. A speculative job snapshots its state first (see _roll_back)."""
        subs = self.subshards[key]
        if len(subs) == 1:
            job = self._job(subs[0], grad, grad_scale, ready, missing)
            job.snapshot = self._snapshot(subs[0]) if speculative else None
            self.pipeline.submit(job)
            return
        full = self._assembly.begin(key, self.numel[key], len(subs), self.compute_dtype)
        load = _shared(grad)
        for p in subs:
            job = self._job(p, _slicer(load, p.lo, p.hi), grad_scale, ready, missing, into=full[p.lo:p.hi])
            job.snapshot = self._snapshot(p) if speculative else None
            self.pipeline.submit(job)

    def _job(self, sub: SubShard, grad: torch.Tensor | Callable[[], torch.Tensor], grad_scale: float, ready: Any,
             missing: Ranges, into: torch.Tensor | None = None) -> Job:
        """Sub-shard `sub`'s job: one run of one group's scalars at the sub-shard's next step count
        (the common case, on backward's thread in eager mode: nothing built), else its runs."""
        count = self.sub_steps[sub.key] + 1
        bounds = self.group_runs[sub.owner]
        if len(bounds) == 1 and not missing and sub.key not in self.lag:
            return Job(sub.key, sub.numel, grad, self._scalars(bounds[0][1], count, grad_scale), ready, into=into)
        runs, lag = self._plan(sub, count, grad_scale, missing)
        self._pending[sub.key] = (count, lag)
        whole = len(runs) == 1 and runs[0][:2] == (0, sub.numel)
        first = runs[0][2] if runs else self._scalars(bounds[0][1], count, grad_scale)
        return Job(sub.key, sub.numel, grad, first, ready, into=into, runs=None if whole else tuple(runs))

    def _plan(self, sub: SubShard, count: int, grad_scale: float,
              missing: Ranges) -> tuple[list[tuple[int, int, Scalars]], list[tuple[int, int, int]]]:
        """Sub-shard `sub`'s runs `(start, end, scalars)` (offsets within it) of one group and one
        step count, leaving out the `missing` ranges; and its lag once they are stepped (the
        missing ranges one step further behind)."""
        lo, hi = sub.lo, sub.hi
        groups = self.group_runs[sub.owner]
        lag = self.lag.get(sub.key, [])
        cuts = {lo, hi, *(start for start, _ in groups if lo < start < hi)}
        for a, b, *_ in (*lag, *missing):
            cuts.update(c for c in (a, b) if lo < c < hi)
        points = sorted(cuts)
        runs: list[tuple[int, int, Scalars]] = []
        after: list[tuple[int, int, int]] = []
        for a, b in zip(points, points[1:]):
            i = _covering(lag, a)
            k = lag[i][2] if i is not None else 0
            skipped = _covering(missing, a) is not None
            _extend(after, a, b, k + 1 if skipped else k)
            if skipped:
                continue
            group = groups[bisect.bisect_right(groups, (a, math.inf)) - 1][1]
            sc = self._scalars(group, count - k, grad_scale)
            if runs and runs[-1][1] == a - lo and runs[-1][2] == sc:
                runs[-1] = (runs[-1][0], b - lo, sc)
            else:
                runs.append((a - lo, b - lo, sc))
        return runs, [r for r in after if r[2]]

    def _updated(self, job: Job) -> tuple[str, torch.Tensor, bool] | None:
        """(shard, updated compute copy, owned) once `job` completes its shard, else None."""
        sub = self._subshard[job.key]
        if sub.key == sub.owner:
            if job.out is None:
                raise RuntimeError(f"shard {sub.owner}: stepped without an updated buffer (internal error)")
            return sub.owner, job.out, job.out_owned
        full = self._assembly.subshard_done(sub.owner)
        return None if full is None else (sub.owner, full, True)

    def _stream(self, job: Job) -> None:
        if self.on_updated is None:
            raise RuntimeError("updates streamed without a receiver (internal error)")
        done = self._updated(job)
        if done is not None:
            self.on_updated(*done)

    def _held_loader(self, key: str) -> Callable[[], torch.Tensor]:
        store, numel = self.grad_store, self.numel[key]

        def load() -> torch.Tensor:
            view = store.view(key)
            if view is not None:
                return view
            buf = store.staging_buffer(numel, self.compute_dtype)  # page-aligned on nvme: no bounce copy
            return store.read(key, buf).wait()
        return load

    def _end_step(self) -> None:
        self._assembly.abandon()  # empty unless the step failed part way
        self._pending.clear()  # jobs the worker skipped after a failure: their counts stay
        if self._arrived:
            self.order = list(self._arrived) + [k for k in self.order if k not in self._arrived]
        self._arrived, self._held, self._sq_norm, self._missing = [], set(), 0.0, {}
        self._norms, self._speculated = [], []

    def zero_grads(self) -> None:
        """Forget gradients handed in since the last step (their buffers stay for reuse)."""
        if self.eager and self._arrived:
            raise RuntimeError("ShardOptimizer.zero_grads: eager shards were already stepped; call finish_step")
        if self._speculated:
            self._roll_back(restore_copies=True)
        self._arrived, self._held, self._sq_norm, self._missing = [], set(), 0.0, {}
        self._norms = []

    def _scalars(self, group: int, step: int, grad_scale: float) -> Scalars:
        g = self.optimizer.param_groups[group]
        b1, b2 = g["betas"]
        return Scalars(step, float(g["lr"]), b1, b2, float(g["eps"]), float(g["weight_decay"]),
                       self.config.optimizer.name == "adamw", grad_scale)

    def _to_kernel(self, grad: torch.Tensor, owned: bool) -> tuple[torch.Tensor, Any]:
        """The gradient where the kernel runs: device→pinned host on a side stream, or kept."""
        if grad.device == self.kernel_device:
            return (grad if owned else grad.clone()), None
        dst = torch.empty(grad.numel(), dtype=grad.dtype, device=self.kernel_device,
                          pin_memory=self.kernel_device.type == "cpu" and torch.cuda.is_available())
        return dst, copy_async(dst, grad)

    def planned(self) -> list[tuple[str, int]]:
        """The sub-shards in their expected stepping order (the last step's arrival order)."""
        return [(p.key, p.numel) for k in self.order for p in self.subshards[k]]

    def prefetch(self) -> None:
        """Start reading the coming step's state (the runtimes call it at the end of a step, once
        the updated shards are installed, and at the forward of a boundary micro-batch), so the
        NVMe reads overlap whatever comes before the next backward."""
        self.pipeline.prefetch()

    # ---- state ----
    def master(self, key: str) -> torch.Tensor:
        """A fp32 copy of `key`'s master shard (on the CPU), read one sub-shard at a time: the
        moments pass through and are never held for the whole shard (a streamed save reads
        every master shard)."""
        self.pipeline.quiesce()
        out = torch.empty(self.numel[key], dtype=torch.float32)
        for p in self.subshards[key]:
            self.access.check(p.key)
            sub = self.store.read(p.key, torch.empty(self.spec.state_numel(p.numel), dtype=torch.float32)).wait()
            out[p.lo:p.hi].copy_(sub.view(len(self.spec.parts), -1)[self.spec.part_names.index("master")])
        return out

    def read_state(self, key: str) -> dict[str, torch.Tensor]:
        """CPU copies of a shard's parts ('master', 'm', 'v'), read through its store in one go."""
        self.pipeline.quiesce()
        out = torch.empty(len(self.spec.parts), self.numel[key], dtype=torch.float32)
        for p in self.subshards[key]:
            self.access.check(p.key)
            sub = self.store.read(p.key, torch.empty(self.spec.state_numel(p.numel), dtype=torch.float32)).wait()
            out[:, p.lo:p.hi].copy_(sub.view(len(self.spec.parts), -1))
        return dict(zip(self.spec.part_names, out.unbind(0)))

    def write_state(self, key: str, parts: dict[str, torch.Tensor]) -> None:
        """Replace a shard's master, m and v (each 1-D, of the shard's size). An earlier failed
        write-back (of any shard) is not raised here: this is how the state is recovered after
        one (a checkpoint load), and a shard not rewritten stays refused until it is."""
        self.pipeline.quiesce(overwriting=True)
        n = self.numel[key]
        values = [parts[part].detach().reshape(-1) for part in self.spec.part_names]
        for part, value in zip(self.spec.part_names, values):
            if value.numel() != n:
                raise ValueError(f"ShardOptimizer.write_state({key!r}): {part} has {value.numel()} elements, "
                                 f"the shard has {n}")
        for p in self.subshards[key]:  # on the host: parts may come from any device (a master edited on the GPU)
            state = torch.cat([v[p.lo:p.hi].to("cpu", torch.float32) for v in values])
            self.store.write(p.key, state).wait()
            self.access.rewritten(p.key)
            if self.pipeline.unsure == p.key:  # its state is known again
                self.pipeline.unsure = None

    def take_edit(self, key: str, master: torch.Tensor, changed: torch.Tensor | None = None) -> None:
        """A user's edit of a shard's parameters becomes its master, the moments kept, as a torch
        optimizer steps whatever the parameter holds and keeps its state when a weight is edited
        in place. `master`: this rank's shard of the edited values, in any dtype (in bf16/fp16
        the master takes the compute copy's values); with `changed` (a bool mask) only those
        elements do, so a write to a few rows leaves the others' fp32 bits alone."""
        parts = self.read_state(key)
        edited = master.detach().to("cpu", torch.float32).reshape(-1)
        if changed is not None:
            edited = torch.where(changed.to("cpu").reshape(-1), edited, parts["master"])
        parts["master"] = edited
        self.write_state(key, parts)

    def state_dict(self) -> dict:
        return {**self.state_dict_scalars(), "lagging": self.lagging(),
                "state": {k: self.read_state(k) for k in self.numel}}

    def state_dict_scalars(self) -> dict:
        """Everything but the tensors (JSON-ready): step counts, hyperparameters, loss scaler."""
        return {"steps": dict(self.steps), "sub_steps": dict(self.sub_steps), "param_groups": self._groups(),
                "scaler": self.scaler.state_dict(), "skipped_steps": self.skipped_steps}

    def load_state_dict(self, sd: dict) -> None:
        missing = set(self.numel) - set(sd["state"])
        if missing:
            raise KeyError(f"ShardOptimizer.load_state_dict: no state for shards {sorted(missing)}")
        for key, parts in sd["state"].items():
            self.write_state(key, parts)
        self.load_scalars(sd, lagging=sd.get("lagging", {}))

    def load_scalars(self, sd: dict, *, same_layout: bool = True, scaler: bool = True,
                     lagging: dict[str, list[list[int]]] | None = None, pieces: Pieces | None = None) -> None:
        """Everything but the tensors. With another layout (world size, buckets) the shard keys
        differ; every shard then takes the largest saved step count (they differ only after a step
        that failed part way, when the ones it skipped are one behind). `lagging` (see lagging())
        gives the parameters that had fewer steps their own counts again, through `pieces` (the
        shard map); without it (a checkpoint saved before per-parameter counts, when every
        parameter was stepped) every element takes its sub-shard's count.
        `scaler=False` keeps this optimizer's own loss scaler (the saved one is another precision's)."""
        if same_layout and set(sd["steps"]) == set(self.steps):
            self.steps.update({k: int(v) for k, v in sd["steps"].items()})
        else:
            top = max((int(v) for v in sd["steps"].values()), default=0)
            self.steps = {k: top for k in self.steps}
        self.sub_steps = {sub.key: self.steps[key] for key, subs in self.subshards.items() for sub in subs}
        saved_subs = {k: int(v) for k, v in sd.get("sub_steps", {}).items()}
        if same_layout and set(saved_subs) == set(self.sub_steps):
            self.sub_steps = saved_subs
        self._load_lagging(lagging or {}, pieces or self._own_pieces())
        for group, saved in zip(self.optimizer.param_groups, sd["param_groups"]):
            group.update({k: (tuple(v) if k == "betas" else v) for k, v in saved.items()})
        if scaler:
            self.scaler.load_state_dict(sd["scaler"])
        self.skipped_steps = int(sd.get("skipped_steps", 0))

    def lagging(self, pieces: Pieces | None = None) -> dict[str, list[list[int]]]:
        """The element ranges whose step count is below their sub-shard's (parameters that had no
        gradient in some steps), by parameter: name -> [[parameter offset, numel, step count]].
        In parameter coordinates, through `pieces` (the shard map: shard -> (name, parameter
        offset, shard offset, numel)), so a checkpoint loads at another world size or bucketing;
        without it each shard is one parameter named by its key."""
        pieces = pieces or self._own_pieces()
        out: dict[str, list[list[int]]] = {}
        for key, subs in self.subshards.items():
            for sub in subs:
                for lo, hi, k in self.lag.get(sub.key, ()):
                    for name, poff, soff, n in pieces[key]:
                        a, b = max(lo, soff), min(hi, soff + n)
                        if a < b:
                            out.setdefault(name, []).append([poff + a - soff, b - a, self.sub_steps[sub.key] - k])
        return out

    def _load_lagging(self, saved: dict[str, list[list[int]]], pieces: Pieces) -> None:
        """self.lag from `saved` (lagging()'s form) against the sub-shards' counts as loaded; a
        range saved with as many steps as its sub-shard has now (or more) does not lag."""
        lag: dict[str, list[tuple[int, int, int]]] = {}
        for key, subs in self.subshards.items():
            for name, poff, soff, n in pieces.get(key, ()):
                for qoff, qn, count in saved.get(name, ()):
                    a, b = max(poff, qoff), min(poff + n, qoff + qn)
                    for sub in subs if a < b else ():
                        lo, hi = max(soff + a - poff, sub.lo), min(soff + b - poff, sub.hi)
                        if lo < hi and self.sub_steps[sub.key] > count:
                            lag.setdefault(sub.key, []).append((lo, hi, self.sub_steps[sub.key] - count))
        self.lag = {}
        for sub, ranges in lag.items():
            merged: list[tuple[int, int, int]] = []
            for lo, hi, k in sorted(ranges):
                _extend(merged, lo, hi, k)
            self.lag[sub] = merged

    def _own_pieces(self) -> Pieces:
        return {key: [(key, 0, 0, n)] for key, n in self.numel.items()}

    def _groups(self) -> list[dict]:
        return [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items() if k != "params"}
                for g in self.optimizer.param_groups]

    def bytes_retained(self) -> dict[str, int]:
        return {f"optimizer/{self.store.tier}": self.store.bytes_retained(),
                f"gradients/{self.grad_store.tier}": self.grad_store.bytes_retained(),
                "staging": self.access.staging_bytes}

    def held_grads(self) -> dict[str, int]:
        """Bytes of each gradient shard the grads tier holds for a deferred step (compute dtype)."""
        elem = torch.empty((), dtype=self.compute_dtype).element_size()
        return {k: self.numel[k] * elem for k in self.grad_store.keys() if k in self.numel}

    def slot_rounding_bytes(self) -> int:
        """Bytes the optimizer tier holds beyond its state (the spec's bytes per element): NVMe
        slots are whole pages."""
        return self.store.bytes_retained() - self.spec.state_bytes(sum(self.numel.values()))

    def close(self) -> None:
        """Every store is closed (its files removed, its drive path freed) even when the
        pipeline reports a failed write-back; that error is still raised."""
        try:
            self.pipeline.close()
        finally:
            try:
                self.store.close()
            finally:
                self.grad_store.close()


def _listed(keys: list[str]) -> str:
    """A few keys and how many more: a line, not a list of thousands of shards."""
    more = f" and {len(keys) - 3} more" if len(keys) > 3 else ""
    return ", ".join(keys[:3]) + more


def _apart(seen: list[tuple[str | None, str | None, int, int]]) -> str | None:
    """From every rank's (failed hand-over, mixed_steps(), least and most step count): a line
    saying how the shards of all ranks stand apart, or None when they stand at one step."""
    for rank, (_, mixed, _, _) in enumerate(seen):
        if mixed is not None:
            return mixed if len(seen) == 1 else f"on rank {rank}, {mixed}"
    low, high = min(s[2] for s in seen), max(s[3] for s in seen)
    if low == high:
        return None
    at = {r: s[2] for r, s in enumerate(seen)}
    return ", ".join(f"rank {r}'s shards at step {n}" for r, n in at.items())


def _shared(grad: torch.Tensor | Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """The gradient, loaded at most once for all the sub-shards of its shard."""
    if not callable(grad):
        return lambda: grad
    cache: list[torch.Tensor] = []

    def load() -> torch.Tensor:
        if not cache:
            cache.append(grad())
        return cache[0]
    return load


def _checked_ranges(key: str, ranges: Ranges, numel: int) -> tuple[tuple[int, int], ...]:
    """`ranges` as tuples, refused in one line unless ordered, disjoint, non-empty and inside the shard."""
    out = tuple((int(lo), int(hi)) for lo, hi in ranges)
    at = 0
    for lo, hi in out:
        if not at <= lo < hi <= numel:
            raise ValueError(f"ShardOptimizer.grad_ready({key!r}): missing ranges {list(out)[:4]} are not ordered, "
                             f"disjoint, non-empty ranges inside the shard's {numel} elements")
        at = hi
    return out


def _covering(ranges: Sequence[tuple[int, ...]], at: int) -> int | None:
    """The index of the range of ordered, disjoint `ranges` ((lo, hi, ...) each) holding `at`, if any."""
    i = bisect.bisect_right(ranges, (at, math.inf)) - 1
    return i if i >= 0 and ranges[i][0] <= at < ranges[i][1] else None


def _extend(runs: list[tuple[int, int, int]], lo: int, hi: int, k: int) -> None:
    """Append (lo, hi, k) to ordered `runs`, merged with the last one when it goes on with the same k."""
    if runs and runs[-1][1] == lo and runs[-1][2] == k:
        runs[-1] = (runs[-1][0], hi, k)
    else:
        runs.append((lo, hi, k))


def _slicer(load: Callable[[], torch.Tensor], lo: int, hi: int) -> Callable[[], torch.Tensor]:
    return lambda: load()[lo:hi]
