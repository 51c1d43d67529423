"""adam_step_flat: the native kernels on every ISA path this CPU has, against float64, torch,
the scalar oracle (bit for bit) and torch's own bf16/fp16 conversions."""
from __future__ import annotations

import warnings

import pytest
import torch

from adam_reference import (SIZES, assert_bits_equal, assert_close, isa_params, lr_schedule,
                            reference_adam)
from zero_offload import native
from zero_offload.optim import _native_adam, adam_step_flat

needs_native = pytest.mark.skipif(not _native_adam.available(), reason="native library not loaded")

MODES = {"adam": (0.0, False), "adam_l2": (0.1, False), "adamw": (0.1, True)}
LOWP = (torch.bfloat16, torch.float16)


def _state(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=gen), torch.zeros(n), torch.zeros(n)


def _grads(n: int, steps: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed + 1)
    return [torch.randn(n, generator=gen).to(dtype) for _ in range(steps)]


def _run(p, m, v, grads, lrs, *, mode: str, isa: str, out=None, grad_scale=1.0, threads=None):
    wd, decoupled = MODES[mode]
    for step, (g, lr) in enumerate(zip(grads, lrs), start=1):
        seen = adam_step_flat(p, g, m, v, step=step, lr=lr, beta1=0.9, beta2=0.999, eps=1e-8,
                              weight_decay=wd, decoupled=decoupled, grad_scale=grad_scale,
                              lowp_out=out, isa=isa, threads=threads)
        assert seen is False


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("isa", isa_params())
def test_twenty_scheduled_steps_match_float64(isa: str, n: int, mode: str) -> None:
    p0, m, v = _state(n, seed=n)
    p, grads, lrs = p0.clone(), _grads(n, 20, torch.float32, seed=n), lr_schedule(20)
    _run(p, m, v, grads, lrs, mode=mode, isa=isa)
    wd, decoupled = MODES[mode]
    rp, rm, rv = reference_adam(p0, grads, lrs, weight_decay=wd, decoupled=decoupled)
    assert_close(p, rp, "param")
    assert_close(m, rm, "exp_avg")
    assert_close(v, rv, "exp_avg_sq")


@pytest.mark.parametrize("isa", isa_params())
def test_million_elements_match_float64_and_torch_fused(isa: str) -> None:
    n, steps = 1_000_003, 3
    p0, m, v = _state(n, seed=3)
    p, grads, lrs = p0.clone(), _grads(n, steps, torch.float32, seed=3), lr_schedule(steps)
    _run(p, m, v, grads, lrs, mode="adamw", isa=isa)
    rp, rm, rv = reference_adam(p0, grads, lrs, weight_decay=0.1, decoupled=True)
    assert_close(p, rp, "param")
    assert_close(m, rm, "exp_avg")
    assert_close(v, rv, "exp_avg_sq")
    tp = torch.nn.Parameter(p0.clone())
    opt = torch.optim.AdamW([tp], lr=lrs[0], weight_decay=0.1, fused=True)
    for g, lr in zip(grads, lrs):
        opt.param_groups[0]["lr"] = lr
        tp.grad = g
        opt.step()
    assert_close(p, tp.detach(), "param")
    assert_close(m, opt.state[tp]["exp_avg"], "exp_avg")
    assert_close(v, opt.state[tp]["exp_avg_sq"], "exp_avg_sq")


@pytest.mark.parametrize("out_dtype", [None, torch.float32, *LOWP])
@pytest.mark.parametrize("grad_dtype", [torch.float32, *LOWP])
@pytest.mark.parametrize("isa", isa_params(include_scalar=False))
def test_vector_paths_equal_scalar_oracle_bit_for_bit(isa: str, grad_dtype, out_dtype) -> None:
    for n in (*SIZES, 70_001):
        for mode in MODES:
            results = []
            for path in ("scalar", isa):
                p, m, v = _state(n, seed=7)
                # Odd sizes write the copy one element into its buffer: the unaligned store path.
                out = None if out_dtype is None else torch.empty(n + 1, dtype=out_dtype)[n % 2:][:n]
                _run(p, m, v, _grads(n, 3, grad_dtype, seed=7), [1e-2, 5e-3, 2e-3], mode=mode,
                     isa=path, out=out, grad_scale=0.37)
                results.append((p, m, v, out))
            for name, a, b in zip(("param", "exp_avg", "exp_avg_sq", "lowp_out"), *results):
                if a is not None:
                    assert_bits_equal(b, a, f"{isa} vs scalar {name}, n={n}, {mode}")


