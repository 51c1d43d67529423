"""The interrupt sweep: a KeyboardInterrupt at each line the main thread runs in one training
step (forward, backward, step, save), as the default SIGINT handler raises one between two
bytecodes, and what each leaves the engine in.

One case is an engine (stage, tier, I/O backend) on a tiny model. Step 1 runs clean and is saved;
each point then loads that checkpoint, runs step 2 and its save under `sys.settrace` with the
trace function raising KeyboardInterrupt at the point's line event (lines of zero_offload's own
files only; each thread traces itself, so only the main thread's lines are points), and sorts
the outcome:

- consistent: the engine is OK, its phase IDLE or FORWARD, its counters at step 1 or 2, and its
  step counts, master shards and weights those of an uninterrupted run at that step; a save
  then load gives them back exactly, and training on to step 3 matches the uninterrupted run.
  Or (consistent@backward) its backward is whole and step() was not called, as a Ctrl-C in the
  loop between the two leaves it: step() then gives step 2 exactly (a load drops it).
- stopped: the engine refuses forward, step and save with a one-line reason, and a load of the
  step-1 checkpoint brings it back (step 2 and 3 then match the uninterrupted run).
- BAD: anything else (mixed state, a refusal a load does not clear, an interrupt lost or turned
  into another error, live budget left taken, a hang: a point running past `POINT_S` dumps every
  thread's stack and ends the process with status 124).

With `--what load` the points are the lines of a load of step 2's checkpoint into the engine
at step 1 instead (consistent@1: refused before anything changed; consistent@2: loaded; or
stopped: `engine.load_failed` until a load succeeds).

`python tests/_interrupt_sweep.py --stage 2 --tier cpu [--every N] [--all] [--what load]` runs
one case and prints one JSON line (tests/test_interrupt_sweep.py, scripts/interrupt_sweep.py).
"""
from __future__ import annotations

import argparse
import dis
import faulthandler
import functools
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

import zero_offload
from zero_offload.config import Config
from zero_offload.engine.phase import EngineStateError, Phase

ZO_DIR = os.path.dirname(os.path.abspath(zero_offload.__file__)) + os.sep
WIDTH = 8
POINT_S = float(os.environ.get("ZO_SWEEP_POINT_S", "30"))  # one point's bound: far above its ~0.1 s, so only a hang reaches it


@dataclass(frozen=True)
class Case:
    stage: int
    tier: str
    backend: str = "auto"
    what: str = "step"  # what each point interrupts: "step" (step 2 and its save) or "load" (of step 2's)

    @property
    def name(self) -> str:
        return f"stage{self.stage}-{self.tier}-{self.backend}" + ("" if self.what == "step" else f"-{self.what}")


def build(case: Case, root: str) -> Any:
    """The case's engine on a 3-layer MLP: a bucket (or unit) per layer, the optimizer and (at
    stage 3) the parameters on `case.tier`."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh(),
                          nn.Linear(WIDTH, WIDTH))
    tiers = {"optimizer": case.tier, "grads": "cpu"}
    extra: dict[str, Any] = {}
    if case.stage == 3:
        tiers["params"] = case.tier
        extra["stage3"] = {"resident_bytes": 0}
    else:
        extra["bucket_bytes"] = WIDTH * (WIDTH + 1) * 4
    nvme = os.path.join(root, "nvme")
    os.makedirs(nvme, exist_ok=True)
    cfg = Config(stage=case.stage, precision={"dtype": "fp32"}, tiers=tiers, nvme_paths=(nvme,),
                 optimizer={"lr": 0.01, "weight_decay": 0.01}, io={"backend": case.backend}, **extra)
    return zero_offload.initialize(model, cfg)


def batch(i: int) -> torch.Tensor:
    return torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(i))


def train_step(eng: Any, i: int) -> None:
    eng.backward(eng(batch(i)).pow(2).mean())
    eng.step()


def body(eng: Any, ck: str) -> None:
    """What each point interrupts: step 2 and its save."""
    train_step(eng, 2)
    eng.save_checkpoint(ck)


@dataclass
class Snapshot:
    global_steps: int
    steps: dict[str, int]
    sub_steps: dict[str, int]
    masters: dict[str, torch.Tensor]
    weights: dict[str, torch.Tensor]

    def differs(self, other: "Snapshot") -> str | None:
        """What differs from `other`, in a few words; None when nothing does."""
        for what in ("global_steps", "steps", "sub_steps"):
            if getattr(self, what) != getattr(other, what):
                return f"{what} {getattr(self, what)} != {getattr(other, what)}"
        for what in ("masters", "weights"):
            a, b = getattr(self, what), getattr(other, what)
            bad = sorted(k for k in a.keys() | b.keys() if k not in a or k not in b or not torch.equal(a[k], b[k]))
            if bad:
                return f"{what} {bad[:3]} differ"
        return None


def snapshot(eng: Any) -> Snapshot:
    """The engine's counters and state; the weights read from the compute copy (the module at
    stages 0-2, the unit shards at stage 3), the masters from the optimizer's store."""
    so = eng.runtime.shard_optimizer
    masters = {k: so.master(k) for k in so.numel}
    if eng.config.stage == 3:
        weights = {k: v.clone() for k, v in eng.consolidated_state_dict().items()}
    else:
        weights = {k: v.detach().float().clone() for k, v in eng.module.state_dict().items()}
    return Snapshot(eng.global_steps, dict(so.steps), dict(so.sub_steps), masters, weights)


