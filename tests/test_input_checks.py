"""Bad input is one line naming the key or flag and the value, raised before any work:
DeepSpeed configs, the ledger, the CLI's estimate and benchmarks, and the swap files."""
from __future__ import annotations

import argparse
import errno
import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest

from zero_offload import IgnoredDeepSpeedKeys, cli, ledger
from zero_offload.bench import adam as bench_adam
from zero_offload.bench import io as bench_io
from zero_offload.config import Config, ConfigError
from zero_offload.deepspeed_compat import config_from_deepspeed
from zero_offload.io import swap_files

Z = {"stage": 2, "offload_optimizer": {"device": "cpu"}}


def _ds(**top: Any) -> dict:
    return {"zero_optimization": Z, **top}


def _one_line(text: str) -> None:
    assert len(str(text).strip().splitlines()) == 1 and "Traceback" not in str(text), text


# ---- DeepSpeed configs ------------------------------------------------------------------------

@pytest.mark.parametrize("params,name", [
    ({}, "adamw"),  # DeepSpeed's ADAM_W_MODE_DEFAULT = True: "Adam" is decoupled unless opted out
    ({"adam_w_mode": True}, "adamw"),
    ({"adam_w_mode": False}, "adam"),
])
def test_deepspeed_adam_follows_deepspeeds_adam_w_mode_default(params: dict, name: str) -> None:
    cfg = Config.from_dict(_ds(optimizer={"type": "Adam", "params": {"weight_decay": 0.1, **params}}))
    assert cfg.optimizer.name == name
    # AdamW is decoupled whatever adam_w_mode says (effective_adam_w_mode = name == adamw or mode).
    cfg = Config.from_dict(_ds(optimizer={"type": "AdamW", "params": {"adam_w_mode": False}}))
    assert cfg.optimizer.name == "adamw"


BOOL = "= .* expected true or false"
AUTO = "= 'auto' is the Hugging Face placeholder"


@pytest.mark.parametrize("ds,key,needle", [
    # strings are not taken for bools
    (_ds(bf16={"enabled": "false"}), "bf16.enabled", BOOL),
    (_ds(fp16={"enabled": "true"}), "fp16.enabled", BOOL),
    (_ds(bf16={"enabled": 1}), "bf16.enabled", BOOL),
    ({"zero_optimization": {**Z, "overlap_comm": "false"}}, "zero_optimization.overlap_comm", BOOL),
    ({"zero_optimization": {**Z, "contiguous_gradients": "yes"}}, "zero_optimization.contiguous_gradients", BOOL),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": "false"}}},
     "zero_optimization.offload_optimizer.pin_memory", BOOL),
    (_ds(optimizer={"type": "Adam", "params": {"adam_w_mode": "false"}}), "optimizer.params.adam_w_mode", BOOL),
    # the Hugging Face placeholder must be resolved first
    (_ds(bf16={"enabled": "auto"}), "bf16.enabled", AUTO),
    (_ds(fp16={"enabled": "auto"}), "fp16.enabled", AUTO),
    (_ds(gradient_clipping="auto"), "gradient_clipping", AUTO),
    (_ds(gradient_accumulation_steps="auto"), "gradient_accumulation_steps", AUTO),
    ({"zero_optimization": {**Z, "reduce_bucket_size": "auto"}}, "zero_optimization.reduce_bucket_size", AUTO),
    (_ds(optimizer={"type": "AdamW", "params": {"lr": "auto"}}), "optimizer.params.lr", AUTO),
])
def test_deepspeed_bools_and_placeholders_are_refused_by_name(ds: dict, key: str, needle: str) -> None:
    with pytest.raises(ConfigError, match=f"DeepSpeed key '{key}' {needle}") as exc:
        Config.from_dict(ds)
    _one_line(exc.value)


