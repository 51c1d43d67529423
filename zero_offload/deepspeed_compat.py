"""Reading a DeepSpeed config, so users can bring the one they already have.

A key whose meaning we do not reproduce is never silently dropped. Every key is one of:

- mapped onto our Config: the stage, the offload blocks' tiers and paths, precision, the
  optimizer, clipping, the batch sizes, the aio block, and zero_optimization.leaf_module.classes
  (the modules DeepSpeed fetches whole, an MoE layer: stage3.leaf_modules, by class name; its
  `names` and `name_suffixes` are refused);
- accepted without effect (_INERT_KEYS): DeepSpeed's logging, and knobs that only tune DeepSpeed's
  own implementation (its buffer pools, its optimizer tile, which collective it calls), so what is
  stored where and what the step computes are the same whatever their value. They are still
  type-checked, and named in one warning (IgnoredDeepSpeedKeys) per config read, so the user
  knows they did nothing;
- accepted only with the value that matches what our engine does (_CHECKED_KEYS: use_gds), as
  ignoring another value would change what the user gets; that value is refused with the reason;
- refused: any other key. Every refused key and value, in every section, is listed by its dotted
  path in ONE error (_refuse_unsupported): stopping at the first section made bringing a config
  take one run per section. A refused top-level key with an equivalent says what to use instead.

The batch sizes are mapped as DeepSpeed reads them: DeepSpeed derives the accumulation steps from
them (train_batch_size = micro batch x accumulation x world size), and so do we (the world size:
the process group's, else the launcher's WORLD_SIZE). A dict is read as DeepSpeed's when it has a
top-level key only DeepSpeed has (`is_deepspeed`), with or without zero_optimization, or when it
is a bare zero_optimization block.

Every value we map is type-checked here, under its DeepSpeed name: JSON has no schema, and a
Python `bool("false")` or `int(True)` would silently turn a slip into a setting. A value Config
then refuses (out of range) is reported under its DeepSpeed key too, as the user wrote it
(`_as_deepspeeds`), not as our field holding a converted value.
"""
from __future__ import annotations

import json
import math
import os
import warnings
from dataclasses import fields
from typing import Any, Callable, Mapping

from zero_offload.config import SHOWN, Config, ConfigError, ForeignFormat, register_format, shown, user_stacklevel
from zero_offload.tiers import CPU, DEVICE, REGISTRY, from_deepspeed, spelled, tier

_FLAG, _COUNT = "true or false", "an integer >= 0"  # the kinds of value an unmapped key must hold
# Accepted without effect, type-checked (kind; None: unchecked, as DeepSpeed's logging keys always
# were) and named in one warning. The why, per key, from DeepSpeed's config documentation:
_INERT_KEYS: dict[tuple[str, ...], str | None] = {
    # DeepSpeed's own logging and bookkeeping.
    ("steps_per_print",): None, ("wall_clock_breakdown",): None, ("zero_allow_untested_optimizer",): None,
    ("dump_state",): None,
    # Copies gradients into one buffer as they are produced (against fragmentation): our gradients
    # always sit in flat buffers, and either value gives the same gradients.
    ("zero_optimization", "contiguous_gradients"): _FLAG,
    # How long DeepSpeed keeps a gathered stage-3 parameter for reuse: a memory / traffic trade in
    # its own fetcher. Our gathered units are bounded by stage3.live_budget_bytes (its
    # stage3_max_live_parameters) and released unit by unit; the weights computed with are the same.
    ("zero_optimization", "stage3_max_reuse_distance"): _COUNT,
    # The tile DeepSpeed's offloaded optimizer steps (and swaps) at a time: ours steps its shard in
    # its own sub-shards, with the same Adam on the same values.
    ("zero_optimization", "sub_group_size"): _COUNT,
    # Stage 1-2 with CPU offload: which rank copies which gradient slice to CPU memory. The same
    # averaged gradient reaches the same optimizer state.
    ("zero_optimization", "round_robin_gradients"): _FLAG,
    # Gathering the updated parameters after a step: DeepSpeed's bucket size, and all-gather or a
    # series of broadcasts. Either way every rank ends with the same values.
    ("zero_optimization", "allgather_bucket_size"): _COUNT,
    ("zero_optimization", "allgather_partitions"): _FLAG,
    # Reduce-scatter (or reduce) instead of all-reduce to average gradients: the same average.
    ("zero_optimization", "reduce_scatter"): _FLAG,
    # DeepSpeed's NVMe swap buffer pools (how many, how large): ours is the staging ring, sized by
    # pinned_budget_bytes. Where state lives is set by the device key, which we map.
    ("zero_optimization", "offload_optimizer", "buffer_count"): _COUNT,
    ("zero_optimization", "offload_param", "buffer_count"): _COUNT,
    ("zero_optimization", "offload_param", "buffer_size"): _COUNT,
    # How DeepSpeed fills the optimizer's NVMe files at start-up: the same initial state.
    ("zero_optimization", "offload_optimizer", "fast_init"): _FLAG,
    # How DeepSpeed's libaio handle submits requests (overlapped; one call per request or one for a
    # block): ours always keeps io.queue_depth requests in flight. The bytes written are the same.
    ("aio", "overlap_events"): _FLAG,
    ("aio", "single_submit"): _FLAG,
    # Which kernel DeepSpeed's Adam runs (torch's or its fused one): the same maths.
    ("optimizer", "params", "torch_adam"): _FLAG,
    # What DeepSpeed's save_16bit_model() writes (the Hugging Face Trainer calls it): an API we do
    # not have. save_checkpoint and training are the same either way; full weights come from
    # engine.consolidated_state_dict(). fp16 in the key's older name.
    ("zero_optimization", "stage3_gather_16bit_weights_on_model_save"): _FLAG,
    ("zero_optimization", "stage3_gather_fp16_weights_on_model_save"): _FLAG,
}
# What a key of _CHECKED_KEYS's verdict is when its value is accepted: what our engine does anyway,
# or without effect (DeepSpeed itself reads it only in another setting). Any other verdict is the
# reason its value is refused.
_OURS, _IGNORED = "ours", "ignored"


