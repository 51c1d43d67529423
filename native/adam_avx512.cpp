// AVX-512 Adam/AdamW kernel, 16 floats per vector, masked loads and stores for the tail. Built
// with the AVX-512 flags and run only when CPUID says so. Same operations, same order as
// adam_scalar.cpp, so results are bit-identical to the oracle.
//
// Two bf16 output variants: integer round-to-nearest-even (AVX-512 F/BW), and VCVTNEPS2BF16
// (AVX512-BF16). That instruction flushes denormal inputs to zero, unlike torch and the oracle,
// so a vector holding a denormal takes the integer rounding instead (a rare branch).
//
// C++ builds contract a*b+c into one FMA by default (-ffp-contract=fast), which rounds once
// instead of twice and breaks bit-equality between the paths: contraction is off, and the
// FMAs torch's fused AdamW rounds with (native/adam.h) are written out explicitly.
#pragma GCC optimize("fp-contract=off")
// GCC 12's AVX-512 headers seed masked builtins with a self-initialized `__Y`, which -Wall
// reports as maybe-uninitialized at every use: a false positive that would bury real warnings.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include <cstring>

#include "adam.h"

namespace {

struct Coeffs16 {
  __m512 lerp_weight, beta2, one_minus_beta2, step_size, bias_correction2_sqrt, eps, grad_scale, l2,
      decay;
  bool decoupled, use_l2, lerp_from_grad;
};

Coeffs16 broadcast(const zo_adam_coeffs& c) {
  return {_mm512_set1_ps(c.lerp_weight),
          _mm512_set1_ps(c.beta2),     _mm512_set1_ps(c.one_minus_beta2),
          _mm512_set1_ps(c.step_size), _mm512_set1_ps(c.bias_correction2_sqrt),
          _mm512_set1_ps(c.eps),
          _mm512_set1_ps(c.grad_scale),
          _mm512_set1_ps(c.l2),        _mm512_set1_ps(c.decay),
          c.decoupled != 0,            c.decoupled == 0 && c.l2 != 0.0f,
          c.lerp_from_grad != 0};
}

const uint16_t* u16(const void* p) { return static_cast<const uint16_t*>(p); }

// Lanes outside `k` read as zero and never touch memory.
template <int G>
__m512 load_grad16(const void* grad, int64_t i, __mmask16 k) {
  if constexpr (G == ZO_DTYPE_F32) return _mm512_maskz_loadu_ps(k, static_cast<const float*>(grad) + i);
  const __m256i h = _mm256_maskz_loadu_epi16(k, u16(grad) + i);
  if constexpr (G == ZO_DTYPE_F16) return _mm512_cvtph_ps(h);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));  // bf16: exact
}

__m256i bf16_by_integer(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb);
  const __mmask16 is_nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  r = _mm512_mask_or_epi32(r, is_nan, u, _mm512_set1_epi32(0x400000));  // NaN: quiet, unrounded
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}

__m256i bf16_by_insn(__m512 x) {
  if (_mm512_fpclass_ps_mask(x, 0x20)) return bf16_by_integer(x);  // 0x20: denormal
  const __m256bh h = _mm512_cvtneps_pbh(x);
  __m256i out;
  std::memcpy(&out, &h, sizeof out);
  return out;
}

__mmask16 first(int64_t n) { return n >= 16 ? 0xffff : static_cast<__mmask16>((1u << n) - 1); }

template <int O, bool kInsn>
__m256i to_lowp(__m512 p) {
  if constexpr (O == ZO_DTYPE_F16) return _mm512_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT);
  return kInsn ? bf16_by_insn(p) : bf16_by_integer(p);
}

constexpr int64_t out_bytes(int O) { return O == ZO_DTYPE_F32 ? 4 : 2; }

