"""The Hugging Face integration: `ZeroOffloadTrainer`, a transformers.Trainer trained by the engine;
`save_pretrained(engine, directory)`, the engine's model in Hugging Face (or PEFT) format,
streamed from the tiers; and `from_pretrained(folder, config)`, a Hugging Face folder into an
engine, built on the meta device and streamed into the tiers through transformers' own
load-time weight conversion.

The only part of zero_offload that imports transformers (and accelerate, which Trainer needs; peft
where the model is a PEFT model); install them with `pip install zero_offload[hf]`. See docs/hf.md.
Each name is imported when first used: loading a model need not import transformers' Trainer.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from zero_offload.hf.load import from_pretrained
    from zero_offload.hf.save import save_pretrained
    from zero_offload.hf.trainer import ENGINE_DIR, ZeroOffloadTrainer

_WHERE = {"ENGINE_DIR": "trainer", "ZeroOffloadTrainer": "trainer", "from_pretrained": "load",
          "save_pretrained": "save"}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"zero_offload.hf.{_WHERE[name]}"), name)
    globals()[name] = value
    return value
