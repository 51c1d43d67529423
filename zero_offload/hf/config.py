"""The engine's Config for a Trainer run: the user's config, its training values from TrainingArguments.

A Trainer user sets the learning rate, Adam's betas and eps, weight decay, accumulation, clipping
and precision in TrainingArguments; the zero_offload config (ours, or the DeepSpeed JSON they
already have) says where the state lives. So those values come from TrainingArguments, as
transformers fills a DeepSpeed config (`HfTrainerDeepSpeedConfig.trainer_config_process`): a
DeepSpeed `"auto"` takes the TrainingArguments value, a value written out must equal it, and all
differences are listed in one error. A zero_offload Config or dict follows the same rule; a Config
field left at its default counts as not written (a Config cannot tell the two apart).

This module imports nothing from transformers: it reads the TrainingArguments' attributes.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import warnings
from typing import Any, Mapping

from zero_offload.config import Config, ConfigError, parse_json, user_stacklevel
from zero_offload.deepspeed_compat import is_deepspeed

AUTO = "auto"
# Optimizers of TrainingArguments.optim that are the engine's AdamW (torch's semantics).
ADAMW_NAMES = ("adamw_torch", "adamw_torch_fused")
# TrainingArguments.optim -> the engine's optimizer of the same update: torch's AdamW, and
# bitsandbytes' 32-bit Lion (paged or not: paging moves its state, the update is the paper's).
OPTIMIZERS = {**{name: "adamw" for name in ADAMW_NAMES}, "lion_32bit": "lion", "paged_lion_32bit": "lion"}
# DeepSpeed's scheduler types: the Trainer's own scheduler (lr_scheduler_type) runs instead.
_DS_SCHEDULERS = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest")


def _dtype(args: Any) -> str:
    if args.bf16 or getattr(args, "bf16_full_eval", False):
        return "bf16"
    return "fp16" if args.fp16 or getattr(args, "fp16_full_eval", False) else "fp32"


def _max_grad_norm(args: Any) -> float:
    """TrainingArguments.max_grad_norm; Trainer compares it with 0 at every step, so None fails there."""
    if not isinstance(args.max_grad_norm, (int, float)) or isinstance(args.max_grad_norm, bool):
        raise ConfigError(f"TrainingArguments.max_grad_norm = {args.max_grad_norm!r}: Trainer needs a number "
                          "(max_grad_norm=0 for no clipping)")
    return float(args.max_grad_norm)


def training_values(args: Any) -> dict[str, tuple[Any, str]]:
    """Our field (dotted) -> (the TrainingArguments value, its name there)."""
    return {
        "optimizer.lr": (float(args.learning_rate), "learning_rate"),
        "optimizer.betas": ((float(args.adam_beta1), float(args.adam_beta2)), "adam_beta1+adam_beta2"),
        "optimizer.eps": (float(args.adam_epsilon), "adam_epsilon"),
        "optimizer.weight_decay": (float(args.weight_decay), "weight_decay"),
        "optimizer.name": (engine_optimizer(args), "optim"),
        "gradient_accumulation_steps": (int(args.gradient_accumulation_steps), "gradient_accumulation_steps"),
        "clip_grad_norm": (max(0.0, _max_grad_norm(args)), "max_grad_norm"),  # Trainer: <= 0 is no clipping
        "precision.dtype": (_dtype(args), "bf16/fp16"),
    }


def _ds_values(args: Any) -> dict[str, tuple[Any, str, bool]]:
    """DeepSpeed key (dotted) -> (TrainingArguments value, its name, must a written value match)."""
    per_device = int(args.per_device_train_batch_size)
    gas = int(args.gradient_accumulation_steps)
    return {
        "train_micro_batch_size_per_gpu": (per_device, "per_device_train_batch_size", True),
        "gradient_accumulation_steps": (gas, "gradient_accumulation_steps", True),
        "train_batch_size": (int(args.world_size) * per_device * gas, "train_batch_size (calculated)", True),
        "gradient_clipping": (_max_grad_norm(args), "max_grad_norm", True),
        "optimizer.params.lr": (float(args.learning_rate), "learning_rate", True),
        "optimizer.params.betas": ([float(args.adam_beta1), float(args.adam_beta2)], "adam_beta1+adam_beta2", True),
        "optimizer.params.eps": (float(args.adam_epsilon), "adam_epsilon", True),
        "optimizer.params.weight_decay": (float(args.weight_decay), "weight_decay", True),
        "fp16.enabled": (_dtype(args) == "fp16", "fp16|fp16_full_eval", True),
        "bf16.enabled": (_dtype(args) == "bf16", "bf16|bf16_full_eval", True),
    }


def _node(data: dict, dotted: str) -> tuple[dict | None, str]:
    """The dict holding the last key of `dotted`, and that key (None where a section is absent)."""
    *path, last = dotted.split(".")
    for key in path:
        data = data.get(key)
        if not isinstance(data, dict):
            return None, last
    return data, last


def _fill(data: dict, values: Mapping[str, tuple[Any, str, bool]], mismatches: list[str]) -> None:
    """Each "auto" takes the TrainingArguments value; a written value that differs is a mismatch."""
    for key, (value, name, must_match) in values.items():
        node, last = _node(data, key)
        if node is None or last not in node:
            continue
        if node[last] == AUTO:
            node[last] = value
        elif must_match and not _same(node[last], value):
            mismatches.append(f"{key}={json.dumps(node[last])} vs TrainingArguments {name}={json.dumps(value)}")


def _same(a: Any, b: Any) -> bool:
    """JSON equality: lists elementwise, true/false only to booleans, numbers by value."""
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    return a == b


def _hidden_size(model: Any) -> int | None:
    """The model's hidden size, where transformers reads it for the bucket-size "auto" values."""
    config = getattr(model, "config", None)
    for c in (config, getattr(config, "text_config", None)):
        if c is None:
            continue
        if isinstance(getattr(c, "hidden_size", None), int):
            return c.hidden_size
        if getattr(c, "hidden_sizes", None):
            return max(c.hidden_sizes)
    return None


