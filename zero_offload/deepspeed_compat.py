"""Reading a DeepSpeed config, so users can bring the one they already have.

Only keys whose meaning we reproduce are mapped; any other key is an error that names it, so a
setting the user relies on is never silently dropped. Keys DeepSpeed uses only for its own
bookkeeping (logging) are listed in _INERT and accepted without effect, because they do not
change what is stored where or how the step is computed. The batch sizes do: DeepSpeed derives
the accumulation steps from them (train_batch_size = micro batch x accumulation x world size),
and so do we (the world size: the process group's, else the launcher's WORLD_SIZE).

Every value we map is type-checked here, under its DeepSpeed name: JSON has no schema, and a
Python `bool("false")` or `int(True)` would silently turn a slip into a setting.
"""
from __future__ import annotations

import math
import os
from typing import Any, Mapping

from zero_offload.config import Config, ConfigError

_INERT = {"steps_per_print", "wall_clock_breakdown", "zero_allow_untested_optimizer", "dump_state"}
_TOP = {"zero_optimization", "bf16", "fp16", "optimizer", "gradient_accumulation_steps", "gradient_clipping",
        "aio", "train_batch_size", "train_micro_batch_size_per_gpu"} | _INERT
# contiguous_gradients is accepted because we always lay gradients out contiguously.
_ZERO = {"stage", "offload_optimizer", "offload_param", "reduce_bucket_size", "overlap_comm", "contiguous_gradients",
         "stage3_prefetch_bucket_size", "stage3_max_live_parameters", "stage3_param_persistence_threshold"}
_OFFLOAD = {"device", "nvme_path", "pin_memory"}
_AIO = {"block_size", "queue_depth", "thread_count", "intra_op_parallelism"}
_ADAM_PARAMS = {"lr", "betas", "eps", "weight_decay", "adam_w_mode", "torch_adam"}
# fp16 key -> (our precision field, whether it is an integer)
_FP16_KEYS = {"loss_scale": ("static_scale", False), "initial_scale_power": ("initial_scale_power", True),
              "loss_scale_window": ("scale_window", True), "hysteresis": ("hysteresis", True),
              "min_loss_scale": ("min_scale", False)}
# DeepSpeed's ADAM_W_MODE_DEFAULT: "Adam" means decoupled weight decay unless adam_w_mode is false.
_ADAM_W_MODE_DEFAULT = True


