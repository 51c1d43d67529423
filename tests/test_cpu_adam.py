"""CPUAdam / CPUAdamW as drop-ins for torch.optim.Adam / AdamW: schedules, state dicts, groups."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

from adam_reference import SIZES, assert_bits_equal, assert_close, isa_params, reference_adam
from zero_offload.optim import CPUAdam, CPUAdamW, _native_adam, adam_step_flat

needs_native = pytest.mark.skipif(not _native_adam.available(), reason="native library not loaded")


def _params(seed: int = 0, sizes=SIZES) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in sizes]


def _set_grads(params, step: int) -> None:
    gen = torch.Generator().manual_seed(1000 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)


def _schedule(opt: torch.optim.Optimizer, first: int) -> torch.optim.lr_scheduler.LRScheduler:
    # Warm-up then decay: the lr differs at every one of the 20 steps. A resumed run starts the
    # schedule at `first` (its groups carry torch's initial_lr from the state dict).
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5) * 0.9**s, last_epoch=first - 1)


def _train(params, opt, steps: int, first: int = 0) -> None:
    sched = _schedule(opt, first)
    for step in range(first, first + steps):
        _set_grads(params, step)
        opt.step()
        sched.step()


def _assert_state_close(ours_opt, ours_params, ref_opt, ref_params) -> None:
    for p, q in zip(ours_params, ref_params):
        assert_close(p.detach(), q.detach(), "param")
        mine, theirs = ours_opt.state[p], ref_opt.state[q]
        assert_close(mine["exp_avg"], theirs["exp_avg"], "exp_avg")
        assert_close(mine["exp_avg_sq"], theirs["exp_avg_sq"], "exp_avg_sq")
        assert float(mine["step"]) == float(theirs["step"])


@pytest.mark.parametrize("weight_decay", [0.0, 0.05])
@pytest.mark.parametrize("adamw", [False, True], ids=["adam", "adamw"])
@pytest.mark.parametrize("isa", isa_params())
def test_twenty_scheduled_steps_match_torch_and_float64(isa: str, adamw: bool, weight_decay: float) -> None:
    ours_params, ref_params = _params(), _params()
    start = [p.detach().clone() for p in ours_params]
    ours_cls, ref_cls = (CPUAdamW, torch.optim.AdamW) if adamw else (CPUAdam, torch.optim.Adam)
    ours = ours_cls(ours_params, lr=1e-2, weight_decay=weight_decay, isa=isa)
    ref = ref_cls(ref_params, lr=1e-2, weight_decay=weight_decay, foreach=False)
    _train(ours_params, ours, 20)
    _train(ref_params, ref, 20)
    _assert_state_close(ours, ours_params, ref, ref_params)
    lrs = [1e-2 * min(1.0, (s + 1) / 5) * 0.9**s for s in range(20)]
    for i, p in enumerate(ours_params):
        grads = []
        for step in range(20):
            _set_grads(ours_params, step)
            grads.append(ours_params[i].grad.clone())
        rp, rm, rv = reference_adam(start[i], grads, lrs, weight_decay=weight_decay, decoupled=adamw)
        assert_close(p.detach(), rp, "param")
        assert_close(ours.state[p]["exp_avg"], rm, "exp_avg")
        assert_close(ours.state[p]["exp_avg_sq"], rv, "exp_avg_sq")


def test_state_dict_has_torch_layout() -> None:
    ours_params, ref_params = _params(sizes=(3, 5)), _params(sizes=(3, 5))
    ours, ref = CPUAdamW(ours_params), torch.optim.AdamW(ref_params)
    _train(ours_params, ours, 1)
    _train(ref_params, ref, 1)
    mine, theirs = ours.state_dict(), ref.state_dict()
    assert mine["param_groups"][0].keys() == theirs["param_groups"][0].keys()
    for i in (0, 1):
        assert mine["state"][i].keys() == theirs["state"][i].keys()
        assert mine["state"][i]["step"].dtype == theirs["state"][i]["step"].dtype
        assert mine["state"][i]["step"].shape == theirs["state"][i]["step"].shape == ()


@pytest.mark.parametrize("isa", isa_params())
def test_state_dict_round_trip_mid_run(isa: str) -> None:
    straight_params = _params()
    straight = CPUAdamW(straight_params, lr=1e-2, weight_decay=0.05, isa=isa)
    _train(straight_params, straight, 20)

    first_params = _params()
    first = CPUAdamW(first_params, lr=1e-2, weight_decay=0.05, isa=isa)
    _train(first_params, first, 10)
    saved = copy.deepcopy(first.state_dict())
    resumed_params = [torch.nn.Parameter(p.detach().clone()) for p in first_params]
    resumed = CPUAdamW(resumed_params, lr=1e-2, weight_decay=0.05, isa=isa)
    resumed.load_state_dict(copy.deepcopy(saved))  # loading aliases the tensors, as in torch
    _train(resumed_params, resumed, 10, first=10)
    for p, q in zip(resumed_params, straight_params):
        assert_bits_equal(p.detach(), q.detach(), "resumed vs uninterrupted weights")
        assert_bits_equal(resumed.state[p]["exp_avg_sq"], straight.state[q]["exp_avg_sq"], "resumed v")

    # The same state dict drives torch's AdamW to the same place, and torch's drives ours.
    torch_params = [torch.nn.Parameter(p.detach().clone()) for p in first_params]
    torch_opt = torch.optim.AdamW(torch_params, lr=1e-2, weight_decay=0.05)
    torch_opt.load_state_dict(copy.deepcopy(saved))
    _train(torch_params, torch_opt, 10, first=10)
    _assert_state_close(resumed, resumed_params, torch_opt, torch_params)
    back_params = [torch.nn.Parameter(p.detach().clone()) for p in torch_params]
    back = CPUAdamW(back_params, isa=isa)
    back.load_state_dict(copy.deepcopy(torch_opt.state_dict()))
    assert back.param_groups[0]["weight_decay"] == 0.05


@needs_native
def test_hundred_tensors_in_one_call_equal_per_tensor_flat_steps() -> None:
    params = _params(sizes=[1000 + 37 * i for i in range(100)])
    flat_copies = [p.detach().clone() for p in params]
    opt = CPUAdamW(params, lr=1e-2, weight_decay=0.05, threads=3)
    moments = [(torch.zeros_like(t), torch.zeros_like(t)) for t in flat_copies]
    for step in range(1, 4):
        _set_grads(params, step)
        opt.step()
        for t, p, (m, v) in zip(flat_copies, params, moments):
            adam_step_flat(t, p.grad, m, v, step=step, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8,
                           weight_decay=0.05, decoupled=True, threads=1)
    for p, t, (m, v) in zip(params, flat_copies, moments):
        assert_bits_equal(p.detach(), t, "multi-tensor call vs one flat call per tensor")
        assert_bits_equal(opt.state[p]["exp_avg"], m, "exp_avg")


def test_param_groups_non_contiguous_params_and_missing_grads() -> None:
    gen = torch.Generator().manual_seed(5)
    base = torch.randn(6, 9, generator=gen)
    ours_params = [torch.nn.Parameter(base.clone().t()), torch.nn.Parameter(torch.randn(7, generator=gen)),
                   torch.nn.Parameter(torch.randn(4, generator=gen))]
    assert not ours_params[0].is_contiguous()
    ref_params = [torch.nn.Parameter(p.detach().clone()) for p in ours_params]
    groups = lambda ps: [{"params": ps[:1], "lr": 3e-3}, {"params": ps[1:], "weight_decay": 0.2}]  # noqa: E731
    ours, ref = CPUAdam(groups(ours_params), lr=1e-2), torch.optim.Adam(groups(ref_params), lr=1e-2)
    for step in range(3):
        for ps in (ours_params, ref_params):
            _set_grads(ps[:2], step)  # the last parameter never has a gradient
        ours.step()
        ref.step()
    _assert_state_close(ours, ours_params[:2], ref, ref_params[:2])
    assert ours_params[2] not in ours.state
    assert_bits_equal(ours_params[2].detach(), ref_params[2].detach(), "untouched parameter")


def test_closure_is_called_with_grad_enabled() -> None:
    p = torch.nn.Parameter(torch.ones(3))
    opt = CPUAdam([p], lr=0.1)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = (p * p).sum()
        loss.backward()
        return loss

    assert float(opt.step(closure).detach()) == 3.0
    assert (p.detach() < 1).all()


@pytest.mark.parametrize("kwargs, message", [
    (dict(amsgrad=True), "CPUAdam: amsgrad=True is not implemented"),
    (dict(maximize=True), "CPUAdam: maximize=True is not implemented"),
    (dict(lr=-1.0), "CPUAdam: invalid lr -1.0"),
    (dict(lr=float("inf")), "CPUAdam: invalid lr inf"),
    (dict(weight_decay=float("nan")), "CPUAdam: invalid weight_decay nan"),
    (dict(betas=(0.9, 1.0)), "CPUAdam: invalid betas[1] 1.0"),
    (dict(isa="neon"), "isa='neon': unknown ISA"),
])
def test_bad_options_are_one_line_errors(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError) as err:
        CPUAdam(_params(sizes=(3,)), **kwargs)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_non_float32_parameter_is_refused_before_anything_moves() -> None:
    good, bad = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
    opt = CPUAdam([good, bad])
    good.grad, bad.grad = torch.ones(3), torch.ones(3, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"CPUAdam: steps float32 CPU parameters, group 0 param 1 is torch.bfloat16"):
        opt.step()
    assert good not in opt.state and torch.equal(good.detach(), torch.ones(3))


def test_without_native_library_torch_fused_runs_and_says_so_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_native_adam, "available", lambda: False)
    monkeypatch.setattr(_native_adam, "_warned", set())
    ours_params, ref_params = _params(), _params()
    ours = CPUAdamW(ours_params, lr=1e-2, weight_decay=0.05)
    ref = torch.optim.AdamW(ref_params, lr=1e-2, weight_decay=0.05, fused=True)
    with pytest.warns(RuntimeWarning, match="CPUAdamW: native CPU Adam unavailable"):
        _train(ours_params, ours, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _train(ours_params, ours, 4, first=1)
    _train(ref_params, ref, 5)
    for p, q in zip(ours_params, ref_params):
        assert_bits_equal(p.detach(), q.detach(), "torch fused fallback vs torch fused")


@needs_native
def test_bench_adam_command_measures_every_case(capsys: pytest.CaptureFixture) -> None:
    import json

    from zero_offload import cli

    assert cli.main(["bench-adam", "--params", "40000", "--rounds", "1", "--threads", "1", "--pause-ms", "0", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["config"]["params"] == 40000 and report["config"]["threads"] == 1
    assert {"stream", "torch_fused", "torch_foreach", "ours_fp32", "torch_same_work", "ours_bf16",
            "cpu_adam_one", "cpu_adam_many"} <= report["rows"].keys()
    assert all(row["seconds"] > 0 for row in report["rows"].values())
    assert set(report["ratios"]) >= {"a_vs_torch_fused", "a_vs_bandwidth", "b_vs_torch_same_work", "c_many_vs_one"}


def test_a_state_dict_of_another_model_is_refused_not_stepped_out_of_bounds() -> None:
    """load_state_dict casts dtype and device only: moments of 2 elements for a parameter of
    1000 went to the kernel with the parameter's count (a segfault, before the check)."""
    small, big = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(1000))
    donor = CPUAdamW([small], lr=1e-2)
    small.grad = torch.ones(2)
    donor.step()
    opt = CPUAdamW([big], lr=1e-2)
    opt.load_state_dict(donor.state_dict())
    big.grad = torch.ones(1000)
    with pytest.raises(ValueError, match=r"param 0 \(1000 elements\) has exp_avg of 2 .*a state dict of another model"):
        opt.step()


