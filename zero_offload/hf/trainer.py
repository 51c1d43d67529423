"""ZeroOffloadTrainer: transformers' Trainer, training through a zero_offload engine.

    trainer = ZeroOffloadTrainer(model=model, args=TrainingArguments(...), train_dataset=...,
                                 zero_offload_config="ds_config.json")
    trainer.train()
    trainer.save_model("out")  # config.json + model.safetensors (streamed), for from_pretrained

Only Trainer's overridable methods are replaced, nothing is patched. The engine is built in
__init__ from the model, the resolved config (config.py: the user's config, its training values
from TrainingArguments) and the Trainer's two parameter groups (weight decay, none on biases and
norms). The loop's model, optimizer and Accelerator are accelerator.py's; the scheduler is the
Trainer's own, on engine.optimizer. A checkpoint-N folder holds the Trainer's files as usual
(trainer_state.json, rng_state*.pth, scheduler.pt, the model in HF format) and the engine's
atomic checkpoint in checkpoint-N/zero_offload instead of optimizer.pt.
"""
from __future__ import annotations

import functools
import inspect
import os
import warnings
from typing import Any

import torch
from transformers import Trainer
from transformers.trainer import TRAINING_ARGS_NAME
from transformers.trainer_pt_utils import reissue_pt_warnings

import zero_offload
from zero_offload import comm
from zero_offload.config import Config, ConfigError
from zero_offload.engine.engine import Engine, engine_of
from zero_offload.hf.accelerator import EngineModel, TrainerOptimizer, ZeroOffloadAccelerator
from zero_offload.hf.config import check_optimizer, resolve
from zero_offload.hf.load import ConvertedWeights, build_on_meta, folder_config, load_model
from zero_offload.hf.save import save_pretrained

ENGINE_DIR = "zero_offload"  # the engine's checkpoint inside Trainer's checkpoint-N folder
SCHEDULER_NAME = "scheduler.pt"  # as transformers names it


def _refuse_arguments(bound: dict[str, Any]) -> None:
    """Trainer arguments that would bypass the engine, each refused in one line."""
    args = bound.get("args")
    if args is not None and getattr(args, "deepspeed", None):
        raise ConfigError("TrainingArguments(deepspeed=...) hands training to the deepspeed package: pass the "
                          "DeepSpeed JSON as ZeroOffloadTrainer(zero_offload_config=...) instead")
    if bound.get("model") is None:
        raise ConfigError("ZeroOffloadTrainer needs model=: a model, a Hugging Face folder or an engine; the engine "
                          "is built from it in __init__ (model_init, which rebuilds the model in train(), is not supported)")
    if bound.get("model_init") is not None:
        raise ConfigError("ZeroOffloadTrainer(model_init=...) is not supported: pass model=")
    if any(o is not None for o in bound.get("optimizers", (None, None))):
        raise ConfigError("ZeroOffloadTrainer(optimizers=...): the engine steps AdamW and the Trainer's scheduler "
                          "(lr_scheduler_type) drives it; set them in TrainingArguments")
    if bound.get("optimizer_cls_and_kwargs") is not None:
        raise ConfigError("ZeroOffloadTrainer(optimizer_cls_and_kwargs=...): the engine steps AdamW; set its "
                          "hyperparameters in TrainingArguments")
    if args is not None:
        _refuse_training_arguments(args)


def _refuse_training_arguments(args: Any) -> None:
    check_optimizer(args)
    if args.fsdp:
        raise ConfigError("TrainingArguments(fsdp=...) shards the model with torch FSDP: the engine shards it "
                          "(zero_offload_config stage 3); leave fsdp unset")
    if args.fp16_full_eval or args.bf16_full_eval:
        raise ConfigError("TrainingArguments fp16_full_eval / bf16_full_eval cast the model: the engine evaluates "
                          "in its own precision (bf16=True or fp16=True)")
    if args.torch_compile:
        raise ConfigError("TrainingArguments(torch_compile=True): the engine runs the model's modules through its "
                          "own hooks, which torch.compile would trace (stage 3 refuses it); at stages 0-2 compile "
                          "the model before passing it, or leave torch_compile off")
    if args.n_gpu > 1:
        raise ConfigError(f"one process sees {args.n_gpu} GPUs, which Trainer would drive with DataParallel: run "
                          "one process per GPU (torchrun --nproc_per_node N); the engine does the data parallelism")


