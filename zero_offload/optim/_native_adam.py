"""The ctypes binding of the native CPU Adam (native/adam.h): structs, ISA and thread choice.

The ISA is chosen once per process: the best path the CPU supports, unless `ZERO_OFFLOAD_ISA`
(scalar|avx2|avx512) forces one; forcing a path the CPU lacks is a one-line error, never a
silent downgrade, so a benchmark or test always runs what it names. Threads default to every
core this process may run on; `ZERO_OFFLOAD_THREADS` or an explicit count overrides that (0 in
either means every core).
The library call releases the GIL (ctypes does so for every foreign call).
"""
from __future__ import annotations

import ctypes
import functools
import os
import warnings
from typing import Any, NoReturn, Sequence

import torch

from zero_offload import native
from zero_offload.optim.adamw import GRAD_SCALE, AdamWHyperparams
from zero_offload.optim.spec import check_number

ISA_NAMES = ("scalar", "avx2", "avx512")  # index = zo_adam_isa
ISA_NEEDS = {
    "scalar": (),
    "avx2": ("avx2", "fma", "f16c"),
    "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma", "f16c"),
}
GRAD_DTYPES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}  # zo_dtype
OUT_DTYPES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}  # the copy of the updated weights
# zo_adam_status codes >= 0: the step ran. NONFINITE_GRAD: check_finite saw an Inf/NaN gradient and
# wrote nothing; NONFINITE_PARAM: the update was written and left an Inf/NaN parameter.
OK, NONFINITE_GRAD, NONFINITE_PARAM = 0, 1, 2
_STATUS = {
    -1: "the ISA is unknown or this CPU cannot run it",
    -2: "a gradient or output dtype the kernel does not take",
    -3: "a null pointer, negative length, step < 1 or threads < 1",
}


class IsaError(ValueError):
    """A requested ISA path (argument or ZERO_OFFLOAD_ISA) that does not exist or cannot run here."""


class AdamTensor(ctypes.Structure):
    """zo_adam_tensor: one contiguous run and its own step count."""

    _fields_ = [
        ("param", ctypes.c_void_p), ("exp_avg", ctypes.c_void_p), ("exp_avg_sq", ctypes.c_void_p),
        ("grad", ctypes.c_void_p), ("lowp_out", ctypes.c_void_p),
        ("n", ctypes.c_int64), ("step", ctypes.c_int64),
        ("grad_dtype", ctypes.c_int32), ("out_dtype", ctypes.c_int32),
    ]


class AdamHyper(ctypes.Structure):
    """zo_adam_hyper: what one call shares (one param group)."""

    _fields_ = [
        ("lr", ctypes.c_double), ("beta1", ctypes.c_double), ("beta2", ctypes.c_double),
        ("eps", ctypes.c_double), ("weight_decay", ctypes.c_double), ("grad_scale", ctypes.c_double),
        ("decoupled", ctypes.c_int32), ("check_finite", ctypes.c_int32),
    ]


def check_hyper(owner: str, *, lr: Any, betas: Any, eps: Any, weight_decay: Any, grad_scale: Any = 1.0) -> None:
    """One-line errors, named after `owner`, for hyperparameters no Adam accepts: the spec's one
    check (optim/adamw.py, torch's ranges), and the per-call grad_scale."""
    def fail(name: str, value: Any, allowed: str) -> NoReturn:
        raise ValueError(f"{owner}: invalid {name} {value!r} ({allowed})")

    AdamWHyperparams(lr, betas, eps, weight_decay).check(fail)
    check_number("grad_scale", grad_scale, GRAD_SCALE, fail)


@functools.cache
def _lib() -> ctypes.CDLL | None:
    """The native library with our signatures declared, or None (load_reason() says why)."""
    handle = native.lib()
    if handle is None or not hasattr(handle, "zo_adam_step"):
        return None
    handle.zo_adam_step.argtypes = [ctypes.POINTER(AdamTensor), ctypes.c_int64,
                                    ctypes.POINTER(AdamHyper), ctypes.c_int32, ctypes.c_int32]
    handle.zo_adam_step.restype = ctypes.c_int32
    handle.zo_adam_isa_supported.argtypes = [ctypes.c_int32]
    for name in ("zo_adam_isa_supported", "zo_adam_avx512_uses_bf16_insn", "zo_adam_pool_threads"):
        getattr(handle, name).restype = ctypes.c_int32
    return handle


def available() -> bool:
    """Whether the native kernels can run in this process."""
    return _lib() is not None


def load_reason() -> str:
    """Why the native kernels are not available (empty when they are)."""
    if available():
        return ""
    return native.load_error() or "the native library has no zo_adam_step (rebuild: make native)"


def supported_isas() -> list[str]:
    """The ISA paths this CPU can run, slowest first."""
    if not available():
        return []
    return [name for i, name in enumerate(ISA_NAMES) if _lib().zo_adam_isa_supported(i)]


def _missing_features(name: str) -> list[str]:
    have = native.cpu_features()
    return [feature for feature in ISA_NEEDS[name] if not have.get(feature, False)]