@pytest.mark.parametrize("isa", isa_params())
def test_float32_out_is_the_updated_master_bit_for_bit(isa: str) -> None:
    # Aligned (streaming stores) and one element off (unaligned stores), whole vectors and tails.
    for n, shift in ((4096, 0), (4096, 1), (70_001, 0), (70_001, 1), (5, 1)):
        p, m, v = _state(n, seed=n)
        out = torch.full((n + 1,), float("nan"))[shift:][:n]
        _run(p, m, v, _grads(n, 2, torch.bfloat16, seed=n), [1e-2, 5e-3], mode="adamw", isa=isa, out=out)
        assert_bits_equal(out, p, f"float32 copy, n={n}, shift={shift}")
        assert out.data_ptr() != p.data_ptr()
    n = 1_000_003  # split between threads in blocks: every block writes its own part of the copy
    p, m, v = _state(n, seed=4)
    out = torch.full((n,), float("nan"))
    _run(p, m, v, _grads(n, 1, torch.float32, seed=4), [1e-3], mode="adamw", isa=isa, out=out, threads=3)
    assert_bits_equal(out, p, "float32 copy, 3 threads")


def _special_values(dtype: torch.dtype) -> torch.Tensor:
    """Values where conversions go wrong: ties, overflow, subnormals, signed zero, Inf, NaN."""
    tie_bf16 = [1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8)]            # halfway: round to even
    tie_f16 = [1 + 2**-11, 1 + 3 * 2**-11, 2**-24 * 0.5, 2**-24 * 1.5]
    big = [65504.0, 65519.99, 65520.0, 7e4, 3.0e38, -3.4e38]          # fp16 max, edges, overflow
    tiny = [6e-8, 2.9e-8, 3e-8, 1e-6, 6.1e-5, 1e-39, -1e-40, 1.1754942e-38]  # fp16/fp32 subnormals
    odd = [0.0, -0.0, float("inf"), float("-inf"), float("nan"), -float("nan")]
    gen = torch.Generator().manual_seed(11)
    spread = torch.randn(4000, generator=gen) * torch.logspace(-30, 30, 4000)
    return torch.cat([torch.tensor(tie_bf16 + tie_f16 + big + tiny + odd), spread])


@pytest.mark.parametrize("out_dtype", LOWP)
@pytest.mark.parametrize("isa", isa_params())
def test_lowp_out_equals_torch_conversion(isa: str, out_dtype: torch.dtype) -> None:
    # lr = 0 leaves the weights exactly as they are, so lowp_out is a pure conversion of them.
    p = _special_values(out_dtype)
    n = p.numel()
    before = p.clone()
    out = torch.empty(n, dtype=out_dtype)
    adam_step_flat(p, torch.ones(n), torch.zeros(n), torch.zeros(n), step=1, lr=0.0, beta1=0.9,
                   beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled=False, lowp_out=out, isa=isa)
    assert_bits_equal(p, before, "weights under lr=0")
    expected = p.to(out_dtype)
    nan = torch.isnan(p)
    assert torch.equal(torch.isnan(out), nan)
    assert_bits_equal(out[~nan], expected[~nan], f"{out_dtype} copy")
    # And after a real step, the copy is the conversion of the updated weights.
    p, m, v = _state(4097, seed=5)
    out = torch.empty(4097, dtype=out_dtype)
    _run(p, m, v, _grads(4097, 2, torch.float32, seed=5), [1e-2, 1e-2], mode="adamw", isa=isa, out=out)
    assert_bits_equal(out, p.to(out_dtype), f"{out_dtype} copy after steps")


