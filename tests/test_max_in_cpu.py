"""DeepSpeed's offload_param.max_in_cpu, as DeepSpeed means it, and the transformers docs' configs.

With parameters on nvme DeepSpeed keeps the first parameter partitions of each rank, up to
max_in_cpu elements (default 1e9), in CPU memory and only the rest on nvme. We refused any
value but 0, so the ZeRO-3 NVMe example of transformers' own DeepSpeed page did not run; now the
first units whose shards fit stay in host RAM (stage3.max_in_cpu), the rest on nvme, and every
ZeRO-2 and ZeRO-3 offload example of that page trains through ZeroOffloadTrainer as written.
"""
from __future__ import annotations

import copy
import json
import os
import warnings
from typing import Any

import pytest
import torch
from torch import nn

import zero_offload

LR, WD = 1e-2, 0.01


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


class _Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Block() for _ in range(4)])
        self.head = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x).pow(2).mean()


def _nvme_json(path: str, **offload_param: Any) -> dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": 4,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
            "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": path},
                                  "offload_param": {"device": "nvme", "nvme_path": path, **offload_param}}}


@pytest.mark.parametrize("max_in_cpu,on_cpu", [(0, 0), (1100, 1), (2200, 2), (None, 5)])
def test_the_first_units_up_to_max_in_cpu_stay_in_host_ram_and_train_as_adamw(max_in_cpu: int | None, on_cpu: int,
                                                                               tmp_path: Any) -> None:
    """Each block's shard is 32 x 32 + 32 = 1056 elements: 1100 keeps one in host RAM, 2200 two,
    DeepSpeed's default 1e9 (left out) all five units; the memory report's ideal follows."""
    torch.manual_seed(0)
    model = _Stack()
    ref = copy.deepcopy(model)
    extra = {} if max_in_cpu is None else {"max_in_cpu": max_in_cpu}
    engine = zero_offload.initialize(model, _nvme_json(str(tmp_path), **extra))
    kinds = [u.store is engine.runtime.params_cpu_store for u in engine.runtime.units]
    assert kinds == [True] * on_cpu + [False] * (5 - on_cpu)
    shard_bytes = sum(4 * g.layout.shard_numel for u in engine.runtime.units[:on_cpu] for g in u.groups)
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD)
    for i in range(3):
        x = torch.randn(4, 32, generator=torch.Generator().manual_seed(i))
        engine.backward(engine(x))
        engine.step()
        ref(x).backward()
        opt.step()
        opt.zero_grad()
    rows = {(r["group"], r["tier"]): r for r in engine.memory_report()["rows"]}
    got = engine.consolidated_state_dict()
    engine.close()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-7, msg=k)
    held_cpu = rows.get(("weights", "cpu"), {"retained": 0})["retained"]
    assert held_cpu == shard_bytes  # padding included, as for any tier
    if on_cpu:
        assert rows[("weights", "cpu")]["ideal"] == 4 * min(max_in_cpu or 10 ** 9, 4 * 1056 + 33)


def test_a_checkpoint_loads_across_max_in_cpu_values(tmp_path: Any) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    torch.manual_seed(0)
    engine = zero_offload.initialize(_Stack(), _nvme_json(str(tmp_path / "a"), max_in_cpu=2200))
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(0))
    engine.backward(engine(x))
    engine.step()
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    want = engine.consolidated_state_dict()
    engine.close()
    other = zero_offload.initialize(_Stack(), _nvme_json(str(tmp_path / "b"), max_in_cpu=0))
    other.load_checkpoint(str(tmp_path / "ckpt"))
    got = other.consolidated_state_dict()
    other.close()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0, msg=k)


def test_max_in_cpu_with_parameters_in_cpu_memory_is_named_as_unread() -> None:
    data = {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "max_in_cpu": 10},
                                  "offload_optimizer": {"device": "cpu"}}}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = zero_offload.Config.from_deepspeed(data)
    assert cfg.stage3.max_in_cpu == 0
    assert any("zero_optimization.offload_param.max_in_cpu" in str(w.message) for w in caught)


# ---- the ZeRO-2 and ZeRO-3 offload configs of transformers' DeepSpeed page, as written -------------

