"""Config built from keywords: a keyword that is not a field is the same one-line ConfigError
from_dict gives for the key (it was Python's bare TypeError from the generated __init__), and a
DeepSpeed name is pointed to ours. Everything else about construction is as it was."""
from __future__ import annotations

import copy
import dataclasses
import inspect
import pickle
from typing import Any

import pytest

from zero_offload import Config, ConfigError
from zero_offload.config import IOConfig, OptimizerConfig, PrecisionConfig, Stage3Config, Tiers


def _message(build: Any) -> str:
    with pytest.raises(ConfigError) as exc:
        build()
    text = str(exc.value)
    assert "\n" not in text, text
    return text


@pytest.mark.parametrize("kwargs,data", [
    ({"stgae": 3}, {"stgae": 3}),
    ({"stage": 3, "tiers": {"optimiser": "cpu"}}, {"stage": 3, "tiers": {"optimiser": "cpu"}}),
    ({"io": {"qd": 4}}, {"io": {"qd": 4}}),
])
def test_unknown_keyword_says_what_from_dict_says(kwargs: dict, data: dict) -> None:
    keyword = _message(lambda: Config(**kwargs))
    assert keyword == _message(lambda: Config.from_dict(data))
    assert keyword.startswith("unknown config key '")


def test_unknown_keyword_names_the_closest_field() -> None:
    assert _message(lambda: Config(stgae=3)) == "unknown config key 'stgae'; did you mean 'stage'?"
    assert _message(lambda: Config(stage=1).replace(stgae=2)) == "unknown config key 'stgae'; did you mean 'stage'?"


@pytest.mark.parametrize("build,text", [
    (lambda: Tiers(optimiser="cpu"), "unknown config key 'tiers.optimiser'; did you mean 'optimizer'?"),
    (lambda: PrecisionConfig(dtyp="bf16"), "unknown config key 'precision.dtyp'; did you mean 'dtype'?"),
    (lambda: OptimizerConfig(weight_decy=0.1),
     "unknown config key 'optimizer.weight_decy'; did you mean 'weight_decay'?"),
    (lambda: IOConfig(qd=4), "unknown config key 'io.qd'; valid keys: block_size"),
    (lambda: Stage3Config(prefetch=2), "unknown config key 'stage3.prefetch'; did you mean 'prefetch_depth'?"),
])
def test_unknown_keyword_of_a_section_is_named_under_the_section(build: Any, text: str) -> None:
    assert _message(build).startswith(text)


@pytest.mark.parametrize("kwargs,text", [
    ({"gradient_clipping": 1.0}, "unknown config key 'gradient_clipping' (DeepSpeed's name); did you mean "
                                 "'clip_grad_norm'?"),
    ({"overlap_comm": False}, "did you mean 'overlap_step'?"),
    ({"reduce_bucket_size": 5e8}, "did you mean 'bucket_bytes'? (in bytes; DeepSpeed counts elements)"),
    ({"bf16": {"enabled": True}}, "did you mean precision={'dtype': 'bf16'}?"),
    ({"offload_optimizer": {"device": "cpu"}}, "did you mean tiers={'optimizer': 'cpu'}?"),
    ({"stage3_max_live_parameters": 10**9}, "did you mean stage3={'live_budget_bytes': ...}? (in bytes"),
    ({"zero_optimization": {"stage": 3}}, "unknown config key 'zero_optimization' (a DeepSpeed key): give a whole "
                                          "DeepSpeed config as a dict to Config.from_dict"),
    ({"train_batch_size": 32}, "(a DeepSpeed key): give a whole DeepSpeed config"),
    ({"scheduler": {}}, "unknown config key 'scheduler' (a DeepSpeed key zero_offload does not support): build a "
                        "torch.optim.lr_scheduler on engine.optimizer"),
])
def test_deepspeed_name_as_a_keyword_points_to_ours(kwargs: dict, text: str) -> None:
    """Config(gradient_clipping=1.0) raised TypeError (or, spelled close to nothing of ours, listed
    our fields without saying which one it is)."""
    assert text in _message(lambda: Config(**kwargs))


def test_keyword_and_positional_construction_are_unchanged() -> None:
    """Guards: the check is in __new__, so the dataclass's __init__ is untouched."""
    cfg = Config(3, tiers={"optimizer": "cpu"}, nvme_paths="/tmp")
    assert cfg.stage == 3 and cfg.tiers == Tiers("device", "device", "cpu") and cfg.nvme_paths == ("/tmp",)
    assert [p.name for p in inspect.signature(Config).parameters.values()] == \
        [f.name for f in dataclasses.fields(Config)]
    assert pickle.loads(pickle.dumps(cfg)) == cfg and copy.deepcopy(cfg) == cfg
    assert cfg.replace(stage=2).stage == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.stage = 2  # type: ignore[misc]
    with pytest.raises(TypeError, match="multiple values for argument 'stage'"):
        Config(3, stage=3)  # type: ignore[misc]
    with pytest.raises(ConfigError, match="Config takes its fields as keywords"):
        Config({"stage": 3})  # type: ignore[arg-type]