@pytest.mark.parametrize("ds,key", [
    (_ds(gradient_clipping=None), "gradient_clipping"),
    (_ds(gradient_clipping=True), "gradient_clipping"),
    ({"zero_optimization": {**Z, "reduce_bucket_size": None}}, "zero_optimization.reduce_bucket_size"),
    ({"zero_optimization": {**Z, "reduce_bucket_size": True}}, "zero_optimization.reduce_bucket_size"),
    ({"zero_optimization": {**Z, "reduce_bucket_size": float("nan")}}, "zero_optimization.reduce_bucket_size"),
    ({"zero_optimization": {**Z, "reduce_bucket_size": 2.5}}, "zero_optimization.reduce_bucket_size"),
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "stage3_max_live_parameters": "x"}},
     "zero_optimization.stage3_max_live_parameters"),
    (_ds(fp16={"enabled": True, "loss_scale": "x"}), "fp16.loss_scale"),
    (_ds(fp16={"enabled": True, "loss_scale": None}), "fp16.loss_scale"),
    (_ds(fp16={"enabled": True, "initial_scale_power": True}), "fp16.initial_scale_power"),
    (_ds(optimizer={"type": "AdamW", "params": {"betas": 0.9}}), "optimizer.params.betas"),
    (_ds(optimizer={"type": "AdamW", "params": {"betas": [0.9, "x"]}}), r"optimizer.params.betas\[1\]"),
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": 5}}},
     "zero_optimization.offload_optimizer.nvme_path"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": ["cpu"]}}},
     "zero_optimization.offload_optimizer.device"),
    (_ds(aio={"queue_depth": "8"}), "aio.queue_depth"),
    ({"zero_optimization": {"stage": True}}, "zero_optimization.stage"),
    # sections present but not objects: no longer read as empty
    ({"zero_optimization": []}, "zero_optimization"),
    (_ds(bf16=False), "bf16"),
    (_ds(optimizer=None), "optimizer"),
    (_ds(optimizer={"type": "AdamW", "params": None}), "optimizer.params"),
])
def test_deepspeed_bad_values_name_the_deepspeed_key(ds: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=f"DeepSpeed key '{key}'") as exc:
        Config.from_dict(ds)
    _one_line(exc.value)


def test_deepspeed_good_values_still_map() -> None:
    with pytest.warns(IgnoredDeepSpeedKeys, match="zero_optimization.contiguous_gradients"):
        cfg = Config.from_dict({"zero_optimization": {**Z, "reduce_bucket_size": 5e8, "overlap_comm": False,
                                                      "contiguous_gradients": True},
                                "bf16": {"enabled": True}, "gradient_clipping": 1, "gradient_accumulation_steps": 2,
                                "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "betas": [0.8, 0.9]}}})
    assert cfg.bucket_bytes == 2 * 500_000_000 and cfg.overlap_step is False and cfg.clip_grad_norm == 1.0
    assert cfg.precision.dtype == "bf16" and cfg.gradient_accumulation_steps == 2
    assert cfg.optimizer.betas == (0.8, 0.9) and cfg.optimizer.name == "adamw"
    fp16 = Config.from_dict(_ds(fp16={"enabled": True, "loss_scale": 0, "initial_scale_power": 12.0}))
    assert fp16.precision.dtype == "fp16" and fp16.precision.initial_scale_power == 12


# ---- the ledger -------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,needle", [
    (dict(tiers={"optimizer": "disk"}), "tiers['optimizer'] = 'disk'"),
    (dict(tiers={"optimiser": "cpu"}), "tiers key 'optimiser'"),
    (dict(ranks_per_node=-2), "ranks_per_node must be an integer >= 1, got -2"),
    (dict(ranks_per_node=0), "ranks_per_node must be an integer >= 1, got 0"),
    (dict(ranks_per_node=2.5), "ranks_per_node must be an integer >= 1, got 2.5"),
    (dict(ranks_per_node=True), "ranks_per_node must be an integer >= 1, got True"),
    (dict(stage=True), "stage must be 0, 1, 2 or 3, got True"),
    (dict(stage=1.0), "stage must be 0, 1, 2 or 3, got 1.0"),
    (dict(params=True), "params must be an integer >= 0, got True"),
    (dict(dp=True), "dp must be an integer >= 1, got True"),
])
def test_ledger_refuses_what_it_cannot_count(kwargs: dict, needle: str) -> None:
    args = {"params": 12, "dp": 3, "stage": 1, **kwargs}
    with pytest.raises(ValueError) as exc:
        ledger.ideal(**args)
    assert needle in str(exc.value)


def test_ledger_tier_columns_add_up_to_the_per_rank_total() -> None:
    for tier in ledger.TIER_COLUMNS:
        d = ledger.ideal(12, 3, 1, tiers={"optimizer": tier}, ranks_per_node=3).as_dict()
        assert sum(d["per_rank_by_tier"][t]["total"] for t in ledger.TIER_COLUMNS) == d["per_device"]["total"] == 96


# ---- the CLI ----------------------------------------------------------------------------------