@pytest.mark.parametrize("grad_dtype", LOWP)
@pytest.mark.parametrize("isa", isa_params())
def test_lowp_grads_are_converted_exactly(isa: str, grad_dtype: torch.dtype) -> None:
    # With beta1 = 0 torch's lerp makes the first moment g + 0 * (g - m) = g exactly (m = +0.0 so
    # that a -0.0 gradient keeps its sign: -0.0 - +0.0 = -0.0), so it shows the conversion in.
    g = _special_values(grad_dtype).to(grad_dtype)
    g = g[torch.isfinite(g)]
    n = g.numel()
    m = torch.zeros(n)
    adam_step_flat(torch.zeros(n), g, m, torch.zeros(n), step=1, lr=1e-3, beta1=0.0, beta2=0.999,
                   eps=1e-8, weight_decay=0.0, decoupled=False, isa=isa)
    assert_bits_equal(m, g.float(), f"{grad_dtype} gradient read as fp32")


def _poisoned(n: int, dtype: torch.dtype, where: int, kind: str) -> tuple[torch.Tensor, float]:
    g = torch.randn(n, generator=torch.Generator().manual_seed(2)).to(dtype)
    if kind == "scale_overflow":  # finite in its dtype, Inf once multiplied by grad_scale
        g[where] = torch.finfo(dtype).max
        return g, 1e35
    g[where] = float("inf") if kind == "inf" else float("nan")
    return g, 0.5


@pytest.mark.parametrize("kind", ["inf", "nan", "scale_overflow"])
@pytest.mark.parametrize("grad_dtype", [torch.float32, *LOWP])
@pytest.mark.parametrize("isa", isa_params())
def test_nonfinite_gradient_is_reported_and_nothing_changes(isa: str, grad_dtype, kind: str) -> None:
    for n, where in ((1, 0), (31, 30), (4097, 0), (4097, 2048), (4097, 4096), (200_003, 200_002)):
        g, scale = _poisoned(n, grad_dtype, where, kind)
        p, m, v = _state(n, seed=1)
        m.fill_(0.25)
        v.fill_(0.5)
        out = torch.full((n,), 3.0, dtype=torch.bfloat16)
        saved = [t.clone() for t in (p, m, v, out)]
        seen = adam_step_flat(p, g, m, v, step=4, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                              weight_decay=0.1, decoupled=True, grad_scale=scale, lowp_out=out,
                              check_finite=True, isa=isa, threads=2)
        assert seen is True, f"n={n} at {where}"
        for name, before, after in zip(("param", "exp_avg", "exp_avg_sq", "lowp_out"), saved, (p, m, v, out)):
            assert_bits_equal(after, before, f"{name} after a refused step (n={n}, at {where})")
        # Without the check the step runs and the bad value spreads into that weight, as in torch.
        assert adam_step_flat(p, g, m, v, step=4, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                              weight_decay=0.1, decoupled=True, grad_scale=scale, isa=isa) is False
        assert torch.isnan(p[where]) and torch.isfinite(p[:where]).all()


@pytest.mark.parametrize("isa", isa_params())
def test_check_finite_on_finite_gradients_changes_nothing_else(isa: str) -> None:
    results = []
    for check in (False, True):
        p, m, v = _state(4097, seed=9)
        g = _grads(4097, 1, torch.float16, seed=9)[0]
        assert adam_step_flat(p, g, m, v, step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                              weight_decay=0.0, decoupled=False, check_finite=check, isa=isa) is False
        results.append((p, m, v))
    for a, b in zip(*results):
        assert_bits_equal(b, a, "check_finite on finite gradients")


@needs_native
def test_thread_count_does_not_change_bits() -> None:
    n = 1_000_003  # odd, so the split edges and the tail never line up with a vector
    results = []
    for threads in (1, 2, 3, 7):
        p, m, v = _state(n, seed=4)
        out = torch.empty(n, dtype=torch.bfloat16)
        _run(p, m, v, _grads(n, 2, torch.bfloat16, seed=4), [1e-3, 1e-3], mode="adamw",
             isa=None, out=out, threads=threads)
        results.append((p, m, v, out))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert_bits_equal(b, a, "threads")


def _flat_args(n: int = 8) -> dict:
    return dict(param=torch.zeros(n), grad=torch.zeros(n), exp_avg=torch.zeros(n), exp_avg_sq=torch.zeros(n))


HYPER = dict(step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled=False)
_SHARED, _WIDE = torch.zeros(8), torch.zeros(16)  # one tensor as two arguments; overlapping views