def _zero_block(data: Mapping[str, Any]) -> Mapping[str, Any]:
    zero = data.get("zero_optimization")
    return zero if isinstance(zero, Mapping) else {}


def _params_on_nvme(data: Mapping[str, Any]) -> bool:
    block = _zero_block(data).get("offload_param")
    asked = from_deepspeed(block.get("device")) if isinstance(block, Mapping) else None
    return asked is not None and asked.needs_nvme_paths


# DeepSpeed's default offload_param.max_in_cpu (runtime/zero/offload_config.py): what a config
# that leaves it out keeps in CPU memory with device nvme.
_MAX_IN_CPU_DEFAULT = 10 ** 9
_MAX_IN_CPU = ("zero_optimization", "offload_param", "max_in_cpu")


def _max_in_cpu_field(data: Mapping[str, Any]) -> dict[str, int]:
    """stage3.max_in_cpu from offload_param.max_in_cpu (DeepSpeed's default where it is left
    out) when parameters go to nvme; nothing otherwise."""
    if not _params_on_nvme(data):
        return {}
    found, value = _find(data, _MAX_IN_CPU)
    return {"max_in_cpu": _number(value, "zero_optimization.offload_param.max_in_cpu", integer=True)
            if found else _MAX_IN_CPU_DEFAULT}


def _use_gds(value: Any, data: Mapping[str, Any]) -> str:
    """aio.use_gds: true moves NVMe data straight to GPU memory (GPUDirect Storage). We always go
    through pinned host memory, which is what false says."""
    if value is True:
        return "zero_offload does not use GPUDirect Storage, NVMe data passes through pinned host memory: set false"
    return _OURS


# Keys accepted only with the value that matches what our engine does: key path -> (kind, verdict).
_CHECKED_KEYS: dict[tuple[str, ...], tuple[str, Callable[[Any, Mapping[str, Any]], str]]] = {
    ("aio", "use_gds"): (_FLAG, _use_gds),
}


def _keys_under(path: tuple[str, ...]) -> set[str]:
    """The unmapped keys (_INERT_KEYS, _CHECKED_KEYS) a section may hold."""
    return {k[-1] for k in (*_INERT_KEYS, *_CHECKED_KEYS) if k[:-1] == path}


_TOP = {"zero_optimization", "bf16", "fp16", "optimizer", "gradient_accumulation_steps", "gradient_clipping",
        "aio", "train_batch_size", "train_micro_batch_size_per_gpu"} | _keys_under(())
# DeepSpeed top-level keys we do not reproduce -> what to use instead ("" where nothing is): refused
# by name, and like every DeepSpeed-only key they mark a dict as a DeepSpeed config (which need not
# have zero_optimization).
_LOG_IT = "log from the training loop"
_REFUSED_TOP: dict[str, str] = {
    "scheduler": "build a torch.optim.lr_scheduler on engine.optimizer and call its step() when engine.step() "
                 "returns True",
    "amp": "use bf16 or fp16 instead",
    "activation_checkpointing": "use torch.utils.checkpoint in the model's forward",
    "flops_profiler": "use torch.profiler",
    "tensorboard": _LOG_IT, "wandb": _LOG_IT, "csv_monitor": _LOG_IT,
    "memory_breakdown": "use engine.memory_report()",
    **dict.fromkeys(("communication_data_type", "prescale_gradients", "gradient_predivide_factor",
                     "sparse_gradients", "zero_force_ds_cpu_optimizer", "elasticity", "autotuning",
                     "data_types"), ""),
}
_OURS_FIELDS = {f.name for f in fields(Config)}
# optimizer and gradient_accumulation_steps are keys of both formats, so they say neither.
_DS_ONLY = (_TOP | set(_REFUSED_TOP)) - _OURS_FIELDS
_OURS_ONLY = _OURS_FIELDS - _TOP
_ZERO = {"stage", "offload_optimizer", "offload_param", "reduce_bucket_size", "overlap_comm",
         "stage3_prefetch_bucket_size", "stage3_max_live_parameters",
         "stage3_param_persistence_threshold", "leaf_module"} | _keys_under(("zero_optimization",))
