"""Config values that cannot be meant are refused: upper bounds on integer settings, capped
strings and paths, error messages that quote at most a few hundred characters of a value,
duplicate JSON keys, and one wording per range."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from zero_offload import cli
from zero_offload.config import MAX_ACCUMULATION, Config, ConfigError

LONG = 1 << 20  # a 1 MiB string: before, every character of it reached the message
SHORT_MESSAGE = 1000


def _refused(data: dict) -> str:
    with pytest.raises(ConfigError) as err:
        Config.from_dict(data)
    msg = str(err.value)
    assert "\n" not in msg and len(msg) < SHORT_MESSAGE, msg[:300]
    return msg


@pytest.mark.parametrize("data, field", [
    ({"gradient_accumulation_steps": 10**30}, "'gradient_accumulation_steps' = 1000000000000000000000000000000"),
    ({"gradient_accumulation_steps": MAX_ACCUMULATION + 1}, "'gradient_accumulation_steps'"),
    ({"pinned_budget_bytes": 2**60}, "'pinned_budget_bytes'"),
    ({"bucket_bytes": 10**30}, "'bucket_bytes'"),
    ({"precision": {"scale_window": 2**40}}, "'precision.scale_window'"),
    ({"precision": {"hysteresis": 2**40}}, "'precision.hysteresis'"),
    ({"io": {"block_size": 4096 * 2**30}}, "'io.block_size'"),
    ({"stage": 3, "stage3": {"live_budget_bytes": 2**60}}, "'stage3.live_budget_bytes'"),
    ({"stage": 3, "stage3": {"unit_bytes": 2**60}}, "'stage3.unit_bytes'"),
    ({"stage": 3, "stage3": {"resident_bytes": 2**60}}, "'stage3.resident_bytes'"),
])
def test_integer_settings_have_upper_bounds(data: dict, field: str) -> None:
    msg = _refused(data)
    assert field in msg and "expected an integer in [" in msg and "inf" not in msg


def test_a_deepspeed_accumulation_too_large_is_named_by_its_key() -> None:
    msg = _refused({"zero_optimization": {"stage": 1}, "gradient_accumulation_steps": 10**30})
    assert msg.startswith("DeepSpeed key 'gradient_accumulation_steps' = 10000") and f", {MAX_ACCUMULATION}]" in msg


def test_the_largest_accumulation_is_accepted() -> None:
    assert Config(gradient_accumulation_steps=MAX_ACCUMULATION).gradient_accumulation_steps == MAX_ACCUMULATION


@pytest.mark.parametrize("data", [
    {"nvme_paths": "/" + "x" * LONG, "tiers": {"optimizer": "nvme"}},
    {"nvme_paths": ["/tmp/a"] * 1000},
    {"nvme_paths": "/tmp/a\0b"},
    {"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "nvme", "nvme_path": "/" + "x" * LONG}}},
    {"stage": 3, "stage3": {"unit_modules": ["B" * LONG]}},
    {"stage": 3, "stage3": {"leaf_modules": ["Block"] * 10_000}},
])
def test_strings_and_paths_are_capped(data: dict) -> None:
    msg = _refused(data)
    assert "at most" in msg


@pytest.mark.parametrize("data", [
    {"x" * LONG: 1},
    {"tiers": {"optimizer": "x" * LONG}},
    {"precision": {"dtype": ["x" * LONG]}},
    {"zero_optimization": {"stage": 1, "x" * LONG: 1}},
    {"zero_optimization": {"offload_optimizer": {"device": "x" * LONG}}},
    {"zero_optimization": {"stage": 1}, "optimizer": {"type": "x" * LONG}},
    {"zero_optimization": {"stage": 1}, "optimizer": {"params": {"lr": "x" * LONG}}},
    {"zero_optimization": {"stage": 3, "leaf_module": {"classes": 5}}, "bf16": {"enabled": "x" * LONG}},
])
def test_messages_quote_a_few_hundred_characters_of_a_value(data: dict) -> None:
    _refused(data)


def test_config_check_of_a_50mb_path_fails_in_one_short_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """`config --check` used to print the whole path and exit 0; initialize then failed with a
    message as long as the path."""
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"nvme_paths": "/" + "x" * (50 << 20), "tiers": {"optimizer": "nvme"}}))
    assert cli.main(["config", "--check", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err) < SHORT_MESSAGE and "'nvme_paths'" in err and "characters)" in err


@pytest.mark.parametrize("text, key", [
    ('{"stage": 1, "stage": 2}', "'stage'"),
    ('{"optimizer": {"lr": 0.1, "lr": 0.2}}', "'lr'"),
    ('{"zero_optimization": {"stage": 2, "stage": 3}}', "'stage'"),
    ('{"zero_optimization": {"stage": 1}, "optimizer": {"type": "AdamW", "params": {"lr": 1, "lr": 2}}}', "'lr'"),
])
def test_duplicate_json_keys_are_refused(tmp_path: Path, text: str, key: str) -> None:
    """Ours and DeepSpeed's: json.loads kept the last value without a word."""
    path = tmp_path / "c.json"
    path.write_text(text)
    with pytest.raises(ConfigError, match=f"gives the key {key} twice in one object"):
        Config.from_file(str(path))


def test_a_key_repeated_in_different_objects_is_fine(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    path.write_text('{"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu", "pin_memory": false},'
                    ' "offload_param": {"device": "none", "pin_memory": false}}}')
    assert Config.from_file(str(path)).stage == 1


@pytest.mark.parametrize("beta", [1.0, 1.5, -0.1])
def test_one_wording_for_the_range_of_a_beta(beta: float) -> None:
    """beta = 1.5 said "in [0.0, 1.0]" and beta = 1.0 "in [0, 1)": one range, one wording."""
    assert _refused({"optimizer": {"betas": [0.9, beta]}}).endswith("expected a finite number in [0.0, 1.0)")
    ds = _refused({"zero_optimization": {"stage": 1}, "optimizer": {"params": {"betas": [beta, 0.999]}}})
    assert ds.endswith("expected a finite number in [0.0, 1.0)") and "optimizer.params.betas[0]" in ds


def test_the_preemption_checkpoint_dir_is_capped_like_a_path() -> None:
    from zero_offload import Config, ConfigError

    with pytest.raises(ConfigError, match=r"preemption.checkpoint_dir.*at most 4095 bytes") as info:
        Config(preemption={"handle_signals": True, "checkpoint_dir": "d" * 50_000})
    assert len(str(info.value)) < 600