@pytest.mark.parametrize("change, message", [
    (dict(param=torch.zeros(8, dtype=torch.bfloat16)), "param must be float32, got torch.bfloat16"),
    (dict(exp_avg_sq=torch.zeros(9)), "exp_avg_sq has 9 elements, param has 8"),
    (dict(grad=torch.zeros(8, dtype=torch.int32)), "grad must be float32, bfloat16 or float16, got torch.int32"),
    (dict(grad=torch.zeros(16)[::2]), "grad must be contiguous"),
    (dict(lowp_out=torch.zeros(8, dtype=torch.int32)), "lowp_out must be float32, bfloat16 or float16, got torch.int32"),
    (dict(lowp_out=torch.zeros(7)), "lowp_out has 7 elements, param has 8"),
    (dict(step=0), "step must be a whole number in [1, 2**63), got 0"),
    (dict(isa="sse9"), "isa='sse9': unknown ISA; choose one of scalar, avx2, avx512"),
    (dict(threads=-1), "threads=-1: expected a whole number >= 0"),
    (dict(step=2**64 + 5), "step must be a whole number in [1, 2**63)"),  # wrapped to step 5 in the ABI struct
    (dict(beta1=1.0), "invalid betas[0] 1.0"),
    (dict(lr=float("nan")), "invalid lr nan"),
    (dict(eps=-1.0), "invalid eps -1.0"),
    (dict(grad_scale=float("inf")), "invalid grad_scale inf"),
    (dict(exp_avg=_SHARED, exp_avg_sq=_SHARED), "exp_avg and exp_avg_sq overlap in memory"),
    (dict(param=_WIDE[:8], lowp_out=_WIDE[4:12]), "param and lowp_out overlap in memory"),
])
def test_bad_arguments_are_one_line_errors(change: dict, message: str) -> None:
    args = {**_flat_args(), **HYPER, **change}
    with pytest.raises(ValueError) as err:
        adam_step_flat(args.pop("param"), args.pop("grad"), args.pop("exp_avg"), args.pop("exp_avg_sq"), **args)
    assert message in str(err.value) and "\n" not in str(err.value)


@needs_native
def test_isa_this_cpu_lacks_is_refused_by_name() -> None:
    missing = [n for n in _native_adam.ISA_NAMES if n not in _native_adam.supported_isas()]
    if not missing:
        pytest.skip("this CPU runs every ISA path")
    with pytest.raises(_native_adam.IsaError, match=f"isa='{missing[-1]}': this CPU lacks .*; it can run scalar"):
        adam_step_flat(**_flat_args(), **HYPER, isa=missing[-1])


@needs_native
def test_environment_forces_and_validates_the_isa(monkeypatch: pytest.MonkeyPatch) -> None:
    _native_adam.default_isa.cache_clear()
    try:
        monkeypatch.setenv("ZERO_OFFLOAD_ISA", "scalar")
        assert _native_adam.default_isa() == "scalar"
        assert native.info()["cpu_adam"]["isa"] == "scalar"
        _native_adam.default_isa.cache_clear()
        monkeypatch.setenv("ZERO_OFFLOAD_ISA", "avx9")
        with pytest.raises(_native_adam.IsaError, match="ZERO_OFFLOAD_ISA='avx9': unknown ISA"):
            _native_adam.default_isa()
        assert "ZERO_OFFLOAD_ISA='avx9'" in native.info()["cpu_adam"]["error"]
    finally:
        monkeypatch.delenv("ZERO_OFFLOAD_ISA")
        _native_adam.default_isa.cache_clear()
    assert _native_adam.default_isa() == _native_adam.supported_isas()[-1]


def test_thread_count_comes_from_environment_or_affinity(monkeypatch: pytest.MonkeyPatch) -> None:
    import os
    _native_adam.default_threads.cache_clear()
    try:
        assert _native_adam.resolve_threads(None) == len(os.sched_getaffinity(0))
        _native_adam.default_threads.cache_clear()
        monkeypatch.setenv("ZERO_OFFLOAD_THREADS", "3")
        assert _native_adam.resolve_threads(0) == 3 and _native_adam.resolve_threads(5) == 5
        _native_adam.default_threads.cache_clear()
        monkeypatch.setenv("ZERO_OFFLOAD_THREADS", "two")
        with pytest.raises(ValueError, match="ZERO_OFFLOAD_THREADS='two': expected a whole number"):
            _native_adam.resolve_threads(None)
    finally:
        _native_adam.default_threads.cache_clear()