def test_a_gradient_of_another_size_is_refused() -> None:
    """torch lets `p.grad.data` be swapped for a tensor of another size; the kernel then read
    past its end and wrote garbage into the weights, silently."""
    p = torch.nn.Parameter(torch.ones(1000))
    p.grad = torch.ones(1000)
    p.grad.data = torch.ones(3)
    with pytest.raises(ValueError, match="param 0 has 1000 elements, its gradient 3"):
        CPUAdamW([p], lr=1e-2).step()
    assert torch.equal(p.detach(), torch.ones(1000))


def test_betas_given_as_a_list_are_taken_as_torch_takes_them() -> None:
    """torch.optim.Adam accepts betas=[0.9, 0.999]; a cache on the hyperparameter check made it
    a TypeError (unhashable list) and grew by one entry per learning rate a scheduler set."""
    from zero_offload.optim import _native_adam

    p = torch.nn.Parameter(torch.ones(4))
    p.grad = torch.ones(4)
    CPUAdamW([p], lr=1e-2, betas=[0.9, 0.999]).step()
    assert not hasattr(_native_adam.check_hyper, "cache_info") and hasattr(_native_adam._lib, "cache_info")


def _pair(adamw: bool, isa: str, sizes=(5, 17), threads: int | None = None, **kwargs):
    """Ours and torch's optimizer over equal copies of the same parameters."""
    ours_params, ref_params = _params(sizes=sizes), _params(sizes=sizes)
    ours_cls, ref_cls = (CPUAdamW, torch.optim.AdamW) if adamw else (CPUAdam, torch.optim.Adam)
    return (ours_cls(ours_params, isa=isa, threads=threads, **kwargs), ours_params,
            ref_cls(ref_params, foreach=False, **kwargs), ref_params)