def _docs_zero2(_: str) -> dict[str, Any]:
    """ "ZeRO configuration", ZeRO-2 (with the comma the page's first version lacked)."""
    return {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                                  "allgather_partitions": True, "allgather_bucket_size": 5e8, "overlap_comm": True,
                                  "reduce_scatter": True, "reduce_bucket_size": 5e8, "contiguous_gradients": True,
                                  "round_robin_gradients": True}}


def _zero3_block(offload_optimizer: dict, offload_param: dict) -> dict[str, Any]:
    return {"stage": 3, "offload_optimizer": offload_optimizer, "offload_param": offload_param,
            "overlap_comm": True, "contiguous_gradients": True, "sub_group_size": 1e9, "reduce_bucket_size": "auto",
            "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
            "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
            "stage3_gather_16bit_weights_on_model_save": True}


def _docs_zero3(_: str) -> dict[str, Any]:
    """ "ZeRO configuration", ZeRO-3: parameters and optimizer on the CPU."""
    cpu = {"device": "cpu", "pin_memory": True}
    return {"zero_optimization": _zero3_block(cpu, cpu)}


def _full(zero: dict[str, Any]) -> dict[str, Any]:
    """The page's whole-file form around a zero_optimization block: "auto" everywhere else."""
    return {"fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
                     "hysteresis": 2, "min_loss_scale": 1},
            "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                      "weight_decay": "auto"}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                         "warmup_num_steps": "auto"}},
            "zero_optimization": zero, "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
            "steps_per_print": 2000, "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
            "wall_clock_breakdown": False}


def _docs_nvme(path: str) -> dict[str, Any]:
    """ "NVMe configuration": ZeRO-3/Infinity, both groups on nvme, max_in_cpu 1e9, the aio block."""
    zero = _zero3_block({"device": "nvme", "nvme_path": path, "pin_memory": True, "buffer_count": 4,
                         "fast_init": False},
                        {"device": "nvme", "nvme_path": path, "pin_memory": True, "buffer_count": 5,
                         "buffer_size": 1e8, "max_in_cpu": 1e9})
    zero["aio"] = {"block_size": 262144, "queue_depth": 32, "thread_count": 1, "single_submit": False,
                   "overlap_events": True}
    return _full(zero)


def _docs_notebook(_: str) -> dict[str, Any]:
    """ "Notebook": ds_config_zero3.json, ZeRO-3 with parameters and optimizer on the CPU."""
    cpu = {"device": "cpu", "pin_memory": True}
    return _full(_zero3_block(cpu, cpu))


@pytest.mark.parametrize("example", [_docs_zero2, _docs_zero3, _docs_nvme, _docs_notebook])
def test_transformers_docs_deepspeed_configs_train_through_the_trainer_unchanged(example: Any, tmp_path: Any) -> None:
    pytest.importorskip("transformers")
    from transformers import Trainer

    from _hf import Tokens, logged, max_relative_difference, tiny_llama, training_args
    from zero_offload.hf import ZeroOffloadTrainer

    nvme = tmp_path / "local_nvme"
    nvme.mkdir()
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(example(str(nvme))))
    train = Tokens(8, seed=0)
    plain = Trainer(model=tiny_llama(), args=training_args(str(tmp_path / "plain"), max_steps=2), train_dataset=train)
    plain.train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the keys accepted without effect, the scheduler block
        ours = ZeroOffloadTrainer(model=tiny_llama(), args=training_args(str(tmp_path / "ours"), max_steps=2),
                                  train_dataset=train, zero_offload_config=str(path))
        ours.train()
    assert logged(ours.state.log_history, "loss") == pytest.approx(logged(plain.state.log_history, "loss"), rel=1e-5)
    want = {k: v.detach() for k, v in plain.model.state_dict().items()}
    assert max_relative_difference(ours.engine.consolidated_state_dict(), want) < 1e-5
    ours.engine.close()
    assert os.listdir(nvme) == [] or example is _docs_nvme


def test_an_aio_block_both_inside_zero_optimization_and_at_the_top_is_refused() -> None:
    data = _docs_nvme("/local_nvme")
    data["aio"] = dict(data["zero_optimization"]["aio"])
    with pytest.raises(zero_offload.config.ConfigError, match="aio block at the top level and one inside"):
        zero_offload.Config.from_deepspeed(data)
