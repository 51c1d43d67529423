// Run-time CPU feature detection. A feature counts only when CPUID reports it and the OS has
// enabled the register state it needs (XGETBV), otherwise executing it faults.
#include "zo_cpuid.h"

#include <cpuid.h>

namespace {

uint64_t read_xcr0() {
  uint32_t eax = 0, edx = 0;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return (static_cast<uint64_t>(edx) << 32) | eax;
}

uint32_t detect() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return 0;
  uint32_t out = 0;
  const bool osxsave = c & (1u << 27);
  if (c & (1u << 20)) out |= ZO_CPU_SSE42;
  if (!osxsave) return out;
  const uint64_t xcr0 = read_xcr0();
  const bool ymm_ok = (xcr0 & 0x6) == 0x6;     // SSE + AVX state
  const bool zmm_ok = (xcr0 & 0xE6) == 0xE6;   // + opmask, ZMM_Hi256, Hi16_ZMM
  if (ymm_ok && (c & (1u << 12))) out |= ZO_CPU_FMA;
  if (ymm_ok && (c & (1u << 29))) out |= ZO_CPU_F16C;
  if (__get_cpuid_max(0, nullptr) < 7) return out;
  __cpuid_count(7, 0, a, b, c, d);
  if (ymm_ok && (b & (1u << 5))) out |= ZO_CPU_AVX2;
  if (zmm_ok && (b & (1u << 16))) out |= ZO_CPU_AVX512F;
  if (zmm_ok && (b & (1u << 17))) out |= ZO_CPU_AVX512DQ;
  if (zmm_ok && (b & (1u << 30))) out |= ZO_CPU_AVX512BW;
  if (zmm_ok && (b & (1u << 31))) out |= ZO_CPU_AVX512VL;
  unsigned a1 = 0, b1 = 0, c1 = 0, d1 = 0;
  __cpuid_count(7, 1, a1, b1, c1, d1);
  if (zmm_ok && (a1 & (1u << 5))) out |= ZO_CPU_AVX512_BF16;
  return out;
}

}  // namespace

extern "C" uint32_t zo_cpu_features(void) {
  static const uint32_t features = detect();
  return features;
}

extern "C" int zo_abi_version(void) { return 3; }  // 3: zo_adam_step reports non-finite parameters (2)