def _params_of(opt: torch.optim.Optimizer) -> list[torch.nn.Parameter]:
    return [p for group in opt.param_groups for p in group["params"]]


@pytest.mark.parametrize("source", [torch.optim.Adam, CPUAdam])
@pytest.mark.parametrize("isa", isa_params())
def test_adamw_stays_adamw_after_loading_an_adam_state_dict(isa: str, source) -> None:
    """torch.optim.AdamW.__setstate__ forces decoupled_weight_decay=True; CPUAdamW took the
    loaded False and went on as L2 Adam (weights ~3e-3 off torch's after one step)."""
    donor_params = _params(sizes=(5, 17))
    donor = source(donor_params, lr=1e-2, weight_decay=0.5)
    _train(donor_params, donor, 1)
    saved = donor.state_dict()
    ours_params = [torch.nn.Parameter(p.detach().clone()) for p in donor_params]
    ref_params = [torch.nn.Parameter(p.detach().clone()) for p in donor_params]
    ours, ref = CPUAdamW(ours_params, isa=isa), torch.optim.AdamW(ref_params, foreach=False)
    ours.load_state_dict(copy.deepcopy(saved))  # copies: loading aliases the donor's tensors
    ref.load_state_dict(copy.deepcopy(saved))
    assert ours.param_groups[0]["decoupled_weight_decay"] is True
    _train(ours_params, ours, 3, first=1)
    _train(ref_params, ref, 3, first=1)
    _assert_state_close(ours, ours_params, ref, ref_params)