def _key(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def _unknown(where: str, data: Mapping[str, Any], allowed: set[str]) -> None:
    extra = sorted(set(data) - allowed)
    if extra:
        raise ConfigError(f"DeepSpeed key(s) not supported by zero_offload in {where}: {', '.join(extra)}")


def _bad(key: str, value: Any, expected: str) -> ConfigError:
    """The one-line error for a bad value; 'auto' gets its own hint, a wrong kind names its type."""
    if isinstance(value, str) and value == "auto":
        return ConfigError(f"DeepSpeed key '{key}' = 'auto' is the Hugging Face placeholder: resolve it first "
                           "(let the HF Trainer fill it in, or write the value)")
    got = "" if isinstance(value, (int, float)) and not isinstance(value, bool) else f", got {type(value).__name__}"
    return ConfigError(f"DeepSpeed key '{key}' = {value!r} is invalid: expected {expected}{got}")


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


def _offload(zero: Mapping[str, Any], key: str, paths: list[str]) -> str:
    """The tier an offload_* block asks for; collects its nvme_path."""
    block = _section(zero, key, "zero_optimization")
    _unknown(f"zero_optimization.{key}", block, _OFFLOAD)
    device = block.get("device", "none")
    tier = {"none": "device", "cpu": "cpu", "nvme": "nvme"}.get(device) if isinstance(device, str) else None
    if tier is None:
        raise ConfigError(f"DeepSpeed key 'zero_optimization.{key}.device' = {device!r}: expected none, cpu or nvme")
    if tier == "nvme":
        for p in _nvme_paths(block, key):
            if p not in paths:
                paths.append(p)
    return tier


def _fp16_settings(block: Mapping[str, Any]) -> dict[str, Any]:
    """The loss-scale keys, checked even when fp16 is off: a typo'd value is still a slip."""
    out: dict[str, Any] = {}
    for ds_key, (ours, integer) in _FP16_KEYS.items():
        if ds_key in block:
            out[ours] = _number(block[ds_key], f"fp16.{ds_key}", integer=integer)
    return out


def _precision(data: Mapping[str, Any]) -> dict[str, Any]:
    bf16_block = _section(data, "bf16", "")
    _unknown("bf16", bf16_block, {"enabled"})
    fp16_block = _section(data, "fp16", "")
    _unknown("fp16", fp16_block, {"enabled", *_FP16_KEYS})
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
    _unknown("optimizer", block, {"type", "params"})
    kind = block.get("type", "AdamW")
    params = _section(block, "params", "optimizer")
    _unknown("optimizer.params", params, _ADAM_PARAMS)
    if not isinstance(kind, str) or kind.lower() not in ("adam", "adamw"):
        raise ConfigError(f"DeepSpeed optimizer type {block.get('type')!r} is not supported: use Adam or AdamW")
    # As DeepSpeed: effective_adam_w_mode = name == "adamw" or adam_w_mode (default True).
    adam_w_mode = _flag(params, "adam_w_mode", "optimizer.params", _ADAM_W_MODE_DEFAULT)
    _flag(params, "torch_adam", "optimizer.params", False)  # which kernel DeepSpeed uses; same maths
    decoupled = kind.lower() == "adamw" or adam_w_mode
    return {"name": "adamw" if decoupled else "adam", **_adam_params(params)}


def _stage3(zero: Mapping[str, Any], dtype_bytes: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for ds_key, ours in (("stage3_max_live_parameters", "live_budget_bytes"),
                         ("stage3_param_persistence_threshold", "resident_bytes"),
                         ("stage3_prefetch_bucket_size", "unit_bytes")):
        if ds_key in zero:
            out[ours] = _number(zero[ds_key], f"zero_optimization.{ds_key}", integer=True) * dtype_bytes
    return out


def _zero_scalars(zero: Mapping[str, Any], dtype_bytes: int) -> dict[str, Any]:
    """stage, bucket size, overlap and the stage-3 sizes (DeepSpeed counts elements, we bytes)."""
    _flag(zero, "contiguous_gradients", "zero_optimization", True)  # always true for us; still a bool
    out: dict[str, Any] = {"stage": _number(zero.get("stage", 0), "zero_optimization.stage", integer=True)}
    if "reduce_bucket_size" in zero:
        out["bucket_bytes"] = _number(zero["reduce_bucket_size"], "zero_optimization.reduce_bucket_size",
                                      integer=True) * dtype_bytes
    if "overlap_comm" in zero:
        out["overlap_step"] = _flag(zero, "overlap_comm", "zero_optimization", True)
    stage3 = _stage3(zero, dtype_bytes)
    if stage3:
        out["stage3"] = stage3
    return out


def _pin_memory(zero: Mapping[str, Any]) -> dict[str, Any]:
    """pin_memory of either offload block; pinned if either asks for it, absent if neither says."""
    blocks = [_section(zero, k, "zero_optimization") for k in ("offload_optimizer", "offload_param")]
    pins = [_flag(b, "pin_memory", f"zero_optimization.{k}", False)
            for b, k in zip(blocks, ("offload_optimizer", "offload_param")) if "pin_memory" in b]
    return {"pin_memory": any(pins)} if pins else {}


def _world_size() -> int:
    """The process group's size when there is one (as DeepSpeed takes it), else the launcher's
    WORLD_SIZE (a config read before the group is made), else 1."""
    from zero_offload import comm

    if comm.is_distributed():
        return comm.world_size()
    value = os.environ.get("WORLD_SIZE", "1") or "1"
    if not value.isdigit() or int(value) < 1:
        raise ConfigError(f"WORLD_SIZE = {value!r} is not a world size (a whole number >= 1)")
    return int(value)


def _accumulation(data: Mapping[str, Any]) -> int | None:
    """gradient_accumulation_steps as DeepSpeed has it: given, or derived from train_batch_size =
    train_micro_batch_size_per_gpu x steps x world size; all three given must agree."""
    keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    total, micro, steps = (_number(data[k], k, integer=True) if k in data else None for k in keys)
    if total is None or micro is None:
        return steps
    world = _world_size()
    derived, rest = divmod(total, micro * world) if micro > 0 else (0, 1)
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
    _unknown("aio", aio, _AIO)
    io = {k2: _number(aio[k1], f"aio.{k1}", integer=True) for k1, k2 in (
        ("block_size", "block_size"), ("queue_depth", "queue_depth"), ("thread_count", "threads"),
        ("intra_op_parallelism", "threads")) if k1 in aio}
    if io:
        out["io"] = io
    return out


def config_from_deepspeed(data: Mapping[str, Any]) -> Config:
    """Map a DeepSpeed config dict onto ours; a bare zero_optimization dict is accepted too."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"a DeepSpeed config must be a JSON object, got {type(data).__name__}")
    if "zero_optimization" not in data:
        data = {"zero_optimization": data}
    _unknown("the DeepSpeed config", data, _TOP)
    zero = _section(data, "zero_optimization", "")
    _unknown("zero_optimization", zero, _ZERO)
    paths: list[str] = []
    tiers = {"optimizer": _offload(zero, "offload_optimizer", paths), "params": _offload(zero, "offload_param", paths)}
    # DeepSpeed keeps reduced gradients next to the offloaded optimizer; so do we.
    tiers["grads"] = "cpu" if tiers["optimizer"] != "device" else "device"
    precision = _precision(data)
    dtype_bytes = 4 if precision["dtype"] == "fp32" else 2
    kwargs: dict[str, Any] = {"tiers": tiers, "precision": precision, "nvme_paths": tuple(paths),
                              "optimizer": _optimizer(data), **_zero_scalars(zero, dtype_bytes),
                              **_pin_memory(zero), **_training(data)}
    return Config(**kwargs)
