// The scalar Adam/AdamW kernel: the readable oracle that the AVX2 and AVX-512 kernels must match
// bit for bit. Compiled with baseline flags only, so it runs on any x86-64.
//
// Rounding rules (the vector kernels implement the same ones in hardware or integer code):
//   fp32 -> bf16: round to nearest even; NaN stays NaN (quiet bit set, sign and top payload kept).
//   fp32 -> fp16: round to nearest even; overflow -> Inf; NaN -> quiet NaN with the top payload.
//   bf16 -> fp32: exact (a shift). fp16 -> fp32: exact; a signalling NaN comes back quiet, as
//   VCVTPH2PS does.
//
// C++ builds contract a*b+c into one FMA by default (-ffp-contract=fast), which rounds once
// instead of twice and breaks bit-equality between the paths: contraction is off, and the
// FMAs torch's fused AdamW rounds with (native/adam.h) are written out explicitly.
#pragma GCC optimize("fp-contract=off")
#include <cmath>
#include <cstring>

#include "adam.h"

namespace {

uint32_t bits_of(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}

float float_of(uint32_t u) {
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

float bf16_to_f32(uint16_t h) { return float_of(static_cast<uint32_t>(h) << 16); }

float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0x1f) return float_of(sign | 0x7f800000u | (mant << 13) | (mant ? 0x400000u : 0u));
  if (exp != 0) return float_of(sign | ((exp + 112u) << 23) | (mant << 13));
  // Zero or subnormal: mant * 2^-24 is exact in fp32.
  const float magnitude = static_cast<float>(mant) * 0x1p-24f;
  return float_of(sign | bits_of(magnitude));
}

uint16_t f32_to_bf16(float x) {
  const uint32_t u = bits_of(x);
  if (std::isnan(x)) return static_cast<uint16_t>((u >> 16) | 0x40u);
  const uint32_t lsb = (u >> 16) & 1u;  // ties go to the even result
  return static_cast<uint16_t>((u + 0x7fffu + lsb) >> 16);
}

uint16_t f32_to_f16(float x) {
  const uint32_t u = bits_of(x);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7e00u | static_cast<uint16_t>((a >> 13) & 0x3ffu);
  if (a >= 0x477ff000u) return sign | 0x7c00u;  // >= 65520 rounds (ties-to-even) to Inf
  if (a < 0x38800000u) {
    // Below the smallest normal 2^-14: the result is round(|x| * 2^24) units of 2^-24, and
    // 1024 of them is exactly the encoding of the smallest normal.
    const float units = std::nearbyint(float_of(a) * 0x1p24f);
    return sign | static_cast<uint16_t>(units);
  }
  const uint32_t exp = (a >> 23) - 112u;
  const uint32_t mant = a & 0x7fffffu;
  uint32_t h = (exp << 10) | (mant >> 13);
  const uint32_t rest = mant & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) h += 1;  // a carry moves into the exponent
  return sign | static_cast<uint16_t>(h);
}

float load_grad(const void* grad, int32_t dtype, int64_t i) {
  if (dtype == ZO_DTYPE_BF16) return bf16_to_f32(static_cast<const uint16_t*>(grad)[i]);
  if (dtype == ZO_DTYPE_F16) return f16_to_f32(static_cast<const uint16_t*>(grad)[i]);
  return static_cast<const float*>(grad)[i];
}

void store_lowp(void* out, int32_t dtype, int64_t i, float x) {
  if (dtype == ZO_DTYPE_F32) static_cast<float*>(out)[i] = x;
  if (dtype == ZO_DTYPE_BF16) static_cast<uint16_t*>(out)[i] = f32_to_bf16(x);
  if (dtype == ZO_DTYPE_F16) static_cast<uint16_t*>(out)[i] = f32_to_f16(x);
}

}  // namespace

int32_t zo_adam_range_scalar(const zo_adam_tensor& t, const zo_adam_coeffs& c, int64_t begin,
                             int64_t end) {
  bool nonfinite = false;  // ORed per element: no branch, and no effect on the arithmetic
  for (int64_t i = begin; i < end; ++i) {
    float p = t.param[i];
    float g = load_grad(t.grad, t.grad_dtype, i) * c.grad_scale;
    if (c.decoupled) {
      p = p * c.decay;
    } else if (c.l2 != 0.0f) {
      g = std::fma(p, c.l2, g);  // torch's grad.add(param, alpha=wd): one rounding
    }
    // torch's exp_avg.lerp_(g, 1 - beta1): one FMA onto m (onto g when 1 - beta1 >= 0.5).
    const float m_old = t.exp_avg[i];
    const float m = std::fma(c.lerp_weight, g - m_old, c.lerp_from_grad ? g : m_old);
    // torch's exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2): (g * (1 - beta2)) * g
    // added to v * beta2 in one FMA (g * g alone would overflow for |g| > ~1.8e19).
    const float v = std::fma(g * c.one_minus_beta2, g, t.exp_avg_sq[i] * c.beta2);
    const float denom = std::sqrt(v) / c.bias_correction2_sqrt + c.eps;
    p = p - (c.step_size * m) / denom;
    t.param[i] = p;
    t.exp_avg[i] = m;
    t.exp_avg_sq[i] = v;
    store_lowp(t.lowp_out, t.out_dtype, i, p);
    nonfinite |= !std::isfinite(p);
  }
  return nonfinite ? 1 : 0;
}

int32_t zo_adam_scan_scalar(const void* grad, int32_t dtype, float scale, int64_t begin,
                            int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    if (!std::isfinite(load_grad(grad, dtype, i) * scale)) return 1;
  }
  return 0;
}
