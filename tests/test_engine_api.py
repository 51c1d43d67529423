"""The engine's call order, its one-line errors, the memory report, and a save killed by SIGKILL."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

import zero_offload
from zero_offload.engine.engine import EngineStateError
from zero_offload.engine.buckets.runtime import UPDATED_ROW
from _engine_model import batch, make_model

HERE = os.path.dirname(os.path.abspath(__file__))


def _engine(**cfg: object) -> zero_offload.engine.engine.Engine:
    return zero_offload.initialize(make_model(), dict(stage=1, tiers={"optimizer": "cpu", "grads": "cpu"}, **cfg))


def test_calls_out_of_order_get_one_line_errors() -> None:
    engine = _engine()
    x, y = batch(0, 2)
    with pytest.raises(EngineStateError, match=r"engine.step\(\) called in phase idle: call engine.backward\(loss\) first"):
        engine.step()
    with pytest.raises(EngineStateError, match=r"backward\(\) called in phase idle: run a forward"):
        engine.backward(torch.ones((), requires_grad=True))
    loss = engine(x, y)
    with pytest.raises(ValueError, match="engine.backward expects a scalar loss tensor, got list"):
        engine.backward([loss])
    engine.backward(loss)
    with pytest.raises(EngineStateError, match="engine.forward called in phase backward: call engine.step"):
        engine(x, y)
    with pytest.raises(EngineStateError, match=r"engine.save_checkpoint called in phase backward"):
        engine.save_checkpoint("/nonexistent")
    assert engine.step() is True
    with pytest.raises(RuntimeError, match=r"outside engine.backward\(\): call engine.backward\(loss\), not loss.backward\(\)"):
        engine(x, y).backward()
    engine.close()


def test_initialize_rejects_bad_input() -> None:
    with pytest.raises(zero_offload.ConfigError, match="initialize expects a torch.nn.Module, got int"):
        zero_offload.initialize(3)
    frozen = torch.nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(zero_offload.ConfigError, match="no parameter with requires_grad=True"):
        zero_offload.initialize(frozen)
    with pytest.raises(zero_offload.ConfigError, match="unknown config key 'stag'"):
        zero_offload.initialize(make_model(), {"stag": 1})


def test_lr_scheduler_drives_the_engine_lr() -> None:
    engine = _engine(optimizer={"lr": 0.1})
    sched = torch.optim.lr_scheduler.StepLR(engine.optimizer, step_size=1, gamma=0.5)
    for step in range(2):
        x, y = batch(step, 2)
        engine.backward(engine(x, y))
        engine.step()
        with warnings.catch_warnings():  # the scheduler saw the engine's update ("before optimizer.step()" otherwise)
            warnings.simplefilter("error")
            sched.step()
    assert engine.optimizer.param_groups[0]["lr"] == pytest.approx(0.025)
    assert engine.grad_norm is None  # the overlapped step never needs the total (see Engine.grad_norm)
    engine.close()


def test_consolidated_state_dict_loads_into_plain_model() -> None:
    engine = _engine(precision={"dtype": "bf16"})
    x, y = batch(0, 2)
    engine.backward(engine(x, y))
    engine.step()
    sd = engine.consolidated_state_dict()
    plain = make_model()
    plain.load_state_dict(sd)
    assert sd["tok.weight"].dtype == torch.float32 and torch.equal(sd["tok.weight"], sd["head.weight"])
    assert not torch.equal(plain.tok.weight, make_model().tok.weight)
    engine.close()


def test_memory_report_retained_equals_ideal_when_padding_is_zero() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(32, 64, bias=False), torch.nn.Linear(64, 32, bias=False))
    engine = zero_offload.initialize(model, dict(stage=2, precision={"dtype": "bf16"}, clip_grad_norm=1.0,
                                                 tiers={"optimizer": "cpu", "grads": "cpu"}))
    loss = engine(torch.randn(4, 32, dtype=torch.bfloat16)).float().pow(2).mean()
    engine.backward(loss)
    engine.step()
    report = engine.memory_report(verbose=False)
    rows = {(r["group"], r["tier"]): r for r in report["rows"]}
    assert rows[("optimizer", "cpu")]["retained"] == rows[("optimizer", "cpu")]["ideal"] == 4096 * 12
    assert rows[("weights", "device")]["retained"] == rows[("weights", "device")]["ideal"] == 4096 * 2
    assert rows[("gradients", "cpu")]["peak"] == rows[("gradients", "cpu")]["ideal"] == 4096 * 2
    assert report["other"]["padding (optimizer state)"] == 0
    assert report["other"][UPDATED_ROW] == 4096 * 2  # bf16 copies the CPU Adam writes, held at step()
    assert "retained" in report["table"] and report["process"]["rss"] > 0
    engine.close()


def test_memory_report_names_nvme_slot_rounding(tmp_path: object) -> None:
    """On the nvme tier a shard's slot is whole pages: a 32-element bias (384 bytes of master + m +
    v) takes a 4 KiB slot. The report names that difference, so retained = ideal + padding + it."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 32))
    engine = zero_offload.initialize(model, dict(stage=1, bucket_bytes=4096, nvme_paths=[str(tmp_path)],
                                                 tiers={"optimizer": "nvme", "grads": "cpu"}))
    report = engine.memory_report(verbose=False)
    row = {(r["group"], r["tier"]): r for r in report["rows"]}[("optimizer", "nvme")]
    other = report["other"]
    assert other["NVMe slot rounding (optimizer state)"] == 4096 - 32 * 12
    assert row["retained"] - row["ideal"] == other["padding (optimizer state)"] + other["NVMe slot rounding (optimizer state)"]
    assert other[UPDATED_ROW] == (2048 + 32) * 4  # staged fp32 shards come back in buffers of their own
    engine.close()


