"""Run a test function on D gloo ranks in fresh processes, under a hard timeout.

Ranks start from a fork server that imported torch (and whatever heavy modules the test session
already imported, the test modules included) once, so a rank costs a fork, not an interpreter
start and a torch import; each rank then takes the parent's current environment, as a spawned
process would.

Each rank arms faulthandler to dump every thread's stack shortly before the deadline, so a
deadlock fails fast and shows where each rank was stuck. A rank's exception is written to a file
and becomes the parent's failure message. Functions must be importable (module level).
"""
from __future__ import annotations

import datetime
import faulthandler
import multiprocessing as mp
import os
import socket
import sys
import tempfile
import traceback
from typing import Any, Callable

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_PRELOAD_ALWAYS = ("torch", "torch.distributed", "numpy")
_PRELOAD_IF_LOADED = ("transformers", "peft", "safetensors", "accelerate", "zero_offload")


def _context() -> mp.context.BaseContext:
    """The fork server's context; what it preloads is fixed when the first rank starts."""
    ctx = mp.get_context("forkserver")
    here = os.path.dirname(os.path.abspath(__file__))
    tests = [name for name, mod in list(sys.modules.items())
             if os.path.dirname(os.path.abspath(getattr(mod, "__file__", None) or "/")) == here]
    heavy = [m for m in _PRELOAD_IF_LOADED if m in sys.modules]
    ctx.set_forkserver_preload([*_PRELOAD_ALWAYS, *heavy, *sorted(tests)])
    return ctx


def _rank_main(fn: Callable[..., None], rank: int, world: int, port: int, timeout: float, errdir: str,
               kwargs: dict[str, Any], pg_timeout: float | None = None, env: dict[str, str] | None = None) -> None:
    if env is not None:  # the parent's environment now, not the fork server's at its start
        os.environ.clear()
        os.environ.update(env)
    import torch
    import torch.distributed as dist

    stackfile = open(os.path.join(errdir, f"stack{rank}.txt"), "w")
    faulthandler.dump_traceback_later(max(timeout - 10, 5), exit=True, file=stackfile)
    faulthandler.enable(file=stackfile, all_threads=True)  # a rank killed by a signal (an abort) shows where
    torch.set_num_threads(1)
    try:
        if world > 1:
            extra = {} if pg_timeout is None else {"timeout": datetime.timedelta(seconds=pg_timeout)}
            dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}",
                                    **extra)
        fn(rank, world, **kwargs)
        if world > 1:
            dist.barrier()
            dist.destroy_process_group()
    except BaseException:
        with open(os.path.join(errdir, f"error{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        sys.stderr.write(traceback.format_exc())
        os._exit(1)
    # Not through the interpreter's finalization: a gloo worker thread may still be dropping a
    # finished Work that holds Python-made tensors (the barrier keeps the all-gathers before it),
    # and a thread that needs the GIL while the interpreter finalizes ends in std::terminate
    # (SIGABRT, "terminate called without an active exception"; about one run in twenty here).
    faulthandler.cancel_dump_traceback_later()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(fn: Callable[..., None], world: int, *, timeout: float = 200.0, pg_timeout: float | None = None,
              **kwargs: Any) -> None:
    """Run fn(rank, world, **kwargs) on `world` ranks (world 1 still runs in a child, without a group).
    `pg_timeout`: the process group's collective timeout in seconds (gloo's default is 30 minutes)."""
    ctx = _context()
    port = _free_port()
    env = dict(os.environ)
    with tempfile.TemporaryDirectory() as errdir:
        procs = [ctx.Process(target=_rank_main, args=(fn, r, world, port, timeout, errdir, kwargs, pg_timeout, env))
                 for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for r in hung:
            procs[r].kill()
            procs[r].join()
        msgs = []
        for r, p in enumerate(procs):
            for name in (f"error{r}.txt", f"stack{r}.txt"):
                path = os.path.join(errdir, name)
                if os.path.exists(path) and os.path.getsize(path):
                    msgs.append(f"--- rank {r} {name} ---\n" + open(path).read())
            if p.exitcode != 0 and not msgs:
                msgs.append(f"rank {r} exited with code {p.exitcode}")
        if hung or any(p.exitcode != 0 for p in procs):
            pytest.fail(f"{world} ranks failed (hung: {hung}, exit codes {[p.exitcode for p in procs]}):\n"
                        + "\n".join(msgs), pytrace=False)
