// Force-included (-include) before native/adam_avx512.cpp to run that file, unchanged, on an
// AVX2 host: SIMDe's portable AVX-512 types and intrinsics stand in for the real ones, so CI
// checks the AVX-512 path's arithmetic on hosts without AVX-512. Each 512-bit operation that
// rounds runs as two native 256-bit halves (_mm256_fmadd_ps, _mm256_div_ps, ...), so it
// rounds exactly as the AVX-512 instruction does; the #errors below refuse any build where
// SIMDe would fall back to something else. The five intrinsics SIMDe 0.8.2 lacks are written
// here from the Intel SDM's definitions, and so are the four masked loads and stores the kernel
// uses: SIMDe's read and write all 64 bytes (its masked store writes zeros to masked-off lanes),
// where the instruction never touches a masked-off element; the tails depend on that.
#pragma once
#include <immintrin.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>

#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>

#if defined(SIMDE_X86_AVX512F_NATIVE)
#error "built with AVX-512 enabled: this emulation is for hosts without it"
#endif
#if !defined(SIMDE_X86_AVX2_NATIVE) || !defined(SIMDE_X86_FMA_NATIVE) || !defined(SIMDE_X86_F16C_NATIVE)
#error "needs -mavx2 -mfma -mf16c: the 512-bit operations must run as native 256-bit halves"
#endif
#if !SIMDE_NATURAL_VECTOR_SIZE_LE(256)
#error "SIMDe's natural vector size must be 256 bits, so 512-bit arithmetic splits into AVX2 halves"
#endif

namespace zo_emulated {

inline uint32_t bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}

// VFPCLASSPS: bit 0 QNaN, 1 +0, 2 -0, 3 +Inf, 4 -Inf, 5 denormal, 6 finite negative, 7 SNaN.
inline __mmask16 fpclass_ps_mask(simde__m512 x, int imm) {
  alignas(64) float f[16];
  simde_mm512_store_ps(f, x);
  __mmask16 out = 0;
  for (int i = 0; i < 16; ++i) {
    const uint32_t u = bits(f[i]), exponent = (u >> 23) & 0xff, mantissa = u & 0x7fffff;
    const bool negative = u >> 31, nan = exponent == 0xff && mantissa != 0;
    int cls = 0;
    if (nan) cls |= (mantissa & 0x400000) ? 0x01 : 0x80;
    if (exponent == 0 && mantissa == 0) cls |= negative ? 0x04 : 0x02;
    if (exponent == 0xff && mantissa == 0) cls |= negative ? 0x10 : 0x08;
    if (exponent == 0 && mantissa != 0) cls |= 0x20;
    if (negative && !nan && exponent != 0xff) cls |= 0x40;
    if (cls & imm) out |= static_cast<__mmask16>(1u << i);
  }
  return out;
}

// VCVTNEPS2BF16: round to nearest even, NaN quieted and truncated, denormal inputs read as
// zero (the property the kernel steers around).
inline __m256bh cvtneps_pbh(simde__m512 x) {
  alignas(64) float f[16];
  simde_mm512_store_ps(f, x);
  uint16_t h[16];
  for (int i = 0; i < 16; ++i) {
    const uint32_t u = bits(f[i]);
    if ((u & 0x7f800000) == 0x7f800000 && (u & 0x7fffff)) {
      h[i] = static_cast<uint16_t>((u >> 16) | 0x40);
    } else if ((u & 0x7f800000) == 0) {
      h[i] = static_cast<uint16_t>((u >> 16) & 0x8000);
    } else {
      h[i] = static_cast<uint16_t>((u + 0x7fff + ((u >> 16) & 1)) >> 16);
    }
  }
  __m256bh out;
  std::memcpy(&out, h, sizeof out);
  return out;
}

// VCVTPS2PH zmm: the same conversion as F16C's, on each 256-bit half.
#define ZO_EMULATED_CVTPS_PH(x, rounding)                                                      \
  _mm256_set_m128i(_mm256_cvtps_ph(simde_mm512_extractf32x8_ps((x), 1), (rounding)),           \
                   _mm256_cvtps_ph(simde_mm512_extractf32x8_ps((x), 0), (rounding)))

// VPMOVDW: the low 16 bits of each 32-bit lane.
inline __m256i cvtepi32_epi16(simde__m512i x) {
  alignas(64) uint32_t w[16];
  simde_mm512_store_si512(w, x);
  uint16_t h[16];
  for (int i = 0; i < 16; ++i) h[i] = static_cast<uint16_t>(w[i]);
  __m256i out;
  std::memcpy(&out, h, sizeof out);
  return out;
}

// VMOVNTPS zmm faults unless the address is 64-byte aligned; a value-level emulation need not
// bypass the cache, but it must fault where the instruction would.
inline void stream_ps(float* p, simde__m512 x) {
  if (reinterpret_cast<uintptr_t>(p) & 63) std::abort();
  simde_mm512_store_ps(p, x);
}

// Masked loads and stores touch only the elements whose mask bit is set, as the instruction
// does (fault suppression): a tail never reads or writes past the end of its tensor.
template <typename Vec, typename Elem>
inline Vec maskz_loadu(__mmask16 k, const void* p) {
  Elem lanes[sizeof(Vec) / sizeof(Elem)] = {};
  for (unsigned i = 0; i < sizeof(Vec) / sizeof(Elem); ++i) {
    if (k >> i & 1) std::memcpy(&lanes[i], static_cast<const Elem*>(p) + i, sizeof(Elem));
  }
  Vec out;
  std::memcpy(&out, lanes, sizeof out);
  return out;
}

template <typename Vec, typename Elem>
inline void mask_storeu(void* p, __mmask16 k, Vec x) {
  Elem lanes[sizeof(Vec) / sizeof(Elem)];
  std::memcpy(lanes, &x, sizeof lanes);
  for (unsigned i = 0; i < sizeof(Vec) / sizeof(Elem); ++i) {
    if (k >> i & 1) std::memcpy(static_cast<Elem*>(p) + i, &lanes[i], sizeof(Elem));
  }
}

}  // namespace zo_emulated

#define _mm512_fpclass_ps_mask(x, imm) zo_emulated::fpclass_ps_mask((x), (imm))
#define _mm512_cvtneps_pbh(x) zo_emulated::cvtneps_pbh(x)
#define _mm512_cvtps_ph(x, rounding) ZO_EMULATED_CVTPS_PH((x), (rounding))
#define _mm512_cvtepi32_epi16(x) zo_emulated::cvtepi32_epi16(x)
#define _mm512_stream_ps(p, x) zo_emulated::stream_ps((p), (x))
#undef _mm512_maskz_loadu_ps
#undef _mm512_mask_storeu_ps
#undef _mm256_maskz_loadu_epi16
#undef _mm256_mask_storeu_epi16
#define _mm512_maskz_loadu_ps(k, p) zo_emulated::maskz_loadu<simde__m512, float>((k), (p))
#define _mm512_mask_storeu_ps(p, k, x) zo_emulated::mask_storeu<simde__m512, float>((p), (k), (x))
#define _mm256_maskz_loadu_epi16(k, p) zo_emulated::maskz_loadu<__m256i, uint16_t>((k), (p))
#define _mm256_mask_storeu_epi16(p, k, x) zo_emulated::mask_storeu<__m256i, uint16_t>((p), (k), (x))
