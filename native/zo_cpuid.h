// CPU feature detection for run-time dispatch. The bits are part of the C ABI that
// zero_offload/native.py reads; never renumber them.
#pragma once
#include <cstdint>

enum zo_cpu_feature : uint32_t {
  ZO_CPU_AVX2 = 1u << 0,
  ZO_CPU_FMA = 1u << 1,
  ZO_CPU_F16C = 1u << 2,
  ZO_CPU_AVX512F = 1u << 3,
  ZO_CPU_AVX512BW = 1u << 4,
  ZO_CPU_AVX512_BF16 = 1u << 5,
  ZO_CPU_AVX512VL = 1u << 6,
  ZO_CPU_AVX512DQ = 1u << 7,
  ZO_CPU_SSE42 = 1u << 8,
};

extern "C" {
// Bitmask of zo_cpu_feature that the CPU has AND the OS saves (XCR0), so a set bit is usable.
uint32_t zo_cpu_features(void);
// Bumped whenever an exported signature changes; the Python side refuses a mismatch.
int zo_abi_version(void);
}
