// CPU Adam/AdamW on contiguous fp32 shards: the C ABI (zo_adam_*) and the contract between the
// dispatcher (adam_dispatch.cpp) and the per-ISA kernels (adam_scalar/avx2/avx512.cpp).
//
// Every ISA kernel performs the SAME float operations in the SAME order as the scalar kernel,
// fusing a multiply-add only where every kernel does (zo_adam_coeffs says where and why), so
// all paths give bit-identical results: the scalar file is the oracle and the tests compare
// the fast paths to it bit for bit. (Not NaN payloads: where two different NaNs meet in a
// commutative add, the compiler's operand order picks the one kept.)
// The pool's workers run with the caller's MXCSR (flush-to-zero, denormals-are-zero, rounding).
#pragma once
#include <cstdint>

// Element types of gradients in and of the copy of the updated weights out (f32: a plain copy, so
// a caller that needs the weights apart from the master gets them without a second pass over
// memory); numbers are part of the ABI.
enum zo_dtype : int32_t {
  ZO_DTYPE_NONE = 0,  // no copy is written
  ZO_DTYPE_F32 = 1,
  ZO_DTYPE_BF16 = 2,
  ZO_DTYPE_F16 = 3,
};

// Kernel paths; numbers are part of the ABI (zero_offload/optim/_native_adam.py).
enum zo_adam_isa : int32_t {
  ZO_ADAM_ISA_SCALAR = 0,
  ZO_ADAM_ISA_AVX2 = 1,    // AVX2 + FMA unit + F16C
  ZO_ADAM_ISA_AVX512 = 2,  // AVX-512 F/BW/VL/DQ; AVX512-BF16 conversions when the CPU has them
  ZO_ADAM_ISA_COUNT = 3,
};

// Return codes of zo_adam_step.
enum zo_adam_status : int32_t {
  ZO_ADAM_OK = 0,
  ZO_ADAM_NONFINITE = 1,      // a scaled gradient was Inf/NaN: nothing was written
  ZO_ADAM_NONFINITE_PARAM = 2,  // the update was written and left an Inf/NaN parameter
  ZO_ADAM_BAD_ISA = -1,       // unknown ISA, or one this CPU cannot run
  ZO_ADAM_BAD_DTYPE = -2,     // grad dtype not f32/bf16/f16, or out dtype not none/f32/bf16/f16
  ZO_ADAM_BAD_ARGUMENT = -3,  // null pointer, negative length, step < 1, threads < 1
};

// One contiguous run of n elements and its own step count (torch keeps a step per parameter).
struct zo_adam_tensor {
  float* param;
  float* exp_avg;
  float* exp_avg_sq;
  const void* grad;  // grad_dtype elements
  void* lowp_out;    // out_dtype elements (the updated weights), or null when ZO_DTYPE_NONE
  int64_t n;
  int64_t step;      // 1-based count INCLUDING this update (bias correction uses it)
  int32_t grad_dtype;
  int32_t out_dtype;
};

// Hyperparameters shared by every tensor of one call (one torch param_group).
struct zo_adam_hyper {
  double lr, beta1, beta2, eps, weight_decay;
  double grad_scale;   // multiplies each gradient first: 1/loss-scale times the clip coefficient
  int32_t decoupled;   // 1: AdamW (param *= 1 - lr*wd); 0: Adam (grad += wd*param)
  int32_t check_finite;  // 1: scan the scaled gradients first and write nothing if one is Inf/NaN
};

extern "C" {
// Steps every tensor in place with `threads` threads (the caller's thread is one of them).
// Returns a zo_adam_status: every kernel ORs a check of each updated parameter vector into a
// flag in the same pass (no branch per element), so a step that produced Inf/NaN says so. The GIL is not involved: this library never touches Python.
int32_t zo_adam_step(const zo_adam_tensor* tensors, int64_t count, const zo_adam_hyper* hyper,
                     int32_t isa, int32_t threads);
// 1 if this CPU (and OS) can run the ISA path, else 0.
int32_t zo_adam_isa_supported(int32_t isa);
// 1 if the AVX-512 path converts to bf16 with the AVX512-BF16 instruction on this CPU.
int32_t zo_adam_avx512_uses_bf16_insn(void);
// Number of worker threads the persistent pool holds now (for info() and tests).
int32_t zo_adam_pool_threads(void);
}

