"""`from_pretrained(folder, zero_offload_config)`: a Hugging Face model folder straight into an
engine, the model built on the meta device and its weights streamed into the tiers unit by unit
(stage 3), so a model larger than host RAM loads.

Checkpoints are often stored in another layout than the modules hold: transformers 5 converts
them at load time (Mixtral's experts are stored one module per expert and held as fused 3-D
tensors; ViT's and GPT-NeoX's names changed). ConvertedWeights applies transformers' own
conversion (`get_model_conversion_mapping`, its `rename_source_key` and its converters' `convert`),
one target at a time: the filler asks for a unit's tensors, and each is produced from the few
stored tensors it needs (all experts of one layer), never the whole model.

A tensor the folder does not hold (Marian's sinusoidal positions, never saved; a key left out)
and every non-persistent buffer (Gemma 3's embed_scale, RoPE's inv_freq) are initialized by the
model's own `_init_weights`, unit by unit, as transformers' loader initializes them: the source
says so (`init_missing`, weights_files.WeightSource) and materialize.py does it. The missing keys
are named in a warning where transformers reports them (not those its
`_keys_to_ignore_on_load_missing` lists).

At stages 0-2 the engine holds the whole model on its device anyway: transformers' own
from_pretrained loads it, and the engine takes it as it would any built model.
"""
from __future__ import annotations

import os
import types
import warnings
from copy import deepcopy
from functools import partial
from typing import Any, Collection, Mapping

import torch
from torch import nn

from zero_offload.config import Config, ConfigError, user_stacklevel
from zero_offload.engine.engine import Engine, initialize
from zero_offload.engine.model.weights_files import one_line, open_weights


class _Job:
    """How one stored-to-module conversion is done: the name transformers files it under (its
    first target), the transform to copy for it (None: a plain rename) and the stored tensors it
    takes, as (transformers' source pattern, stored name)."""

    def __init__(self, first: str, template: Any) -> None:
        self.first, self.template = first, template
        self.sources: list[tuple[str, str]] = []

    def targets(self) -> list[str]:
        """Every module name it produces: a one-to-many converter (a fused qkv chunked) produces
        its first target's name with each of its target patterns in place of the first."""
        patterns = getattr(self.template, "target_patterns", [])
        if len(patterns) <= 1:
            return [self.first]
        return [self.first.replace(patterns[0], p, 1) for p in patterns]


