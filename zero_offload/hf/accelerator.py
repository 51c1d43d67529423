"""What the Trainer's loop holds in place of a DDP-wrapped model, its optimizer and its Accelerator.

The Trainer calls, per micro-batch, `model(**inputs)` then `accelerator.backward(loss)`; at its
accumulation boundary `accelerator.clip_grad_norm_`, `optimizer.step()`, `lr_scheduler.step()`
unless `accelerator.optimizer_step_was_skipped`, and `model.zero_grad()`. The engine instead
needs `engine(...)`, `engine.backward(loss)` and `engine.step()` after every backward (it counts
micro-batches itself and applies the update at its own boundary, clipping included). So:

- `EngineModel` is the loop's `model`: calls go through the engine, attributes to the module;
- `ZeroOffloadAccelerator.backward` runs `engine.backward` and `engine.step`, after lining the
  engine's boundary up with the Trainer's (an epoch's last cycle may be shorter);
- `clip_grad_norm_` returns the norm the engine computed in that step (it clipped already);
- `TrainerOptimizer.step` has nothing left to do; its param_groups are engine.optimizer's.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator

import torch
from accelerate import Accelerator

from zero_offload.engine.engine import Engine


class EngineModel:
    """The model the Trainer's loop calls: forwards go through the engine (which gathers units at
    stage 3 and tracks the phase), every other attribute is the module's. Not an nn.Module, so
    accelerate neither wraps it in DDP nor moves it."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.engine(*args, **kwargs)

    forward = __call__

    def train(self, mode: bool = True) -> "EngineModel":
        self.engine.train(mode)
        return self

    def eval(self) -> "EngineModel":
        return self.train(False)

    def zero_grad(self, set_to_none: bool = True) -> None:  # noqa: ARG002
        """Nothing to clear: engine.step() consumed the gradients."""

    def to(self, *args: Any, **kwargs: Any) -> None:  # noqa: ARG002
        raise RuntimeError("the zero_offload engine places the model (on its device, in its precision); "
                           "it cannot be moved or cast (bf16_full_eval / fp16_full_eval are not supported)")

    def __getattr__(self, name: str) -> Any:
        if name == "engine":  # not set yet (a copy being built): not the module's either
            raise AttributeError(name)
        return getattr(self.engine.module, name)


class TrainerOptimizer:
    """`trainer.optimizer`: the engine's param_groups (its scheduler drives them); its step() is
    a no-op because ZeroOffloadAccelerator.backward has already run engine.step()."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    @property
    def param_groups(self) -> list[dict]:
        return self.engine.optimizer.param_groups

    @property
    def defaults(self) -> dict:
        return self.engine.optimizer.defaults

    def step(self, closure: Callable[[], Any] | None = None) -> None:  # noqa: ARG002
        """The update was applied by engine.step() right after the boundary's backward."""

    def zero_grad(self, set_to_none: bool = True) -> None:  # noqa: ARG002
        """engine.step() clears the gradients."""

    def state_dict(self) -> dict:
        raise RuntimeError("trainer.optimizer.state_dict(): the optimizer state (master shards, moments, step "
                           "counts) lives in the engine; ZeroOffloadTrainer saves it with engine.save_checkpoint "
                           "in checkpoint-N/zero_offload")

    def load_state_dict(self, state_dict: dict) -> None:  # noqa: ARG002
        raise RuntimeError("trainer.optimizer.load_state_dict(): resume with trainer.train(resume_from_checkpoint=...),"
                           " which loads the engine's checkpoint")

    def __repr__(self) -> str:
        return f"TrainerOptimizer(zero_offload engine, {len(self.param_groups)} param groups)"


class ZeroOffloadAccelerator(Accelerator):
    """The Trainer's Accelerator with the engine's backward, step, clipping and model; data loaders,
    gathers and the process state are accelerate's (so the sampler still shards per rank)."""

    engine: Engine | None = None
    _applied = True  # whether the last boundary's step applied the update (False: fp16 overflow)

    def attach(self, engine: Engine) -> None:
        self.engine = engine
        self.engine_model = EngineModel(engine)

    def prepare_model(self, model: torch.nn.Module, device_placement: bool | None = None,
                      evaluation_mode: bool = False) -> Any:
        """The engine's module comes back as the EngineModel: no DDP (the engine reduces the
        gradients), no device placement (the engine placed it), no autocast (it computes in its
        own precision)."""
        if self.engine is not None and model is self.engine.module:
            return self.engine_model
        return super().prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)

    def unwrap_model(self, model: Any, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True) -> Any:
        if isinstance(model, EngineModel):
            return model.engine.module
        return super().unwrap_model(model, keep_fp32_wrapper=keep_fp32_wrapper, keep_torch_compile=keep_torch_compile)

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:  # noqa: ARG002
        """engine.backward then engine.step. The Trainer's loss is already scaled for the whole
        accumulation cycle (by num_items_in_batch or 1/steps); the engine scales by
        1/gradient_accumulation_steps itself, so the loss goes in times that count: the summed
        gradient is the Trainer's whatever the cycle's length."""
        engine = self._engine()
        self._line_up_boundary(engine)
        gas = engine.config.gradient_accumulation_steps
        boundary = engine.is_boundary
        engine.backward(loss * gas if gas != 1 else loss)
        applied = engine.step()
        if boundary:
            self._applied = applied

    def _line_up_boundary(self, engine: Engine) -> None:
        """The Trainer ends a cycle where it says (sync_gradients): at an epoch's end after fewer
        micro-batches than gradient_accumulation_steps, where engine.end_accumulation_cycle()
        makes this micro-batch the engine's boundary too (its partial sums are stepped, whatever
        their number)."""
        if self.sync_gradients and not engine.is_boundary:
            engine.end_accumulation_cycle()
        elif not self.sync_gradients and engine.is_boundary:
            raise RuntimeError(f"the Trainer accumulates more micro-batches than the engine's "
                               f"gradient_accumulation_steps={engine.config.gradient_accumulation_steps}; "
                               "they must be the same")

    def clip_grad_norm_(self, parameters: Iterator[torch.nn.Parameter], max_norm: float,  # noqa: ARG002
                        norm_type: float = 2) -> torch.Tensor | None:
        """The global norm (before clipping) of the averaged gradients of the step the engine just
        applied; the engine clipped them to config.clip_grad_norm = max_grad_norm. Trainer asks
        with max_norm=inf when max_grad_norm is 0: config.py then sets track_grad_norm, so the
        overlapped step forms the norm too (None only for an engine configured otherwise)."""
        if norm_type != 2:
            raise ValueError(f"clip_grad_norm_(norm_type={norm_type}): the engine clips by the L2 norm")
        norm = self._engine().grad_norm
        return None if norm is None else torch.tensor(norm)

    @property
    def optimizer_step_was_skipped(self) -> bool:
        return not self._applied

    def _engine(self) -> Engine:
        if self.engine is None:
            raise RuntimeError("ZeroOffloadAccelerator: no engine attached (ZeroOffloadTrainer attaches it)")
        return self.engine