def _world_mismatch(trainer: int, engine: int) -> str:
    """Under torchrun on a machine without a GPU, accelerate runs one process per rank unless
    use_cpu=True: every rank would then read all the data and write every file."""
    hint = "set TrainingArguments(use_cpu=True) on a machine without a GPU" if not torch.cuda.is_available() \
        else "start every rank with the same launcher (torchrun) before building TrainingArguments"
    return (f"the engine trains on {engine} ranks (the launcher's process group) but TrainingArguments sees "
            f"{trainer}, so Trainer would neither shard the data nor save from one rank: {hint}")


def _model_to_build(given: Any, model_class: Any) -> tuple[torch.nn.Module, str | None]:
    """What Trainer is given as its model, and the folder to load, for each form of `model=`: a
    built model (no folder), a folder (its model built on the meta device: config only), or an
    Engine (its module). A module some live engine already trains is refused in one line."""
    if isinstance(given, Engine):
        if given.closed:
            raise ConfigError("ZeroOffloadTrainer(model=engine): the engine is closed")
        return given.module, None
    if isinstance(given, (str, os.PathLike)):
        folder = os.fspath(given)
        return build_on_meta(model_class or _auto_causal_lm(), folder_config(folder), None), folder
    owner = engine_of(given)
    if owner is not None:
        raise ConfigError("ZeroOffloadTrainer(model=...): this model is already trained by an engine (engine.module); "
                          "pass the engine itself, ZeroOffloadTrainer(model=engine, ...), or the model's folder")
    return given, None


def _auto_causal_lm() -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM


def _source_for(model: torch.nn.Module, folder: str) -> Any:
    """The folder's weights for the meta model Trainer holds, as from_pretrained reads them."""
    source = ConvertedWeights(model, folder)
    model._weight_conversions = [t for t in source.transforms if t.was_used()]
    return source


def _adopted(engine: Engine, wanted: Config, groups: list[dict]) -> Engine:
    """An engine built before the Trainer (zero_offload.hf.from_pretrained): what it cannot change
    now (accumulation, clipping, precision, the optimizer, its weight-decay groups) must be what
    TrainingArguments asks, else one line says what differs; its lr, betas and eps are set from them."""
    have = engine.config
    fields = {"gradient_accumulation_steps": lambda c: c.gradient_accumulation_steps,
              "clip_grad_norm": lambda c: c.clip_grad_norm, "precision.dtype": lambda c: c.precision.dtype,
              "optimizer.name": lambda c: c.optimizer.name, "overlap_step": lambda c: c.overlap_step}
    differ = [f"{k}={get(have)!r} (TrainingArguments want {get(wanted)!r})" for k, get in fields.items()
              if get(have) != get(wanted)]
    decay = {name: g["weight_decay"] for g in groups for name in g["params"]}
    if any(engine.weight_decay_of(name) != wd for name, wd in decay.items()):
        differ.append("weight decay (Trainer's: none on biases and norms)")
    if differ:
        raise ConfigError(f"ZeroOffloadTrainer(model=engine): the engine was built with {'; '.join(differ)}; build it "
                          "with those values, or pass the model's folder and let the Trainer build the engine")
    for g in engine.optimizer.param_groups:  # before Trainer's scheduler takes lr as its base
        g["lr"], g["betas"], g["eps"] = wanted.optimizer.lr, wanted.optimizer.betas, wanted.optimizer.eps
    return engine


def _same_device(engine: torch.device, batches: torch.device) -> bool:
    """The same kind of device and, for accelerators, the same one (the CPU is one whatever its index)."""
    return engine.type == batches.type and (engine.type == "cpu" or engine.index == batches.index)