def live_taken(eng: Any) -> int:
    """Bytes of stage 3's live budget taken (0 between passes); 0 at stages 0-2."""
    prefetcher = getattr(eng.runtime, "prefetcher", None)
    return 0 if prefetcher is None else int(prefetcher.budget.live)


# ---- tracing -------------------------------------------------------------------------------

def deliver_sigint(frame: Any) -> None:
    """What Python does on SIGINT between two bytecodes: it calls the SIGINT handler, which by
    default raises KeyboardInterrupt (the engine holds it while its bookkeeping runs)."""
    handler = signal.getsignal(signal.SIGINT)
    if callable(handler):
        handler(signal.SIGINT, frame)


@functools.lru_cache(maxsize=None)
def _with_exits(code: Any) -> frozenset[int]:
    """Offsets where a `with` block's exit begins (`__exit__(None, None, None)`: three
    LOAD_CONST None, then the call). The tracer reports a line event there, but Python checks
    for signals only at calls and backward jumps, so a SIGINT is never handled between the body
    and that call; raising one there would leave a lock held that no real Ctrl-C can."""
    ins = list(dis.get_instructions(code))
    out = set()
    for i in range(len(ins) - 3):
        consts = ins[i:i + 3]
        if all(x.opname == "LOAD_CONST" and x.argval is None for x in consts) and \
                ins[i + 3].opname in ("PRECALL", "CALL") and ins[i + 3].arg == 2:
            out.add(ins[i].offset)
    return frozenset(out)


def _finalizing(frame: Any) -> bool:
    """Whether `frame` runs inside a finalizer (`__del__`): Python cannot raise from one, so a
    KeyboardInterrupt handled there is printed as "Exception ignored" and lost, whatever the
    engine does (docs/faults.md); the sweep delivers it at the next line outside instead."""
    while frame is not None:
        if frame.f_code.co_name == "__del__":
            return True
        frame = frame.f_back
    return False


class Interrupter:
    """A trace function counting the line events of zero_offload's frames on this thread;
    with `at`, SIGINT is delivered at that event (once), where it is recorded."""

    def __init__(self, at: int | None = None) -> None:
        self.at, self.n, self.fired = at, 0, None
        self.lines: list[tuple[str, int]] = []

    def __call__(self, frame: Any, event: str, arg: Any) -> Callable[..., Any] | None:
        return self._local if frame.f_code.co_filename.startswith(ZO_DIR) else None

    def _local(self, frame: Any, event: str, arg: Any) -> Callable[..., Any] | None:
        if event != "line":
            return self._local
        where = (frame.f_code.co_filename[len(ZO_DIR):], frame.f_lineno)
        if self.at is None:
            self.lines.append(where)
        elif self.n == self.at and (frame.f_lasti in _with_exits(frame.f_code) or _finalizing(frame)):
            self.at += 1  # no signal is handled there (or none can be raised): the next line takes it
        elif self.n == self.at:
            self.fired = where
            self.n += 1
            deliver_sigint(frame)
        self.n += 1
        return self._local

    def run(self, fn: Callable[[], None]) -> None:
        sys.settrace(self)
        try:
            fn()
        finally:
            sys.settrace(None)


# ---- one case ---------------------------------------------------------------------------------

@dataclass
class Result:
    point: int
    where: tuple[str, int] | None
    outcome: str  # "consistent@1", "consistent@2", "stopped", "not reached", or "BAD: ..."
    detail: str = ""


