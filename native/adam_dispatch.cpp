// zo_adam_step: checks the arguments, picks the ISA kernel, splits the work over a persistent
// thread pool. Baseline flags only; the kernels it calls live in their own ISA files and are
// reached only after CPUID (zo_cpu_features) says the CPU can run them.
//
// The engine steps many shards per optimizer step, so threads are created once and parked on a
// condition variable between calls rather than spawned per call. Calls are serialized: two
// Python threads stepping at once take turns rather than oversubscribing the cores.
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <new>
#include <system_error>
#include <thread>
#include <vector>
#include <xmmintrin.h>

#include "adam.h"
#include "zo_cpuid.h"

namespace {

// Runs job(0..n-1) on n threads, the caller being thread 0, and returns when all are done.
class Pool {
 public:
  // How many threads (the caller included) a job may use, growing the pool towards `want`.
  // Fewer when the OS refuses a new thread: the step then runs on what there is.
  int reserve(int want) {
    try {
      while (size() + 1 < want) spawn();
    } catch (const std::system_error&) {
    }
    return std::min(size() + 1, want);
  }

  // n must not exceed what reserve() returned.
  void run(int n, const std::function<void(int)>& job) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      job_ = &job;
      csr_ = _mm_getcsr();  // workers run with the caller's FTZ/DAZ and rounding mode
      active_ = n;
      pending_ = n - 1;
      ++generation_;
    }
    wake_.notify_all();
    job(0);
    std::unique_lock<std::mutex> lock(mu_);
    done_.wait(lock, [this] { return pending_ == 0; });
    job_ = nullptr;
  }

  int size() {
    std::lock_guard<std::mutex> lock(mu_);
    return workers_;
  }

 private:
  // A worker blocks every signal, so signals (Ctrl-C) reach the Python thread, not a kernel.
  void spawn() {
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    std::lock_guard<std::mutex> lock(mu_);
    const int id = workers_ + 1;
    const uint64_t seen = generation_;
    try {
      std::thread([this, id, seen] { loop(id, seen); }).detach();  // parked until the process exits
    } catch (...) {
      pthread_sigmask(SIG_SETMASK, &old, nullptr);
      throw;
    }
    pthread_sigmask(SIG_SETMASK, &old, nullptr);
    ++workers_;
  }

  void loop(int id, uint64_t seen) {
    for (;;) {
      const std::function<void(int)>* job;
      unsigned csr;
      {
        std::unique_lock<std::mutex> lock(mu_);
        wake_.wait(lock, [&] { return generation_ != seen; });
        seen = generation_;
        if (id >= active_) continue;  // this call needs fewer threads than the pool holds
        job = job_;
        csr = csr_;
      }
      const unsigned saved = _mm_getcsr();
      _mm_setcsr(csr);
      (*job)(id);
      _mm_setcsr(saved);
      std::lock_guard<std::mutex> lock(mu_);
      if (--pending_ == 0) done_.notify_one();
    }
  }

  std::mutex mu_;
  std::condition_variable wake_, done_;
  const std::function<void(int)>* job_ = nullptr;
  uint64_t generation_ = 0;
  unsigned csr_ = 0;
  int workers_ = 0, active_ = 0, pending_ = 0;
};

std::mutex g_call_mu;  // one zo_adam_step at a time
Pool* g_pool = nullptr;
pid_t g_pool_pid = 0;

// A child forked while another thread held g_call_mu would wait on it for ever: give it a fresh one.
void renew_after_fork() { new (&g_call_mu) std::mutex(); }
const int g_atfork = pthread_atfork(nullptr, nullptr, renew_after_fork);

// A forked child inherits the pool's bookkeeping but not its threads: it gets a fresh pool
// (the old object is leaked on purpose; its mutex may have been held at fork time).
Pool& pool() {
  if (g_pool == nullptr || g_pool_pid != getpid()) {
    g_pool = new Pool();
    g_pool_pid = getpid();
  }
  return *g_pool;
}