_ZERO_ONLY = _ZERO - _OURS_FIELDS  # all but stage: they mark a bare zero_optimization block
_OFFLOAD = {"device", "nvme_path", "pin_memory"}
# stage3_* key -> our stage3 field (DeepSpeed counts elements, we bytes)
_STAGE3_KEYS = {"stage3_max_live_parameters": "live_budget_bytes",
                "stage3_param_persistence_threshold": "resident_bytes",
                "stage3_prefetch_bucket_size": "unit_bytes"}
# offload block -> the tier (state group) it moves
_BLOCK_GROUP = {"offload_optimizer": "optimizer", "offload_param": "params"}
_AIO = {"block_size", "queue_depth", "thread_count", "intra_op_parallelism"}
_ADAM_PARAMS = {"lr", "betas", "eps", "weight_decay", "adam_w_mode"}
# fp16 key -> (our precision field, whether it is an integer)
_FP16_KEYS = {"loss_scale": ("static_scale", False), "initial_scale_power": ("initial_scale_power", True),
              "loss_scale_window": ("scale_window", True), "hysteresis": ("hysteresis", True),
              "min_loss_scale": ("min_scale", False)}
# DeepSpeed's ADAM_W_MODE_DEFAULT: "Adam" means decoupled weight decay unless adam_w_mode is false.
_ADAM_W_MODE_DEFAULT = True
# Our field -> where its value sits in a DeepSpeed config (first path present wins), so that a
# value Config refuses is reported under the DeepSpeed key, as the user wrote it: not as, say,
# bucket_bytes = -20 for a reduce_bucket_size of -5 elements.
_ORIGIN: dict[str, tuple[tuple[Any, ...], ...]] = {
    "stage": (("zero_optimization", "stage"),),
    "bucket_bytes": (("zero_optimization", "reduce_bucket_size"),),
    **{f"stage3.{ours}": (("zero_optimization", ds),) for ds, ours in _STAGE3_KEYS.items()},
    **{f"precision.{ours}": (("fp16", ds),) for ds, (ours, _) in _FP16_KEYS.items()},
    **{f"optimizer.{k}": (("optimizer", "params", k),) for k in ("lr", "eps", "weight_decay")},
    **{f"optimizer.betas[{i}]": (("optimizer", "params", "betas", i),) for i in (0, 1)},
    "stage3.max_in_cpu": (("zero_optimization", "offload_param", "max_in_cpu"),),
    "io.block_size": (("aio", "block_size"),),
    "io.queue_depth": (("aio", "queue_depth"),),
    "io.threads": (("aio", "thread_count"), ("aio", "intra_op_parallelism")),
    "clip_grad_norm": (("gradient_clipping",),),
    "gradient_accumulation_steps": (("gradient_accumulation_steps",),),
    "nvme_paths": (("zero_optimization", "offload_optimizer", "nvme_path"),
                   ("zero_optimization", "offload_param", "nvme_path")),
}


