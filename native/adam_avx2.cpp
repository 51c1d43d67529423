// AVX2 + F16C Adam/AdamW kernel, 8 floats per vector. Built with -mavx2 -mfma -mf16c and run
// only when CPUID says so. Same operations, same order as adam_scalar.cpp, so results are
// bit-identical to the oracle. The tail (< 8 elements) goes through a padded stack copy so that
// it, too, runs this exact vector code.
//
// C++ builds contract a*b+c into one FMA by default (-ffp-contract=fast), which rounds once
// instead of twice and breaks bit-equality between the paths: contraction is off, and the
// FMAs torch's fused AdamW rounds with (native/adam.h) are written out explicitly.
#pragma GCC optimize("fp-contract=off")
#include <immintrin.h>

#include <cstring>

#include "adam.h"

namespace {

struct Coeffs8 {
  __m256 lerp_weight, beta2, one_minus_beta2, step_size, bias_correction2_sqrt, eps, grad_scale, l2,
      decay;
  bool decoupled, use_l2, lerp_from_grad;
};

Coeffs8 broadcast(const zo_adam_coeffs& c) {
  return {_mm256_set1_ps(c.lerp_weight),
          _mm256_set1_ps(c.beta2),     _mm256_set1_ps(c.one_minus_beta2),
          _mm256_set1_ps(c.step_size), _mm256_set1_ps(c.bias_correction2_sqrt),
          _mm256_set1_ps(c.eps),
          _mm256_set1_ps(c.grad_scale),
          _mm256_set1_ps(c.l2),        _mm256_set1_ps(c.decay),
          c.decoupled != 0,            c.decoupled == 0 && c.l2 != 0.0f,
          c.lerp_from_grad != 0};
}

template <int G>
__m256 load_grad8(const void* grad, int64_t i) {
  if constexpr (G == ZO_DTYPE_F32) return _mm256_loadu_ps(static_cast<const float*>(grad) + i);
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(
      static_cast<const uint16_t*>(grad) + i));
  if constexpr (G == ZO_DTYPE_F16) return _mm256_cvtph_ps(h);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));  // bf16: exact
}

// Round to nearest even in integer arithmetic; a NaN keeps its top bits and is made quiet.
__m128i to_bf16x8(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb);
  const __m256i quiet = _mm256_or_si256(u, _mm256_set1_epi32(0x400000));
  const __m256 is_nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
  const __m256i pick = _mm256_castps_si256(
      _mm256_blendv_ps(_mm256_castsi256_ps(rounded), _mm256_castsi256_ps(quiet), is_nan));
  const __m256i high = _mm256_srli_epi32(pick, 16);  // each lane now fits 16 bits unsigned
  return _mm_packus_epi32(_mm256_castsi256_si128(high), _mm256_extracti128_si256(high, 1));
}

constexpr int64_t out_bytes(int O) { return O == ZO_DTYPE_F32 ? 4 : 2; }

// Writes the updated weights [i, stop) (still in L1) into the copy, converted to O. NT
// (non-temporal) stores skip reading the copy's old bytes in: it is write-only here.
template <int O, bool kStream>
void store_lowp(const zo_adam_tensor& t, int64_t i, int64_t stop) {
  if constexpr (O == ZO_DTYPE_F32) {
    float* out = static_cast<float*>(t.lowp_out);
    for (; i < stop; i += 8) {
      if constexpr (kStream) {
        _mm256_stream_ps(out + i, _mm256_loadu_ps(t.param + i));
      } else {
        _mm256_storeu_ps(out + i, _mm256_loadu_ps(t.param + i));
      }
    }
    return;
  }
  for (; i < stop; i += 8) {
    const __m256 p = _mm256_loadu_ps(t.param + i);
    const __m128i h = O == ZO_DTYPE_BF16 ? to_bf16x8(p) : _mm256_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT);
    __m128i* dst = reinterpret_cast<__m128i*>(static_cast<uint16_t*>(t.lowp_out) + i);
    if constexpr (kStream) {
      _mm_stream_si128(dst, h);
    } else {
      _mm_storeu_si128(dst, h);
    }
  }
}