def test_memory_report_names_no_updated_copies_for_a_resident_fp32_master() -> None:
    engine = zero_offload.initialize(torch.nn.Linear(64, 32), dict(stage=1, tiers={"optimizer": "cpu"}))
    assert engine.memory_report(verbose=False)["other"][UPDATED_ROW] == 0  # the master is copied in place
    engine.close()


CHILD = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, {here!r})
    import torch, zero_offload
    from _engine_model import batch, make_model
    engine = zero_offload.initialize(make_model(), dict(stage=2, tiers={{"optimizer": "cpu", "grads": "cpu"}}))
    for step in range(2):
        x, y = batch(step, 2); engine.backward(engine(x, y)); engine.step()
    engine.save_checkpoint({ckpt!r})
    torch.save(engine.consolidated_state_dict(), {ckpt!r} + ".expected.pt")
    x, y = batch(2, 2); engine.backward(engine(x, y)); engine.step()
    os.environ["ZERO_OFFLOAD_TEST_SAVE_PAUSE"] = "60"
    print("saving B", flush=True)
    engine.save_checkpoint({ckpt!r})
""")


def test_sigkill_inside_save_leaves_previous_checkpoint_loadable(tmp_path) -> None:
    ckpt = str(tmp_path / "ckpt")
    proc = subprocess.Popen([sys.executable, "-c", CHILD.format(here=HERE, ckpt=ckpt)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.strip() == "saving B", proc.stderr.read()
        deadline = 30.0
        while not os.path.exists(ckpt + ".tmp") and deadline > 0:  # B's files are being written
            deadline -= 0.05
            subprocess.run(["sleep", "0.05"])
        assert os.path.exists(ckpt + ".tmp")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == -signal.SIGKILL
    engine = _engine()
    engine.load_checkpoint(ckpt)
    assert engine.global_steps == 2
    expected = torch.load(ckpt + ".expected.pt", weights_only=True)
    got = engine.consolidated_state_dict()
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    engine.close()


def test_load_refuses_a_missing_checkpoint(tmp_path) -> None:
    from zero_offload.engine.state.checkpoint import CheckpointError

    engine = _engine()
    with pytest.raises(CheckpointError, match="no checkpoint at .*: manifest.json is missing"):
        engine.load_checkpoint(str(tmp_path / "none"))
    engine.close()


def test_a_loop_ported_from_plain_torch_is_told_where_the_update_is() -> None:
    """engine.optimizer.step() did nothing, silently (the next forward then complained about a
    missing engine.step()); engine.train() / engine.eval() did not exist, as they do on
    DeepSpeed's engine."""
    engine = _engine()
    assert engine.eval() is engine and not engine.module.training
    assert engine.train() is engine and engine.module.training
    x, y = batch(0, 2)
    engine.backward(engine(x, y))
    with pytest.raises(RuntimeError, match=r"engine.optimizer.step\(\): the update is applied by engine.step\(\)"):
        engine.optimizer.step()
    engine.optimizer.zero_grad()  # harmless: the engine clears gradients itself
    assert engine.step() is True
    engine.close()
