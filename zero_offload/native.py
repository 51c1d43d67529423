"""Loading the native library, late and clearly.

The library is optional: every kernel has a pure-PyTorch fallback. So a missing or broken
build never fails `import zero_offload`; it is recorded here, and `info()` (and
`zero-offload info`) says what loaded, what did not and why. Modules that own a native
mechanism declare their own ctypes signatures on `lib()` and add a line to `info()` through
`register_info`.

Environment:
  ZERO_OFFLOAD_NATIVE=0          do not load the library (the fallback paths run)
  ZERO_OFFLOAD_NATIVE_PATH=FILE  load this file instead of the one installed with the package
"""
from __future__ import annotations

import ctypes
import glob
import os
from typing import Any, Callable

ABI_VERSION = 3  # native/cpuid.cpp; 2: the CPU Adam takes an f32 copy out (ZO_DTYPE_F32); 3: it reports non-finite parameters

# Bit numbers of native/zo_cpuid.h; part of the ABI.
CPU_FEATURE_BITS = {
    "avx2": 0, "fma": 1, "f16c": 2, "avx512f": 3, "avx512bw": 4,
    "avx512_bf16": 5, "avx512vl": 6, "avx512dq": 7, "sse4_2": 8,
}

_state: dict[str, Any] = {"tried": False, "lib": None, "path": None, "error": None}
_info_hooks: dict[str, Callable[[], dict]] = {}


def _default_path() -> str | None:
    here = os.path.dirname(os.path.abspath(__file__))
    found = sorted(glob.glob(os.path.join(here, "_zo_native*.so")))
    return found[0] if found else None


def _load() -> None:
    _state["tried"] = True
    if os.environ.get("ZERO_OFFLOAD_NATIVE", "1") == "0":
        _state["error"] = "disabled by ZERO_OFFLOAD_NATIVE=0"
        return
    path = os.environ.get("ZERO_OFFLOAD_NATIVE_PATH") or _default_path()
    _state["path"] = path
    if path is None:
        _state["error"] = "no _zo_native*.so next to the package (the native build failed or was skipped at install)"
        return
    try:
        lib = ctypes.CDLL(path)
        lib.zo_abi_version.restype = ctypes.c_int
        lib.zo_cpu_features.restype = ctypes.c_uint32
        abi = lib.zo_abi_version()
    except (OSError, AttributeError) as exc:
        _state["error"] = f"cannot load {path}: {exc}"
        return
    if abi != ABI_VERSION:
        _state["error"] = f"{path} has ABI version {abi}, this package needs {ABI_VERSION}: reinstall"
        return
    _state["lib"] = lib


def lib() -> ctypes.CDLL | None:
    """The loaded native library, or None (then `load_error()` says why)."""
    if not _state["tried"]:
        _load()
    return _state["lib"]


def load_error() -> str | None:
    """Why the native library is not loaded, or None when it is."""
    lib()
    return _state["error"]


def _features_from_proc() -> set[str]:
    """CPU flags as the kernel reports them; used only to describe a machine without the library."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_features() -> dict[str, bool]:
    """Which dispatchable CPU features this machine has (CPUID + OS support when native loads)."""
    handle = lib()
    if handle is not None:
        mask = handle.zo_cpu_features()
        return {name: bool(mask >> bit & 1) for name, bit in CPU_FEATURE_BITS.items()}
    flags = _features_from_proc()
    return {name: name in flags for name in CPU_FEATURE_BITS}


def register_info(name: str, fn: Callable[[], dict]) -> None:
    """Let a native-backed mechanism (CPU Adam, async I/O) report its choices in `info()`."""
    _info_hooks[name] = fn


def _import_mechanisms() -> None:
    # Importing them runs their register_info calls; a failure is reported, never raised.
    import importlib

    for module in ("zero_offload.optim._native_adam", "zero_offload.io.aio"):
        try:
            importlib.import_module(module)
        except ImportError as exc:
            _info_hooks.setdefault(module.rsplit(".", 1)[-1], lambda exc=exc: {"error": str(exc)})


def info() -> dict[str, Any]:
    """What loaded, what did not and why, and what each mechanism chose."""
    handle = lib()
    out: dict[str, Any] = {
        "loaded": handle is not None,
        "path": _state["path"],
        "error": _state["error"],
        "cpu_features": cpu_features(),
    }
    _import_mechanisms()
    for name, fn in sorted(_info_hooks.items()):
        try:
            out[name] = fn()
        except Exception as exc:  # a broken mechanism must not hide the others
            out[name] = {"error": f"{type(exc).__name__}: {exc}"}
    return out