// ---- between the dispatcher and the kernels (C++ linkage, not exported to Python) ----

// Float coefficients of one tensor's step, computed in double and rounded once per call.
//
// Every kernel rounds as the vector body of torch's fused CPU Adam/AdamW does, so for fp32
// gradients param, m and v come out bit-identical to it (torch's foreach and single-tensor
// paths use the same formulas, but torch.sqrt on fp32 is not always correctly rounded):
//   g = fma(p, wd, g)                              (Adam: grad.add(param, alpha=wd))
//   p = p * decay                                  (AdamW: param.mul_(1 - lr*wd))
//   m = fma(lerp_weight, g - m, base)              (exp_avg.lerp_(g, 1 - beta1))
//   v = fma(g * (1 - beta2), g, v * beta2)         (exp_avg_sq.mul_(beta2).addcmul_(g, g, 1 - beta2))
//   p = p - (step_size * m) / (sqrt(v) / bias_correction2_sqrt + eps)
// The lerp rounds once where m*beta1 + g*(1-beta1) rounded three times, ~2.7x further from
// float64 over a run. Folding sqrt(bc2) into step_size and eps would save the second
// division, but changes the rounding: the loop is memory-bound, so the division is kept.
struct zo_adam_coeffs {
  // With w = float(1 - beta1), as torch's lerp: lerp_weight = w and base m when w < 0.5,
  // else lerp_weight = w - 1 (exact) and base g, so that g + (w - 1)(g - m) = m + w(g - m).
  float lerp_weight;
  int32_t lerp_from_grad;
  float beta2, one_minus_beta2;
  float step_size;              // lr / (1 - beta1^step)
  float bias_correction2_sqrt;  // sqrt(1 - beta2^step)
  float eps;
  float grad_scale;
  float l2;         // Adam: weight decay added to the gradient; 0 for AdamW
  float decay;      // AdamW: 1 - lr*wd applied to the param first; unused for Adam
  int32_t decoupled;
};

// Updates elements [begin, end) of t. Same arithmetic in every ISA file. Returns 1 if an
// updated parameter in [begin, end) is Inf or NaN, else 0.
using zo_adam_range_fn = int32_t (*)(const zo_adam_tensor& t, const zo_adam_coeffs& c,
                                  int64_t begin, int64_t end);
// Returns 1 if any grad[i] * scale in [begin, end) is Inf or NaN.
using zo_adam_scan_fn = int32_t (*)(const void* grad, int32_t dtype, float scale,
                                    int64_t begin, int64_t end);

int32_t zo_adam_range_scalar(const zo_adam_tensor& t, const zo_adam_coeffs& c, int64_t begin,
                          int64_t end);
int32_t zo_adam_scan_scalar(const void* grad, int32_t dtype, float scale, int64_t begin,
                            int64_t end);
int32_t zo_adam_range_avx2(const zo_adam_tensor& t, const zo_adam_coeffs& c, int64_t begin,
                        int64_t end);
int32_t zo_adam_scan_avx2(const void* grad, int32_t dtype, float scale, int64_t begin,
                          int64_t end);
int32_t zo_adam_range_avx512(const zo_adam_tensor& t, const zo_adam_coeffs& c, int64_t begin,
                          int64_t end);
// The same, converting to bf16 with VCVTNEPS2BF16 (AVX512-BF16) instead of integer rounding.
int32_t zo_adam_range_avx512bf16(const zo_adam_tensor& t, const zo_adam_coeffs& c, int64_t begin,
                              int64_t end);
int32_t zo_adam_scan_avx512(const void* grad, int32_t dtype, float scale, int64_t begin,
                            int64_t end);
