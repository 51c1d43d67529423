"""Reading a DeepSpeed config, so users can bring the one they already have.

Only keys whose meaning we reproduce are mapped; any other key is an error that names it, so a
setting the user relies on is never silently dropped. Keys DeepSpeed uses only for its own
bookkeeping (batch sizes, logging) are listed in _INERT and accepted without effect, because
they do not change what is stored where or how the step is computed.
"""
from __future__ import annotations

from typing import Any, Mapping

from zero_offload.config import Config, ConfigError

_INERT = {"train_batch_size", "train_micro_batch_size_per_gpu", "steps_per_print", "wall_clock_breakdown",
          "zero_allow_untested_optimizer", "dump_state"}
_TOP = {"zero_optimization", "bf16", "fp16", "optimizer", "gradient_accumulation_steps", "gradient_clipping",
        "aio"} | _INERT
# contiguous_gradients is accepted because we always lay gradients out contiguously.
_ZERO = {"stage", "offload_optimizer", "offload_param", "reduce_bucket_size", "overlap_comm", "contiguous_gradients",
         "stage3_prefetch_bucket_size", "stage3_max_live_parameters", "stage3_param_persistence_threshold"}
_OFFLOAD = {"device", "nvme_path", "pin_memory"}
_AIO = {"block_size", "queue_depth", "thread_count", "intra_op_parallelism"}
_ADAM_PARAMS = {"lr", "betas", "eps", "weight_decay", "adam_w_mode", "torch_adam"}


def _unknown(where: str, data: Mapping[str, Any], allowed: set[str]) -> None:
    extra = sorted(set(data) - allowed)
    if extra:
        raise ConfigError(f"DeepSpeed key(s) not supported by zero_offload in {where}: {', '.join(extra)}")


def _section(data: Mapping[str, Any], key: str, where: str) -> Mapping[str, Any]:
    value = data.get(key) or {}
    if not isinstance(value, Mapping):
        raise ConfigError(f"DeepSpeed key '{where}.{key}' must be an object, got {type(value).__name__}")
    return value


def _offload(zero: Mapping[str, Any], key: str, paths: list[str]) -> str:
    """The tier an offload_* block asks for; collects its nvme_path."""
    block = _section(zero, key, "zero_optimization")
    _unknown(f"zero_optimization.{key}", block, _OFFLOAD)
    device = block.get("device", "none")
    tier = {"none": "device", "cpu": "cpu", "nvme": "nvme"}.get(device)
    if tier is None:
        raise ConfigError(f"DeepSpeed key 'zero_optimization.{key}.device' = {device!r}: expected none, cpu or nvme")
    if tier == "nvme":
        if not block.get("nvme_path"):
            raise ConfigError(f"DeepSpeed key 'zero_optimization.{key}.device' = 'nvme' needs nvme_path")
        path = block["nvme_path"]
        for p in [path] if isinstance(path, str) else list(path):
            if p not in paths:
                paths.append(p)
    return tier


def _precision(data: Mapping[str, Any]) -> dict[str, Any]:
    bf16 = bool(_section(data, "bf16", "").get("enabled", False))
    fp16_block = _section(data, "fp16", "")
    _unknown("fp16", fp16_block, {"enabled", "loss_scale", "initial_scale_power", "loss_scale_window",
                                  "hysteresis", "min_loss_scale"})
    _unknown("bf16", _section(data, "bf16", ""), {"enabled"})
    fp16 = bool(fp16_block.get("enabled", False))
    if bf16 and fp16:
        raise ConfigError("DeepSpeed config enables both bf16 and fp16: choose one")
    if not fp16:
        return {"dtype": "bf16" if bf16 else "fp32"}
    out: dict[str, Any] = {"dtype": "fp16", "static_scale": float(fp16_block.get("loss_scale", 0.0))}
    for ds_key, ours in (("initial_scale_power", "initial_scale_power"), ("loss_scale_window", "scale_window"),
                         ("hysteresis", "hysteresis"), ("min_loss_scale", "min_scale")):
        if ds_key in fp16_block:
            out[ours] = fp16_block[ds_key]
    return out


def _optimizer(data: Mapping[str, Any]) -> dict[str, Any]:
    block = _section(data, "optimizer", "")
    if not block:
        return {}
    _unknown("optimizer", block, {"type", "params"})
    kind = str(block.get("type", "AdamW")).lower()
    params = dict(_section(block, "params", "optimizer"))
    _unknown("optimizer.params", params, _ADAM_PARAMS)
    if kind not in ("adam", "adamw"):
        raise ConfigError(f"DeepSpeed optimizer type {block.get('type')!r} is not supported: use Adam or AdamW")
    decoupled = kind == "adamw" or bool(params.pop("adam_w_mode", kind == "adamw"))
    params.pop("torch_adam", None)
    if "betas" in params:
        params["betas"] = tuple(params["betas"])
    return {"name": "adamw" if decoupled else "adam", **params}


def _stage3(zero: Mapping[str, Any], dtype_bytes: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if "stage3_max_live_parameters" in zero:
        out["live_budget_bytes"] = int(zero["stage3_max_live_parameters"]) * dtype_bytes
    if "stage3_param_persistence_threshold" in zero:
        out["resident_bytes"] = int(zero["stage3_param_persistence_threshold"]) * dtype_bytes
    if "stage3_prefetch_bucket_size" in zero:
        out["unit_bytes"] = int(zero["stage3_prefetch_bucket_size"]) * dtype_bytes
    return out


def config_from_deepspeed(data: Mapping[str, Any]) -> Config:
    """Map a DeepSpeed config dict onto ours; a bare zero_optimization dict is accepted too."""
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
    kwargs: dict[str, Any] = {"stage": zero.get("stage", 0), "tiers": tiers, "precision": precision,
                              "nvme_paths": tuple(paths), "optimizer": _optimizer(data)}
    pins = [_section(zero, k, "zero_optimization").get("pin_memory") for k in ("offload_optimizer", "offload_param")]
    if any(p is not None for p in pins):
        kwargs["pin_memory"] = any(bool(p) for p in pins)
    if "reduce_bucket_size" in zero:
        kwargs["bucket_bytes"] = int(zero["reduce_bucket_size"]) * (4 if precision["dtype"] == "fp32" else 2)
    stage3 = _stage3(zero, 4 if precision["dtype"] == "fp32" else 2)
    if stage3:
        kwargs["stage3"] = stage3
    if "overlap_comm" in zero:
        kwargs["overlap_step"] = bool(zero["overlap_comm"])
    if "gradient_accumulation_steps" in data:
        kwargs["gradient_accumulation_steps"] = data["gradient_accumulation_steps"]
    if "gradient_clipping" in data:
        kwargs["clip_grad_norm"] = float(data["gradient_clipping"])
    aio = _section(data, "aio", "")
    _unknown("aio", aio, _AIO)
    io = {k2: aio[k1] for k1, k2 in (("block_size", "block_size"), ("queue_depth", "queue_depth"),
                                     ("thread_count", "threads"), ("intra_op_parallelism", "threads")) if k1 in aio}
    if io:
        kwargs["io"] = io
    return Config(**kwargs)
