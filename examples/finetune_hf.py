"""Fine-tune a Hugging Face causal LM with ZeroOffloadTrainer, parameters and optimizer on NVMe.

    python examples/finetune_hf.py --model path/to/local/model --text corpus.txt
    python examples/finetune_hf.py                       # a tiny random Llama made here, on README.md

The model folder is what `save_pretrained` writes (config.json, weights, tokenizer). Without
--model a tiny random Llama and a character-level tokenizer are built offline and saved to a
temporary folder first, then loaded from it like any other. The Trainer is given the folder
itself: at zero_offload stage 3 the model is built on the meta device and its weights streamed
into files under --nvme-dir one unit at a time, so it may be larger than host RAM. Training is
transformers' Trainer (its progress bar and logging). At the end the model is saved in Hugging
Face format under --output (kept) and reloaded with from_pretrained for a short generation.
--ds-config takes your DeepSpeed JSON instead ("auto" values are filled from the arguments).
Run it against the installed package (`pip install -e .[hf]`, or `make setup`), which carries
the native CPU Adam and I/O library.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from typing import Any

import torch
from transformers import (AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM,
                          PreTrainedTokenizerFast, TrainingArguments)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
try:
    from zero_offload.hf import ZeroOffloadTrainer
except ImportError:  # the source tree on sys.path would run without the native library
    sys.exit("zero_offload is not installed: run `pip install -e .[hf]` (or `make setup`) in the repository first")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a local model folder (default: make a tiny random Llama)")
    ap.add_argument("--text", default=os.path.join(ROOT, "README.md"), help="the text file to train on")
    ap.add_argument("--output", default="finetune_hf_output", help="where checkpoints and the final model go (kept)")
    ap.add_argument("--nvme-dir", default=None, help="directory on the drive for the nvme tier (default: a temp dir)")
    ap.add_argument("--ds-config", default=None, help="a DeepSpeed JSON to use instead of the built-in stage 3 config")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--accumulation", type=int, default=2)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--bf16", action="store_true", help="compute in bf16 (fp32 master weights)")
    ap.add_argument("--prompt", default="zero_offload ")
    ap.add_argument("--new-tokens", type=int, default=60)
    return ap.parse_args(argv)


def char_tokenizer(text: str) -> PreTrainedTokenizerFast:
    """One token per character of `text` (plus unknown/bos/eos/pad): a BPE with no merges."""
    from tokenizers import Tokenizer, decoders, models

    specials = ["<unk>", "<s>", "</s>", "<pad>"]
    vocab = {tok: i for i, tok in enumerate(specials + sorted(set(text) - set(specials)))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.decoder = decoders.Fuse()  # join characters back without spaces
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")


def make_tiny_model(text: str, folder: str) -> str:
    """A tiny random Llama and its character tokenizer, saved as a model folder."""
    tokenizer = char_tokenizer(text)
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=len(tokenizer), max_position_embeddings=512,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


class Blocks(torch.utils.data.Dataset):
    """The text's token ids cut into blocks of `seq`, each its own label (the model shifts them)."""

    def __init__(self, ids: list[int], seq: int) -> None:
        n = len(ids) // seq
        if n == 0:
            raise SystemExit(f"the text has {len(ids)} tokens, fewer than one block of --seq {seq}")
        self.blocks = torch.tensor(ids[: n * seq]).view(n, seq)

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.blocks[i], "labels": self.blocks[i]}


def zero_offload_config(nvme_dir: str, ds_config: str | None) -> Any:
    """The user's DeepSpeed JSON, else stage 3 with parameters and optimizer state on nvme and
    zero_offload's own unit choice (each decoder layer a unit)."""
    if ds_config is not None:
        return ds_config
    return {"stage": 3, "tiers": {"params": "nvme", "optimizer": "nvme", "grads": "cpu"}, "nvme_paths": [nvme_dir]}


def main(argv: list[str] | None = None) -> str:
    """Train, save, reload and generate; returns the generated text."""
    a = parse(argv)
    scratch = tempfile.TemporaryDirectory(prefix="finetune_hf_")  # the tiny model and the nvme files
    output = a.output
    nvme_dir = a.nvme_dir or os.path.join(scratch.name, "nvme")
    os.makedirs(nvme_dir, exist_ok=True)
    text = open(a.text, encoding="utf-8").read()
    folder = a.model or make_tiny_model(text, os.path.join(scratch.name, "tiny-llama"))

    tokenizer = AutoTokenizer.from_pretrained(folder)
    data = Blocks(tokenizer(text)["input_ids"], a.seq)
    args = TrainingArguments(output_dir=output, per_device_train_batch_size=a.batch,
                             gradient_accumulation_steps=a.accumulation, max_steps=a.steps, learning_rate=a.lr,
                             warmup_steps=max(1, a.steps // 10), lr_scheduler_type="cosine", weight_decay=0.01,
                             max_grad_norm=1.0, logging_steps=max(1, a.steps // 10), save_strategy="no",
                             bf16=a.bf16, report_to=[], dataloader_num_workers=0, optim="adamw_torch", seed=0,
                             dataloader_pin_memory=torch.cuda.is_available(),
                             use_cpu=not torch.cuda.is_available())  # else torchrun's ranks are not one run
    trainer = ZeroOffloadTrainer(model=folder, args=args, train_dataset=data, processing_class=tokenizer,
                                 zero_offload_config=zero_offload_config(nvme_dir, a.ds_config))
    trainer.train()
    final = os.path.join(output, "final")
    trainer.save_model(final)  # config.json + model.safetensors + the tokenizer
    trainer.engine.close()  # its nvme files go

    generated = generate(final, a.prompt, a.new_tokens)
    scratch.cleanup()  # the tiny model and the nvme files; the output folder is kept
    if trainer.is_world_process_zero():
        print(f"saved to {os.path.abspath(final)}\n--- generated from the saved model ---\n{generated}")
    return generated


def generate(folder: str, prompt: str, new_tokens: int) -> str:
    """Greedy generation from the model as from_pretrained loads it."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0], skip_special_tokens=True)


if __name__ == "__main__":
    main()