@needs_native
def test_info_reports_the_chosen_path() -> None:
    report = native.info()["cpu_adam"]
    assert report["available"] and report["isa"] in report["supported"]
    assert report["supported"][0] == "scalar"


def test_without_native_library_torch_path_runs_and_says_so_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_native_adam, "available", lambda: False)
    monkeypatch.setattr(_native_adam, "_warned", set())
    n = 4097
    p0, m, v = _state(n, seed=6)
    p, grads, lrs = p0.clone(), _grads(n, 3, torch.bfloat16, seed=6), lr_schedule(3)
    out = torch.empty(n, dtype=torch.float16)
    with pytest.warns(RuntimeWarning, match="adam_step_flat: native CPU Adam unavailable"):
        _run(p, m, v, grads[:1], lrs[:1], mode="adamw", isa=None, out=out)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _run_from(p, m, v, grads, lrs, first_step=2)
    rp, rm, rv = reference_adam(p0, grads, lrs, weight_decay=0.1, decoupled=True)
    assert_close(p, rp, "param")
    assert_close(m, rm, "exp_avg")
    g_bad = grads[0].clone()
    g_bad[5] = float("inf")
    before = p.clone()
    assert adam_step_flat(p, g_bad, m, v, step=4, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                          weight_decay=0.1, decoupled=True, check_finite=True) is True
    assert_bits_equal(p, before, "torch path after a refused step")


def _run_from(p, m, v, grads, lrs, first_step: int) -> None:
    for step in range(first_step, len(grads) + 1):
        adam_step_flat(p, grads[step - 1], m, v, step=step, lr=lrs[step - 1], beta1=0.9, beta2=0.999,
                       eps=1e-8, weight_decay=0.1, decoupled=True)


def test_a_gradient_may_share_memory_with_the_low_precision_copy() -> None:
    """Every path reads the gradient at an index before writing the copy there: allowed."""
    args = _flat_args()
    g = torch.ones(8)
    adam_step_flat(args["param"], g, args["exp_avg"], args["exp_avg_sq"], lowp_out=g, **HYPER)
    assert torch.equal(g, args["param"])


@needs_native
def test_pool_threads_take_the_callers_denormal_mode() -> None:
    """torch.set_flush_denormal sets the calling thread's MXCSR only: the pool's workers kept
    the mode they were spawned with, so some blocks were flushed and others not."""
    n = 1 << 21
    kw = dict(step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, decoupled=True)

    def flushed(threads: int) -> int:
        p = torch.full((n,), 0x000B5000, dtype=torch.int32).view(torch.float32)  # ~1e-39, a denormal
        adam_step_flat(p, torch.zeros(n), torch.zeros(n), torch.zeros(n), threads=threads, **kw)
        return int((p.view(torch.int32) == 0).sum())
    flushed(2)  # the pool's threads are made here, in the default mode
    torch.set_flush_denormal(True)
    try:
        assert [flushed(1), flushed(2), flushed(2)] == [n, n, n]
    finally:
        torch.set_flush_denormal(False)


@pytest.mark.parametrize("native", [True, False])
def test_runs_equal_one_call_per_run_bit_for_bit(native: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """adam_step_runs (each parameter group's runs of a shard in one call) is adam_step_flat over
    each run with that run's hyperparameters, on the native kernel and on the torch fallback."""
    from zero_offload.optim.flat import adam_step_runs

    if native and not _native_adam.available():
        pytest.skip("native library not loaded")
    if not native:
        monkeypatch.setattr(_native_adam, "available", lambda: False)
    g = torch.Generator().manual_seed(3)
    n, edges = 5000, [0, 7, 1030, 1031, 2048, 4999, 5000]
    hyper = [dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, decoupled=True, grad_scale=0.5),
             dict(lr=3e-2, beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.0, decoupled=True, grad_scale=0.5)]
    runs = [(lo, hi, hyper[i % 2]) for i, (lo, hi) in enumerate(zip(edges, edges[1:]))]
    state = [torch.randn(n, generator=g) for _ in range(2)] + [torch.rand(n, generator=g)]
    grad, out = torch.randn(n, generator=g), torch.empty(n, dtype=torch.bfloat16)
    a = [t.clone() for t in state]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fallback says once that it runs
        adam_step_runs(a[0], grad, a[1], a[2], runs, step=3, lowp_out=out)
        b, out_b = [t.clone() for t in state], torch.empty(n, dtype=torch.bfloat16)
        for lo, hi, h in runs:
            adam_step_flat(b[0][lo:hi], grad[lo:hi], b[1][lo:hi], b[2][lo:hi], step=3, lowp_out=out_b[lo:hi], **h)
    for x, y in zip(a + [out], b + [out_b]):
        assert torch.equal(x, y)


