// The emulated build's CPU features: the host's, plus the AVX-512 bits, so the dispatcher
// (native/adam_dispatch.cpp, unchanged) offers the avx512 path that avx512_on_avx2.h makes
// runnable. native/cpuid.cpp is compiled beside this with its zo_cpu_features renamed to
// zo_host_cpu_features. ZO_EMULATED_BF16=0 leaves out AVX512-BF16 (also on a host that has
// it), so the kernel's integer bf16 rounding runs instead of the instruction's.
#include <cstdlib>
#include <cstring>

#include "zo_cpuid.h"

extern "C" uint32_t zo_host_cpu_features(void);

extern "C" uint32_t zo_cpu_features(void) {
  const char* bf16 = std::getenv("ZO_EMULATED_BF16");
  uint32_t avx512 = ZO_CPU_AVX512F | ZO_CPU_AVX512BW | ZO_CPU_AVX512VL | ZO_CPU_AVX512DQ;
  uint32_t host = zo_host_cpu_features();
  if (bf16 == nullptr || std::strcmp(bf16, "0") != 0) avx512 |= ZO_CPU_AVX512_BF16;
  else host &= ~static_cast<uint32_t>(ZO_CPU_AVX512_BF16);
  return host | avx512;
}
