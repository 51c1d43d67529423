"""The AVX-512 path, run on hosts without AVX-512: native/adam_avx512.cpp under SIMDe emulation.

tests/native_emulated/build.py compiles the whole native library with that one file's AVX-512
intrinsics emulated over AVX2 halves (rounding as the real instructions do) and the AVX-512 CPU
bits added, and the CPU Adam tests' avx512 cases then run against it: bit-equality with the
scalar oracle, every dtype and tail, the non-finite checks, and the distance from float64 against
torch's fused AdamW. Both bf16 conversions run: the AVX512-BF16 instruction and the integer one.
On an AVX-512 host the same cases also run natively, in their own files.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

from native_emulated import build
from zero_offload import native

HERE = os.path.dirname(os.path.abspath(__file__))
# What the library that loaded says: its path, the ISA paths it offers, its bf16 conversion.
PROBE = ("from zero_offload import native; from zero_offload.optim import _native_adam as a; "
         "print(native.info()['path'], a.supported_isas(), native.lib().zo_adam_avx512_uses_bf16_insn())")
ISA_TESTS = ["test_flat_adam.py", "test_cpu_adam.py", "test_adam_fidelity.py", "test_nonfinite_step.py"]

pytestmark = [
    pytest.mark.skipif(not all(native.cpu_features().get(f, False) for f in build.HOST_FEATURES),
                       reason="the emulation runs AVX-512 as AVX2 halves: this CPU lacks AVX2, FMA or F16C"),
    pytest.mark.skipif(shutil.which(build.CXX) is None, reason=f"no C++ compiler ({build.CXX})"),
    pytest.mark.skipif(build.simde_include() is None, reason="simde-py not installed (a test dependency)"),
]


@pytest.fixture(scope="module")
def emulated_lib(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build.build(str(tmp_path_factory.mktemp("emulated-avx512")))


def _env(lib: str, bf16_insn: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("ZERO_OFFLOAD_ISA", "ZERO_OFFLOAD_NATIVE")}
    env.update(ZERO_OFFLOAD_NATIVE_PATH=lib, ZO_EMULATED_BF16="1" if bf16_insn else "0")
    return env


@pytest.mark.parametrize("bf16_insn", [True, False], ids=["bf16-insn", "bf16-integer"])
def test_avx512_cases_pass_on_the_emulated_path(emulated_lib: str, bf16_insn: bool) -> None:
    env = _env(emulated_lib, bf16_insn)
    probe = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0, probe.stderr[-3000:]
    assert probe.stdout.split() == [emulated_lib, "['scalar',", "'avx2',", "'avx512']", str(int(bf16_insn))], probe.stdout
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "avx512", "-rs",
                          *ISA_TESTS], cwd=HERE, env=env, capture_output=True, text=True, timeout=600)
    summary = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else ""
    assert run.returncode == 0, f"emulated avx512 cases failed ({summary}):\n{run.stdout[-6000:]}{run.stderr[-2000:]}"
    passed = re.search(r"(\d+) passed", summary)
    assert passed and int(passed.group(1)) > 0 and "skipped" not in summary, summary