def check_isa(name: str, source: str) -> str:
    """`name` if this machine can run it, else an IsaError naming `source` and what is missing."""
    if name not in ISA_NAMES:
        raise IsaError(f"{source}={name!r}: unknown ISA; choose one of {', '.join(ISA_NAMES)}")
    if not available():
        raise IsaError(f"{source}={name!r}: the native library is not available ({load_reason()})")
    if name not in supported_isas():
        missing = ", ".join(_missing_features(name)) or "CPU support"
        raise IsaError(f"{source}={name!r}: this CPU lacks {missing}; "
                       f"it can run {', '.join(supported_isas())}")
    return name


@functools.cache
def default_isa() -> str:
    """The path chosen once for this process: ZERO_OFFLOAD_ISA if set, else the fastest supported."""
    forced = os.environ.get("ZERO_OFFLOAD_ISA", "").strip()
    if forced:
        return check_isa(forced, "ZERO_OFFLOAD_ISA")
    isas = supported_isas()
    return isas[-1] if isas else "scalar"


def resolve_isa(isa: str | None) -> str:
    """An explicit ISA (checked), or the process default."""
    return default_isa() if isa is None else check_isa(isa, "isa")


@functools.cache
def default_threads() -> int:
    """ZERO_OFFLOAD_THREADS if set, else every core this process may run on (read once).

    0 means every core, as `threads=0` and config.optimizer.threads do, so one number means
    the same thing wherever it is written."""
    raw = os.environ.get("ZERO_OFFLOAD_THREADS", "").strip()
    if not raw.isdigit() and raw:
        raise ValueError(f"ZERO_OFFLOAD_THREADS={raw!r}: expected a whole number >= 0 (0 = all cores)")
    return int(raw) if raw and int(raw) > 0 else len(os.sched_getaffinity(0))


def resolve_threads(threads: int | None) -> int:
    """An explicit thread count (None or 0 mean the default, as in config.optimizer.threads)."""
    if threads is None or threads == 0:
        return default_threads()
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 0:
        raise ValueError(f"threads={threads!r}: expected a whole number >= 0 (0 = all cores)")
    return threads


def make_tensor(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                exp_avg_sq: torch.Tensor, step: int, lowp_out: torch.Tensor | None) -> AdamTensor:
    """The descriptor of one run; the caller has checked dtypes, devices, sizes and contiguity."""
    out_ptr = lowp_out.data_ptr() if lowp_out is not None else None
    out_code = OUT_DTYPES[lowp_out.dtype] if lowp_out is not None else 0
    return AdamTensor(param.data_ptr(), exp_avg.data_ptr(), exp_avg_sq.data_ptr(), grad.data_ptr(),
                      out_ptr, param.numel(), int(step), GRAD_DTYPES[grad.dtype], out_code)


def make_hyper(*, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
               decoupled: bool, grad_scale: float = 1.0, check_finite: bool = False) -> AdamHyper:
    """The hyperparameters of one call."""
    return AdamHyper(float(lr), float(beta1), float(beta2), float(eps), float(weight_decay),
                     float(grad_scale), int(bool(decoupled)), int(bool(check_finite)))


def step(items: Sequence[AdamTensor], hyper: AdamHyper, *, isa: str, threads: int) -> int:
    """Run zo_adam_step; its status: OK, NONFINITE_GRAD (check_finite saw a non-finite gradient:
    nothing was written) or NONFINITE_PARAM (written; an updated parameter is Inf/NaN)."""
    array = (AdamTensor * len(items))(*items)
    rc = _lib().zo_adam_step(array, len(items), ctypes.byref(hyper), ISA_NAMES.index(isa), threads)
    if rc < 0:
        raise ValueError(f"zo_adam_step refused the call: {_STATUS.get(rc, f'status {rc}')}")
    return rc


_warned: set[str] = set()


def warn_fallback_once(what: str) -> None:
    """Say once per process and caller that the torch path runs instead of the native kernel."""
    if what in _warned:
        return
    _warned.add(what)
    warnings.warn(f"{what}: native CPU Adam unavailable ({load_reason()}); using the torch path",
                  RuntimeWarning, stacklevel=3)


def describe() -> dict[str, Any]:
    """The `cpu_adam` entry of zero_offload.native.info()."""
    if not available():
        return {"available": False, "reason": load_reason(), "fallback": "torch"}
    out: dict[str, Any] = {"available": True, "supported": supported_isas(),
                           "forced_by": "ZERO_OFFLOAD_ISA" if os.environ.get("ZERO_OFFLOAD_ISA") else None,
                           "avx512_bf16_instructions": bool(_lib().zo_adam_avx512_uses_bf16_insn()),
                           "pool_threads": _lib().zo_adam_pool_threads()}
    try:
        out["isa"] = default_isa()
        out["threads"] = default_threads()
    except ValueError as exc:
        out["error"] = str(exc)
    return out


native.register_info("cpu_adam", describe)