@pytest.mark.parametrize("adamw", [False, True], ids=["adam", "adamw"])
@pytest.mark.parametrize("isa", isa_params())
def test_huge_finite_gradient_keeps_training_as_torch_does(isa: str, adamw: bool) -> None:
    """(g*g)*(1-beta2) overflowed to an infinite exp_avg_sq for |g| > ~1.8e19 and froze the
    weight for good; torch computes (g*(1-beta2))*g, which stays finite up to |g| ~5.8e20."""
    ours, ours_params, ref, ref_params = _pair(adamw, isa, sizes=(4,), lr=1e-2)
    for step in range(4):
        g = torch.tensor([1e19, -3e19, 4e20, 1.0]) if step == 0 else torch.ones(4)
        ours_params[0].grad, ref_params[0].grad = g.clone(), g.clone()
        ours.step()
        ref.step()
    assert torch.isfinite(ours.state[ours_params[0]]["exp_avg_sq"]).all()
    _assert_state_close(ours, ours_params, ref, ref_params)


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
@pytest.mark.parametrize("isa", isa_params())
def test_a_copied_or_pickled_optimizer_steps_as_torch_does(isa: str, how: str) -> None:
    """torch pickles defaults, state and param_groups only: the copy had no _isa or _threads and
    its first step raised AttributeError."""
    import pickle

    ours, ours_params, ref, ref_params = _pair(True, isa, lr=1e-2, weight_decay=0.05, threads=2)
    _train(ours_params, ours, 2)
    _train(ref_params, ref, 2)
    clone = copy.deepcopy if how == "deepcopy" else lambda o: pickle.loads(pickle.dumps(o))  # noqa: E731
    ours, ref = clone(ours), clone(ref)
    assert (ours._isa, ours._threads) == (isa, 2)
    ours_params, ref_params = _params_of(ours), _params_of(ref)
    _train(ours_params, ours, 3, first=2)
    _train(ref_params, ref, 3, first=2)
    _assert_state_close(ours, ours_params, ref, ref_params)


