"""Random token ids as a Trainer dataset, labels the ids (the model shifts them): the Trainer
scripts' data (scripts/trainer_bigger_than_ram.py, scripts/bench_clip_overlap.py)."""
from __future__ import annotations

import torch


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int, seq: int, vocab: int, seed: int = 0) -> None:
        self.ids = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}
