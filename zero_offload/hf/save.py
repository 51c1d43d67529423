"""The engine's model in Hugging Face format, streamed from the tiers (issue 21).

`save_pretrained(engine, directory)` writes what `model.save_pretrained(directory)` writes for
the trained model, without the model ever being whole in memory:

- a transformers model: config.json (and generation_config.json), and the weights streamed by
  `engine.save_safetensors` into model.safetensors or shards of at most `max_shard_size` with
  model.safetensors.index.json. The keys are the ones transformers saves: its
  `_keys_to_ignore_on_save` dropped, tied weights once (transformers' own
  remove_tied_weights_from_state_dict decides which name stays, run on a meta copy of the state
  dict, so no value is read for it).
- a PEFT model: only the adapters. PEFT's own
  get_peft_model_state_dict picks them, on the meta copy; the engine gathers those tensors only
  (small: the frozen base's units are never read) and PEFT's save_pretrained writes
  adapter_config.json and adapter_model.safetensors with its key names.
- any other module: the state dict in model.safetensors (as Trainer saves a plain module).

A collective: every rank calls it; the main process (rank 0 by default) writes.
"""
from __future__ import annotations

import os
import re
import warnings
from typing import Any

import torch
from torch import nn

from zero_offload import comm
from zero_offload.engine.engine import Engine
from zero_offload.engine.state.export import DEFAULT_MAX_SHARD_SIZE, tensor_specs

_UNITS = {"KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "TB": 10 ** 12}


def parse_size(size: int | str) -> int:
    """Bytes from an int or a string such as "5GB" or "500MB" (decimal units, as huggingface_hub reads them)."""
    if isinstance(size, int) and not isinstance(size, bool):
        return size
    match = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]B)\s*", size.upper()) if isinstance(size, str) else None
    if match is None:
        raise ValueError(f"max_shard_size={size!r}: expected a number of bytes or a string like '5GB' (KB, MB, GB, TB)")
    return int(float(match.group(1)) * _UNITS[match.group(2)])


def _peft_model(model: nn.Module) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def save_pretrained(engine: Engine, save_directory: str, *, model: nn.Module | None = None,
                    is_main_process: bool | None = None, max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
                    **adapter_kwargs: Any) -> None:
    """`model.save_pretrained(save_directory)` from the engine's weights, streamed (see the module
    docstring). `model` defaults to engine.module; `adapter_kwargs` (selected_adapters,
    save_embedding_layers) go to PEFT's save_pretrained."""
    from transformers import PreTrainedModel

    model = engine.module if model is None else model
    write = comm.rank() == 0 if is_main_process is None else is_main_process
    if getattr(model, "_hf_peft_config_loaded", False):
        raise NotImplementedError("save_pretrained: adapters loaded through transformers (model.add_adapter / "
                                  "load_adapter) are not saved by the streamed save yet; wrap the model with "
                                  "peft.get_peft_model instead")
    if _peft_model(model):
        _save_adapters(engine, model, save_directory, write, adapter_kwargs)
    elif adapter_kwargs:
        raise TypeError(f"save_pretrained: {sorted(adapter_kwargs)} apply to adapters only; this model has none")
    elif isinstance(model, PreTrainedModel):
        _save_model(engine, model, save_directory, write, parse_size(max_shard_size))
    else:
        engine.save_safetensors(save_directory, max_shard_size=parse_size(max_shard_size), write=write)


def meta_state_dict(engine: Engine) -> dict[str, torch.Tensor]:
    """The state dict as meta tensors (shapes and saved dtypes): what transformers and PEFT look
    at to choose keys, with no value read."""
    specs = tensor_specs(engine.runtime, engine.model_view)
    return {k: torch.empty(s.shape, dtype=s.dtype, device="meta") for k, s in specs.items()}


def saved_keys(model: nn.Module, meta: dict[str, torch.Tensor]) -> list[str] | None:
    """The keys transformers' save_pretrained writes: without `_keys_to_ignore_on_save` and with
    tied weights once (for meta tensors transformers tells ties by the parameter objects). None
    where transformers would write another layout than the modules' (its weight conversions,
    e.g. fused experts saved one by one), which the streamed save cannot produce."""
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    state = {k: v for k, v in meta.items() if k not in (getattr(model, "_keys_to_ignore_on_save", None) or ())}
    state = remove_tied_weights_from_state_dict(state, model)
    key_of = {id(v): k for k, v in state.items()}
    converted = revert_weight_conversion(model, dict(state))  # on the meta copy: names and shapes only
    if len(converted) != len(state) or any(key_of.get(id(v)) != k for k, v in converted.items()):
        return None
    return list(state)


