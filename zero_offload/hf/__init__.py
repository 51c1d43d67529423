"""The Hugging Face integration: `ZeroOffloadTrainer`, a transformers.Trainer trained by the engine;
`save_pretrained(engine, directory)`, the engine's model in Hugging Face (or PEFT) format,
streamed from the tiers; and `from_pretrained(folder, config)`, a Hugging Face folder into an
engine, built on the meta device and streamed into the tiers through transformers' own
load-time weight conversion.

The only part of zero_offload that imports transformers (and accelerate, which Trainer needs; peft
where the model is a PEFT model); install them with `pip install zero_offload[hf]`. See docs/hf.md.
"""
from __future__ import annotations

from zero_offload.hf.load import from_pretrained
from zero_offload.hf.save import save_pretrained
from zero_offload.hf.trainer import ENGINE_DIR, ZeroOffloadTrainer

__all__ = ["ENGINE_DIR", "ZeroOffloadTrainer", "from_pretrained", "save_pretrained"]