def _key(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


# Each object a DeepSpeed config may hold, by its key path, and the keys it may hold: any other key
# found in any of them is refused, all in one error.
_ALLOWED: dict[tuple[str, ...], set[str]] = {
    (): _TOP,
    ("zero_optimization",): _ZERO,
    **{("zero_optimization", block): _OFFLOAD | _keys_under(("zero_optimization", block)) for block in _BLOCK_GROUP},
    ("zero_optimization", "offload_param"): _OFFLOAD | {_MAX_IN_CPU[-1]} | _keys_under(("zero_optimization", "offload_param")),
    ("zero_optimization", "leaf_module"): {"classes"},
    ("aio",): _AIO | _keys_under(("aio",)),
    ("bf16",): {"enabled"},
    ("fp16",): {"enabled", *_FP16_KEYS},
    ("optimizer",): {"type", "params"},
    ("optimizer", "params"): _ADAM_PARAMS | _keys_under(("optimizer", "params")),
}


def _dotted(path: tuple[Any, ...]) -> str:
    """A key path as written, each part cut as error messages quote values (a key may be any size)."""
    return ".".join(str(p) if len(str(p)) <= SHOWN else shown(p) for p in path)


def _refuse_unsupported(data: Mapping[str, Any]) -> None:
    """One error naming every key we do not reproduce, in every section, by its dotted path, and
    every value of a _CHECKED_KEYS key that differs from what we do: one line, however long, so
    a config is fixed in one round rather than one section per run."""
    problems = _unknown_keys(data) + _refused_values(data)
    if problems:
        raise ConfigError(f"DeepSpeed key(s) not supported by zero_offload: {'; '.join(problems)}")


def _unknown_keys(data: Mapping[str, Any]) -> list[str]:
    """The keys no section allows, sorted within each section; a top-level one with an
    equivalent says what to use. A section that is not an object is left to _section to refuse."""
    out: list[str] = []
    for path, allowed in _ALLOWED.items():
        found, block = _find(data, path)
        if found and isinstance(block, Mapping):
            out += [_with_hint(path + (key,)) for key in sorted(block, key=str) if key not in allowed]
    return out


def _with_hint(path: tuple[Any, ...]) -> str:
    hint = _REFUSED_TOP.get(path[0], "") if len(path) == 1 else ""
    return f"{_dotted(path)} ({hint})" if hint else _dotted(path)


def _refused_values(data: Mapping[str, Any]) -> list[str]:
    """Each _CHECKED_KEYS value that differs from what we do, with why. A value of the wrong kind
    is left to _unused_keys, which names what it should be."""
    out: list[str] = []
    for path, (_, verdict) in _CHECKED_KEYS.items():
        found, value = _find(data, path)
        said = verdict(value, data) if found else _OURS
        if said not in (_OURS, _IGNORED):
            out.append(f"{_dotted(path)} = {json.dumps(value)} ({said})")  # a number or a flag: short
    return out


def _unused_keys(data: Mapping[str, Any]) -> list[str]:
    """The keys given that we accept without effect, each checked to be of its kind first (as
    DeepSpeed checks them: a slip is a slip even where the value goes unused)."""
    out: list[str] = []
    for path, kind in _INERT_KEYS.items():
        found, value = _find(data, path)
        if found:
            _check_kind(value, path, kind)
            out.append(_dotted(path))
    for path, (kind, verdict) in _CHECKED_KEYS.items():
        found, value = _find(data, path)
        if found:
            _check_kind(value, path, kind)
            if verdict(value, data) == _IGNORED:
                out.append(_dotted(path))
    found, value = _find(data, _MAX_IN_CPU)
    if found and not _params_on_nvme(data):  # DeepSpeed reads it with device nvme only
        _check_kind(value, _MAX_IN_CPU, _COUNT)
        out.append(_dotted(_MAX_IN_CPU))
    return out


def _check_kind(value: Any, path: tuple[str, ...], kind: str | None) -> None:
    """A true JSON boolean for _FLAG, a whole number >= 0 for _COUNT (as DeepSpeed's ge=0)."""
    if kind == _FLAG and not isinstance(value, bool):
        raise _bad(_dotted(path), value, _FLAG)
    if kind == _COUNT and _number(value, _dotted(path), integer=True) < 0:
        raise _bad(_dotted(path), value, _COUNT)


class IgnoredDeepSpeedKeys(UserWarning):
    """DeepSpeed keys accepted without effect (see the module docstring); its own class, so a
    caller (a CLI) can show it apart or silence it."""


def _warn_unused(keys: list[str]) -> None:
    """One warning for a config read, naming every key that did nothing."""
    if keys:
        warnings.warn(f"DeepSpeed key(s) accepted without effect, as they change nothing zero_offload stores or "
                      f"computes: {', '.join(keys)}", IgnoredDeepSpeedKeys, stacklevel=user_stacklevel())


def _bad(key: str, value: Any, expected: str) -> ConfigError:
    """The one-line error for a bad value; 'auto' gets its own hint, a wrong kind names its type."""
    if isinstance(value, str) and value == "auto":
        return ConfigError(f"DeepSpeed key '{key}' = 'auto' is the Hugging Face placeholder: resolve it first "
                           "(zero_offload.hf.ZeroOffloadTrainer, or hf.from_pretrained(..., training_args=args), fills it from "
                           "TrainingArguments; or write the value)")
    got = "" if isinstance(value, (int, float)) and not isinstance(value, bool) else f", got {type(value).__name__}"
    return ConfigError(f"DeepSpeed key '{key}' = {shown(value)} is invalid: expected {expected}{got}")


def _section(data: Mapping[str, Any], key: str, where: str) -> Mapping[str, Any]:
    """The object under `key`, {} when absent; present but not an object (null, false, []) is an error."""
    if key not in data:
        return {}
    value = data[key]
    if not isinstance(value, Mapping):
        raise _bad(_key(where, key), value, "an object")
    return value


def _flag(block: Mapping[str, Any], name: str, where: str, default: bool) -> bool:
    """A true JSON boolean: the string "false" is truthy in Python, so strings are refused."""
    value = block.get(name, default)
    if not isinstance(value, bool):
        raise _bad(_key(where, name), value, "true or false")
    return value


def _number(value: Any, key: str, *, integer: bool = False) -> Any:
    """A finite number (an int when `integer`; 5e8 is fine, 5.5 is not). bool, null and strings
    are refused, as int(True) == 1 and float("1") would pass a slip through."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _bad(key, value, "an integer" if integer else "a finite number")
    if integer and value != int(value):
        raise _bad(key, value, "an integer")
    return int(value) if integer else value


def _nvme_paths(block: Mapping[str, Any], key: str) -> list[str]:
    """nvme_path: one directory, or (our extension) a list of them."""
    value = block.get("nvme_path")
    if value is None or value == "":
        raise ConfigError(f"DeepSpeed key 'zero_optimization.{key}.device' = 'nvme' needs nvme_path")
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not items or not all(isinstance(p, str) and p for p in items):
        raise _bad(f"zero_optimization.{key}.nvme_path", value, "a directory path or a list of them")
    return items


def _offload(zero: Mapping[str, Any], key: str) -> tuple[str, list[str]]:
    """The tier an offload_* block asks for, and its nvme_path(s) when that tier is nvme."""
    block = _section(zero, key, "zero_optimization")
    device = block.get("device", DEVICE.deepspeed)
    asked = from_deepspeed(device)
    if asked is None:
        raise ConfigError(f"DeepSpeed key 'zero_optimization.{key}.device' = {shown(device)}: "
                          f"expected {spelled([t.deepspeed for t in REGISTRY])}")
    return asked.name, (_nvme_paths(block, key) if asked.needs_nvme_paths else [])


def _dirs(paths: list[str]) -> set[str]:
    """The directories a path list names, so '/mnt/a/' and '/mnt/a' (or another order) compare equal."""
    return {os.path.normpath(os.path.expanduser(p)) for p in paths}


def _shared_nvme_paths(optimizer: list[str], params: list[str]) -> tuple[str, ...]:
    """One path list for both blocks: we stripe every group over the same paths, while DeepSpeed
    keeps each group's files on its own path, so two blocks naming different ones are refused
    rather than merged (which would put each group's files on the other's drive too)."""
    if optimizer and params and _dirs(optimizer) != _dirs(params):
        given = [p[0] if len(p) == 1 else p for p in (optimizer, params)]
        raise ConfigError(f"DeepSpeed zero_optimization.offload_optimizer.nvme_path = {shown(given[0])} and "
                          f"offload_param.nvme_path = {shown(given[1])} differ: zero_offload stripes every group over "
                          "one list of paths; give the same path (or list) for both")
    return tuple(dict.fromkeys(optimizer or params))


def _fp16_settings(block: Mapping[str, Any]) -> dict[str, Any]:
    """The loss-scale keys, checked even when fp16 is off: a typo'd value is still a slip."""
    out: dict[str, Any] = {}
    for ds_key, (ours, integer) in _FP16_KEYS.items():
        if ds_key in block:
            out[ours] = _number(block[ds_key], f"fp16.{ds_key}", integer=integer)
    return out


def _precision(data: Mapping[str, Any]) -> dict[str, Any]:
    bf16_block = _section(data, "bf16", "")
    fp16_block = _section(data, "fp16", "")
    bf16 = _flag(bf16_block, "enabled", "bf16", False)
    fp16 = _flag(fp16_block, "enabled", "fp16", False)
    scale = _fp16_settings(fp16_block)
    if bf16 and fp16:
        raise ConfigError("DeepSpeed config enables both bf16 and fp16: choose one")
    if not fp16:
        return {"dtype": "bf16" if bf16 else "fp32"}
    return {"dtype": "fp16", **scale}


def _betas(value: Any) -> tuple[float, float]:
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise _bad("optimizer.params.betas", value, "two numbers [beta1, beta2]")
    return _number(value[0], "optimizer.params.betas[0]"), _number(value[1], "optimizer.params.betas[1]")


def _adam_params(params: Mapping[str, Any]) -> dict[str, Any]:
    """lr, eps, weight_decay and betas, each checked under its DeepSpeed name. A weight_decay
    left out is DeepSpeed's default, 0 (its Adam classes'), not ours (0.01)."""
    out: dict[str, Any] = {k: _number(params[k], f"optimizer.params.{k}")
                           for k in ("lr", "eps", "weight_decay") if k in params}
    out.setdefault("weight_decay", 0.0)
    if "betas" in params:
        out["betas"] = _betas(params["betas"])
    return out


def _optimizer(data: Mapping[str, Any]) -> dict[str, Any]:
    block = _section(data, "optimizer", "")
    if not block:
        return {}
    kind = block.get("type", "AdamW")
    params = _section(block, "params", "optimizer")
    if not isinstance(kind, str) or kind.lower() not in ("adam", "adamw"):
        raise ConfigError(f"DeepSpeed optimizer type {shown(block.get('type'))} is not supported: use Adam or AdamW")
    # As DeepSpeed: effective_adam_w_mode = name == "adamw" or adam_w_mode (default True).
    adam_w_mode = _flag(params, "adam_w_mode", "optimizer.params", _ADAM_W_MODE_DEFAULT)
    decoupled = kind.lower() == "adamw" or adam_w_mode
    return {"name": "adamw" if decoupled else "adam", **_adam_params(params)}


def _stage3(zero: Mapping[str, Any], stage: int, dtype_bytes: int) -> dict[str, Any]:
    """The stage3_* sizes and the leaf module classes, refused by name below stage 3 (where they
    would do nothing)."""
    leaves = _leaf_classes(zero)
    given = [k for k in _STAGE3_KEYS if k in zero] + (["leaf_module.classes"] if leaves else [])
    if given and stage in (0, 1, 2):  # a stage out of range is the error to report, by Config
        raise ConfigError(f"DeepSpeed key(s) {', '.join('zero_optimization.' + k for k in given)} apply only "
                          f"to stage 3, but zero_optimization.stage is {stage}")
    out: dict[str, Any] = {_STAGE3_KEYS[k]: _number(zero[k], f"zero_optimization.{k}", integer=True) * dtype_bytes
                           for k in given if k in _STAGE3_KEYS}
    if leaves:
        out["leaf_modules"] = leaves
    return out


def _leaf_classes(zero: Mapping[str, Any]) -> list[str]:
    """leaf_module.classes: DeepSpeed matches a class by its name or its module path and name
    (one string is one class); ours are names, so a path keeps its last part."""
    value = _section(zero, "leaf_module", "zero_optimization").get("classes", [])
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(c, str) and c.strip(".") for c in items):
        key, kind = "zero_optimization.leaf_module.classes", "a list of module class names"
        raise _bad(key, value, kind) if not isinstance(value, list) else ConfigError(
            f"DeepSpeed key '{key}' = {shown(value)} is invalid: expected {kind}")
    return [c.rpartition(".")[2] for c in items]


