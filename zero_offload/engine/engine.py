"""The public facade: `initialize(model, config)` → Engine, which owns the phase machine (phase.py).

The Engine owns the order of calls (IDLE → FORWARD → BACKWARD → STEP → IDLE), its health (OK,
STOPPED, LOAD_FAILED, CLOSED: whether it may train), the micro-batch count that decides the
gradient-accumulation boundary, and the fp16 loss scale applied in backward. Everything that
differs between ZeRO stages sits behind a runtime (BucketRuntime in buckets/runtime.py for stages
0-2, Stage3Runtime in stage3/runtime.py for stage 3) with one interface, engine/runtime.py's
`Runtime`; `Engine.__init__` is the one place that looks at the stage, to choose it.
"""
from __future__ import annotations

import contextlib
import warnings
import weakref
from enum import Enum
from typing import Any, Iterator

import torch

from zero_offload import comm
from zero_offload.config import Config, ConfigError
from zero_offload.engine.model.attributes import refuse_sparse_gradients
from zero_offload.engine.model.weights_files import Weights
from zero_offload.engine.runtime import ModelView, Runtime, Standing, TrainingState
from zero_offload.engine.step.param_groups import resolve as resolve_groups, runs as group_runs
from zero_offload.engine.step.shard_optimizer import DTYPES, HandOverFailed
from zero_offload.engine.phase import EngineStateError, InterruptGuard, Phase, PhaseMachine  # phase.py
from zero_offload.io import swap_files


class Health(Enum):
    """Whether the engine may train: OK; STOPPED (a step or backward failed in a way that leaves
    no state to go on from: forward, backward, step and saves refuse until a load succeeds);
    LOAD_FAILED (a load stopped part way, or is in progress: the state is partly overwritten);
    CLOSED (for good)."""

    OK = "ok"
    STOPPED = "stopped"
    LOAD_FAILED = "load failed"
    CLOSED = "closed"


class HealthState:
    """The engine's Health and why; each transition names the states it may leave and raises
    from any other (nothing leaves CLOSED; only a successful load leaves LOAD_FAILED)."""

    def __init__(self) -> None:
        self.health = Health.OK
        self.reason: str | None = None

    def _move(self, what: str, allowed: tuple[Health, ...], to: Health, reason: str | None) -> None:
        if self.health not in allowed:
            raise EngineStateError(f"internal error: engine health {self.health.value} cannot {what}")
        self.health, self.reason = to, reason

    def stop(self, reason: str) -> None:
        """A failure left nothing to go on from (see Engine._abort_backward, _runtime_step); a
        stop after a stop keeps the first reason (a second Ctrl-C stops first, then the
        failure it caused is seen)."""
        if self.health is Health.STOPPED:
            return
        self._move("stop", (Health.OK,), Health.STOPPED, reason)

    def resume(self) -> None:
        """A stop withdrawn without a load (engine.stopped = None)."""
        self._move("resume", (Health.STOPPED,), Health.OK, None)

    def begin_load(self) -> None:
        """A verified checkpoint is about to be written: a failure from here leaves a mixture."""
        self._move("begin a load", (Health.OK, Health.STOPPED, Health.LOAD_FAILED), Health.LOAD_FAILED,
                   "a load is in progress")

    def load_failed(self, reason: str) -> None:
        self._move("fail a load", (Health.LOAD_FAILED,), Health.LOAD_FAILED, reason)

    def loaded(self) -> None:
        """The load rewrote the whole state (partial sums and every replica with it)."""
        self._move("finish a load", (Health.LOAD_FAILED,), Health.OK, None)

    def close(self) -> None:
        self.health, self.reason = Health.CLOSED, None  # from any state, and again (close is idempotent)

    def why(self, health: Health) -> str | None:
        """The reason when the engine is in `health`, else None."""
        return self.reason if self.health is health else None