// Writes the updated weights [i, stop) (still in L1) into the copy, converted to O. Whole
// vectors go out as NT (non-temporal) stores when aligned: the copy is write-only here, so
// reading its old bytes in first would be wasted traffic.
template <int O, bool kInsn>
void store_lowp(const zo_adam_tensor& t, int64_t i, int64_t stop, bool stream) {
  if constexpr (O == ZO_DTYPE_F32) {  // a plain copy (64-byte aligned for NT stores)
    float* out = static_cast<float*>(t.lowp_out);
    for (; i + 16 <= stop; i += 16) {
      if (stream) {
        _mm512_stream_ps(out + i, _mm512_loadu_ps(t.param + i));
      } else {
        _mm512_storeu_ps(out + i, _mm512_loadu_ps(t.param + i));
      }
    }
    if (i < stop) {
      const __mmask16 k = first(stop - i);
      _mm512_mask_storeu_ps(out + i, k, _mm512_maskz_loadu_ps(k, t.param + i));
    }
    return;
  }
  uint16_t* out = static_cast<uint16_t*>(t.lowp_out);
  for (; i + 16 <= stop; i += 16) {
    const __m256i h = to_lowp<O, kInsn>(_mm512_loadu_ps(t.param + i));
    if (stream) {
      _mm256_stream_si256(reinterpret_cast<__m256i*>(out + i), h);
    } else {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), h);
    }
  }
  if (i < stop) {
    const __mmask16 k = first(stop - i);
    const __m256i h = to_lowp<O, kInsn>(_mm512_maskz_loadu_ps(k, t.param + i));
    _mm256_mask_storeu_epi16(out + i, k, h);
  }
}

// Returns `bad` with p - p (+0 if finite, else NaN) ORed in on the lanes of k (a masked-off
// lane may compute NaN from its zeros: with eps = 0, 0/0), for the caller's non-finite check.
template <int G>
inline __m512 step16(const zo_adam_tensor& t, const Coeffs16& c, int64_t i, __mmask16 k, __m512 bad) {
  __m512 p = _mm512_maskz_loadu_ps(k, t.param + i);
  __m512 g = _mm512_mul_ps(load_grad16<G>(t.grad, i, k), c.grad_scale);
  if (c.decoupled) {
    p = _mm512_mul_ps(p, c.decay);
  } else if (c.use_l2) {
    g = _mm512_fmadd_ps(p, c.l2, g);
  }
  const __m512 m_old = _mm512_maskz_loadu_ps(k, t.exp_avg + i);
  const __m512 m = _mm512_fmadd_ps(c.lerp_weight, _mm512_sub_ps(g, m_old), c.lerp_from_grad ? g : m_old);
  const __m512 v = _mm512_fmadd_ps(_mm512_mul_ps(g, c.one_minus_beta2), g,
                                   _mm512_mul_ps(_mm512_maskz_loadu_ps(k, t.exp_avg_sq + i), c.beta2));
  const __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(v), c.bias_correction2_sqrt), c.eps);
  p = _mm512_sub_ps(p, _mm512_div_ps(_mm512_mul_ps(c.step_size, m), denom));
  _mm512_mask_storeu_ps(t.param + i, k, p);
  _mm512_mask_storeu_ps(t.exp_avg + i, k, m);
  _mm512_mask_storeu_ps(t.exp_avg_sq + i, k, v);
  return _mm512_mask_or_ps(bad, k, bad, _mm512_sub_ps(p, p));
}

// Chunks of kChunk elements: first the update, then the conversion of the chunk's weights
// from L1, as in adam_avx2.cpp (a fused loop holds fewer iterations in flight).
constexpr int64_t kChunk = 512;

