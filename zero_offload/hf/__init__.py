"""The Hugging Face integration: `ZeroOffloadTrainer`, a transformers.Trainer trained by the engine.

The only part of zero_offload that imports transformers (and accelerate, which Trainer needs);
install them with `pip install zero_offload[hf]`. See docs/hf.md.
"""
from __future__ import annotations

from zero_offload.hf.trainer import ENGINE_DIR, ZeroOffloadTrainer

__all__ = ["ENGINE_DIR", "ZeroOffloadTrainer"]