def _fill_sizes(data: dict, model: Any) -> None:
    """zero_optimization's "auto" sizes from the hidden size, as transformers fills them; the
    stage-3 ones only at stage 3 (below it they do nothing, and "auto" there says nothing)."""
    zero = data.get("zero_optimization")
    if not isinstance(zero, dict):
        return
    stage3 = zero.get("stage") == 3
    sizes = {"reduce_bucket_size": lambda h: h * h, "stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
             "stage3_param_persistence_threshold": lambda h: 10 * h}
    auto = [k for k in sizes if zero.get(k) == AUTO]
    if not auto:
        return
    hidden = _hidden_size(model)
    for key in auto:
        if key.startswith("stage3_") and not stage3:
            del zero[key]
        elif hidden is None:
            raise ConfigError(f"DeepSpeed key 'zero_optimization.{key}' = 'auto' needs the model's config.hidden_size, "
                              "which this model does not have: write the value")
        else:
            zero[key] = sizes[key](hidden)


def _drop_scheduler(data: dict, args: Any) -> None:
    """A DeepSpeed `scheduler` block: the Trainer's scheduler (lr_scheduler_type, warmup) drives
    engine.optimizer instead, said in one warning since DeepSpeed's warmup curve is not reproduced."""
    block = data.pop("scheduler", None)
    if block is None:
        return
    kind = block.get("type") if isinstance(block, dict) else None
    if kind not in _DS_SCHEDULERS:
        raise ConfigError(f"DeepSpeed key 'scheduler.type' = {kind!r}: expected one of {', '.join(_DS_SCHEDULERS)}")
    warnings.warn(f"DeepSpeed scheduler {kind} is not run: ZeroOffloadTrainer uses TrainingArguments' "
                  f"lr_scheduler_type={str(getattr(args.lr_scheduler_type, 'value', args.lr_scheduler_type))!r} "
                  f"with warmup_steps={args.warmup_steps} on engine.optimizer", UserWarning,
                  stacklevel=user_stacklevel())


def _from_deepspeed(data: Mapping[str, Any], args: Any, model: Any) -> Config:
    filled = copy.deepcopy(dict(data))
    _drop_scheduler(filled, args)
    mismatches: list[str] = []
    _fill(filled, _ds_values(args), mismatches)
    _refuse_mismatches(mismatches, "DeepSpeed config")
    _fill_sizes(filled, model)
    return Config.from_deepspeed(filled)


def _refuse_mismatches(mismatches: list[str], what: str) -> None:
    if mismatches:
        raise ConfigError(f"{what} values differ from TrainingArguments: {'; '.join(mismatches)}; set them to "
                          "'auto' (or leave them out) and let TrainingArguments give them")


