"""The only file that calls torch.distributed.

Data parallelism is torch.distributed under torchrun (NCCL on GPUs, gloo on CPU); without an
initialized process group everything here is the D = 1 identity, so single-process code needs
no branches. Gloo lacks some fused collectives (reduce-scatter into a tensor); those fall back to
an equivalent composition here, and only here.

When a peer rank raises or dies, the collective this rank is in fails with the backend's own
words ("Connection reset by peer", a timeout) and nothing of ours. Every collective here turns
such a failure into PeerFailure: which rank this is, which collective of what, in which phase of
which step (`during`, set by the engine), that a peer went away and that its own log has the cause.
"""
from __future__ import annotations

import contextlib
import os
import re
import warnings
from typing import Any, Iterator

import torch
import torch.distributed as dist

LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")  # what torchrun sets for every rank


class PeerFailure(RuntimeError):
    """A collective failed because another rank went away, raised or stalled (the backend's
    transport error, kept as __cause__)."""


# What the engine is doing, for PeerFailure's message: ("backward", step) while a backward runs.
# A module global, not a thread-local: backward's hooks may run on autograd's device threads.
_doing: tuple[str, int] | None = None
# The backend's words for a peer that is gone or silent (gloo's pair.cc / unbound_buffer.cc,
# NCCL's abort, a socket error), as opposed to a mistake in this rank's own call.
_PEER_GONE = re.compile(r"connection (reset|closed|refused)|closed by peer|timed out|timeout|broken pipe|"
                        r"socket|transport|communicator was aborted|peer", re.IGNORECASE)


@contextlib.contextmanager
def during(phase: str, step: int) -> Iterator[None]:
    """Name what the collectives inside are for ('backward', 'step'; `step` 1-based), so a
    PeerFailure says it; nested uses keep the outer one."""
    global _doing
    outer = _doing
    _doing = outer or (phase, step)
    try:
        yield
    finally:
        _doing = outer


def _describe(t: torch.Tensor) -> str:
    kind = " gradient" if _doing and _doing[0] == "backward" else ""
    return f"{t.numel():,} {str(t.dtype).replace('torch.', '')}{kind} elements"


def _where() -> str:
    """' in the backward of step 3', ' in optimizer step 3', or '' outside the engine's calls."""
    if _doing is None:
        return ""
    phase, step = _doing
    return f" in optimizer step {step}" if phase == "step" else f" in the {phase} of step {step}"


@contextlib.contextmanager
def _collective(name: str, what: str) -> Iterator[None]:
    """A backend error meaning a peer is gone becomes one line of ours (the backend's first line
    kept at the end); any other error passes as it is."""
    try:
        yield
    except PeerFailure:
        raise
    except RuntimeError as exc:
        said = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        if not (isinstance(exc, getattr(dist, "DistBackendError", ())) or _PEER_GONE.search(said)):
            raise
        raise PeerFailure(f"rank {rank()}: the {name} of {what}{_where()} failed: a peer rank went away or raised "
                          f"(its own log has the cause); {backend()} said: {said[:300]}") from exc


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def join_launcher_group() -> bool:
    """Under torchrun (WORLD_SIZE > 1 in the environment) with no process group yet, create the
    one the launcher describes: NCCL when CUDA is present, gloo otherwise. Without this every
    rank would silently train a replica of its own at D = 1. True when this call created it;
    a group the user made first is used as it is."""
    world = env_int("WORLD_SIZE", 1, low=1)
    if is_distributed():
        if world > 1 and dist.get_world_size() != world:  # a group of one per rank trains D replicas apart
            warnings.warn(f"the process group has {dist.get_world_size()} rank(s) but WORLD_SIZE={world}: "
                          "training at the group's size", stacklevel=3)
        return False
    if world <= 1:
        return False
    missing = [v for v in LAUNCHER_VARS if not os.environ.get(v)]
    if missing:
        raise RuntimeError(f"WORLD_SIZE={world} but {', '.join(missing)} not set: launch with torchrun, or call "
                           "torch.distributed.init_process_group before zero_offload.initialize")
    rank = env_int("RANK", 0, low=0)
    if rank >= world:  # gloo would abort this rank in C++ and leave the others waiting
        raise RuntimeError(f"RANK={rank} is not below WORLD_SIZE={world}")
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return True