@dataclass
class Sweep:
    case: Case
    root: str
    eng: Any = None
    refs: dict[int, Snapshot] = field(default_factory=dict)
    ck1: str = ""
    ck2: str = ""
    live: int = 0  # the live budget taken after step 3 of the uninterrupted run

    def setup(self) -> list[tuple[str, int]]:
        """The uninterrupted run's snapshots at steps 1-3, step 1's checkpoint, and the line
        events of one clean step 2 + save (the points)."""
        ref = build(self.case, os.path.join(self.root, "ref"))
        self.ck1 = os.path.join(self.root, "ck1")
        train_step(ref, 1)
        ref.save_checkpoint(self.ck1)
        self.refs[1] = snapshot(ref)
        train_step(ref, 2)
        self.ck2 = os.path.join(self.root, "ck2")
        ref.save_checkpoint(self.ck2)
        self.refs[2] = snapshot(ref)
        train_step(ref, 3)
        self.refs[3], self.live = snapshot(ref), live_taken(ref)
        ref.close()
        self.eng = build(self.case, os.path.join(self.root, "run"))
        self.eng.load_checkpoint(self.ck1)
        counter = Interrupter()
        counter.run(lambda: self.body(os.path.join(self.root, "ck_count")))
        return counter.lines

    def body(self, ck: str) -> None:
        """What a point interrupts: step 2 and its save to `ck`, or a load of step 2's checkpoint."""
        if self.case.what == "load":
            self.eng.load_checkpoint(self.ck2)
        else:
            body(self.eng, ck)

    def point(self, at: int) -> Result:
        """Interrupt at line event `at` of step 2 + save, and sort what it left."""
        eng = self.eng
        ck = os.path.join(self.root, "ck_point")
        shutil.rmtree(ck, ignore_errors=True)
        try:
            eng.load_checkpoint(self.ck1)
        except Exception as exc:  # noqa: BLE001 -- the previous point's BAD left it wedged
            self.rebuild()
            return Result(at, None, "BAD: wedged", f"the reset load refused: {_line(exc)}")
        trace = Interrupter(at)
        raised: BaseException | None = None
        try:
            trace.run(lambda: self.body(ck))
        except BaseException as exc:  # noqa: BLE001 -- sorted below
            raised = exc
        if trace.fired is None:
            return Result(at, None, "not reached")
        try:
            outcome, detail = self.sort(raised, ck)
        except BaseException as exc:  # noqa: BLE001 -- a check that raised is a bad outcome
            outcome, detail = "BAD: check raised", _line(exc)
        if outcome.startswith("BAD"):
            self.rebuild()
        return Result(at, trace.fired, outcome, detail)

    def sort(self, raised: BaseException | None, ck: str) -> tuple[str, str]:
        eng = self.eng
        if not isinstance(raised, KeyboardInterrupt):
            return "BAD: interrupt lost", "nothing raised" if raised is None else f"raised {_line(raised)}"
        if eng.stopped or eng.load_failed:
            return self._stopped(eng.stopped or eng.load_failed)
        phase = eng.phase.phase
        if phase is Phase.BACKWARD:  # between backward and step(), as a Ctrl-C in the loop leaves it
            return self._before_step()
        if phase not in (Phase.IDLE, Phase.FORWARD):
            return "BAD: wedged", f"engine OK in phase {phase.value}"
        g = eng.global_steps
        if g not in (1, 2):
            return "BAD: mixed", f"global_steps {g}"
        now = snapshot(eng)
        off = now.differs(self.refs[g])
        if off is not None:
            return "BAD: mixed", f"claims step {g}: {off}"
        if os.path.isdir(ck):  # an interrupted save either finished or left nothing
            probe = build(self.case, os.path.join(self.root, "probe"))
            try:
                probe.load_checkpoint(ck)
                off = snapshot(probe).differs(self.refs[2])
            finally:
                probe.close()
                shutil.rmtree(os.path.join(self.root, "probe"), ignore_errors=True)
            if off is not None:
                return "BAD: mixed checkpoint", off
        saved = os.path.join(self.root, "ck_saved")
        eng.save_checkpoint(saved)
        bad = self._continue(g)
        if bad:
            return "BAD: diverges", bad
        eng.load_checkpoint(saved)
        off = snapshot(eng).differs(self.refs[g])
        if off is not None:
            return "BAD: inexact save", off
        return f"consistent@{g}", ""

    def _before_step(self) -> tuple[str, str]:
        """A whole backward whose step() was not called: at step 1, and step() makes it step 2
        exactly (a load would drop it instead: the next point's reset load does that)."""
        eng = self.eng
        if eng.global_steps != 1:
            return "BAD: mixed", f"in phase backward at global_steps {eng.global_steps}"
        eng.step()
        off = snapshot(eng).differs(self.refs[2])
        if off is not None:
            return "BAD: mixed", f"step() after the interrupted backward: {off}"
        bad = self._continue(2)
        return ("BAD: diverges", bad) if bad else ("consistent@backward", "")

    def _stopped(self, reason: str) -> tuple[str, str]:
        eng = self.eng
        if "\n" in reason:
            return "BAD: stopped, reason not one line", reason[:200]
        for call in (lambda: eng(batch(9)), eng.step, lambda: eng.save_checkpoint(os.path.join(self.root, "x"))):
            try:
                call()
            except EngineStateError:
                continue
            return "BAD: stopped but a call went on", reason
        eng.load_checkpoint(self.ck1)
        bad = self._continue(1)
        return ("BAD: load does not bring it back", bad) if bad else ("stopped", reason)

    def _continue(self, g: int) -> str | None:
        """Train from step g to 3; what differs from the uninterrupted run, if anything (the
        live budget taken too: a unit the interrupt left counted would stay so)."""
        for i in range(g + 1, 4):
            train_step(self.eng, i)
        if live_taken(self.eng) != self.live:
            return f"live budget leaked: {live_taken(self.eng)} bytes taken after step 3, {self.live} uninterrupted"
        return snapshot(self.eng).differs(self.refs[3])

    def rebuild(self) -> None:
        try:
            self.eng.close()
        except BaseException:  # noqa: BLE001 -- the bad outcome is already recorded
            pass
        shutil.rmtree(os.path.join(self.root, "run"), ignore_errors=True)
        self.eng = build(self.case, os.path.join(self.root, "run"))