def _zero_scalars(zero: Mapping[str, Any], dtype_bytes: int) -> dict[str, Any]:
    """stage, bucket size, overlap and the stage-3 sizes (DeepSpeed counts elements, we bytes)."""
    out: dict[str, Any] = {"stage": _number(zero.get("stage", 0), "zero_optimization.stage", integer=True)}
    if "reduce_bucket_size" in zero:
        out["bucket_bytes"] = _number(zero["reduce_bucket_size"], "zero_optimization.reduce_bucket_size",
                                      integer=True) * dtype_bytes
    if "overlap_comm" in zero:
        out["overlap_step"] = _flag(zero, "overlap_comm", "zero_optimization", True)
    stage3 = _stage3(zero, out["stage"], dtype_bytes)
    if stage3:
        out["stage3"] = stage3
    return out


def _pin_memory(zero: Mapping[str, Any], tiers: Mapping[str, str]) -> dict[str, Any]:
    """Our one pin_memory flag from the offload blocks'. DeepSpeed 0.19.8's default is true
    (runtime/zero/offload_config.py), as ours, so neither saying means pinned. A block that
    offloads nothing (device none) has nothing to pin; two offloading blocks that disagree are
    refused, as one flag cannot keep both."""
    said: dict[str, bool] = {}
    for key, group in _BLOCK_GROUP.items():
        block = _section(zero, key, "zero_optimization")
        pin = _flag(block, "pin_memory", f"zero_optimization.{key}", True)  # checked even where unused
        if "pin_memory" in block and tier(tiers[group]).off_device:
            said[key] = pin
    if len(set(said.values())) > 1:
        opt, par = (json.dumps(said[k]) for k in _BLOCK_GROUP)
        raise ConfigError(f"DeepSpeed zero_optimization.offload_optimizer.pin_memory = {opt} and "
                          f"offload_param.pin_memory = {par} differ: zero_offload pins host memory for every "
                          "group or for none; give both the same value")
    return {"pin_memory": next(iter(said.values()), True)}