def _device_for(model: torch.nn.Module) -> torch.device:
    """The compute device: CUDA when present, else the CPU. The GPU is LOCAL_RANK's under
    torchrun; without LOCAL_RANK (mpirun, SLURM, a group made by hand) the one the process chose
    with torch.cuda.set_device; with one visible GPU per process (CUDA_VISIBLE_DEVICES set per
    rank), that one whatever LOCAL_RANK says. Peak statistics start here, so the memory report's
    CUDA peak is this engine's, not an earlier one's in the same process."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    local = comm.env_int("LOCAL_RANK", -1, low=0)
    index = torch.cuda.current_device() if local < 0 else local
    if torch.cuda.device_count() == 1:
        index = 0
    elif index >= torch.cuda.device_count():
        raise RuntimeError(f"LOCAL_RANK={index} but this process sees {torch.cuda.device_count()} GPUs")
    device = torch.device("cuda", index)
    torch.cuda.set_device(device)
    torch.cuda.reset_peak_memory_stats(device)
    return device


# module -> the engine training it: a Trainer given an engine's module names the engine instead.
_ENGINES: "weakref.WeakKeyDictionary[torch.nn.Module, weakref.ref[Engine]]" = weakref.WeakKeyDictionary()


def engine_of(module: object) -> "Engine | None":
    """The open engine that trains `module`, if one does."""
    try:
        ref = _ENGINES.get(module)  # type: ignore[call-overload]
    except TypeError:  # not weak-referenceable: no module of ours
        return None
    engine = ref() if ref is not None else None
    return engine if engine is not None and not engine.closed else None


class Engine:
    """Trains `model` under `config`; see the package docs for the call sequence."""

    def __init__(self, model: torch.nn.Module, config: Config, *, init_fn: Any = None,
                 weights: Weights = None, param_groups: Any = None) -> None:
        self.config = config
        refuse_sparse_gradients(model)
        # Resolved before anything else: stage 3 replaces the parameter objects the groups name.
        groups = None if param_groups is None else resolve_groups(model, param_groups, config.optimizer)
        self._group_of = {} if groups is None else dict(groups[1])  # trainable name -> its param group
        self.device = _device_for(model)  # before a NCCL group is made: it binds to the current device
        comm.join_launcher_group()
        self.dtype = DTYPES[config.precision.dtype]
        self.orig_dtypes = {k: v.dtype for k, v in model.state_dict(keep_vars=True).items()}
        self.phase = PhaseMachine()
        self.health = HealthState()  # OK, STOPPED, LOAD_FAILED, CLOSED (see _require_loaded)
        # Ctrl-C is held while backward and step run (their bookkeeping is one transaction); a
        # second one ends the call at once and stops the engine (_forced).
        self.interrupts = InterruptGuard(self._forced)
        self.micro_step = 0
        self.global_steps = 0
        self._hyper: list[tuple] | None = None  # hyperparameters when the last backward began
        self.runtime: Runtime
        self._preemption: Any = None  # the signal handlers of preemption.handle_signals
        # What the pre-emption checkpoint saves as client_state: a callable returning it, e.g.
        # lambda: {"scheduler": scheduler.state_dict()}; None saves none.
        self.preemption_client_state: Any = None
        if config.stage == 3:
            # The runtime materializes (meta models) and places the model unit by unit and
            # broadcasts rank 0's initial values itself: moving the whole model to the device
            # first would defeat stage 3.
            from zero_offload.engine.stage3.runtime import Stage3Runtime

            self.module = model
            self.runtime = Stage3Runtime(model, config, self.device, init_fn=init_fn, weights=weights,
                                         phase=self.phase.view())
        else:
            self._build_bucket_runtime(model, config, init_fn, weights)
        # An engine dropped without close() still lets its threads, files and swap-folder locks go
        # (the runtime's threads hold the runtime, never the engine); at exit too.
        self._finalizer = weakref.finalize(self, self.runtime.close)
        _ENGINES[self.module] = weakref.ref(self)
        try:
            if groups is not None:
                self._set_groups(*groups)
            if config.preemption.handle_signals:
                from zero_offload.engine.preemption import PreemptionWatch

                self._preemption = PreemptionWatch(self, config.preemption)
        except BaseException:
            self.close()
            raise

    def _forced(self) -> None:
        """A second Ctrl-C while one was held: the call ends wherever it is (in a SIGINT handler,
        before the KeyboardInterrupt is raised), so the engine stops first (a load in progress
        is LOAD_FAILED already)."""
        if self.health.health is Health.OK:
            self.health.stop(f"a second Ctrl-C ended step {self.global_steps + 1} part way "
                             f"(phase {self.phase.phase.value}); its state is not known")

    def _build_bucket_runtime(self, model: torch.nn.Module, config: Config, init_fn: Any, weights: Weights) -> None:
        """Stages 0-2: the whole model on the compute device in the compute dtype."""
        if init_fn is not None or weights is not None:
            raise ConfigError("initialize: init_fn and weights (materializing a meta model) need stage 3")
        if any(p.is_meta for p in model.parameters()):
            raise ConfigError("initialize: the model has parameters on the meta device; build it for real "
                              "or use stage 3 with init_fn= or weights=")
        meta = next((n for n, b in model.named_buffers() if b.is_meta), None)
        if meta is not None:
            raise ConfigError(f"initialize: buffer '{meta}' is on the meta device (it has no value); build the "
                              "module that registers it for real, or use stage 3, which computes such buffers")
        from zero_offload.engine.buckets.runtime import BucketRuntime
        from zero_offload.engine.step.precision import place

        self.module = place(model, self.device, self.dtype)  # floating-point tensors only
        self._broadcast_initial_state()
        self.runtime = BucketRuntime(self.module, config, self.device)

    def _set_groups(self, hyper: list[dict], group_of: dict[str, int]) -> None:
        """Each shard's runs of one parameter group, from the pieces its shard map lists."""
        runs = {key: group_runs(pieces, group_of) for key, pieces in self.runtime.shard_map().items()}
        self.runtime.shard_optimizer.set_groups(hyper, runs)

    def _broadcast_initial_state(self) -> None:
        """Every rank starts from rank 0's weights and buffers, as DDP does."""
        with torch.no_grad():
            for t in list(self.module.parameters()) + list(self.module.buffers()):
                comm.broadcast_(t.data, 0)

    def weight_decay_of(self, name: str) -> float:
        """The weight decay the step applies to trainable parameter `name` (its group's)."""
        return self.optimizer.param_groups[self._group_of.get(name, 0)]["weight_decay"]

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """param_groups for torch.optim.lr_scheduler schedulers (the update itself is engine.step())."""
        return self.runtime.optimizer

    @property
    def closed(self) -> bool:
        return self.health.health is Health.CLOSED

    @property
    def load_failed(self) -> str | None:
        """Why the last load_checkpoint stopped part way (or that one is in progress), if it did."""
        return self.health.why(Health.LOAD_FAILED)

    @property
    def stopped(self) -> str | None:
        """Why training cannot go on until a load (see _require_loaded), if it cannot."""
        return self.health.why(Health.STOPPED)

    @stopped.setter
    def stopped(self, reason: str | None) -> None:
        """Only None, withdrawing a stop (tests of the checks behind it); a stop has its reason."""
        if reason is not None:
            raise EngineStateError("engine.stopped can only be cleared (set to None)")
        self.health.resume()

    @property
    def model_view(self) -> ModelView:
        """The model as the state code (checkpoints, exports) reads it beside the runtime."""
        return ModelView(self.module, self.device, self.orig_dtypes)

    @property
    def training_state(self) -> TrainingState:
        return TrainingState(self.global_steps, self.micro_step)

    @property
    def is_boundary(self) -> bool:
        """Whether the current micro-batch ends a gradient-accumulation cycle."""
        return (self.micro_step + 1) % self.config.gradient_accumulation_steps == 0

    def end_accumulation_cycle(self) -> None:
        """Make the current micro-batch the last of its accumulation cycle (call it before that
        micro-batch's backward): a cycle cut short, as Trainer's at an epoch's end. Its step()
        applies the update of the partial sums so far, each micro-batch's gradient still scaled
        by 1/gradient_accumulation_steps (scale the losses for the mean you want)."""
        self._require_idle("end_accumulation_cycle")  # after backward the reduction chose already
        gas = self.config.gradient_accumulation_steps
        self.micro_step += gas - 1 - self.micro_step % gas

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self.interrupts.held():  # the optimizer's read-ahead plan is one transaction too
            self._require_loaded("forward")
            self.runtime.refuse_compiled(self.module)
            if self.phase.phase is Phase.IDLE and torch.is_grad_enabled():
                self.runtime.begin_forward(self.is_boundary)
            self.phase.start_forward()
        with comm.during("forward", self.global_steps + 1):  # names the step in a peer's failure
            return self.module(*args, **kwargs)

    forward = __call__

    def train(self, mode: bool = True) -> Engine:
        """`engine.module.train(mode)`, as on DeepSpeed's engine (an nn.Module): dropout and norms
        follow it; which parameters train is fixed at initialize."""
        self._require_open("train")
        self.module.train(mode)
        return self

    def eval(self) -> Engine:
        """`engine.module.eval()`; run evaluation forwards under torch.no_grad()."""
        return self.train(False)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of `loss` (scaled for fp16); gradients are reduced and stepped as they arrive.

        A Ctrl-C during backward is held (InterruptGuard): the overlapped step has begun updating
        shards, which cannot be undone, so the backward and then its step() are finished by the
        engine, and the KeyboardInterrupt is raised with the engine at the new step, whole
        (the loop's own engine.step() call is not reached)."""
        with self.interrupts.held():
            self._backward(loss)
            if self.interrupts.pending:
                self._step()

    def _backward(self, loss: torch.Tensor) -> None:
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError(f"engine.backward expects a scalar loss tensor, got {type(loss).__name__}"
                             + (f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else ""))
        if not loss.requires_grad:
            raise ValueError("engine.backward: the loss does not require grad (computed under torch.no_grad(), "
                             "or detached): there is nothing to back-propagate")
        self._require_loaded("backward")
        self.phase.start_backward()
        scale = self.runtime.shard_optimizer.scaler.scale
        try:  # its checks (a parameter frozen or edited since initialize) come before anything is reduced
            self.runtime.begin_backward(self.is_boundary)
        except BaseException:
            self.phase.abort_backward()
            raise
        self._hyper = self._hyperparameters()
        try:
            with comm.during("backward", self.global_steps + 1):
                (loss * scale if scale != 1.0 else loss).backward()
                self.runtime.end_backward()  # reduces what got no gradient: may fail the same ways
        except BaseException as exc:
            self._abort_backward(exc)
            raise

    def _abort_backward(self, exc: BaseException) -> None:
        """The backward raised: the gradients it did not reduce are dropped and the engine is
        IDLE again, ready for a forward. Shards already handed to the step keep their update, as
        after a failed step. Inside an accumulation cycle, partial sums that took part of this
        micro-batch cannot be told apart from the others': once anything was reduced, the engine
        refuses to go on until a checkpoint is loaded, rather than train on a corrupted sum. With
        D > 1 it always refuses: a backward's failure is not agreed across ranks (that would be
        one more collective per backward), so the others may be waiting in the reductions this
        rank skipped, and going on would enter mismatched collectives and hang; refusing lets
        the process fail fast instead."""
        touched = True  # if even that cannot be told, assume the worst
        try:
            touched = self.runtime.backward_touched()
            self.runtime.abort_backward()
        finally:
            self.phase.abort_backward()
            if touched and self.config.gradient_accumulation_steps > 1:
                self.health.stop(f"a backward failed part way through a gradient-accumulation cycle "
                                 f"({type(exc).__name__}: {exc}) after some partial gradient sums had taken "
                                 "its gradients")
            elif comm.world_size() > 1:  # not agreed: the other ranks may wait in its collectives
                self.health.stop(f"a backward failed on this rank ({type(exc).__name__}: {exc}); with D > 1 the "
                                 "other ranks may be waiting in its reductions, or stepped other shards")
            elif (standing := self.runtime.standing()).failed_hand_over:  # as after a step (_runtime_step)
                self.health.stop(f"a backward failed ({type(exc).__name__}: {exc}) and a stepped shard's hand-over "
                                 "failed after it; its compute copy or step count may lag its master shard")
            elif (mixed := standing.mixed_steps) is not None:
                self.health.stop(f"a backward failed ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}) "
                                 f"after the overlapped step had updated some shards ({mixed}); "
                                 "overlap_step=False keeps a failed backward from stepping anything")

    def _hyperparameters(self) -> list[tuple] | None:
        """The param_groups' hyperparameters as the overlapped step reads them: during backward,
        as each shard's gradient arrives (None when the step waits for step() instead)."""
        if not self.runtime.shard_optimizer.eager:
            return None
        return [(g["lr"], tuple(g["betas"]), g["eps"], g["weight_decay"]) for g in self.optimizer.param_groups]

    def _warn_late_hyperparameters(self) -> None:
        if self._hyper is not None and self._hyper != self._hyperparameters():
            warnings.warn("engine.step(): lr, betas, eps or weight_decay changed after engine.backward(); the "
                          "overlapped step had used the values set when backward began, the new ones apply from the "
                          "next step (set them before the forward, or use overlap_step=False)", stacklevel=3)

    def _replicated_ranks(self) -> bool:
        return self.runtime.replicated and comm.world_size() > 1

    def step(self) -> bool:
        """At the accumulation boundary apply the update (False if skipped for overflow); clears grads.
        A Ctrl-C during the step is held (InterruptGuard) and raised once the step is complete
        on every shard and counted, so that the engine is left at one step, ready to save or go
        on; a second Ctrl-C ends it at once and stops the engine until a checkpoint is loaded."""
        with self.interrupts.held():
            applied = self._step()
        if self._preemption is not None:  # saves, closes and raises Preempted after a signal
            self._preemption.at_boundary(self, self.preemption_client_state)
        return applied

    def _step(self) -> bool:
        self._require_loaded("step")
        self.phase.start_step()
        applied = False
        try:
            if self.is_boundary:
                self._warn_late_hyperparameters()
                with comm.during("step", self.global_steps + 1):
                    applied = self._runtime_step()
                self.global_steps += 1
            self.micro_step += 1
        finally:
            self.phase.finish_step()
            interrupt = self.runtime.shard_optimizer.take_interrupt()
            if interrupt is not None:  # the user pressed Ctrl-C: it reaches them (after any error, as its context)
                raise interrupt
        return applied

    def _runtime_step(self) -> bool:
        """The runtime's step. A failed step keeps what it stepped (see finish_step), and every
        rank raises. With accumulation it has used up the cycle's partial sums (a retry would
        step one micro-batch at 1/gas scale); at stage 0 with D > 1, if the ranks' shards now
        stand at different steps, the replicas differ for good; and at every stage, shards that
        stand at different steps (some took the step, some did not: Adam's bias correction and
        the weights mix two steps) cannot be trained on or saved. Each way the engine stops
        until a checkpoint load rewrites the state."""
        try:
            return self.runtime.step()
        except BaseException as exc:  # an interrupt too: the boundary backward took the partial sums
            self._stop_after_step(exc, self.runtime.standing())
            raise

    def _stop_after_step(self, exc: BaseException, st: Standing) -> None:
        """Whether (and why) the step that raised `exc` leaves the engine STOPPED; see _runtime_step."""
        if isinstance(exc, HandOverFailed) or (st.failed_hand_over and not isinstance(exc, Exception)):
            self.health.stop(f"a step failed or was interrupted while handing over a stepped shard ({exc!r}); "
                             "its compute copy or step count may lag its master shard")
        elif self.config.gradient_accumulation_steps > 1:
            self.health.stop(f"a step failed ({exc}) after taking the gradient-accumulation cycle's partial sums")
        elif self._replicated_ranks() and not isinstance(exc, Exception):  # not agreed: no collective
            self.health.stop(f"a step was interrupted ({type(exc).__name__}); the stage-0 replicas may differ")
        elif self.runtime.gathers_updates() and not isinstance(exc, Exception):
            self.health.stop(f"a step was interrupted ({type(exc).__name__}) before the updated shards were "
                             "all-gathered; the compute copy lags the master shards")
        elif self._replicated_ranks() and not comm.all_agree(st.counts):
            self.health.stop(f"a step failed ({exc}) and left the stage-0 replicas different")
        elif st.steps_apart is not None:
            why = (str(exc).strip().splitlines() or [""])[0]  # the refusals that quote it stay one line
            self.health.stop(f"a step failed or was interrupted part way ({type(exc).__name__}: {why}) and left "
                             f"the optimizer shards at different steps ({st.steps_apart})")

    @property
    def grad_norm(self) -> float | None:
        """The global L2 norm of the last step's gradients (unscaled, before clipping, over every
        rank; inf after an fp16 overflow), where the step computes it: with clip_grad_norm or
        fp16 loss scaling, which defer the CPU Adam until it is known, and with track_grad_norm.
        None otherwise: the overlapped step updates each shard as its gradient arrives and never
        needs the total."""
        return self.runtime.shard_optimizer.last_grad_norm

    @property
    def skipped_steps(self) -> int:
        return self.runtime.shard_optimizer.skipped_steps

    @contextlib.contextmanager
    def gathered(self, params: Any = None, *, modify: bool = False) -> Iterator[None]:
        """Whole parameters outside forward: `with engine.gathered(engine.module.head): ...`.

        `params`: modules, parameters, or a list of both (default: the whole model). At stage 3
        their units are gathered for the block (a collective: every rank enters it; they must
        fit stage3.live_budget_bytes); elsewhere parameters are whole anyway. With `modify=True`
        the values rank 0 holds when the block ends become every rank's, and the optimizer's
        master (moments kept): how to load or edit weights after initialize at stage 3."""
        from zero_offload.engine.stage3.gathered import wanted_params

        self._require_idle("gathered")
        wanted = wanted_params(params, self.module)
        with self.runtime.gathered(wanted, modify):
            yield

    def memory_report(self, verbose: bool = True) -> dict:
        """Ideal vs retained vs peak bytes per tier x group; prints the table on rank 0 if verbose."""
        from zero_offload.engine.memory import memory_report

        self._require_open("memory_report")
        report = memory_report(self.runtime, self.config, self.device)
        if verbose and comm.rank() == 0:
            print(report["table"])
        return report

    def save_checkpoint(self, path: str, client_state: dict[Any, Any] | None = None) -> None:
        """Save the whole training state atomically (a collective). `client_state` (rank 0's) is
        saved beside it and returned by load_checkpoint: an LR scheduler's state_dict(), the data
        position; plain containers, numbers, strings and tensors only (loads never unpickle)."""
        from zero_offload.engine.state.checkpoint import save

        self._require_idle("save_checkpoint")
        self._require_loaded("save_checkpoint")
        gas = self.config.gradient_accumulation_steps
        if self.micro_step % gas:
            raise EngineStateError(f"engine.save_checkpoint after micro-batch {self.micro_step % gas} of {gas} of a "
                                   "gradient-accumulation cycle: partial gradient sums are not saved; save after the "
                                   "step that ends the cycle")
        save(self.runtime, self.model_view, self.training_state, self.config, path, client_state)

    def load_checkpoint(self, path: str) -> dict[Any, Any] | None:
        """Restore the training state saved at `path`; returns the client_state saved with it (None
        if none was). Every file is verified (sizes and checksums, on every rank, agreed) before
        anything changes: a refused checkpoint leaves the engine as it was, trainable. Only an I/O
        failure once the state is being written (a file that changed since it was verified, the
        engine's own store failing) leaves it refusing to train or save until a load succeeds."""
        from zero_offload.engine.state.checkpoint import apply_load, prepare_load

        # In any phase: after backward (a Ctrl-C before step()) or after a stop, the load
        # drops the backward's work and rewrites everything.
        self._require_open("load_checkpoint")
        # A call that ended part way (a backward whose step() never came, a stop) may have left
        # a step's arrivals and held units: dropped as after a failed backward, then rewritten.
        dirty = self.health.health is not Health.OK or self.phase.phase not in (Phase.IDLE, Phase.FORWARD)
        try:
            plan = prepare_load(self.runtime, self.model_view, self.config, path)  # refused: nothing changed
            self.health.begin_load()
            if dirty:
                self.runtime.abort_backward()
            state = apply_load(self.runtime, self.model_view, self.config, plan)
            with self.interrupts.held():  # the counters, phase and health agree, or the load failed
                self.global_steps, self.micro_step = state.global_steps, state.micro_step
                self.phase.reset()
                self.health.loaded()  # the partial sums and every replica were rewritten with the rest of the state
        except BaseException as exc:
            if self.health.health is Health.LOAD_FAILED:  # this load's failure, or a refusal after a failed one
                self.health.load_failed(f"{type(exc).__name__}: {exc}")
            raise
        comm.barrier()
        return plan.client_state

    def consolidated_state_dict(self) -> dict[str, torch.Tensor]:
        """Full fp32 weights (and buffers) on rank 0, loadable into the plain model; {} elsewhere.
        A collective: every rank must call it."""
        self._require_loaded("consolidated_state_dict")
        return self.runtime.consolidated(self.orig_dtypes)

    def save_safetensors(self, directory: str, keys: Any = None, *, max_shard_size: int | None = None,
                         write: bool | None = None) -> dict[str, str]:
        """The model's weights (`keys`, default all of its state_dict) as Hugging Face safetensors
        in `directory` (model.safetensors, or shards of at most max_shard_size bytes and their
        index), streamed one unit at a time: the model is never whole in memory. Values as
        consolidated_state_dict's, in the model's own dtypes. A collective: every rank calls it;
        rank 0 (or each rank passing write=True) writes. Returns the weight map (key -> file)."""
        from zero_offload.engine.state import export

        self._require_idle("save_safetensors")
        self._require_loaded("save_safetensors")
        size = export.DEFAULT_MAX_SHARD_SIZE if max_shard_size is None else max_shard_size
        return export.save_safetensors(self.runtime, self.model_view, directory, keys, max_shard_size=size,
                                       write=write)

    def export_state_dict(self, keys: Any) -> dict[str, torch.Tensor]:
        """The values of `keys` of the model's state_dict on every rank, as save_safetensors
        writes them; only the units holding them are read (the adapters of a frozen base). A
        collective: every rank calls it with the same keys."""
        from zero_offload.engine.state import export

        self._require_idle("export_state_dict")
        self._require_loaded("export_state_dict")
        return export.state_dict(self.runtime, self.model_view, list(keys))

    def _require_open(self, call: str) -> None:
        if self.health.health is Health.CLOSED:
            raise EngineStateError(f"engine.{call}: the engine was closed")

    def _require_loaded(self, call: str) -> None:
        """OK, or STOPPED for consolidated_state_dict (the weights of a stopped engine still read)."""
        self._require_open(call)
        health, why = self.health.health, self.health.reason
        if health is Health.LOAD_FAILED:
            raise EngineStateError(f"engine.{call}: the last load_checkpoint stopped part way ({why}) "
                                   "and left the state partly overwritten; load a checkpoint that loads")
        if health is Health.STOPPED and call != "consolidated_state_dict":
            raise EngineStateError(f"engine.{call}: {why}; load a checkpoint to go on")

    def _require_idle(self, call: str) -> None:
        self._require_open(call)
        if self.phase.phase not in (Phase.IDLE, Phase.FORWARD):
            raise EngineStateError(f"engine.{call} called in phase {self.phase.phase.value}: call engine.step() first")

    def close(self) -> None:
        """Stop the engine's threads and remove its files (NVMe slots); the engine cannot be used
        afterwards. At stage 3 the module's parameters stay released: take
        consolidated_state_dict() first to keep the weights. Idempotent. A swap file that cannot
        be deleted raises `FilesLeft`, naming each file that remains on disk; calling close()
        again tries again. The path is released however close() ends: a new engine on it reuses
        or removes what is left, as after a crash."""
        self.health.close()
        if self._preemption is not None:
            self._preemption.restore()
        try:
            self._finalizer()  # the runtime's threads and files, once
        except swap_files.FilesLeft:
            pass  # named below, with any file an earlier close() left
        finally:
            swap_files.remove_left(self.config.nvme_paths)


def initialize(model: torch.nn.Module, config: Config | dict | str | None = None, *, init_fn: Any = None,
               weights: Weights = None, param_groups: Any = None, **kwargs: Any) -> Engine:
    """An Engine for `model`; `config` is a Config, a dict, a JSON path, or keyword arguments.

    `param_groups`, as torch optimizers take them (a list of dicts, each with "params": the
    model's parameters or their names, and any of lr, betas, eps, weight_decay), gives groups
    of parameters their own hyperparameters; every trainable parameter must be in one.

    At stage 3 a model built on the meta device is materialized unit by unit, from `init_fn`
    (called per module after the module's own reset_parameters, as `model.apply(init_fn)` after
    eager construction would) or from `weights` (a .safetensors file, a torch state-dict file, a
    Hugging Face index of shards, or a folder holding one; memory-mapped, weights_files.py; or a
    `WeightSource`, such as zero_offload.hf.from_pretrained's converting reader), so a
    model larger than host RAM is never whole in memory.
    """
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"initialize expects a torch.nn.Module, got {type(model).__name__}")
    if isinstance(config, str):
        config = Config.from_file(config)
    elif isinstance(config, dict):
        config = Config.from_dict(config)
    elif config is None:
        config = Config()
    elif not isinstance(config, Config):
        raise ConfigError(f"config must be a Config, dict or path, got {type(config).__name__}")
    if kwargs:
        config = Config.from_dict({**config.to_dict(), **kwargs})
    if not any(p.requires_grad for p in model.parameters()):
        raise ConfigError("initialize: the model has no parameter with requires_grad=True")
    return Engine(model, config, init_fn=init_fn, weights=weights, param_groups=param_groups)
