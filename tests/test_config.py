"""Config: every bad value or combination is one line that names the field."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from zero_offload import Config, ConfigError
from zero_offload.config import IOConfig, Tiers


def test_defaults_and_round_trip(tmp_path: Path) -> None:
    cfg = Config(stage=3, tiers={"params": "nvme", "grads": "cpu", "optimizer": "nvme"}, nvme_paths="/tmp",
                 precision={"dtype": "bf16"}, stage3={"prefetch_depth": 3, "unit_modules": ["Block"]})
    assert cfg.tiers == Tiers("nvme", "cpu", "nvme") and cfg.nvme_paths == ("/tmp",)
    assert Config.from_dict(cfg.to_dict()) == cfg
    path = tmp_path / "c.json"
    path.write_text(json.dumps(cfg.to_dict()))
    assert Config.from_file(str(path)) == cfg
    with pytest.raises(Exception):
        cfg.stage = 2  # frozen


BAD = [
    ({"stage": 4}, "'stage' = 4", "[0, 3]"),
    ({"stage": "2"}, "'stage' = '2'", "expected int"),
    ({"stage": True}, "'stage' = True", "expected int"),
    ({"precision": {"dtype": "fp8"}}, "'precision.dtype' = 'fp8'", "fp32, bf16, fp16"),
    ({"tiers": {"optimizer": "disk"}}, "'tiers.optimizer' = 'disk'", "device, cpu, nvme"),
    ({"optimizer": {"lr": -1}}, "'optimizer.lr' = -1", "[0.0, inf)"),
    ({"optimizer": {"lr": float("inf")}}, "'optimizer.lr' = inf", "finite number in [0.0, inf)"),
    ({"optimizer": {"weight_decay": float("inf")}}, "'optimizer.weight_decay' = inf", "finite number"),
    ({"clip_grad_norm": float("inf")}, "'clip_grad_norm' = inf", "finite number"),
    ({"precision": {"dtype": "fp16", "min_scale": float("inf")}}, "'precision.min_scale' = inf", "finite number"),
    ({"optimizer": {"betas": [0.9, 1.0]}}, "'optimizer.betas[1]' = 1.0", "[0.0, 1.0)"),
    ({"optimizer": {"betas": [0.9]}}, "'optimizer.betas'", "two numbers"),
    ({"optimizer": {"eps": 0}}, "'optimizer.eps' = 0", "(0.0, inf)"),
    ({"optimizer": {"name": "sgd"}}, "'optimizer.name' = 'sgd'", "adamw, adam"),
    ({"io": {"block_size": 5000}}, "'io.block_size' = 5000", "multiple of 4096"),
    ({"io": {"queue_depth": 0}}, "'io.queue_depth' = 0", "[1, 1024]"),
    ({"io": {"backend": "uring"}}, "'io.backend' = 'uring'", "auto, native, aiofiles"),
    ({"gradient_accumulation_steps": 0}, "'gradient_accumulation_steps' = 0", "[1, 1048576]"),
    ({"stage": 3, "stage3": {"unit_modules": None}}, "'stage3.unit_modules' = None", "list of module class names"),
    ({"stage": 3, "stage3": {"unit_modules": 5}}, "'stage3.unit_modules' = 5", "list of module class names"),
    # A section's name nested in another section is that section's field, not the section.
    ({"tiers": {"optimizer": {}}}, "'tiers.optimizer' = {}", "device, cpu, nvme"),
    ({"tiers": {"optimizer": {"foo": 1}}}, "'tiers.optimizer' = {'foo': 1}", "device, cpu, nvme"),
    ({"clip_grad_norm": float("nan")}, "'clip_grad_norm' = nan", "number"),
    ({"pin_memory": "yes"}, "'pin_memory' = 'yes'", "expected bool"),
    ({"nvme_paths": [""]}, "'nvme_paths'", "directory path"),
    ({"stage": 3, "stage3": {"unit_modules": "Block"}}, "'stage3.unit_modules'", "list of module class names"),
    ({"tiers": "cpu"}, "'tiers' = 'cpu'", "Tiers or a dict"),
]


@pytest.mark.parametrize("data,field,allowed", BAD)
def test_bad_values_name_field_value_and_allowed(data: dict, field: str, allowed: str) -> None:
    with pytest.raises(ConfigError) as err:
        Config.from_dict(data)
    msg = str(err.value)
    assert field in msg and allowed in msg and "\n" not in msg


@pytest.mark.parametrize("data,needle", [
    ({"stag": 1}, "unknown config key 'stag'; did you mean 'stage'?"),
    ({"tiers": {"optimiser": "cpu"}}, "unknown config key 'tiers.optimiser'; did you mean 'optimizer'?"),
    ({"io": {"qd": 4}}, "unknown config key 'io.qd'; valid keys: block_size"),
])
def test_unknown_keys_name_the_closest_valid_one(data: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match="^" + needle.replace("?", r"\?").replace("(", r"\(")):
        Config.from_dict(data)


@pytest.mark.parametrize("kwargs,needle", [
    ({"stage": 2, "tiers": {"params": "cpu", "optimizer": "cpu"}}, "tiers.params = 'cpu' needs stage 3"),
    ({"stage": 3, "tiers": {"params": "cpu"}}, "tiers.params = 'cpu' with tiers.optimizer = 'device' is refused"),
    ({"stage": 2, "tiers": {"grads": "cpu"}}, "tiers.grads = 'cpu' with tiers.optimizer = 'device'"),
    ({"stage": 1, "tiers": {"optimizer": "nvme"}}, "tiers.optimizer = 'nvme' needs nvme_paths"),
    ({"stage": 2, "stage3": {"prefetch_depth": 1}}, "stage3 settings are given but stage is 2"),
])
def test_impossible_combinations_say_why(kwargs: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match="^" + needle.replace("(", r"\(").replace(")", r"\)")):
        Config(**kwargs)


def test_every_stage_tier_combination_is_supported_or_refused_with_reason() -> None:
    tiers = ("device", "cpu", "nvme")
    supported = 0
    for stage in range(4):
        for p in tiers:
            for g in tiers:
                for o in tiers:
                    try:
                        Config(stage=stage, tiers=Tiers(p, g, o), nvme_paths=("/tmp",))
                        supported += 1
                    except ConfigError as exc:
                        assert "refused" in str(exc) or "needs stage 3" in str(exc)
    # Device params: (device, device) or any grads tier with an off-device optimizer: 7 per stage.
    # Stage 3 with cpu/nvme params: off-device optimizer (2) x any grads tier (3), twice.
    assert supported == 7 * 4 + 2 * 6


def test_deepspeed_zero_optimization_maps_onto_ours() -> None:
    ds = {"zero_optimization": {"stage": 3,
                                "offload_optimizer": {"device": "nvme", "nvme_path": "/mnt/nvme", "pin_memory": True},
                                "offload_param": {"device": "cpu", "pin_memory": True},
                                "stage3_max_live_parameters": 1000},
          "bf16": {"enabled": True}, "gradient_clipping": 1.0,
          "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.1}},
          "train_micro_batch_size_per_gpu": 4}
    cfg = Config.from_dict(ds)
    assert cfg.stage == 3 and cfg.tiers == Tiers("cpu", "cpu", "nvme") and cfg.nvme_paths == ("/mnt/nvme",)
    assert cfg.precision.dtype == "bf16" and cfg.clip_grad_norm == 1.0 and cfg.pin_memory
    assert cfg.optimizer.lr == 3e-4 and cfg.optimizer.name == "adamw"
    assert cfg.stage3.live_budget_bytes == 2000
    bare = Config.from_deepspeed({"stage": 2, "offload_optimizer": {"device": "cpu"}})
    assert bare.stage == 2 and bare.tiers.optimizer == "cpu"


@pytest.mark.parametrize("ds,needle", [
    ({"zero_optimization": {"stage": 2, "zero_hpz_partition_size": 2}},
     "not supported by zero_offload: zero_optimization.zero_hpz_partition_size"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/x",
                                                          "max_in_cpu": -10}}},
     "DeepSpeed key 'zero_optimization.offload_param.max_in_cpu' = -10 is invalid"),
    ({"zero_optimization": {"stage": 1}, "scheduler": {}}, "not supported by zero_offload: scheduler (build a "),
    ({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "gpu"}}}, "expected none, cpu or nvme"),
    ({"zero_optimization": {"stage": 1}, "optimizer": {"type": "Lamb"}}, "'Lamb' is not supported"),
    ({"zero_optimization": {"stage": 1}, "bf16": {"enabled": True}, "fp16": {"enabled": True}}, "both bf16 and fp16"),
])
def test_deepspeed_unsupported_keys_are_named(ds: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(")):
        Config.from_dict(ds)


def test_io_config_defaults_are_valid() -> None:
    assert IOConfig().block_size == 8 << 20


def _check(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zero_offload.cli", "config", "--check", str(path)],
                          capture_output=True, text=True, timeout=120)


def test_config_check_cli(tmp_path: Path) -> None:
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"stage": 2, "tiers": {"optimizer": "cpu", "grads": "cpu"}}))
    out = _check(good)
    assert out.returncode == 0 and "OK" in out.stdout
    for name, text, needle in [("bad.json", '{"stage": 9}', "'stage' = 9"),
                               ("broken.json", '{"stage": ', "not valid JSON"),
                               ("missing.json", None, "cannot read config file")]:
        path = tmp_path / name
        if text is not None:
            path.write_text(text)
        out = _check(path)
        assert out.returncode == 2 and needle in out.stderr and "Traceback" not in out.stderr
        assert len(out.stderr.strip().splitlines()) == 1


def test_a_dict_or_a_string_where_keywords_and_sections_go_is_explained() -> None:
    """Config({'stage': 3}) said "config field 'stage' = {...} is invalid: expected int", and
    Config(precision='bf16') did not say what a section takes (a review)."""
    with pytest.raises(ConfigError, match=r"Config takes its fields as keywords .* use Config.from_dict\(d\)"):
        Config({"stage": 3})
    with pytest.raises(ConfigError, match=r"'precision' = 'bf16' is invalid: expected a PrecisionConfig or a dict, "
                                          r"e.g. precision=\{'dtype': ...\}"):
        Config(precision="bf16")