def _world_size() -> int:
    """The process group's size when there is one (as DeepSpeed takes it), else the launcher's
    WORLD_SIZE (a config read before the group is made), else 1."""
    from zero_offload import comm

    if comm.is_distributed():
        return comm.world_size()
    value = os.environ.get("WORLD_SIZE", "1") or "1"
    if not value.isdigit() or int(value) < 1:
        raise ConfigError(f"WORLD_SIZE = {shown(value)} is not a world size (a whole number >= 1)")
    return int(value)


def _accumulation(data: Mapping[str, Any]) -> int | None:
    """gradient_accumulation_steps as DeepSpeed has it: DeepSpeed requires train_batch_size =
    train_micro_batch_size_per_gpu x steps x world size and derives the one left out, so a given
    train_batch_size must divide as that says, else DeepSpeed refuses the config and so do we."""
    keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    total, micro, steps = (_number(data[k], k, integer=True) if k in data else None for k in keys)
    for key, value in zip(keys[1:], (micro, steps)):  # checked whether or not train_batch_size is given
        if value is not None and value < 1:
            raise _bad(key, value, "an integer >= 1")
    if total is None:
        return steps
    if micro is None:
        return _steps_without_micro(total, steps, _world_size())
    return _steps_with_micro(total, micro, steps, _world_size())


