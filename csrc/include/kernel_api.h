// The torch-free kernel API: what bindings.cpp calls, implemented once for the CPU (cpu/) and
// once for CUDA (cuda/). Tensor lists arrive as raw pointer arrays; sizes and offsets are int64
// everywhere (no 2^31-element limit).
#pragma once

#include <cstdint>

#include "adam_math.h"
#include "adan_math.h"
#include "lamb_math.h"
#include "lars_math.h"
#include "lion_math.h"
#include "onebit_math.h"
#include "sgd_math.h"
#include "stableadamw_math.h"

namespace lo {

constexpr int kMaxDepth = 8;

// `depth` lists of `n` tensors each. ptr[l] is a host array of n data pointers (device pointers
// for CUDA), or nullptr for a list the call does not use. Tensor i of every list has numel[i]
// elements (numel is a host array).
struct ListArgs {
  int64_t n = 0;
  const int64_t* numel = nullptr;
  void* const* ptr[kMaxDepth] = {};
};

// Element types of a call: params, grads, the optional param copy; Kahan buffers have the param type.
struct Types {
  DType p = DType::F32, g = DType::F32, copy = DType::F32;
  bool has_copy = false, kahan = false;
};

// Where a call runs: CPU threads, or a CUDA stream (cudaStream_t as void*).
struct Exec {
  int threads = 1;
  void* stream = nullptr;
};

// Pieces of flat 1-bit buffers (lightning_optim/comm/plan.py). Piece p covers elements
// [pos[p], pos[p] + len[p]) of the packed-sign / error index space, whose bits start at byte pos[p] / 8
// (pos[p] % 8 == 0; pieces sorted by pos, never overlapping; `total` bounds the space), and elements
// [off[p], off[p] + len[p]) of the unpacked values. Host arrays for the CPU, device arrays for CUDA.
struct Pieces {
  int64_t n = 0, total = 0;
  const int64_t* pos = nullptr;
  const int64_t* off = nullptr;
  const int64_t* len = nullptr;
};

// `out` of a reduction: n * 2 doubles (per tensor: two sums), zeroed by the caller, in the memory
// of the device that runs the call.
#define LO_KERNELS(NS)                                                                                    \
  namespace NS {                                                                                          \
  void adam(const Exec&, const ListArgs&, const AdamHyper&, const Types&, bool amsgrad, bool apply,      \
            bool frozen);                                                                                 \
  void sgd(const Exec&, const ListArgs&, const SgdHyper&, const Types&, bool momentum, bool apply);       \
  void lion(const Exec&, const ListArgs&, const LionHyper&, const Types&, bool apply);                    \
  void adan(const Exec&, const ListArgs&, const AdanHyper&, const Types&, bool apply);                    \
  void lamb_moments(const Exec&, const ListArgs&, const LambHyper&, const Types&, bool norms, double* out); \
  void lamb_apply(const Exec&, const ListArgs&, const LambHyper&, const Types&);                          \
  void lars_norms(const Exec&, const ListArgs&, const Types&, double* out);                               \
  void lars(const Exec&, const ListArgs&, const LarsHyper&, const Types&, bool momentum, bool apply);     \
  void stable_moments(const Exec&, const ListArgs&, const StableHyper&, const Types&, bool rms, double* out); \
  void stable_apply(const Exec&, const ListArgs&, const StableHyper&, const Types&);                      \
  /* 1-bit: flat fp32 buffers; packed holds ceil(n / 8) bytes. */                                        \
  /* table: 256 x 8 values of out_type; byte b decodes to row b */                                         \
  void onebit_unpack_table(const Exec&, const uint8_t* packed, DType out_type, const void* table, void* out, \
                           int64_t n);                                                                     \
  /* per piece p, with scale[p]: out[p] += sum of (x[off + j] + err[pos + j])^2 (err may be null) */   \
  void onebit_seg_sumsq(const Exec&, const float* x, const float* err, const Pieces&, double* out);     \
  /* z = x[off + j] (+ err[pos + j]); bit pos + j <- z >= 0; err[pos + j] <- z - scale[p] sign(z) */    \
  void onebit_seg_compress(const Exec&, const float* x, float* err, uint8_t* packed, const Pieces&,      \
                           const float* scales, Ef mode);                                                 \
  /* out[off + j] <- +-scale[p] by bit pos + j */                                                         \
  void onebit_seg_unpack(const Exec&, const uint8_t* packed, const Pieces&, const float* scales,          \
                         DType out_type, void* out);                                                      \
  /* server: z = (sum_w +-scales[w * n + p] by bit pos + j of row w) / world + err[pos + j]; err <- z;  \
     out[p] += sum of z^2. Rows start row_stride bytes apart. */                                         \
  void onebit_server_mean(const Exec&, const uint8_t* rows, int64_t row_stride, int world,               \
                          const float* scales, float* err, const Pieces&, double* out);                   \
  }

LO_KERNELS(cpu)
LO_KERNELS(cuda)

namespace cpu {
// 1-bit Adam's worker prologue, fused (CPU only; CUDA runs the lerp and onebit_seg_sumsq apart):
// per piece p, x[off + j] <- lerp(x[off + j], grads[p][j], w1), then out[p] += sum of (x + err[pos + j])^2.
void onebit_momentum_sumsq(const Exec&, float* x, const float* const* grads, float w1, const float* err,
                           const Pieces&, double* out);

// Memory roof probe for the benchmarks: a += d, b += d, c += d in one pass (4 reads, 3 writes
// of fp32, the traffic of an fp32 AdamW step), on the same driver as the optimizers.
void roof(const Exec&, float* a, float* b, float* c, const float* d, int64_t n);
}

// Compile-time dispatch helpers shared by both backends (C++17, no torch).
template <typename T> struct Tag { using type = T; };
template <bool B> using BoolTag = std::integral_constant<bool, B>;

template <typename F> void with_type(DType t, F&& f) {
  switch (t) {
    case DType::F32: f(Tag<float>{}); break;
    case DType::BF16: f(Tag<bf16_t>{}); break;
    case DType::F16: f(Tag<f16_t>{}); break;
  }
}

template <typename F> void with_bool(bool b, F&& f) {
  if (b) f(BoolTag<true>{}); else f(BoolTag<false>{});
}

// Params P and grads G: grads are fp32 or the param type (the only pairs the bindings send).
// Kahan only exists for 16-bit params.
template <typename F> void with_param_types(const Types& t, F&& f) {
  with_type(t.p, [&](auto pt) {
    using P = typename std::decay_t<decltype(pt)>::type;
    auto with_grad = [&](auto gt) {
      if constexpr (std::is_same<P, float>::value) {
        f(pt, gt, BoolTag<false>{});
      } else {
        with_bool(t.kahan, [&](auto k) { f(pt, gt, k); });
      }
    };
    if (t.g == DType::F32 || std::is_same<P, float>::value) with_grad(Tag<float>{});
    else with_grad(pt);
  });
}

}  // namespace lo