// Returns the updated parameters, for the caller's non-finite check.
template <int G>
inline __m256 step8(const zo_adam_tensor& t, const Coeffs8& c, int64_t i) {
  __m256 p = _mm256_loadu_ps(t.param + i);
  __m256 g = _mm256_mul_ps(load_grad8<G>(t.grad, i), c.grad_scale);
  if (c.decoupled) {
    p = _mm256_mul_ps(p, c.decay);
  } else if (c.use_l2) {
    g = _mm256_fmadd_ps(p, c.l2, g);
  }
  const __m256 m_old = _mm256_loadu_ps(t.exp_avg + i);
  const __m256 m = _mm256_fmadd_ps(c.lerp_weight, _mm256_sub_ps(g, m_old), c.lerp_from_grad ? g : m_old);
  const __m256 v = _mm256_fmadd_ps(_mm256_mul_ps(g, c.one_minus_beta2), g,
                                   _mm256_mul_ps(_mm256_loadu_ps(t.exp_avg_sq + i), c.beta2));
  const __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(v), c.bias_correction2_sqrt), c.eps);
  p = _mm256_sub_ps(p, _mm256_div_ps(_mm256_mul_ps(c.step_size, m), denom));
  _mm256_storeu_ps(t.param + i, p);
  _mm256_storeu_ps(t.exp_avg + i, m);
  _mm256_storeu_ps(t.exp_avg_sq + i, v);
  return p;
}

// p - p is +0 for a finite p and NaN for Inf/NaN; ORing it into `bad` keeps a NaN once one is seen.
inline __m256 or_nonfinite(__m256 bad, __m256 p) { return _mm256_or_ps(bad, _mm256_sub_ps(p, p)); }

inline int32_t any_nan(__m256 bad) { return _mm256_movemask_ps(_mm256_cmp_ps(bad, bad, _CMP_UNORD_Q)) != 0; }

size_t grad_bytes(int32_t dtype) { return dtype == ZO_DTYPE_F32 ? 4 : 2; }

// The last n < 8 elements: copy them into zero-padded 8-wide buffers, step, copy back. Returns
// 1 if one of the n real lanes is Inf/NaN (a padded lane may be NaN where the real ones are not:
// with eps = 0 its 0/0).
template <int G, int O>
int32_t step_tail(const zo_adam_tensor& t, const Coeffs8& c, int64_t i, int64_t n) {
  alignas(32) float p[8] = {}, m[8] = {}, v[8] = {}, g[8] = {};
  alignas(32) float out[8] = {};  // room for 8 elements of any out dtype
  std::memcpy(p, t.param + i, n * 4);
  std::memcpy(m, t.exp_avg + i, n * 4);
  std::memcpy(v, t.exp_avg_sq + i, n * 4);
  std::memcpy(g, static_cast<const char*>(t.grad) + i * grad_bytes(G), n * grad_bytes(G));
  const zo_adam_tensor tmp{p, m, v, g, out, 8, t.step, G, O};
  step8<G>(tmp, c, 0);
  std::memcpy(t.param + i, p, n * 4);
  std::memset(p + n, 0, (8 - n) * 4);  // only the real lanes count
  const int32_t bad = any_nan(or_nonfinite(_mm256_setzero_ps(), _mm256_load_ps(p)));
  std::memcpy(t.exp_avg + i, m, n * 4);
  std::memcpy(t.exp_avg_sq + i, v, n * 4);
  if constexpr (O != ZO_DTYPE_NONE) {
    store_lowp<O, false>(tmp, 0, 8);
    std::memcpy(static_cast<char*>(t.lowp_out) + i * out_bytes(O), out, n * out_bytes(O));
  }
  return bad;
}

// Chunks of kChunk elements: first the update, then the conversion of the chunk's weights
// from L1. Fused into one loop, the conversion lengthens each iteration's dependency chain
// behind the divide and the out-of-order window holds fewer iterations (measured ~15% slower).
constexpr int64_t kChunk = 512;