def _steps_without_micro(total: int, steps: int | None, world: int) -> int:
    """DeepSpeed's micro batch is then train_batch_size / (steps x world size), steps 1 when not
    given; a micro batch that is not a whole number >= 1 is refused."""
    per_micro = (1 if steps is None else steps) * world
    if total < per_micro or total % per_micro:
        given = "" if steps is None else f"gradient_accumulation_steps {steps} x "
        raise ConfigError(f"DeepSpeed train_batch_size = {total} is not {given}world size {world} x a whole "
                          "train_micro_batch_size_per_gpu >= 1")
    return 1 if steps is None else steps


def _steps_with_micro(total: int, micro: int, steps: int | None, world: int) -> int:
    """The steps train_batch_size / (micro x world size), which a given steps must equal."""
    derived, rest = divmod(total, micro * world)
    if rest or derived < 1 or (steps is not None and steps != derived):
        given = "" if steps is None else f" x gradient_accumulation_steps {steps}"
        raise ConfigError(f"DeepSpeed train_batch_size = {total} is not train_micro_batch_size_per_gpu = {micro}"
                          f"{given} x world size {world}{'' if steps is not None else ' x a whole number of accumulation steps'}")
    return derived


def _training(data: Mapping[str, Any]) -> dict[str, Any]:
    """gradient_accumulation_steps, gradient_clipping and the aio block."""
    out: dict[str, Any] = {}
    steps = _accumulation(data)
    if steps is not None:
        out["gradient_accumulation_steps"] = steps
    if "gradient_clipping" in data:
        out["clip_grad_norm"] = float(_number(data["gradient_clipping"], "gradient_clipping"))
    aio = _section(data, "aio", "")
    io = {k2: _number(aio[k1], f"aio.{k1}", integer=True) for k1, k2 in (
        ("block_size", "block_size"), ("queue_depth", "queue_depth"), ("thread_count", "threads")) if k1 in aio}
    if "intra_op_parallelism" in aio:
        io["threads"] = _aio_threads(aio, io.get("threads"))
    if io:
        out["io"] = io
    return out


def _aio_threads(aio: Mapping[str, Any], thread_count: int | None) -> int:
    """intra_op_parallelism (DeepSpeed's newer name for thread_count) as our one io.threads;
    both given with different values are refused, as one would be silently dropped."""
    threads = _number(aio["intra_op_parallelism"], "aio.intra_op_parallelism", integer=True)
    if thread_count is not None and thread_count != threads:
        raise ConfigError(f"DeepSpeed aio.thread_count = {thread_count} and aio.intra_op_parallelism = {threads} "
                          "differ: both set zero_offload's one io.threads; give one of them")
    return threads


# A DeepSpeed key given where ours are expected (Config(gradient_clipping=1.0)) -> our field, and
# how its value differs where it does.
_ELEMENTS = " (in bytes; DeepSpeed counts elements)"
_OUR_NAMES: dict[str, tuple[str, str]] = {
    "gradient_clipping": ("'clip_grad_norm'", ""),
    "overlap_comm": ("'overlap_step'", ""),
    "reduce_bucket_size": ("'bucket_bytes'", _ELEMENTS),
    "bf16": ("precision={'dtype': 'bf16'}", ""),
    "fp16": ("precision={'dtype': 'fp16'}", ""),
    "aio": ("'io'", ""),
    "offload_optimizer": ("tiers={'optimizer': 'cpu'}", " (or 'nvme', with nvme_paths)"),
    "offload_param": ("tiers={'params': 'cpu'}", " (or 'nvme', with nvme_paths; stage 3)"),
    **{ds: (f"stage3={{'{ours}': ...}}", _ELEMENTS) for ds, ours in _STAGE3_KEYS.items()},
}


def deepspeed_key_hint(key: str) -> str | None:
    """For a DeepSpeed key given as one of our fields, the end of config's "unknown config key"
    line: our name for it, or what to do instead; None for a key DeepSpeed does not have."""
    if key in _OUR_NAMES:
        ours, note = _OUR_NAMES[key]
        return f" (DeepSpeed's name); did you mean {ours}?{note}"
    if _REFUSED_TOP.get(key):
        return f" (a DeepSpeed key zero_offload does not support): {_REFUSED_TOP[key]}"
    if key in _DS_ONLY or key in _ZERO_ONLY:
        return (" (a DeepSpeed key): give a whole DeepSpeed config as a dict to Config.from_dict or "
                "zero_offload.initialize, not as keywords")
    return None


def is_deepspeed(data: Mapping[str, Any]) -> bool:
    """Whether a config dict is DeepSpeed's: it has a top-level key only DeepSpeed has (DeepSpeed
    needs no zero_optimization), or it is a bare zero_optimization block, with a key only that
    block has (offload_optimizer, ...; `stage` alone is ours too). Keys only we have besides are
    refused: read as either format, the other's keys would be reported as unknown, which hides
    that the file mixes the two."""
    if data and all(k in _ZERO for k in data) and any(k in _ZERO_ONLY for k in data):
        return True
    theirs = sorted(str(k) for k in data if k in _DS_ONLY or k in _ZERO_ONLY)
    ours = sorted(str(k) for k in data if k in _OURS_ONLY)
    if theirs and ours:
        raise ConfigError(f"config mixes zero_offload keys ({', '.join(ours)}) with DeepSpeed keys "
                          f"({', '.join(theirs)}): write it in one format")
    return bool(theirs)