template <int G, int O, bool kInsn>
int32_t range(const zo_adam_tensor& tensor, const zo_adam_coeffs& coeffs, int64_t begin, int64_t end) {
  const Coeffs16 c = broadcast(coeffs);
  const zo_adam_tensor t = tensor;  // a local copy: stores through its pointers cannot change it
  // NT stores need 32-byte (bf16/f16) or 64-byte (f32) alignment; chunks start 512 elements
  // apart, so one check serves all.
  const bool stream = (reinterpret_cast<uintptr_t>(static_cast<char*>(t.lowp_out) + begin * out_bytes(O)) &
                       (O == ZO_DTYPE_F32 ? 63 : 31)) == 0;
  __m512 bad = _mm512_setzero_ps();
  for (int64_t i = begin; i < end; i += kChunk) {
    const int64_t stop = i + kChunk < end ? i + kChunk : end;
    for (int64_t j = i; j < stop; j += 16) bad = step16<G>(t, c, j, first(stop - j), bad);
    if constexpr (O != ZO_DTYPE_NONE) store_lowp<O, kInsn>(t, i, stop, stream);
  }
  if (O != ZO_DTYPE_NONE && stream) _mm_sfence();  // NT stores are weakly ordered: publish them
  return _mm512_cmp_ps_mask(bad, bad, _CMP_UNORD_Q) != 0;
}

template <int G, bool kInsn>
int32_t range_out(const zo_adam_tensor& t, const zo_adam_coeffs& c, int64_t begin, int64_t end) {
  if (t.out_dtype == ZO_DTYPE_F32) return range<G, ZO_DTYPE_F32, kInsn>(t, c, begin, end);
  if (t.out_dtype == ZO_DTYPE_BF16) return range<G, ZO_DTYPE_BF16, kInsn>(t, c, begin, end);
  if (t.out_dtype == ZO_DTYPE_F16) return range<G, ZO_DTYPE_F16, kInsn>(t, c, begin, end);
  return range<G, ZO_DTYPE_NONE, kInsn>(t, c, begin, end);
}

template <bool kInsn>
int32_t range_any(const zo_adam_tensor& t, const zo_adam_coeffs& c, int64_t begin, int64_t end) {
  if (t.grad_dtype == ZO_DTYPE_BF16) return range_out<ZO_DTYPE_BF16, kInsn>(t, c, begin, end);
  if (t.grad_dtype == ZO_DTYPE_F16) return range_out<ZO_DTYPE_F16, kInsn>(t, c, begin, end);
  return range_out<ZO_DTYPE_F32, kInsn>(t, c, begin, end);
}

// Flags lanes whose scaled value is Inf or NaN; masked-off lanes are zero, hence finite.
template <int G>
int32_t scan(const void* grad, float scale, int64_t begin, int64_t end) {
  const __m512 s = _mm512_set1_ps(scale);
  constexpr int64_t kBlock = 4096;  // stop early once a block shows a non-finite value
  for (int64_t b = begin; b < end; b += kBlock) {
    const int64_t stop = b + kBlock < end ? b + kBlock : end;
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = b; i < stop; i += 16) {
      const __mmask16 k = first(stop - i);
      const __m512 x = _mm512_mul_ps(load_grad16<G>(grad, i, k), s);
      acc = _mm512_add_ps(acc, _mm512_mul_ps(x, _mm512_setzero_ps()));  // +-0, or NaN
    }
    if (_mm512_cmp_ps_mask(acc, acc, _CMP_UNORD_Q)) return 1;
  }
  return 0;
}

}  // namespace

int32_t zo_adam_range_avx512(const zo_adam_tensor& t, const zo_adam_coeffs& c, int64_t begin,
                             int64_t end) {
  return range_any<false>(t, c, begin, end);
}

int32_t zo_adam_range_avx512bf16(const zo_adam_tensor& t, const zo_adam_coeffs& c, int64_t begin,
                                 int64_t end) {
  return range_any<true>(t, c, begin, end);
}

int32_t zo_adam_scan_avx512(const void* grad, int32_t dtype, float scale, int64_t begin,
                            int64_t end) {
  if (dtype == ZO_DTYPE_BF16) return scan<ZO_DTYPE_BF16>(grad, scale, begin, end);
  if (dtype == ZO_DTYPE_F16) return scan<ZO_DTYPE_F16>(grad, scale, begin, end);
  return scan<ZO_DTYPE_F32>(grad, scale, begin, end);
}
