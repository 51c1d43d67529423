"""Under torchrun the engine joins the group the launcher describes (it used to leave every rank
at D = 1, each training a replica of its own, silently)."""
from __future__ import annotations

import multiprocessing as mp
import os
import socket

import pytest


def _rank(rank: int, world: int, port: int, out: str) -> None:
    try:
        _train(rank, world, port, out)
    except BaseException:
        import traceback

        with open(os.path.join(out, f"error{rank}"), "w") as f:
            f.write(traceback.format_exc())
        raise
    os._exit(0)  # not through interpreter finalization: the gloo teardown race of tests/_dist.py


def _train(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch

    import zero_offload
    from zero_offload import comm
    from _engine_model import batch, make_model

    torch.set_num_threads(1)
    engine = zero_offload.initialize(make_model(), {"stage": 2, "tiers": {"optimizer": "cpu", "grads": "cpu"}})
    for step in range(2):
        x, y = batch(step, 2 * world)
        engine.backward(engine(x[rank::world], y[rank::world]))
        engine.step()
    weights = torch.cat([p.detach().reshape(-1) for p in engine.module.parameters()])
    same = comm.gather_objects(float(weights.sum()))
    with open(os.path.join(out, f"rank{rank}"), "w") as f:
        f.write(f"{comm.world_size()} {comm.backend()} {len(set(same))}")
    engine.close()


def test_ranks_started_by_a_launcher_train_as_one_group(tmp_path: object) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(r, 2, port, str(tmp_path))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    hung = [p for p in procs if p.is_alive()]
    for p in hung:
        p.kill()
    errors = [open(os.path.join(str(tmp_path), f)).read() for f in sorted(os.listdir(str(tmp_path))) if f.startswith("error")]
    assert not hung and all(p.exitcode == 0 for p in procs), ([p.exitcode for p in procs], errors)
    # world 2, the group the engine made (gloo on the CPU), the same weights on both ranks
    assert [open(os.path.join(str(tmp_path), f"rank{r}")).read() for r in range(2)] == ["2 gloo 1"] * 2


def test_a_partial_launcher_environment_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from zero_offload import comm

    monkeypatch.setenv("WORLD_SIZE", "2")
    for var in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(RuntimeError, match="WORLD_SIZE=2 but RANK, MASTER_ADDR, MASTER_PORT not set: launch with torchrun"):
        comm.join_launcher_group()


@pytest.mark.parametrize("env,message", [
    ({"WORLD_SIZE": "two"}, "WORLD_SIZE='two' is not an integer"),
    ({"WORLD_SIZE": "0"}, "WORLD_SIZE=0 must be >= 1"),
    ({"WORLD_SIZE": "2", "RANK": "5"}, "RANK=5 is not below WORLD_SIZE=2"),
    ({"WORLD_SIZE": "2", "RANK": "-1"}, "RANK=-1 must be >= 0"),
])
def test_a_bad_launcher_variable_is_named_in_one_line(env: dict, message: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """RANK=5 of 2 aborted that rank inside gloo (the others waited); a WORLD_SIZE that is not
    plain digits (" 2") trained silently at D = 1."""
    from zero_offload import comm

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29999")
    monkeypatch.setenv("RANK", "0")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(RuntimeError, match=message):
        comm.join_launcher_group()


def test_a_blank_padded_world_size_is_read_as_its_number(monkeypatch: pytest.MonkeyPatch) -> None:
    from zero_offload import comm

    monkeypatch.setenv("WORLD_SIZE", " 2")
    for var in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(RuntimeError, match="WORLD_SIZE=2 but RANK, MASTER_ADDR, MASTER_PORT not set"):
        comm.join_launcher_group()


@pytest.mark.parametrize("local,message", [("a", "LOCAL_RANK='a' is not an integer"),
                                           ("12", "LOCAL_RANK=12 but this process sees 8 GPUs")])
def test_a_bad_local_rank_is_named_before_any_gpu_is_touched(local: str, message: str,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A bare int() ValueError, or a device index past the GPUs (checked with CUDA faked: the
    error comes before anything touches a device)."""
    import torch

    from zero_offload.engine.engine import _device_for

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setenv("LOCAL_RANK", local)
    with pytest.raises(RuntimeError, match=message):
        _device_for(torch.nn.Linear(2, 2))