class ConvertedWeights:
    """A WeightSource (zero_offload.engine.model.weights_files) over a Hugging Face folder, in the
    module's names and layout through transformers' conversion of `model` (see the module docstring)."""

    init_missing = True  # what the folder lacks is initialized by the model's _init_weights, as transformers does

    def __init__(self, model: nn.Module, folder: str, key_mapping: Mapping[str, str] | None = None) -> None:
        from transformers.conversion_mapping import get_model_conversion_mapping

        self.where, self.model = os.fspath(folder), model
        self.stored = open_weights(self.where)  # lazy: a header or an index only
        self.transforms = get_model_conversion_mapping(model, dict(key_mapping) if key_mapping else None, None)
        self.jobs, self.unused = self._plan()
        self._by_target = {t: job for job in self.jobs.values() for t in job.targets()}
        self._alias = self._tied_aliases()
        # A one-to-many conversion's other outputs, each held until asked for: the filler asks for
        # them within the same unit (Dinov2's gate_proj.bias comes between gate_proj.weight and up_proj.weight).
        self._ready: dict[str, torch.Tensor] = {}

    def _tied_aliases(self) -> dict[str, str]:
        """name -> the stored name of the same (tied) parameter, for a name the folder lacks while
        another name of its parameter is there: a tied head stored under lm_head.weight only."""
        names: dict[int, list[str]] = {}
        for n, p in self.model.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(n)
        alias = {}
        for group in names.values():
            present = [n for n in group if n in self._by_target]
            alias.update({n: present[0] for n in group if present and n not in self._by_target})
        return alias

    def _plan(self) -> tuple[dict[str, _Job], list[str]]:
        """Each stored name renamed as transformers' loader renames it (its renamings, then at
        most one converter; the base-model prefix added or dropped to match the model), grouped
        by the name transformers files it under; and the stored names the model has no place
        for, skipped as transformers skips them (it warns of them: so does from_pretrained)."""
        from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

        renamings = [t for t in self.transforms if isinstance(t, WeightRenaming)]
        converters = [t for t in self.transforms if isinstance(t, WeightConverter)]
        by_pattern = {p: c for c in converters for p in c.source_patterns}
        expected = self.model.state_dict()  # meta tensors: names only
        prefix = getattr(self.model, "base_model_prefix", None)
        jobs: dict[str, _Job] = {}
        unused: list[str] = []
        for key in sorted(self.stored, key=dot_natural_key):
            renamed, pattern = rename_source_key(key, renamings, converters, prefix, expected)
            if renamed not in expected and key in expected:  # renamed away from a name the model has
                renamed, pattern = rename_source_key(key, [], [], prefix, expected)
            if renamed not in expected:
                unused.append(key)
                continue
            job = jobs.setdefault(renamed, _Job(renamed, None if pattern is None else by_pattern[pattern]))
            if pattern is not None or not job.sources:  # a plain rename takes the first stored name only
                job.sources.append((key if pattern is None else pattern, key))
        return jobs, unused

    def missing(self) -> list[str]:
        """The model's parameters and persistent buffers the folder does not hold, less those
        transformers does not report (its `_keys_to_ignore_on_load_missing` patterns)."""
        import re

        held = self.names()
        ignored = [re.compile(p) for p in getattr(self.model, "_keys_to_ignore_on_load_missing", None) or ()]
        return [k for k in self.model.state_dict(keep_vars=True) if k not in held
                and not any(p.search(k) for p in ignored)]

    def names(self) -> Collection[str]:
        return dict.fromkeys([*self._by_target, *self._alias]).keys()  # in stored order, for error messages

    def read(self, name: str) -> torch.Tensor:
        name = self._alias.get(name, name)
        if name in self._ready:
            return self._ready.pop(name)
        job = self._by_target[name]
        out = self._convert(job)
        if name not in out:
            raise ValueError(f"weights file {self.where}: transformers' conversion of {self._stored(job)} gave "
                             f"{sorted(out)}, not '{name}'")
        value = out.pop(name)
        self._ready.update(out)
        return value

    def _convert(self, job: _Job) -> dict[str, torch.Tensor]:
        """A plain rename is the stored tensor itself (rename_source_key named it); a converter
        is a copy of transformers' transform fed the job's stored tensors on demand (its
        loader's synchronous path: each tensor read when the transform collects it)."""
        if job.template is None:
            return {job.first: self.stored[job.sources[0][1]]}
        transform = deepcopy(job.template)
        for pattern, key in job.sources:
            transform.add_tensor(job.first, key, pattern, partial(self.stored.__getitem__, key))
        try:
            out = transform.convert(job.first, model=self.model, config=getattr(self.model, "config", None))
        except Exception as exc:
            raise ValueError(f"weights file {self.where}: cannot build '{job.first}' from {self._stored(job)} "
                             f"through transformers' {type(job.template).__name__} ({one_line(exc)}); is the "
                             "folder the model's checkpoint?") from None
        return {k: v[0] if isinstance(v, list) else v for k, v in out.items()}

    @staticmethod
    def _stored(job: _Job) -> str:
        names = [key for _, key in job.sources]
        return f"'{names[0]}'" + (f" and {len(names) - 1} more stored tensors" if len(names) > 1 else "")


def _zo_config(spec: Config | Mapping[str, Any] | str | None) -> Config:
    """Our Config from what initialize accepts (a Config, a dict of ours or DeepSpeed's, a JSON path)."""
    if isinstance(spec, Config):
        return spec
    if isinstance(spec, str):
        return Config.from_file(spec)
    if isinstance(spec, Mapping):
        return Config.from_dict(spec)
    if spec is None:
        return Config()
    raise ConfigError(f"zero_offload_config must be a Config, dict or path, got {type(spec).__name__}")


def _dtype(dtype: torch.dtype | str | None, torch_dtype: torch.dtype | str | None) -> torch.dtype | str | None:
    if dtype is not None and torch_dtype is not None and dtype != torch_dtype:
        raise ValueError(f"from_pretrained: dtype={dtype} and torch_dtype={torch_dtype} differ; give one")
    dtype = dtype if dtype is not None else torch_dtype
    return None if dtype == "auto" else dtype