bool supported(int32_t isa) {
  const uint32_t f = zo_cpu_features();
  const uint32_t avx2 = ZO_CPU_AVX2 | ZO_CPU_FMA | ZO_CPU_F16C;
  const uint32_t avx512 = ZO_CPU_AVX512F | ZO_CPU_AVX512BW | ZO_CPU_AVX512VL | ZO_CPU_AVX512DQ | avx2;
  if (isa == ZO_ADAM_ISA_SCALAR) return true;
  if (isa == ZO_ADAM_ISA_AVX2) return (f & avx2) == avx2;
  if (isa == ZO_ADAM_ISA_AVX512) return (f & avx512) == avx512;
  return false;
}

zo_adam_coeffs coeffs_for(const zo_adam_hyper& h, int64_t step) {
  // In double, then rounded to float once.
  const double bc1 = 1.0 - std::pow(h.beta1, static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(h.beta2, static_cast<double>(step));
  zo_adam_coeffs c;
  const float w = static_cast<float>(1.0 - h.beta1);  // torch rounds the lerp weight to fp32 first
  c.lerp_from_grad = !(std::fabs(w) < 0.5f);
  c.lerp_weight = c.lerp_from_grad ? w - 1.0f : w;  // exact: w is in [0.5, 1] there
  c.beta2 = static_cast<float>(h.beta2);
  c.one_minus_beta2 = static_cast<float>(1.0 - h.beta2);
  c.step_size = static_cast<float>(h.lr / bc1);  // as torch's fused kernel rounds them
  c.bias_correction2_sqrt = static_cast<float>(std::sqrt(bc2));
  c.eps = static_cast<float>(h.eps);
  c.grad_scale = static_cast<float>(h.grad_scale);
  c.decoupled = h.decoupled != 0;
  c.l2 = c.decoupled ? 0.0f : static_cast<float>(h.weight_decay);
  c.decay = static_cast<float>(1.0 - h.lr * h.weight_decay);
  return c;
}

int32_t check_tensor(const zo_adam_tensor& t) {
  if (t.n < 0 || t.step < 1) return ZO_ADAM_BAD_ARGUMENT;
  const bool grad_ok = t.grad_dtype == ZO_DTYPE_F32 || t.grad_dtype == ZO_DTYPE_BF16 ||
                       t.grad_dtype == ZO_DTYPE_F16;
  const bool out_ok = t.out_dtype == ZO_DTYPE_NONE || t.out_dtype == ZO_DTYPE_F32 ||
                      t.out_dtype == ZO_DTYPE_BF16 || t.out_dtype == ZO_DTYPE_F16;
  if (!grad_ok || !out_ok) return ZO_ADAM_BAD_DTYPE;
  if (t.n > 0 && (!t.param || !t.exp_avg || !t.exp_avg_sq || !t.grad)) return ZO_ADAM_BAD_ARGUMENT;
  if (t.n > 0 && t.out_dtype != ZO_DTYPE_NONE && !t.lowp_out) return ZO_ADAM_BAD_ARGUMENT;
  return ZO_ADAM_OK;
}

// Hands out blocks of the concatenated tensors to whichever thread asks next. The cores are
// shared (other work, the engine's I/O threads), so a fixed split would make every call wait
// for its most descheduled thread; with blocks a late thread simply takes fewer of them.
// Block edges are multiples of 64 elements, so on one flat shard no two threads write to the
// same cache line of any array. Results do not depend on who takes which block.
class Blocks {
 public:
  // At least 4 blocks per thread for balance; at most 1 MiB of each fp32 array per block, so
  // the hardware prefetchers rarely restart; multiples of 64 elements.
  Blocks(const zo_adam_tensor* ts, int64_t count, int threads) : starts_(count + 1, 0) {
    for (int64_t j = 0; j < count; ++j) starts_[j + 1] = starts_[j] + ts[j].n;
    size_ = std::clamp(total() / (4 * int64_t{threads}), int64_t{1} << 12, int64_t{1} << 18) & ~int64_t{63};
  }

  int64_t total() const { return starts_.back(); }

  // Calls fn(tensor index, begin, end) for every piece of every block this thread claims,
  // until the blocks run out or `stop` is set.
  template <typename Fn>
  void drain(Fn&& fn) {
    for (;;) {
      const int64_t lo = next_.fetch_add(size_, std::memory_order_relaxed);
      if (lo >= total() || stop.load(std::memory_order_relaxed)) return;
      const int64_t hi = std::min(lo + size_, total());
      auto j = std::upper_bound(starts_.begin(), starts_.end(), lo) - starts_.begin() - 1;
      for (; j + 1 < static_cast<int64_t>(starts_.size()) && starts_[j] < hi; ++j) {
        const int64_t b = std::max(lo, starts_[j]) - starts_[j];
        const int64_t e = std::min(hi, starts_[j + 1]) - starts_[j];
        if (b < e) fn(j, b, e);
      }
    }
  }

  std::atomic<bool> stop{false};

 private:
  std::vector<int64_t> starts_;
  int64_t size_;
  std::atomic<int64_t> next_{0};
};

struct Kernels {
  zo_adam_range_fn range;
  zo_adam_scan_fn scan;
};

Kernels kernels_for(int32_t isa) {
  if (isa == ZO_ADAM_ISA_AVX2) return {zo_adam_range_avx2, zo_adam_scan_avx2};
  if (isa == ZO_ADAM_ISA_AVX512) {
    const bool bf16 = zo_cpu_features() & ZO_CPU_AVX512_BF16;
    return {bf16 ? zo_adam_range_avx512bf16 : zo_adam_range_avx512, zo_adam_scan_avx512};
  }
  return {zo_adam_range_scalar, zo_adam_scan_scalar};
}

// Below this many elements per thread, waking another thread costs more than it saves.
constexpr int64_t kMinPerThread = 1 << 15;

// `total` is the element count of all tensors, summed once by the caller while checking them.
int32_t step_locked(const zo_adam_tensor* ts, int64_t count, int64_t total, const zo_adam_hyper& h,
                    Kernels k, int threads) {
  std::vector<zo_adam_coeffs> coeffs(count);
  for (int64_t j = 0; j < count; ++j) coeffs[j] = coeffs_for(h, ts[j].step);
  const float scale = static_cast<float>(h.grad_scale);
  const int64_t useful = (total + kMinPerThread - 1) / kMinPerThread;
  const int n = pool().reserve(static_cast<int>(useful < threads ? useful : threads));
  if (h.check_finite) {
    Blocks scan(ts, count, n);
    pool().run(n, [&](int) {
      scan.drain([&](int64_t j, int64_t b, int64_t e) {
        if (k.scan(ts[j].grad, ts[j].grad_dtype, scale, b, e)) scan.stop.store(true);
      });
    });
    if (scan.stop.load()) return ZO_ADAM_NONFINITE;
  }
  Blocks update(ts, count, n);
  std::atomic<int32_t> nonfinite{0};  // one relaxed store per block that saw Inf/NaN
  pool().run(n, [&](int) {
    update.drain([&](int64_t j, int64_t b, int64_t e) {
      if (k.range(ts[j], coeffs[j], b, e)) nonfinite.store(1, std::memory_order_relaxed);
    });
  });
  return nonfinite.load() ? ZO_ADAM_NONFINITE_PARAM : ZO_ADAM_OK;
}

}  // namespace