def _cli(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def _cli_error(capsys: pytest.CaptureFixture, *argv: str) -> str:
    rc, out, err = _cli(capsys, *argv)
    assert rc == 2 and out == "", (rc, out, err)
    _one_line(err)
    return err


@pytest.mark.parametrize("argv,needles", [
    (["--stage", "3", "--params-tier", "nvme", "--optimizer-tier", "device"],
     ["--params-tier nvme", "tiers.params = 'nvme' with tiers.optimizer = 'device' is refused"]),
    (["--stage", "2", "--grads-tier", "nvme"], ["--grads-tier nvme", "tiers.grads = 'nvme'", "refused"]),
    (["--stage", "all", "--grads-tier", "cpu"], ["--grads-tier cpu", "refused"]),
    (["--stage", "1", "--ranks-per-node", "-2", "--optimizer-tier", "cpu"], ["--ranks-per-node -2: must be >= 1"]),
    (["--ranks-per-node", "0"], ["--ranks-per-node 0: must be >= 1"]),
])
def test_estimate_refuses_what_config_refuses(capsys: pytest.CaptureFixture, argv: list[str],
                                             needles: list[str]) -> None:
    err = _cli_error(capsys, "estimate", "--params", "12", "--dp", "3", *argv)
    for needle in needles:
        assert needle in err


def test_estimate_all_stages_shows_only_the_allowed_ones(capsys: pytest.CaptureFixture) -> None:
    rc, out, _ = _cli(capsys, "estimate", "--params", "12", "--dp", "3", "--params-tier", "cpu",
                      "--optimizer-tier", "cpu", "--json")
    assert rc == 0
    data = json.loads(out)
    assert list(data["stages"]) == ["3"] and data["stages"]["3"]["per_device"]["total"] == 64
    assert set(data["refused"]) == {"0", "1", "2"} and "needs stage 3" in data["refused"]["0"]


@pytest.mark.parametrize("source,fn,needle", [
    ("import torch\ndef f(width):\n    return torch.nn.Linear(width, width)\n", "f",
     "calling it with no arguments failed: TypeError"),
    ("def f(:\n", "f", "cannot import"),
    ("raise RuntimeError('boom')\n", "f", "RuntimeError: boom"),
    ("def f():\n    raise KeyError('x')\n", "f", "KeyError"),
])
def test_estimate_model_errors_are_one_line_naming_the_model(capsys: pytest.CaptureFixture, tmp_path: Path,
                                                               source: str, fn: str, needle: str) -> None:
    path = tmp_path / "m.py"
    path.write_text(source)
    err = _cli_error(capsys, "estimate", "--model", f"{path}:{fn}")
    assert f"--model '{path}:{fn}'" in err and needle in err


TINY_STEP = ["--d-model", "8", "--layers", "1", "--tokens", "2", "--steps", "1", "--tier", "cpu"]


@pytest.mark.parametrize("flag,value", [
    ("--threads", "0"), ("--steps", "0"), ("--d-model", "0"), ("--layers", "0"), ("--tokens", "-1"),
    ("--staging-mib", "0"), ("--bucket-mib", "-1"), ("--bucket-mib", "nan"), ("--nvme-path", "/nonexistent/zo"),
])
def test_bench_step_checks_its_flags_first(capsys: pytest.CaptureFixture, flag: str, value: str) -> None:
    err = _cli_error(capsys, "bench-step", *TINY_STEP, flag, value)
    assert f"bench-step: {flag} " in err


@pytest.mark.parametrize("value", ["nan", "inf", "-1"])
def test_bench_adam_pause_must_be_finite(capsys: pytest.CaptureFixture, value: str) -> None:
    err = _cli_error(capsys, "bench-adam", "--params", "1000", "--rounds", "1", "--pause-ms", value)
    assert "--pause-ms" in err and "finite" in err


class _Started(Exception):
    """The benchmark got past its argument checks."""


def _no_benchmark(directory: str, size: int) -> None:
    raise _Started


def _io_args(tmp_path: Path, *extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_io.add_arguments(parser)
    return parser.parse_args(["--path", str(tmp_path), "--size", "1MiB", "--block-sizes", "1MiB", "--queue-depths",
                              "2", "--threads", "1", "--rounds", "1", "--no-fio", "--backends", "aiofiles", *extra])


@pytest.mark.parametrize("extra,needle", [
    (["--queue-depths", "100000"], "--queue-depths 100000: config field 'io.queue_depth'"),
    (["--queue-depths", "2,0"], "--queue-depths 0"),
    (["--block-sizes", "0"], "--block-sizes 0: config field 'io.block_size'"),
    (["--block-sizes", "5000"], "--block-sizes 5000"),
    (["--threads", "1000"], "--threads 1000: config field 'io.threads'"),
    (["--rounds", "0"], "--rounds 0"),
    (["--size", "4096"], "--size 4KiB: must hold one block"),
    (["--write-config", "/nonexistent/x.json"], "--write-config '/nonexistent/x.json'"),
    (["--write-config", "."], "--write-config '.'"),
])
def test_bench_io_checks_before_the_benchmark(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              extra: list[str], needle: str) -> None:
    monkeypatch.setattr(bench_io, "scratch_file", _no_benchmark)
    with pytest.raises(ValueError) as exc:
        bench_io.run(_io_args(tmp_path, *extra))
    assert needle in str(exc.value)
    _one_line(exc.value)


def test_bench_io_good_arguments_pass_the_checks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench_io, "scratch_file", _no_benchmark)
    with pytest.raises(_Started):
        bench_io.run(_io_args(tmp_path, "--queue-depths", "1,1024", "--write-config", str(tmp_path / "io.json")))


# ---- swap files -------------------------------------------------------------------------------

def test_swap_dir_never_created_is_not_reported_as_not_removed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    """A read-only filesystem: mkdir fails with EROFS, and so does rmdir of the missing directory."""
    def read_only(path: Any, *args: Any, **kwargs: Any) -> None:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

    f = swap_files.SwapFile(str(tmp_path), "t", 0)
    monkeypatch.setattr(os, "mkdir", read_only)
    monkeypatch.setattr(os, "rmdir", read_only)
    monkeypatch.setattr(os, "unlink", read_only)
    with caplog.at_level(logging.WARNING, logger="zero_offload.io"):
        with pytest.raises(swap_files.SwapError, match="is not writable"):
            f.create(4096, direct=False)
        f.remove()
    assert [r.getMessage() for r in caplog.records] == []


def test_swap_dir_that_was_created_is_removed(tmp_path: Path) -> None:
    f = swap_files.SwapFile(str(tmp_path), "t", 0)
    f.create(4096, direct=False)
    assert os.path.isdir(f.dir)
    f.remove()
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("world,ds,steps", [
    ("1", {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, 8),
    ("2", {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, 4),
    ("2", {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4}, 4),
    ("1", {"train_micro_batch_size_per_gpu": 4}, 1),
])
def test_deepspeed_batch_sizes_give_the_accumulation_steps(world: str, ds: dict, steps: int,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """They were accepted and dropped: a config DeepSpeed runs with 8 accumulation steps ran with 1."""
    monkeypatch.setenv("WORLD_SIZE", world)
    assert config_from_deepspeed({"zero_optimization": {"stage": 1}, **ds}).gradient_accumulation_steps == steps


def test_deepspeed_batch_sizes_that_do_not_add_up_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ConfigError, match=r"train_batch_size = 32 is not train_micro_batch_size_per_gpu = 4 x "
                                          r"world size 3 x a whole number"):
        config_from_deepspeed(_ds(train_batch_size=32, train_micro_batch_size_per_gpu=4))
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ConfigError, match="x gradient_accumulation_steps 2 x world size 1"):
        config_from_deepspeed(_ds(train_batch_size=32, train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=2))


def _ds_steps_in_a_group(rank: int, world: int) -> None:
    os.environ.pop("WORLD_SIZE", None)  # a group made by hand (mp.spawn), no launcher variables
    cfg = config_from_deepspeed(_ds(train_batch_size=16, train_micro_batch_size_per_gpu=2))
    assert cfg.gradient_accumulation_steps == 4, cfg.gradient_accumulation_steps  # 16 / (2 x 2)


def test_deepspeed_batch_sizes_use_the_process_groups_size() -> None:
    """Read from WORLD_SIZE only, a group made without the launcher counted as one rank: 8
    accumulation steps instead of 4, twice the batch DeepSpeed would run."""
    from _dist import run_ranks

    run_ranks(_ds_steps_in_a_group, 2, timeout=60)


def test_deepspeed_weight_decay_left_out_is_deepspeeds_zero() -> None:
    """DeepSpeed's Adam classes default to weight_decay=0; ours is 0.01, which a DeepSpeed config
    without the key used to get."""
    cfg = config_from_deepspeed(_ds(optimizer={"type": "AdamW", "params": {"lr": 1e-4}}))
    assert cfg.optimizer.weight_decay == 0.0


@pytest.mark.parametrize("stage", [0, 2, 3])
@pytest.mark.parametrize("kind", ["Embedding", "EmbeddingBag"])
def test_a_sparse_embedding_is_refused_in_one_line_at_initialize(stage: int, kind: str) -> None:
    """Its sparse gradient failed inside the engine's flat buffers ("unsupported memory format
    option Contiguous"); torch.optim.AdamW refuses sparse gradients too."""
    from torch import nn

    import zero_offload

    model = nn.Sequential(getattr(nn, kind)(10, 4, sparse=True), nn.Linear(4, 1))
    with pytest.raises(ConfigError,
                       match=rf"^initialize: '0' \({kind}\) has sparse=True, whose sparse gradients the engine "
                             r"cannot step \(nor can torch.optim.AdamW\): build it with sparse=False$"):
        zero_offload.initialize(model, {"stage": stage, "tiers": {"optimizer": "cpu", "grads": "cpu",
                                                                  **({"params": "cpu"} if stage == 3 else {})}})