def _line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:300]}"


def choose(lines: list[tuple[str, int]], every: int, exhaustive: bool) -> list[int]:
    """Which line events to interrupt: all of them, or the first event of each distinct line,
    then every `every`-th of those."""
    if exhaustive:
        return list(range(len(lines)))
    first: dict[tuple[str, int], int] = {}
    for i, where in enumerate(lines):
        first.setdefault(where, i)
    return sorted(first.values())[::max(1, every)]


def _watchdog(state: dict[str, Any]) -> None:
    """Ends the process when one point runs past POINT_S: a hang, reported with every stack."""
    while True:
        time.sleep(0.5)
        started = state.get("started")
        if started is not None and time.monotonic() - started > POINT_S:
            print(json.dumps({"hang": state.get("point"), "case": state.get("case")}), flush=True)
            faulthandler.dump_traceback(all_threads=True)
            os._exit(124)


def sweep(case: Case, every: int = 1, exhaustive: bool = False, only: list[int] | None = None) -> dict[str, Any]:
    state: dict[str, Any] = {"case": case.name}
    threading.Thread(target=_watchdog, args=(state,), daemon=True).start()
    root = tempfile.mkdtemp(prefix="zo-sweep-")
    try:
        sw = Sweep(case, root)
        state["started"], state["point"] = time.monotonic(), "setup"
        lines = sw.setup()
        points = only if only is not None else choose(lines, every, exhaustive)
        results = []
        for at in points:
            state["started"], state["point"] = time.monotonic(), f"{at} ({lines[at][0]}:{lines[at][1]})"
            results.append(sw.point(at))
        state["started"] = None
        sw.eng.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    counts: dict[str, int] = {}
    for r in results:
        counts[r.outcome] = counts.get(r.outcome, 0) + 1
    return {"case": case.name, "events": len(lines), "distinct": len(set(lines)), "points": len(points),
            "counts": counts,
            "bad": [{"point": r.point, "where": f"{r.where[0]}:{r.where[1]}" if r.where else None,
                     "outcome": r.outcome, "detail": r.detail} for r in results if r.outcome.startswith("BAD")]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stage", type=int, default=2)
    ap.add_argument("--tier", default="cpu")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--every", type=int, default=1, help="interrupt every N-th distinct line")
    ap.add_argument("--all", action="store_true", help="every line event, not each distinct line once")
    ap.add_argument("--only", type=int, nargs="*", help="these line events only")
    ap.add_argument("--what", choices=("step", "load"), default="step", help="what the points interrupt")
    args = ap.parse_args()
    torch.set_num_threads(1)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # a shell's background job starts with SIGINT ignored
    out = sweep(Case(args.stage, args.tier, args.backend, args.what), args.every, args.all, args.only)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