extern "C" int32_t zo_adam_step(const zo_adam_tensor* tensors, int64_t count,
                                const zo_adam_hyper* hyper, int32_t isa, int32_t threads) {
  if (count < 0 || (count > 0 && !tensors) || !hyper || threads < 1) return ZO_ADAM_BAD_ARGUMENT;
  if (!supported(isa)) return ZO_ADAM_BAD_ISA;
  int64_t total = 0;
  for (int64_t j = 0; j < count; ++j) {
    const int32_t rc = check_tensor(tensors[j]);
    if (rc != ZO_ADAM_OK) return rc;
    total += tensors[j].n;
  }
  if (total == 0) return ZO_ADAM_OK;
  std::lock_guard<std::mutex> lock(g_call_mu);
  return step_locked(tensors, count, total, *hyper, kernels_for(isa), threads);
}

extern "C" int32_t zo_adam_isa_supported(int32_t isa) { return supported(isa) ? 1 : 0; }

extern "C" int32_t zo_adam_avx512_uses_bf16_insn(void) {
  return supported(ZO_ADAM_ISA_AVX512) && (zo_cpu_features() & ZO_CPU_AVX512_BF16) ? 1 : 0;
}

extern "C" int32_t zo_adam_pool_threads(void) {
  std::lock_guard<std::mutex> lock(g_call_mu);
  return pool().size() + 1;
}
