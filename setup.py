"""Build and install zero_offload.

The native library is a plain C ABI (no torch, no Python API) so one build serves every torch
version and nothing compiles at import time. Each instruction-set file gets its own flags, chosen
by its name, so no AVX-512 code can leak into the baseline path; the CPU picks the path at run
time. A failed native build warns and installs the pure-PyTorch package anyway.
"""
from __future__ import annotations

import glob
import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

BASE_FLAGS = ["-O3", "-fPIC", "-std=c++17", "-pthread", "-Wall"]
ISA_FLAGS = {
    "_avx2.cpp": ["-mavx2", "-mfma", "-mf16c"],
    "_avx512.cpp": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mfma", "-mf16c"],
    "_sse42.cpp": ["-msse4.2"],
}


def flags_for(source: str) -> list[str]:
    """Baseline flags plus the ISA flags its file name asks for."""
    for suffix, extra in ISA_FLAGS.items():
        if source.endswith(suffix):
            return BASE_FLAGS + extra
    return BASE_FLAGS


class BuildNative(build_ext):
    """Compile native/*.cpp file by file with per-file flags into one shared library."""

    def build_extension(self, ext: Extension) -> None:
        try:
            self._build(ext)
        except Exception as exc:  # the package must install and import without it
            print(f"WARNING: zero_offload native library not built ({exc}); "
                  "pure-PyTorch fallbacks will run", file=sys.stderr)

    def _build(self, ext: Extension) -> None:
        objects: list[str] = []
        for src in ext.sources:
            objects += self.compiler.compile([src], output_dir=self.build_temp, include_dirs=["native"],
                                             extra_postargs=flags_for(src))
        self.compiler.link_shared_object(objects, self.get_ext_fullpath(ext.name), target_lang="c++",
                                         extra_postargs=["-pthread", "-shared"], libraries=["stdc++"])


if __name__ == "__main__":  # pip's build backend runs this file as __main__ too; the tests import the flags
    sources = sorted(glob.glob(os.path.join("native", "*.cpp")))
    setup(
        ext_modules=[Extension("zero_offload._zo_native", sources=sources, language="c++", optional=True)],
        cmdclass={"build_ext": BuildNative},
    )