def env_int(name: str, default: int, *, low: int) -> int:
    """An integer launcher variable (surrounding blanks allowed), or a one-line error naming it:
    a WORLD_SIZE of " 2" used to train silently at D = 1."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise RuntimeError(f"{name}={os.environ[name]!r} is not an integer") from None
    if value < low:
        raise RuntimeError(f"{name}={value} must be >= {low}")
    return value


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def backend() -> str:
    return str(dist.get_backend()) if is_distributed() else "none"


def all_reduce_(t: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """In-place all-reduce; op is 'sum' or 'max'. A host tensor (a norm, a flag) under a
    NCCL-only group goes through the current device and back: NCCL moves device memory only."""
    if is_distributed():
        moved = t.cuda() if t.device.type == "cpu" and backend() == "nccl" else t
        with _collective("all-reduce", _describe(t)):
            dist.all_reduce(moved, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
        if moved is not t:
            t.copy_(moved)
    return t


def first_failure(error: BaseException | None) -> tuple[int, str] | None:
    """Which rank failed first and why, agreed by every rank: (rank, message), or None when no
    rank failed. One small all-reduce when none did (the usual case); the messages are gathered
    only when one did."""
    if not is_distributed():
        return None if error is None else (0, str(error))
    flag = torch.tensor([0 if error is None else 1], dtype=torch.int32)
    if not int(all_reduce_(flag, op="max")[0]):
        return None
    messages = gather_objects(None if error is None else str(error))
    r = next(r for r, m in enumerate(messages) if m is not None)
    return r, messages[r]


def reduce_scatter_(out: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """out = this rank's 1/D slice of sum over ranks of `full` (full.numel() == D * out.numel())."""
    n = world_size()
    if full.numel() != n * out.numel():
        raise ValueError(f"reduce_scatter: full has {full.numel()} elements, expected {n} x {out.numel()}")
    if n == 1:
        return out.copy_(full.view_as(out))
    if backend() == "nccl":
        with _collective("reduce-scatter", _describe(full)):
            dist.reduce_scatter_tensor(out, full)
        return out
    # gloo has no reduce_scatter_tensor: all-reduce a copy and keep our slice.
    summed = full.detach().clone()
    with _collective("reduce-scatter", _describe(full)):
        dist.all_reduce(summed)
    r = rank()
    return out.copy_(summed.view(n, -1)[r].view_as(out))


def all_gather_(full: torch.Tensor, shard: torch.Tensor) -> torch.Tensor:
    """full = concatenation over ranks of each rank's `shard`."""
    n = world_size()
    if full.numel() != n * shard.numel():
        raise ValueError(f"all_gather: full has {full.numel()} elements, expected {n} x {shard.numel()}")
    if n == 1:
        return full.copy_(shard.view_as(full))
    with _collective("all-gather", _describe(full)):
        if backend() == "nccl":
            dist.all_gather_into_tensor(full, shard)
        else:
            dist.all_gather(list(full.view(n, -1).unbind(0)), shard.reshape(-1))
    return full


def all_gather_in_place_(full: torch.Tensor) -> torch.Tensor:
    """`full` already holds this rank's shard as part `rank`; fill the other ranks' parts.

    NCCL gathers in place (the input is the output's own part, as FSDP2 does); gloo's list form
    needs an input apart from the outputs, so only there the part is copied first."""
    n = world_size()
    if n == 1:
        return full
    mine = full.view(n, -1)[rank()]
    if backend() == "nccl":
        with _collective("all-gather", _describe(full)):
            dist.all_gather_into_tensor(full, mine)
        return full
    return all_gather_(full, mine.clone())


def broadcast_(t: torch.Tensor, src: int = 0) -> torch.Tensor:
    if is_distributed():
        with _collective("broadcast", _describe(t)):
            dist.broadcast(t, src)
    return t


def barrier() -> None:
    if is_distributed():
        with _collective("barrier", "every rank"):
            dist.barrier()


def all_agree(value: Any) -> bool:
    """True when every rank passed an equal (picklable) value; used to agree on a recorded order."""
    values = gather_objects(value)
    return all(v == values[0] for v in values)


def gather_objects(value: Any) -> list[Any]:
    """Every rank's (picklable) `value`, in rank order; [value] without a process group."""
    if not is_distributed():
        return [value]
    values: list[Any] = [None] * world_size()
    with _collective("all-gather", "every rank's status"):
        dist.all_gather_object(values, value)
    return values