class ZeroOffloadTrainer(Trainer):
    """A Trainer whose model is trained by a zero_offload engine; `zero_offload_config` is a
    zero_offload Config, a dict (ours or DeepSpeed's) or the path of a JSON file of either.
    `model` is a built model, a Hugging Face folder (at stage 3 built on the meta device and
    streamed into the tiers unit by unit, so it may exceed host RAM; `model_class` as
    from_pretrained takes it), or an Engine that zero_offload.hf.from_pretrained built.
    Other arguments are Trainer's. After __init__, `trainer.engine` is the Engine."""

    def __init__(self, *args: Any, zero_offload_config: Config | dict | str | None = None, model_class: Any = None,
                 **kwargs: Any) -> None:
        bound = inspect.signature(Trainer.__init__).bind(self, *args, **kwargs).arguments
        _refuse_arguments(bound)
        given = bound.pop("model")
        bound.pop("self")
        model, folder = _model_to_build(given, model_class)
        self._flop_params = (model.num_parameters(exclude_embeddings=True)  # before stage 3 empties them
                             if hasattr(model, "num_parameters") else 0)
        super().__init__(model=model, **bound)
        _refuse_training_arguments(self.args)  # the default TrainingArguments too
        self.zero_offload_config = resolve(given.config if isinstance(given, Engine) else zero_offload_config,
                                           self.args, self.model)
        self.engine: Engine = (_adopted(given, self.zero_offload_config, self._param_groups())
                               if isinstance(given, Engine) else self._build_engine(folder, model_class))
        if not _same_device(self.engine.device, torch.device(self.args.device)):
            self.engine.close()
            raise ConfigError(f"the engine computes on {self.engine.device} but TrainingArguments puts the batches "
                              f"on {self.args.device}: leave use_cpu unset where there is a GPU")
        if self.args.world_size != comm.world_size():
            self.engine.close()
            raise ConfigError(_world_mismatch(self.args.world_size, comm.world_size()))
        self.accelerator.attach(self.engine)
        self.optimizer = TrainerOptimizer(self.engine)
        self.callback_handler.optimizer = self.optimizer

    def _build_engine(self, folder: str | None, model_class: Any) -> Engine:
        """The engine of a built model, or of the folder's: at stage 3 the meta model Trainer holds,
        its weights streamed from the folder; below, the model transformers loads (Trainer's
        model becomes it)."""
        source = None
        if folder is not None and self.zero_offload_config.stage == 3:
            source = _source_for(self.model, folder)
        elif folder is not None:
            self.model = self.model_wrapped = load_model(folder, self.zero_offload_config.stage,
                                                         model_class=model_class)[0]
        return zero_offload.initialize(self.model, self.zero_offload_config, weights=source,
                                       param_groups=self._param_groups())

    def _param_groups(self) -> list[dict]:
        """Trainer's grouping (create_optimizer): weight decay except on biases and norms."""
        decay = set(self.get_decay_parameter_names(self.model))
        names = [n for n, p in self.model.named_parameters() if p.requires_grad]
        groups = [{"params": [n for n in names if n in decay], "weight_decay": self.args.weight_decay},
                  {"params": [n for n in names if n not in decay], "weight_decay": 0.0}]
        return [g for g in groups if g["params"]]

    # ---- the Accelerator, the model's placement, the optimizer and scheduler -----------------

    def _build_accelerator_args(self, **kwargs: Any) -> dict[str, Any]:
        """Trainer's Accelerator arguments, without mixed precision: the engine computes in its
        own dtype and scales fp16 losses itself (accelerate's autocast and GradScaler would
        act on a model and gradients the engine owns)."""
        accelerator_args = super()._build_accelerator_args(**kwargs)
        accelerator_args["mixed_precision"] = "no"
        self._zero_offload_accelerator_args = accelerator_args
        return accelerator_args

    def create_accelerator_and_postprocess(self) -> None:
        """Trainer's setup, then the same Accelerator as ZeroOffloadAccelerator (the process state
        is accelerate's shared one, so both see the same ranks)."""
        super().create_accelerator_and_postprocess()
        self.accelerator = ZeroOffloadAccelerator(**self._zero_offload_accelerator_args)
        self.gather_function = self.accelerator.gather_for_metrics
        if "use_gather_object" in inspect.signature(self.gather_function).parameters:
            self.gather_function = functools.partial(self.gather_function,
                                                     use_gather_object=self.args.eval_use_gather_object)

    def _move_model_to_device(self, model: torch.nn.Module, device: torch.device) -> None:  # noqa: ARG002
        """Nothing: the engine places the model (at stage 3 unit by unit; moving it whole first
        would need the memory stage 3 exists to avoid)."""

    def create_optimizer(self, model: Any = None) -> TrainerOptimizer:  # noqa: ARG002
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> Any:  # noqa: ARG002
        """Trainer's scheduler (lr_scheduler_type, warmup) on engine.optimizer's param_groups."""
        return super().create_scheduler(num_training_steps, optimizer=self.engine.optimizer)

    def floating_point_ops(self, inputs: dict[str, Any]) -> int:
        """As PreTrainedModel counts them (6 x tokens x non-embedding parameters), with the count
        taken before the engine: at stage 3 the module's parameters are empty between passes."""
        if not hasattr(self.model, "estimate_tokens"):
            return 0
        return 6 * self.model.estimate_tokens(inputs) * self._flop_params

    # ---- checkpoints -----------------------------------------------------------------------

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """The engine's checkpoint (every rank; master shards, moments, step counts, hyperparameters)
        in output_dir/zero_offload, where Trainer writes optimizer.pt; the scheduler as Trainer does."""
        self.engine.save_checkpoint(os.path.join(output_dir, ENGINE_DIR))
        if self.args.should_save:
            with warnings.catch_warnings(record=True) as caught:
                torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))
            reissue_pt_warnings(caught)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:  # noqa: ARG002
        """Called by train() before the loop is set up: only checks that the engine's checkpoint is
        there. It is loaded with the optimizer (_load_optimizer_and_scheduler), after the scheduler
        is made, so the saved learning rates overwrite the new scheduler's first ones, as Trainer's
        optimizer.load_state_dict does."""
        self._engine_checkpoint(resume_from_checkpoint)

    def _engine_checkpoint(self, checkpoint: str) -> str:
        path = os.path.join(checkpoint, ENGINE_DIR)
        if not os.path.isdir(path):
            raise ValueError(f"{checkpoint} holds no {ENGINE_DIR}/ engine checkpoint (saved by another Trainer, or with "
                             "save_only_model=True): ZeroOffloadTrainer resumes from the engine's checkpoint")
        return path

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """The engine's whole state (weights, optimizer, its RNG), then the scheduler's."""
        if checkpoint is None:
            return
        self.engine.load_checkpoint(self._engine_checkpoint(checkpoint))
        path = os.path.join(checkpoint, SCHEDULER_NAME)
        if os.path.isfile(path):
            with warnings.catch_warnings(record=True) as caught:
                self.lr_scheduler.load_state_dict(torch.load(path, weights_only=True))
            reissue_pt_warnings(caught)

    def _load_best_model(self) -> None:
        """load_best_model_at_end: the best checkpoint's engine state (its weights, through the
        engine: at stage 3 the module's own parameters are shards)."""
        self.engine.load_checkpoint(self._engine_checkpoint(self.state.best_model_checkpoint))

    # ---- the model in Hugging Face format ------------------------------------------------------

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The model in Hugging Face format from the engine's weights (save.py): config.json and
        model.safetensors (or shards), or for a PEFT model its adapters only, streamed unit by
        unit so the model is never whole in memory. A collective: every rank calls it (Trainer
        does, for save_model and every checkpoint); the main process writes."""
        output_dir = self.args.output_dir if output_dir is None else output_dir
        self._save(output_dir)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """Trainer's _save with the model written by save_pretrained(engine, ...), on every rank
        (Trainer's returns early on ranks that do not write). A state_dict given explicitly is
        saved by Trainer's own code."""
        output_dir = self.args.output_dir if output_dir is None else output_dir
        if state_dict is not None:
            super()._save(output_dir, state_dict=state_dict)
            return
        if self.args.should_save:
            os.makedirs(output_dir, exist_ok=True)
        save_pretrained(self.engine, output_dir, model=self.model, is_main_process=self.args.should_save)
        if not self.args.should_save:
            return
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        elif getattr(self.data_collator, "tokenizer", None) is not None:
            self.data_collator.tokenizer.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))

    @property
    def engine_model(self) -> EngineModel:
        """The engine as the Trainer's loop calls it (forwards through the engine)."""
        return self.accelerator.engine_model
