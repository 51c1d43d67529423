"""Build the native library with its AVX-512 path emulated on an AVX2 host (tests only).

Every file of native/ is compiled with the package's flags (setup.py's; the AVX2 ones for all),
except two:
adam_avx512.cpp gets avx512_on_avx2.h force-included (SIMDe's AVX-512 over AVX2 halves), and
cpuid.cpp's zo_cpu_features is renamed so that cpuid_avx512.cpp can add the AVX-512 bits. The
dispatcher, the ABI and the Python side are the real ones; zero_offload loads the result through
ZERO_OFFLOAD_NATIVE_PATH. Builds are cached by a hash of the sources, flags and compiler.
"""
from __future__ import annotations

import glob
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
NATIVE = os.path.join(ROOT, "native")
CXX = os.environ.get("CXX", "g++")


def _package_flags() -> list[str]:
    """setup.py's baseline flags, plus the AVX2 file's ISA flags (and SSE4.2) for every file."""
    spec = importlib.util.spec_from_file_location("zo_setup", os.path.join(ROOT, "setup.py"))
    setup = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(setup)
    return [*setup.BASE_FLAGS, *setup.ISA_FLAGS["_avx2.cpp"], *setup.ISA_FLAGS["_sse42.cpp"], "-Wno-psabi",
            "-I", NATIVE]


FLAGS = _package_flags()
HOST_FEATURES = ("avx2", "fma", "f16c", "sse4_2")


def simde_include() -> str | None:
    """SIMDe's include folder from the simde-py package, or None when it is not installed."""
    try:
        import simde_py
    except ImportError:
        return None
    return simde_py.get_include()


def _jobs(simde: str) -> list[tuple[str, list[str]]]:
    """(source, extra flags) for each translation unit of the emulated library."""
    prelude = os.path.join(HERE, "avx512_on_avx2.h")
    jobs = []
    for src in sorted(glob.glob(os.path.join(NATIVE, "*.cpp"))):
        extra: list[str] = []
        if src.endswith("adam_avx512.cpp"):
            extra = ["-ffp-contract=off", "-I", simde, "-include", prelude]
        elif src.endswith("cpuid.cpp"):
            extra = ["-Dzo_cpu_features=zo_host_cpu_features"]
        jobs.append((src, extra))
    jobs.append((os.path.join(HERE, "cpuid_avx512.cpp"), []))
    return jobs


def _key(jobs: list[tuple[str, list[str]]]) -> str:
    digest = hashlib.sha256(subprocess.run([CXX, "--version"], capture_output=True, text=True).stdout.encode())
    for path in [*(src for src, _ in jobs), *glob.glob(os.path.join(NATIVE, "*.h")),
                 os.path.join(HERE, "avx512_on_avx2.h")]:
        with open(path, "rb") as f:
            digest.update(path.encode() + f.read())
    digest.update(repr((FLAGS, jobs)).encode())
    return digest.hexdigest()[:16]


def _compile(src: str, extra: list[str], out_dir: str) -> str:
    obj = os.path.join(out_dir, os.path.basename(src) + ".o")
    proc = subprocess.run([CXX, *FLAGS, *extra, "-c", src, "-o", obj], capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"compiling {src} for the emulated AVX-512 build failed:\n{proc.stderr[-4000:]}")
    return obj


def build(cache_dir: str | None = None) -> str:
    """The emulated library's path, built unless a build of the same inputs is cached."""
    simde = simde_include()
    if simde is None:
        raise RuntimeError("simde-py is not installed (pip install simde-py): the emulated build needs SIMDe")
    jobs = _jobs(simde)
    out_dir = os.path.join(cache_dir or os.path.join(ROOT, "build", "emulated-avx512"), _key(jobs))
    lib = os.path.join(out_dir, "libzo_emulated_avx512.so")
    if os.path.exists(lib):
        return lib
    tmp = out_dir + f".tmp{os.getpid()}"
    os.makedirs(tmp, exist_ok=True)
    try:
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            objects = list(pool.map(lambda job: _compile(job[0], job[1], tmp), jobs))
        proc = subprocess.run([CXX, "-shared", "-pthread", "-o", os.path.join(tmp, os.path.basename(lib)),
                               *objects], capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError(f"linking the emulated AVX-512 build failed:\n{proc.stderr[-4000:]}")
        os.replace(tmp, out_dir)  # atomic: a concurrent build's folder wins or this one does
    except OSError:
        if not os.path.exists(lib):
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return lib


if __name__ == "__main__":
    print(build(sys.argv[1] if len(sys.argv) > 1 else None))