_OLD_TORCH_MISSING = ("decoupled_weight_decay", "foreach", "fused", "capturable", "differentiable",
                      "maximize", "amsgrad")


@pytest.mark.parametrize("adamw", [False, True], ids=["adam", "adamw"])
@pytest.mark.parametrize("isa", isa_params())
def test_a_state_dict_from_older_torch_loads_and_steps_as_torch_does(isa: str, adamw: bool) -> None:
    """Older torch wrote no decoupled_weight_decay (nor, further back, foreach, fused, ...):
    step() raised KeyError where torch.optim.Adam/AdamW fill in their defaults."""
    ours, ours_params, ref, ref_params = _pair(adamw, isa, lr=1e-2, weight_decay=0.05)
    _train(ref_params, ref, 2)
    saved = ref.state_dict()
    for key in _OLD_TORCH_MISSING:
        del saved["param_groups"][0][key]
    for p, q in zip(ours_params, ref_params):
        p.data.copy_(q.detach())
    ours.load_state_dict(copy.deepcopy(saved))
    ref.load_state_dict(copy.deepcopy(saved))
    assert ours.param_groups[0]["decoupled_weight_decay"] is adamw
    _train(ours_params, ours, 3, first=2)
    _train(ref_params, ref, 3, first=2)
    _assert_state_close(ours, ours_params, ref, ref_params)


def _spoil_dtype(opt, params) -> None:
    params[1].data = params[1].data.half()
    params[1].grad = params[1].grad.half()