def _whole_config(data: Mapping[str, Any]) -> Mapping[str, Any]:
    """The whole DeepSpeed config: `data`, or a bare zero_optimization block (one with no
    top-level key) wrapped as one. zero_optimization keys beside top-level ones are misplaced."""
    if not any(k in _TOP or k in _REFUSED_TOP for k in data):
        return {"zero_optimization": data}
    misplaced = sorted(str(k) for k in data if k in _ZERO)
    if misplaced:
        raise ConfigError(f"DeepSpeed key(s) {', '.join(misplaced)} belong under zero_optimization, "
                          "not at the top level of the config")
    return data


def _hoisted_aio(data: Mapping[str, Any]) -> Mapping[str, Any]:
    """An aio block inside zero_optimization, as transformers' DeepSpeed page prints its NVMe
    example, read as the top-level block it is meant to be (DeepSpeed reads aio only there),
    with a warning; beside a top-level aio block it is refused, as one of the two would be dropped."""
    zero = data.get("zero_optimization")
    if not isinstance(zero, Mapping) or "aio" not in zero:
        return data
    if "aio" in data:
        raise ConfigError("DeepSpeed config has an aio block at the top level and one inside zero_optimization: "
                          "keep the top-level one (DeepSpeed reads only that)")
    warnings.warn("DeepSpeed key zero_optimization.aio is read as the top-level aio block (DeepSpeed reads aio only "
                  "at the top level of the config: move it there)", UserWarning, stacklevel=user_stacklevel())
    return {**data, "aio": zero["aio"], "zero_optimization": {k: v for k, v in zero.items() if k != "aio"}}


def config_from_deepspeed(data: Mapping[str, Any]) -> Config:
    """Map a DeepSpeed config dict onto ours; a bare zero_optimization dict is accepted too."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"a DeepSpeed config must be a JSON object, got {type(data).__name__}")
    data = _hoisted_aio(_whole_config(data))
    _refuse_unsupported(data)
    unused = _unused_keys(data)
    config = _mapped(data)
    _warn_unused(unused)  # only once the config is good: an error is what to act on first
    return config


def _mapped(data: Mapping[str, Any]) -> Config:
    """Our Config from a whole DeepSpeed config whose keys are all known."""
    zero = _section(data, "zero_optimization", "")
    (opt_tier, opt_paths), (par_tier, par_paths) = (_offload(zero, k) for k in _BLOCK_GROUP)
    # DeepSpeed keeps reduced gradients next to the offloaded optimizer; so do we.
    grads = CPU.name if tier(opt_tier).off_device else DEVICE.name
    tiers = {"optimizer": opt_tier, "params": par_tier, "grads": grads}
    precision = _precision(data)
    dtype_bytes = 4 if precision["dtype"] == "fp32" else 2
    kwargs: dict[str, Any] = {"tiers": tiers, "precision": precision,
                              "nvme_paths": _shared_nvme_paths(opt_paths, par_paths),
                              "optimizer": _optimizer(data), **_zero_scalars(zero, dtype_bytes),
                              **_pin_memory(zero, tiers), **_training(data)}
    in_cpu = _max_in_cpu_field(data)
    if in_cpu:
        kwargs["stage3"] = {**kwargs.get("stage3", {}), **in_cpu}
    try:
        return Config(**kwargs)
    except ConfigError as exc:
        raise _as_deepspeeds(exc, data) from None


def _as_deepspeeds(exc: ConfigError, data: Mapping[str, Any]) -> ConfigError:
    """Config's error for a bad field value, restated under the DeepSpeed key the value came from
    and as the user wrote it; any other error (a refused combination) as it is."""
    for path in _ORIGIN.get(exc.field or "", ()):
        found, value = _find(data, path)
        if found:
            key = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".")
            return ConfigError(f"DeepSpeed key '{key}' = {shown(value)} is invalid: {exc.allowed}")
    return exc


def _find(data: Any, path: tuple[Any, ...]) -> tuple[bool, Any]:
    """(True, the value) at a key path through dicts and lists, else (False, None)."""
    for step in path:
        if isinstance(step, int) and isinstance(data, (list, tuple)) and step < len(data):
            data = data[step]
        elif isinstance(step, str) and isinstance(data, Mapping) and step in data:
            data = data[step]
        else:
            return False, None
    return True, data


# Config.from_dict, from_file and from_deepspeed read DeepSpeed configs through this registration
# (config.py never imports this module: the package's __init__ does, before any config is read).
register_format(ForeignFormat("deepspeed", is_deepspeed, config_from_deepspeed, deepspeed_key_hint))
