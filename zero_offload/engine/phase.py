"""The engine's phase machine: the order of the user's calls, one instance per Engine.

IDLE → FORWARD → BACKWARD → STEP → IDLE (FORWARD → FORWARD for another forward, evaluation
ones included; BACKWARD → IDLE when a backward raises). The Engine owns the machine and moves it;
a runtime that needs the phase is handed a `PhaseView`, which reads it and cannot move it, so
there is one phase however many parts look at it. A seam module: it imports nothing of the
engine, so the sub-packages (stage3/) may read it without importing the facade.
"""
from __future__ import annotations

from enum import Enum

from zero_offload.interrupts import InterruptGuard, held_interrupts  # noqa: F401 -- the Engine's guard


class Phase(Enum):
    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD = "backward"
    STEP = "step"


class EngineStateError(RuntimeError):
    """A call out of order (e.g. step() before backward())."""


class PhaseMachine:
    """The engine's phase; each transition names the phases it may leave and says what is wrong."""

    def __init__(self) -> None:
        self.phase = Phase.IDLE

    def _move(self, call: str, allowed: tuple[Phase, ...], to: Phase, hint: str) -> None:
        if self.phase not in allowed:
            raise EngineStateError(f"engine.{call} called in phase {self.phase.value}: {hint}")
        self.phase = to

    def start_forward(self) -> None:
        self._move("forward", (Phase.IDLE, Phase.FORWARD), Phase.FORWARD,
                   "call engine.step() after engine.backward() before the next forward")

    def start_backward(self) -> None:
        self._move("backward()", (Phase.FORWARD,), Phase.BACKWARD, "run a forward (engine(...)) first")

    def start_step(self) -> None:
        self._move("step()", (Phase.BACKWARD,), Phase.STEP, "call engine.backward(loss) first")

    def finish_step(self) -> None:
        self._move("step()", (Phase.STEP,), Phase.IDLE, "internal error: step finished twice")

    def abort_backward(self) -> None:
        self._move("backward()", (Phase.BACKWARD,), Phase.IDLE, "internal error: no backward to abort")

    def reset(self) -> None:
        """Any phase → IDLE: a checkpoint load after a stop rewrote whatever the call left."""
        self.phase = Phase.IDLE

    def view(self) -> PhaseView:
        """The read-only face of this machine, for the parts the Engine drives."""
        return PhaseView(self)


class PhaseView:
    """Reads a PhaseMachine's phase; has no transitions, so only the machine's owner moves it."""

    __slots__ = ("_machine",)

    def __init__(self, machine: PhaseMachine) -> None:
        self._machine = machine

    @property
    def phase(self) -> Phase:
        return self._machine.phase