def build_on_meta(model_class: Any, config: Any, dtype: torch.dtype | str | None) -> nn.Module:
    """The model built from its config on the meta device (nothing allocated), in `dtype`
    (default the config's), as from_pretrained would build it before loading; ties made."""
    make = model_class.from_config if hasattr(model_class, "from_config") else model_class._from_config
    kwargs = {} if dtype is None else {"dtype": getattr(torch, dtype) if isinstance(dtype, str) else dtype}
    with torch.device("meta"):
        return make(config, **kwargs)


def from_pretrained(folder: str | os.PathLike, zero_offload_config: Config | Mapping[str, Any] | str | None = None,
                    *, model_class: Any = None, dtype: torch.dtype | str | None = None,
                    torch_dtype: torch.dtype | str | None = None, key_mapping: Mapping[str, str] | None = None,
                    param_groups: Any = None, training_args: Any = None, **config_kwargs: Any) -> Engine:
    """An Engine training the model saved in `folder` (config.json and its safetensors or torch
    weights, sharded or not), under `zero_offload_config`. `model_class`: a transformers class
    or Auto class (default AutoModelForCausalLM); `dtype` (or `torch_dtype`): the model's own
    dtype (default the config's), what it is saved back in; `key_mapping`: extra renames, as
    transformers' from_pretrained takes them; `config_kwargs` override config.json's values;
    `training_args`: TrainingArguments whose values fill the config's "auto" entries and must
    match its written ones, as ZeroOffloadTrainer does (so one DeepSpeed JSON serves both).
    The model is `engine.module`. At stage 3 nothing but one unit is ever whole in memory."""
    if training_args is not None:
        from zero_offload.hf.config import resolve

        holder = types.SimpleNamespace(config=folder_config(folder, **config_kwargs))  # the hidden-size autos
        zo = resolve(zero_offload_config, training_args, holder)
    else:
        zo = _zo_config(zero_offload_config)
    model, source = load_model(folder, zo.stage, model_class=model_class, dtype=_dtype(dtype, torch_dtype),
                               key_mapping=key_mapping, **config_kwargs)
    return initialize(model, zo, weights=source, param_groups=param_groups)


def folder_config(folder: str | os.PathLike, **config_kwargs: Any) -> Any:
    """The transformers config of a model folder (one line where the folder is none, or quantized)."""
    from transformers import AutoConfig

    folder = os.fspath(folder)
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise FileNotFoundError(f"from_pretrained: {folder} has no config.json (a folder written by save_pretrained)")
    config = AutoConfig.from_pretrained(folder, **config_kwargs)
    if getattr(config, "quantization_config", None) is not None:
        raise NotImplementedError(f"from_pretrained: {folder} is a quantized checkpoint (config.json's "
                                  "quantization_config); zero_offload loads unquantized weights only")
    return config


def load_model(folder: str | os.PathLike, stage: int, *, model_class: Any = None, dtype: torch.dtype | str | None = None,
               key_mapping: Mapping[str, str] | None = None,
               **config_kwargs: Any) -> tuple[nn.Module, ConvertedWeights | None]:
    """The model of `folder` for an engine at `stage`, and where its weights come from: at
    stage 3 built on the meta device with the folder as its WeightSource (the engine streams it
    in unit by unit); below, loaded by transformers' own from_pretrained (no source)."""
    from transformers import AutoModelForCausalLM

    folder = os.fspath(folder)
    config = folder_config(folder, **config_kwargs)
    model_class = model_class or AutoModelForCausalLM
    if stage != 3:
        return model_class.from_pretrained(folder, config=config, dtype=dtype or "auto", key_mapping=key_mapping), None
    model = build_on_meta(model_class, config, dtype)
    source = ConvertedWeights(model, folder, key_mapping)
    if source.unused:  # transformers' loader reports them too ("unexpected keys")
        warnings.warn(f"from_pretrained: {len(source.unused)} tensors of {folder} have no place in "
                      f"{type(model).__name__} and are not read (the first: '{source.unused[0]}')", stacklevel=user_stacklevel())
    missing = source.missing()
    if missing:  # transformers' loader reports them too ("missing keys": newly initialized)
        warnings.warn(f"from_pretrained: {len(missing)} tensors of {type(model).__name__} are not in {folder} and are "
                      f"initialized by the model's own _init_weights (the first: '{missing[0]}')", stacklevel=user_stacklevel())
    # As transformers' loader leaves them: the conversions this folder used (a later save_pretrained
    # writes the layout it was loaded from), and the model in eval mode (model.train() to train with dropout).
    model._weight_conversions = [t for t in source.transforms if t.was_used()]
    model.eval()
    return model, source