@pytest.mark.parametrize("spoil, message", [
    (_spoil_dtype, r"CPUAdamW: steps float32 CPU parameters, group 1 param 0 is torch.float16"),
    (lambda opt, params: opt.param_groups[1].update(amsgrad=True), r"CPUAdamW: amsgrad=True is not implemented"),
    (lambda opt, params: opt.param_groups[1].update(lr=-1.0), r"CPUAdamW: invalid lr -1.0"),
    (lambda opt, params: opt.param_groups[1].update(betas=(0.9, 1.5)), r"CPUAdamW: invalid betas\[1\] 1.5"),
], ids=["dtype", "amsgrad", "lr", "betas"])
@pytest.mark.parametrize("isa", isa_params())
def test_a_step_refused_for_a_later_group_changes_no_group(isa: str, spoil, message: str) -> None:
    """Each group was checked just before it was stepped: a refusal in group 1 came after group
    0's weights, moments and step counts had moved."""
    groups = lambda ps: [{"params": ps[:1]}, {"params": ps[1:], "lr": 3e-3}]  # noqa: E731
    ours_params, ref_params = _params(sizes=(5, 7)), _params(sizes=(5, 7))
    ours = CPUAdamW(groups(ours_params), lr=1e-2, isa=isa)
    ref = torch.optim.AdamW(groups(ref_params), lr=1e-2, foreach=False)
    _train(ours_params, ours, 1)
    _train(ref_params, ref, 1)
    _set_grads(ours_params, 1)
    saved = copy.deepcopy((ours.state_dict(), [p.detach().clone() for p in ours_params]))
    spoil(ours, ours_params)
    with pytest.raises(ValueError, match=message):
        ours.step()
    state, weights = saved
    assert_bits_equal(ours_params[0].detach(), weights[0], "group 0 weights after a refused step")
    for key in ("exp_avg", "exp_avg_sq", "step"):
        assert torch.equal(ours.state[ours_params[0]][key], state["state"][0][key]), key
    # Once repaired the run goes on as torch's, which never saw the refused call.
    ours_params[1].data, ours_params[1].grad = weights[1].clone(), None
    ours.load_state_dict(state)
    _train(ours_params, ours, 3, first=1)
    _train(ref_params, ref, 3, first=1)
    _assert_state_close(ours, ours_params, ref, ref_params)


def test_a_bad_group_is_refused_when_added() -> None:
    opt = CPUAdamW(_params(sizes=(3,)))
    with pytest.raises(ValueError, match=r"CPUAdamW: invalid lr -1.0") as err:
        opt.add_param_group({"params": _params(seed=1, sizes=(4,)), "lr": -1.0})
    assert "\n" not in str(err.value) and len(opt.param_groups) == 1


@pytest.mark.parametrize("kwargs", [dict(foreach=True), dict(foreach=False), dict(fused=True), dict(fused=False)])
@pytest.mark.parametrize("adamw", [False, True], ids=["adam", "adamw"])
def test_torch_constructor_keywords_that_change_nothing_are_accepted(adamw: bool, kwargs: dict) -> None:
    """torch.optim.Adam(W) takes foreach/fused: code passing them raised TypeError here."""
    ours_params, ref_params = _params(sizes=(5, 17)), _params(sizes=(5, 17))
    ours_cls, ref_cls = (CPUAdamW, torch.optim.AdamW) if adamw else (CPUAdam, torch.optim.Adam)
    ours, ref = ours_cls(ours_params, lr=1e-2, **kwargs), ref_cls(ref_params, lr=1e-2, **kwargs)
    assert {k: ours.param_groups[0][k] for k in kwargs} == kwargs
    _train(ours_params, ours, 3)
    _train(ref_params, ref, 3)
    _assert_state_close(ours, ours_params, ref, ref_params)


@pytest.mark.parametrize("cls", [CPUAdam, CPUAdamW])
@pytest.mark.parametrize("kwargs, message", [
    (dict(capturable=True), "{}: capturable=True is not implemented"),
    (dict(differentiable=True), "{}: differentiable=True is not implemented"),
    (dict(amsgrad=True), "{}: amsgrad=True is not implemented"),
    (dict(lr=-1.0), "{}: invalid lr -1.0"),
    (dict(eps=float("nan")), "{}: invalid eps nan"),
])
def test_refusals_name_the_class_and_take_torch_keywords(cls, kwargs: dict, message: str) -> None:
    """The hyperparameter errors said "CPUAdam" for CPUAdamW too; capturable/differentiable
    were TypeErrors rather than refusals."""
    with pytest.raises(ValueError) as err:
        cls(_params(sizes=(3,)), **kwargs)
    assert message.format(cls.__name__) in str(err.value) and "\n" not in str(err.value)
