"""Stage 3's pass state: one record per unit (unit.UnitPass, its backward progress an enum whose
wrong transitions raise), the runtime's pass sub-state (PassStage), and the Engine's one phase
machine (engine/phase.py), which the runtime reads through a view and never moves."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import zero_offload
from _stage3_model import batch, make_model
from zero_offload.engine.phase import Phase, PhaseMachine, PhaseView
from zero_offload.engine.stage3.runtime import PassStage
from zero_offload.engine.stage3.unit import GatherBuffers, PassStateError, Unit, UnitBackward, UnitPass
from zero_offload.store.host import HostStore

CFG = dict(stage=3, tiers={"params": "cpu", "optimizer": "cpu", "grads": "cpu"},
           stage3={"unit_modules": ["Block3"], "live_budget_bytes": 30000, "prefetch_depth": 2},
           optimizer={"lr": 1e-2})


def _unit() -> Unit:
    lin = nn.Linear(4, 3)
    store = HostStore(pin=False)
    return Unit(0, "lin", [(n, p, p.shape) for n, p in lin.named_parameters()], dtype=torch.float32,
                device=torch.device("cpu"), store=store, staging=GatherBuffers(store))


def test_a_unit_backward_goes_held_finished_let_go() -> None:
    rec = UnitPass(_unit())
    assert rec.backward is UnitBackward.WAITING and not rec.held and not rec.finished
    rec.hold()
    assert rec.backward is UnitBackward.HELD and rec.held and not rec.finished
    rec.finish()
    assert rec.backward is UnitBackward.FINISHED_HELD and rec.held and rec.finished
    rec.let_go()
    assert rec.backward is UnitBackward.FINISHED and not rec.held and rec.finished
    direct = UnitPass(_unit())
    direct.finish()  # reduced at end_backward without being gathered again
    assert direct.backward is UnitBackward.FINISHED


@pytest.mark.parametrize("moves, wrong", [((), "let_go"), (("hold",), "let_go"), (("hold",), "hold"),
                                          (("finish",), "finish"), (("finish",), "hold")])
def test_a_wrong_unit_transition_raises_ours(moves: tuple[str, ...], wrong: str) -> None:
    rec = UnitPass(_unit())
    for m in moves:
        getattr(rec, m)()
    before = rec.backward
    with pytest.raises(PassStateError, match=r"stage 3: unit 'lin': .* in backward state '.*' \(internal error\)"):
        getattr(rec, wrong)()
    assert rec.backward is before


def test_a_phase_view_reads_the_machine_and_cannot_move_it() -> None:
    machine = PhaseMachine()
    view = machine.view()
    machine.start_forward()
    assert view.phase is Phase.FORWARD
    assert not any(hasattr(view, t) for t in ("start_forward", "start_backward", "start_step", "finish_step"))
    with pytest.raises(AttributeError):
        view.phase = Phase.IDLE  # type: ignore[misc]
    assert isinstance(view, PhaseView) and machine.phase is Phase.FORWARD


def test_stage3_reads_the_engines_phase_and_keeps_only_its_pass_stage() -> None:
    engine = zero_offload.initialize(make_model(), CFG)
    rt = engine.runtime
    x, y = batch(0, 2)
    assert rt.phase is Phase.IDLE and rt.stage is PassStage.CLOSED
    loss = engine(x, y)
    assert rt.phase is engine.phase.phase is Phase.FORWARD and rt.stage is PassStage.FORWARD
    engine.backward(loss)
    # the pass closed at end_backward; the engine stays in BACKWARD until step()
    assert rt.phase is Phase.BACKWARD and rt.stage is PassStage.CLOSED
    assert all(r.backward is UnitBackward.FINISHED or (r.backward is UnitBackward.WAITING and r.unit.trainable is None)
               for r in rt._unit_pass)
    engine.step()
    assert rt.phase is Phase.IDLE
    engine.close()