def _huge_grads(n: int) -> list[torch.Tensor]:
    """A first gradient with finite entries too large to square in fp32 (|g| > ~1.8e19, in the
    8-wide body and in the tail), then ordinary ones."""
    first = torch.ones(n)
    first[::3] = 3e19
    first[1::5] = -4e20  # (g * (1 - beta2)) * g = 1.6e38 still finite
    return [first] + [torch.full((n,), 0.5) for _ in range(3)]


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("isa", [*isa_params(), "torch"])
def test_huge_finite_gradient_keeps_the_second_moment_finite_as_torch_does(
        isa: str, mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernels computed (g*g)*(1-beta2): g*g overflowed to Inf for |g| > ~1.8e19, v became
    Inf and the weight never moved again. torch's addcmul computes (g*(1-beta2))*g."""
    if isa == "torch":
        monkeypatch.setattr(_native_adam, "available", lambda: False)
        monkeypatch.setattr(_native_adam, "_warned", {"adam_step_flat"})
    n, lrs = 19, [1e-2, 5e-3, 2e-3, 1e-3]
    p0, m, v = _state(n, seed=9)
    p, grads = p0.clone(), _huge_grads(n)
    _run(p, m, v, grads, lrs, mode=mode, isa=None if isa == "torch" else isa)
    assert torch.isfinite(v).all() and torch.isfinite(p).all()
    wd, decoupled = MODES[mode]
    tp = torch.nn.Parameter(p0.clone())
    opt = (torch.optim.AdamW if decoupled else torch.optim.Adam)([tp], lr=lrs[0], weight_decay=wd, foreach=False)
    for g, lr in zip(grads, lrs):
        opt.param_groups[0]["lr"] = lr
        tp.grad = g.clone()
        opt.step()
    assert_close(p, tp.detach(), "param")
    assert_close(m, opt.state[tp]["exp_avg"], "exp_avg")
    assert_close(v, opt.state[tp]["exp_avg_sq"], "exp_avg_sq")
    rp, rm, rv = reference_adam(p0, grads, lrs, weight_decay=wd, decoupled=decoupled)
    assert_close(p, rp, "param")
    assert_close(v, rv, "exp_avg_sq")
    if isa not in ("scalar", "torch"):  # the vector paths stay the scalar oracle, bit for bit
        q, mq, vq = p0.clone(), torch.zeros(n), torch.zeros(n)
        _run(q, mq, vq, grads, lrs, mode=mode, isa="scalar")
        for name, a, b in (("param", p, q), ("exp_avg", m, mq), ("exp_avg_sq", v, vq)):
            assert_bits_equal(a, b, f"{isa} vs scalar {name}")


def test_zero_threads_means_every_core_in_the_environment_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """threads=0 meant every core but ZERO_OFFLOAD_THREADS=0 was an error: one number, one meaning."""
    import os
    _native_adam.default_threads.cache_clear()
    try:
        monkeypatch.setenv("ZERO_OFFLOAD_THREADS", "0")
        assert _native_adam.resolve_threads(None) == _native_adam.resolve_threads(0) == len(os.sched_getaffinity(0))
        _native_adam.default_threads.cache_clear()
        monkeypatch.setenv("ZERO_OFFLOAD_THREADS", "-2")
        message = r"ZERO_OFFLOAD_THREADS='-2': expected a whole number >= 0 \(0 = all cores\)"
        with pytest.raises(ValueError, match=message):
            _native_adam.resolve_threads(None)
    finally:
        _native_adam.default_threads.cache_clear()