template <int G, int O>
int32_t range(const zo_adam_tensor& tensor, const zo_adam_coeffs& coeffs, int64_t begin, int64_t end) {
  const Coeffs8 c = broadcast(coeffs);
  const zo_adam_tensor t = tensor;  // a local copy: stores through its pointers cannot change it
  const int64_t full = begin + (end - begin) / 8 * 8;
  // NT stores need 16-byte (bf16/f16) or 32-byte (f32) alignment; chunks start 512 elements
  // apart, so one check serves all.
  const bool stream = (reinterpret_cast<uintptr_t>(static_cast<char*>(t.lowp_out) + begin * out_bytes(O)) &
                       (O == ZO_DTYPE_F32 ? 31 : 15)) == 0;
  __m256 bad = _mm256_setzero_ps();
  for (int64_t i = begin; i < full; i += kChunk) {
    const int64_t stop = i + kChunk < full ? i + kChunk : full;
    for (int64_t j = i; j < stop; j += 8) bad = or_nonfinite(bad, step8<G>(t, c, j));
    if constexpr (O != ZO_DTYPE_NONE) {
      if (stream) {
        store_lowp<O, true>(t, i, stop);
      } else {
        store_lowp<O, false>(t, i, stop);
      }
    }
  }
  if (O != ZO_DTYPE_NONE && stream) _mm_sfence();  // NT stores are weakly ordered: publish them
  const int32_t tail = full < end ? step_tail<G, O>(t, c, full, end - full) : 0;
  return any_nan(bad) | tail;
}

template <int G>
int32_t range_out(const zo_adam_tensor& t, const zo_adam_coeffs& c, int64_t begin, int64_t end) {
  if (t.out_dtype == ZO_DTYPE_F32) return range<G, ZO_DTYPE_F32>(t, c, begin, end);
  if (t.out_dtype == ZO_DTYPE_BF16) return range<G, ZO_DTYPE_BF16>(t, c, begin, end);
  if (t.out_dtype == ZO_DTYPE_F16) return range<G, ZO_DTYPE_F16>(t, c, begin, end);
  return range<G, ZO_DTYPE_NONE>(t, c, begin, end);
}

// Accumulates g*scale*0: +-0 while every value is finite, NaN from the first Inf/NaN on.
template <int G>
int32_t scan(const void* grad, float scale, int64_t begin, int64_t end) {
  const __m256 s = _mm256_set1_ps(scale), zero = _mm256_setzero_ps();
  constexpr int64_t kBlock = 4096;  // stop early once a block shows a non-finite value
  for (int64_t b = begin; b < end; b += kBlock) {
    const int64_t stop = b + kBlock < end ? b + kBlock : end;
    __m256 acc = zero;
    int64_t i = b;
    for (; i + 8 <= stop; i += 8) {
      acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_mul_ps(load_grad8<G>(grad, i), s), zero));
    }
    if (i < stop) {
      alignas(32) float pad[8] = {};
      std::memcpy(pad, static_cast<const char*>(grad) + i * grad_bytes(G), (stop - i) * grad_bytes(G));
      acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_mul_ps(load_grad8<G>(pad, 0), s), zero));
    }
    if (_mm256_movemask_ps(_mm256_cmp_ps(acc, acc, _CMP_UNORD_Q))) return 1;
  }
  return 0;
}

}  // namespace

int32_t zo_adam_range_avx2(const zo_adam_tensor& t, const zo_adam_coeffs& c, int64_t begin,
                           int64_t end) {
  if (t.grad_dtype == ZO_DTYPE_BF16) return range_out<ZO_DTYPE_BF16>(t, c, begin, end);
  if (t.grad_dtype == ZO_DTYPE_F16) return range_out<ZO_DTYPE_F16>(t, c, begin, end);
  return range_out<ZO_DTYPE_F32>(t, c, begin, end);
}

int32_t zo_adam_scan_avx2(const void* grad, int32_t dtype, float scale, int64_t begin,
                          int64_t end) {
  if (dtype == ZO_DTYPE_BF16) return scan<ZO_DTYPE_BF16>(grad, scale, begin, end);
  if (dtype == ZO_DTYPE_F16) return scan<ZO_DTYPE_F16>(grad, scale, begin, end);
  return scan<ZO_DTYPE_F32>(grad, scale, begin, end);
}
