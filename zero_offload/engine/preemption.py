"""Saving on pre-emption: SIGTERM or SIGUSR1 → a checkpoint at the next step boundary, then exit.

A scheduler sends SIGTERM (SLURM, with --signal, SIGUSR1 ahead of time) some seconds before it
kills a job. With `preemption.handle_signals` the engine's handler for both only records the
signal: Python runs handlers on the main thread between two bytecodes, where that thread may hold
any lock, so nothing else can safely happen there. `engine.step()` looks at the record when it
ends an accumulation boundary; with D > 1 the ranks agree in one flag all-reduce per boundary, so
every rank saves at the same step even when the signal reached only some of them. The engine then
saves to `preemption.checkpoint_dir`, closes (its swap files go) and raises `Preempted`.
See docs/faults.md.
"""
from __future__ import annotations

import os
import signal
import threading
import weakref
from typing import Any, Callable

import torch

from zero_offload import comm
from zero_offload.config import ConfigError, PreemptionConfig
from zero_offload.io import swap_files

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preempted(SystemExit):
    """engine.step() saved the pre-emption checkpoint and closed the engine. A SystemExit, so
    uncaught it ends the process without a traceback and with exit code 128 + the signal's
    number (143 for SIGTERM, 138 for SIGUSR1), what a shell reports for a death by that signal;
    `except zero_offload.Preempted` to do more first."""

    def __init__(self, signum: int, checkpoint_dir: str, global_steps: int) -> None:
        super().__init__(128 + signum)
        self.signum, self.checkpoint_dir, self.global_steps = signum, checkpoint_dir, global_steps

    def __str__(self) -> str:
        return (f"pre-empted by {signal.Signals(self.signum).name}: checkpoint of step {self.global_steps} "
                f"saved in {self.checkpoint_dir}")


class PreemptionWatch:
    """The signal handlers of one engine, and what it does at a boundary once one has run."""

    def __init__(self, engine: Any, config: PreemptionConfig) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise ConfigError("preemption.handle_signals needs zero_offload.initialize on the main thread: "
                              "Python runs signal handlers there only")
        self._engine = weakref.ref(engine)  # a handler left installed must not keep the engine alive
        self.checkpoint_dir = os.path.abspath(os.path.expanduser(config.checkpoint_dir))
        self.signum: int | None = None
        self._previous = {s: signal.getsignal(s) for s in SIGNALS}
        for s in SIGNALS:
            signal.signal(s, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        """Record the first signal. A handler installed before ours runs too, every time (it is
        the user's); otherwise a second signal, or one after the engine is gone, gets what was
        there before (the default action: the process ends, its swap files removed first), so
        a job stuck before its next boundary can still be ended."""
        engine = self._engine()
        first = self.signum is None and engine is not None and not engine.closed
        if first:
            self.signum = signum
        previous = self._previous[signum]
        if callable(previous) and not swap_files.is_sigterm_guard(previous):
            previous(signum, frame)
        elif not first:
            _pass_on(previous, signum, frame)

    def at_boundary(self, engine: Any, client_state: Callable[[], Any] | None) -> None:
        """After a successful step: at an accumulation boundary, when any rank got a signal,
        save, close and raise Preempted (on every rank)."""
        if engine.micro_step % engine.config.gradient_accumulation_steps:
            return
        signum = self.signum or 0
        if comm.world_size() > 1:
            signum = int(comm.all_reduce_(torch.tensor([signum], dtype=torch.int32), op="max")[0])
        if not signum:
            return
        engine.save_checkpoint(self.checkpoint_dir, None if client_state is None else client_state())
        engine.close()
        raise Preempted(signum, self.checkpoint_dir, engine.global_steps)

    def restore(self) -> None:
        """Put back the handlers ours replaced (where ours is still the one installed)."""
        if threading.current_thread() is not threading.main_thread():
            return  # a finalizer on another thread: ours stays, and passes every signal on
        for s, previous in self._previous.items():
            if signal.getsignal(s) == self._handle:
                signal.signal(s, previous)


def _pass_on(previous: Any, signum: int, frame: Any) -> None:
    """What the handler before ours would have done: call it, ignore, or the default action."""
    if callable(previous):
        previous(signum, frame)
    elif previous != signal.SIG_IGN:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