def _saved_dtype(engine: Engine, model: nn.Module) -> torch.dtype:
    """What transformers records as config.dtype (`model.dtype`: its first floating parameter's),
    in the model's own dtype, not the engine's compute dtype."""
    for name, p in model.named_parameters():
        dtype = engine.orig_dtypes.get(name, p.dtype)
        if dtype.is_floating_point:
            return dtype
    return torch.get_default_dtype()


def _save_model(engine: Engine, model: nn.Module, directory: str, write: bool, max_shard_size: int) -> None:
    keys = saved_keys(model, meta_state_dict(engine))
    if keys is None:
        _save_converted(engine, model, directory, write, max_shard_size)
        return
    if write:
        _write_config(engine, model, directory)
    engine.save_safetensors(directory, keys, max_shard_size=max_shard_size, write=write)


def _save_converted(engine: Engine, model: nn.Module, directory: str, write: bool, max_shard_size: int) -> None:
    """A model transformers saves in a converted layout: its own save_pretrained, from the whole
    state dict (held in memory, as before streaming), with a warning saying so."""
    warnings.warn(f"save_pretrained: transformers saves {type(model).__name__} in another layout than its modules "
                  "(weight conversions, e.g. fused experts saved one by one), which the streamed save cannot write: "
                  "the whole model is gathered into rank 0's memory and saved there by transformers", stacklevel=3)
    full = engine.consolidated_state_dict()  # a collective, whole on rank 0 only: rank 0 writes
    if write and comm.rank() == 0:
        dtypes = engine.orig_dtypes
        model.save_pretrained(directory, state_dict={k: v.to(dtypes.get(k, v.dtype)) for k, v in full.items()},
                              max_shard_size=max_shard_size, is_main_process=True)


def _write_config(engine: Engine, model: nn.Module, directory: str) -> None:
    """config.json and generation_config.json as save_pretrained writes them."""
    from transformers.dynamic_module_utils import custom_object_save

    os.makedirs(directory, exist_ok=True)
    model.config.dtype = str(_saved_dtype(engine, model)).split(".")[1]
    model.config.architectures = [type(model).__name__]
    if model.is_remote_code():
        custom_object_save(model, directory, config=model.config)
    model.config.save_pretrained(directory)
    if model.can_generate():
        model.generation_config.save_pretrained(directory)


def adapter_keys(model: nn.Module, meta: dict[str, torch.Tensor], adapter_kwargs: dict[str, Any]) -> list[str]:
    """The state-dict keys PEFT saves for the adapters (each adapter's get_peft_model_state_dict
    on the meta copy, its values traced back to their keys by identity)."""
    from peft import get_peft_model_state_dict

    names = adapter_kwargs.get("selected_adapters") or list(model.peft_config)
    key_of = {id(v): k for k, v in meta.items()}
    keys: dict[str, None] = {}
    for name in names:
        picked = get_peft_model_state_dict(model, state_dict=meta, adapter_name=name,
                                           save_embedding_layers=adapter_kwargs.get("save_embedding_layers", "auto"))
        untraced = [k for k, v in picked.items() if id(v) not in key_of]
        if untraced:
            raise NotImplementedError(f"the adapter state of {untraced[:3]} is computed by PEFT from several tensors; "
                                      "the streamed save can only gather tensors of the state dict")
        keys.update(dict.fromkeys(key_of[id(v)] for v in picked.values()))
    return list(keys)


def _save_adapters(engine: Engine, model: nn.Module, directory: str, write: bool,
                   adapter_kwargs: dict[str, Any]) -> None:
    """The adapters' tensors gathered (a collective), then the model's own save_pretrained of them."""
    values = engine.export_state_dict(adapter_keys(model, meta_state_dict(engine), adapter_kwargs))
    if write:
        model.save_pretrained(directory, state_dict=values, is_main_process=True, **adapter_kwargs)
