"""Ctrl-C held while bookkeeping runs: the one way an interrupt cannot split a transaction.

Python runs the SIGINT handler on the main thread between two bytecodes, and the default
handler raises KeyboardInterrupt there: in the middle of any sequence of assignments that only
together are a consistent state (a count and the job it counts, a budget and the unit it is
for, a ring's state and the regions it holds). Guarding each line is endless; instead the
engine holds SIGINT over each such transaction (`InterruptGuard.held`, `held_interrupts`)
and raises it at the end, when the state is whole again. A leaf: it imports nothing of ours.
"""
from __future__ import annotations

import contextlib
import signal
import threading
from typing import Any, Callable, Iterator


class InterruptGuard:
    """Holds Ctrl-C (SIGINT) while the engine's step bookkeeping runs, so that an interrupt
    cannot split it: the outermost `held()` replaces the SIGINT handler on the main thread by
    one that only records the signal, and puts the previous one back at the end, calling it
    then for a signal that came (the default handler raises KeyboardInterrupt there, once the
    step is whole). A second SIGINT while one is held calls `on_forced` (the engine stops:
    its state is no longer known) and then the previous handler at once, so a Ctrl-C twice
    still ends a step that hangs. Off the main thread nothing is installed: Python delivers
    signals to the main thread only, so none can interrupt the engine there."""

    def __init__(self, on_forced: Callable[[], None]) -> None:
        self.on_forced = on_forced
        self._depth = 0
        self._previous: Any = None
        self._pending: tuple[int, Any] | None = None

    @property
    def pending(self) -> bool:
        """Whether a Ctrl-C came and is held."""
        return self._pending is not None

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """The body with SIGINT held (nested uses are the outermost's)."""
        if self._depth:
            yield
            return
        installed = self._install()
        self._depth = int(installed)
        try:
            yield
        finally:
            if installed:
                self._depth = 0
                self._release()

    def _install(self) -> bool:
        if threading.current_thread() is not threading.main_thread():
            return False
        previous = signal.getsignal(signal.SIGINT)
        if not callable(previous):  # SIG_IGN, SIG_DFL, or not set by Python: nothing raises here
            return False
        self._previous, self._pending = previous, None
        signal.signal(signal.SIGINT, self._hold)
        return True

    def _hold(self, signum: int, frame: Any) -> None:
        if self._pending is None:
            self._pending = (signum, frame)
            return
        global _forced
        previous = self._previous  # a second Ctrl-C: the state is not known any more
        signal.signal(signal.SIGINT, previous)
        _forced += 1
        self.on_forced()
        previous(signum, frame)

    def _release(self) -> None:
        """The previous handler back first: a Ctrl-C from then on reaches it directly, and one
        that came before is in `_pending` when it is taken."""
        previous = self._previous
        if signal.getsignal(signal.SIGINT) == self._hold:
            signal.signal(signal.SIGINT, previous)
        self._previous = None  # not kept: it may be another engine's guard (nothing else holds it)
        pending, self._pending = self._pending, None
        if pending is not None:
            previous(*pending)


_HELD = InterruptGuard(lambda: None)
_forced = 0  # second Ctrl-Cs that ended a hold at once, in this process


def forced_count() -> int:
    """How many holds a second Ctrl-C has ended so far: a wait that sees the count grow knows
    its KeyboardInterrupt means "stop now", not the first Ctrl-C it would finish the step for."""
    return _forced


def held_interrupts() -> contextlib.AbstractContextManager[None]:
    """SIGINT held for a short body outside the Engine's own guard, where a KeyboardInterrupt
    would be turned into another error (torch.save's writer makes one "unexpected pos")."""
    return _HELD.held()