def _ours(config: Config | Mapping[str, Any], args: Any) -> Config:
    """A zero_offload Config or dict: its training fields, where written, must equal TrainingArguments'."""
    if isinstance(config, Config):
        defaults = _flat(Config().to_dict())
        written = {k: v for k, v in _flat(config.to_dict()).items() if defaults.get(k) != v}
        base = config
    else:
        plain = {k: v for k, v in _flat(dict(config)).items() if v != AUTO}
        written = _flat(dict(config))
        base = Config.from_dict(_unflat(plain))
    mismatches = []
    for key, (value, name) in training_values(args).items():
        if key in written and written[key] != AUTO and not _same(_plain(written[key]), _plain(value)):
            mismatches.append(f"{key}={json.dumps(_plain(written[key]))} vs TrainingArguments {name}="
                              f"{json.dumps(_plain(value))}")
    _refuse_mismatches(mismatches, "zero_offload config")
    return base


def _plain(v: Any) -> Any:
    return list(v) if isinstance(v, tuple) else v


def _flat(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(_flat(v, key + "."))
        else:
            out[key] = v
    return out


def _unflat(flat: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, v in flat.items():
        *path, last = key.split(".")
        node = out
        for p in path:
            node = node.setdefault(p, {})
        node[last] = v
    return out


def _with_training_values(config: Config, args: Any) -> Config:
    """The config with TrainingArguments' training values (every conflict was refused before).
    Trainer logs the global gradient norm of every step, clipping or not (clip_grad_norm_ with
    max_norm=inf when max_grad_norm is 0): without clipping the overlapped step forms it as the
    gradients arrive (track_grad_norm), so the Adam pass stays beside backward."""
    v = {k: value for k, (value, _) in training_values(args).items()}
    optimizer = dataclasses.replace(config.optimizer, name=v["optimizer.name"], lr=v["optimizer.lr"], betas=v["optimizer.betas"],
                                    eps=v["optimizer.eps"], weight_decay=v["optimizer.weight_decay"])
    precision = dataclasses.replace(config.precision, dtype=v["precision.dtype"])
    return config.replace(optimizer=optimizer, precision=precision,
                          gradient_accumulation_steps=v["gradient_accumulation_steps"],
                          clip_grad_norm=v["clip_grad_norm"], track_grad_norm=True)


def _read(path: str) -> dict[str, Any]:
    """A JSON config file, with Config.from_file's one-line errors."""
    try:
        with open(path, "rb") as f:
            data = parse_json(f.read().decode("utf-8"), f"zero_offload_config file {path}")
    except OSError as exc:
        raise ConfigError(f"cannot read zero_offload_config file {path}: {exc.strerror}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"zero_offload_config file {path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"zero_offload_config file {path} must hold a JSON object, got {type(data).__name__}")
    return data


def engine_optimizer(args: Any) -> str:
    """The engine's optimizer for TrainingArguments.optim; any other would be silently replaced."""
    optim = str(getattr(args.optim, "value", args.optim))
    if optim not in OPTIMIZERS:
        raise ConfigError(f"TrainingArguments.optim = {optim!r}: the engine steps one of {', '.join(OPTIMIZERS)} "
                          f"(AdamW and 32-bit Lion, in its own CPU kernels); use optim={ADAMW_NAMES[0]!r}")
    return OPTIMIZERS[optim]


def check_optimizer(args: Any) -> None:
    """TrainingArguments.optim is one the engine steps, with no optim_args it would ignore."""
    engine_optimizer(args)
    if getattr(args, "optim_args", None):
        raise ConfigError(f"TrainingArguments.optim_args = {args.optim_args!r}: the engine's optimizer takes only "
                          "learning_rate, adam_beta1/2, adam_epsilon and weight_decay")


def resolve(spec: Config | Mapping[str, Any] | str | None, args: Any, model: Any = None) -> Config:
    """The engine's Config from `zero_offload_config=` (a Config, a dict of ours or DeepSpeed's,
    or the path of a JSON file holding either) and the TrainingArguments."""
    check_optimizer(args)
    if isinstance(spec, str):
        spec = _read(spec)
    if spec is None:
        spec = Config()
    if isinstance(spec, Mapping) and is_deepspeed(spec):
        config = _from_deepspeed(spec, args, model)
    elif isinstance(spec, (Config, Mapping)):
        config = _ours(spec, args)
    else:
        raise ConfigError(f"zero_offload_config must be a zero_offload Config, a dict or a JSON path, "
                          f"got {type(spec).__name__}")
    return _with_training_values(config, args)
