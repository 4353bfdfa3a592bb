// CUDA 1-bit compression: the element math of include/onebit_math.h, laid out for coalesced access.
//
// The per-piece passes cut the pos space (the packed signs' bit positions) into kSpan-position block
// ranges. Thread 0 of a block finds the first piece reaching into its range once (a bisection), then the
// whole block walks the pieces of the range in order. Inside a piece a warp takes 32 consecutive
// positions per word, kWords words per step (loads of all of them issued before use): lane L reads value
// L of each word (a warp reads 32 consecutive floats of x and of err), __ballot_sync forms the word's 32
// sign bits, which are the packed bytes themselves (bit j of byte k is position 8k + j, LSB first, as
// the CPU kernels pack). A word wholly inside a piece's bytes is stored as 4 bytes (lanes 0..3 of the
// warp store 4 consecutive words); a word at a piece's edge stores its piece's bytes one by one, so the
// bytes of other pieces and of the gaps between pieces are never written. Positions past a piece's end
// in its last byte are padding (bit set, as comm/packing.py pads). Unpacking is the mirror image.
// Sums per piece: a block sum, then one double atomicAdd per block and piece. int64 indices. Torch-free.
#include <cuda_runtime.h>

#include <algorithm>

#include "../include/kernel_api.h"
#include "multi_tensor_apply.cuh"

namespace lo {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kWords = 4;                                  // words (of 32 positions) per warp and step
constexpr int64_t kSpan = int64_t{kWarps} * kWords * 32 * 8;  // positions per block: 8 steps
constexpr unsigned kAll = 0xFFFFFFFFu;

inline int blocks_for_span(int64_t total) { return static_cast<int>((total + kSpan - 1) / kSpan); }

// ------------------------------------------------------------------ the sign table (flat buffers)
// Each thread writes 16 bytes of out: E = 16 / sizeof(T) values from one row of the table.
template <typename T>
__global__ void unpack_table_kernel(const uint8_t* packed, const T* table, T* out, int64_t n, bool vector) {
  constexpr int E = 16 / sizeof(T);
  const int64_t stride = int64_t{gridDim.x} * kThreads;
  const int64_t groups = vector ? n / E : 0;
  for (int64_t k = blockIdx.x * int64_t{kThreads} + threadIdx.x; k < groups; k += stride) {
    const int64_t i = k * E;  // E divides 8: the group lies in one byte
    const T* row = table + 8 * static_cast<int64_t>(packed[i / 8]) + i % 8;
    reinterpret_cast<uint4*>(out)[k] = __ldg(reinterpret_cast<const uint4*>(row));
  }
  for (int64_t i = groups * E + blockIdx.x * int64_t{kThreads} + threadIdx.x; i < n; i += stride)
    out[i] = table[8 * static_cast<int64_t>(packed[i / 8]) + i % 8];
}

// ------------------------------------------------------------------ pieces: the block's walk
// The positions [s, e) of piece p inside this block's range: whole bytes (e rounded up past the piece's
// last position `valid`, the padding); positions >= valid are padding.
struct Span {
  int64_t p, s, e, valid;
};

// The first piece that may reach into [lo, ...): the last p with pos[p] <= lo (0 if none), found once.
__device__ int64_t first_piece(const Pieces& pc, int64_t lo) {
  __shared__ int64_t first;
  if (threadIdx.x == 0) {
    int64_t a = 0, b = pc.n;  // bisect for the first pos > lo
    while (a < b) {
      const int64_t mid = (a + b) / 2;
      if (pc.pos[mid] <= lo) a = mid + 1;
      else b = mid;
    }
    first = a > 0 ? a - 1 : 0;
  }
  __syncthreads();
  const int64_t p = first;
  __syncthreads();  // `first` may be rewritten by a later call in this block
  return p;
}

// fn(span) for every piece with bytes in this block's range, in order; uniform over the block.
template <class Fn>
__device__ LO_INLINE void for_each_span(const Pieces& pc, Fn fn) {
  const int64_t lo = blockIdx.x * kSpan;
  const int64_t hi = lo + kSpan < pc.total ? lo + kSpan : pc.total;
  for (int64_t p = first_piece(pc, lo); p < pc.n && pc.pos[p] < hi; ++p) {
    const int64_t valid = pc.pos[p] + pc.len[p];
    const int64_t s = pc.pos[p] > lo ? pc.pos[p] : lo;
    const int64_t bytes_end = (valid + 7) / 8 * 8;
    const int64_t e = bytes_end < hi ? bytes_end : hi;
    if (s < e) fn(Span{p, s, e, valid});
  }
}

// fn(q0) for the first position of each step of this warp over the span: kWords words of 32 positions,
// word-aligned (q0 % 32 == 0), the lanes' positions q0 + 32 r + lane.
template <class Fn>
__device__ LO_INLINE void for_each_step(const Span& sp, Fn fn) {
  const int64_t w0 = sp.s / 32 * 32;
  const int64_t step = int64_t{kWords} * 32;
  for (int64_t q0 = w0 + (threadIdx.x / 32) * step; q0 < sp.e; q0 += kWarps * step) fn(q0);
}

// The block's sum of v added to out[p] (all threads call it; thread 0 adds).
__device__ void block_add(double* out, int64_t p, float v) {
  __shared__ float part[kWarps];
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_down_sync(kAll, v, offset);
  if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = v;
  __syncthreads();
  if (threadIdx.x == 0) {
    double sum = 0.0;
    for (int w = 0; w < kWarps; ++w) sum += part[w];
    atomicAdd(out + p, sum);
  }
  __syncthreads();
}

// ------------------------------------------------------------------ pieces: the passes
__global__ void __launch_bounds__(kThreads) seg_sumsq_kernel(const float* x, const float* err, Pieces pc, double* out) {
  const int lane = threadIdx.x % 32;
  for_each_span(pc, [&](const Span& sp) {
    const int64_t shift = pc.off[sp.p] - pc.pos[sp.p];  // x[q + shift]: the value at position q
    const int64_t end = sp.e < sp.valid ? sp.e : sp.valid;
    float acc = 0.0f;
    for_each_step(sp, [&](int64_t q0) {
      float z[kWords];
#pragma unroll
      for (int r = 0; r < kWords; ++r) {
        const int64_t q = q0 + 32 * r + lane;
        const bool in = q >= sp.s && q < end;
        z[r] = in ? ef_input(x[q + shift], err ? err[q] : 0.0f) : 0.0f;
      }
#pragma unroll
      for (int r = 0; r < kWords; ++r) acc += z[r] * z[r];
    });
    block_add(out, sp.p, acc);
  });
}

template <Ef MODE>
__global__ void __launch_bounds__(kThreads) seg_compress_kernel(const float* x, float* err, uint8_t* packed, Pieces pc,
                                                                const float* scales, bool word_stores) {
  const int lane = threadIdx.x % 32;
  for_each_span(pc, [&](const Span& sp) {
    const int64_t shift = pc.off[sp.p] - pc.pos[sp.p];
    const float scale = scales[sp.p];
    for_each_step(sp, [&](int64_t q0) {
      float z[kWords];
#pragma unroll
      for (int r = 0; r < kWords; ++r) {  // loads first: kWords values in flight per lane
        const int64_t q = q0 + 32 * r + lane;
        const bool real = q >= sp.s && q < sp.valid && q < sp.e;
        z[r] = real ? (MODE == Ef::Feedback ? ef_input(x[q + shift], err[q]) : x[q + shift]) : 0.0f;
      }
      uint32_t words[kWords];
#pragma unroll
      for (int r = 0; r < kWords; ++r) {
        const int64_t q = q0 + 32 * r + lane;
        const bool real = q >= sp.s && q < sp.valid && q < sp.e;
        if constexpr (MODE != Ef::None) {
          if (real) err[q] = ef_residual(z[r], scale);
        }
        words[r] = __ballot_sync(kAll, real ? sign_bit(z[r]) : true);  // padding (and outside): bit set
      }
      // lane r stores word r: 4 consecutive words from lanes 0..3
      if (lane < kWords) {
        uint32_t word = words[0];
#pragma unroll
        for (int r = 1; r < kWords; ++r) word = lane == r ? words[r] : word;
        const int64_t w = q0 + 32 * lane;  // the word's first position
        if (w < sp.e) {
          if (word_stores && w >= sp.s && w + 32 <= sp.e) {
            *reinterpret_cast<uint32_t*>(packed + w / 8) = word;
          } else {  // the piece's bytes only
            for (int k = 0; k < 4; ++k) {
              const int64_t b = w + 8 * k;
              if (b >= sp.s && b < sp.e) packed[b / 8] = static_cast<uint8_t>(word >> (8 * k));
            }
          }
        }
      }
    });
  });
}

template <typename T>
__global__ void __launch_bounds__(kThreads) seg_unpack_kernel(const uint8_t* packed, Pieces pc, const float* scales, T* out) {
  const int lane = threadIdx.x % 32;
  for_each_span(pc, [&](const Span& sp) {
    const int64_t shift = pc.off[sp.p] - pc.pos[sp.p];  // out[q + shift]: the value of position q
    const T pos = from_float<T>(scales[sp.p]), neg = from_float<T>(-scales[sp.p]);
    const int64_t end = sp.e < sp.valid ? sp.e : sp.valid;
    for_each_step(sp, [&](int64_t q0) {
      uint8_t bytes[kWords];
#pragma unroll
      for (int r = 0; r < kWords; ++r) {  // 4 lanes share a byte: one 4-byte transaction per word
        const int64_t q = q0 + 32 * r + lane;
        bytes[r] = q >= sp.s && q < end ? packed[q / 8] : 0;
      }
#pragma unroll
      for (int r = 0; r < kWords; ++r) {
        const int64_t q = q0 + 32 * r + lane;
        if (q >= sp.s && q < end) out[q + shift] = (bytes[r] >> (q % 8)) & 1u ? pos : neg;
      }
    });
  });
}

__global__ void __launch_bounds__(kThreads) server_mean_kernel(const uint8_t* rows, int64_t row_stride, int world,
                                                              const float* scales, float* err, Pieces pc, double* out) {
  const int lane = threadIdx.x % 32;
  for_each_span(pc, [&](const Span& sp) {
    const int64_t end = sp.e < sp.valid ? sp.e : sp.valid;
    float acc = 0.0f;
    for_each_step(sp, [&](int64_t q0) {
#pragma unroll
      for (int r = 0; r < kWords; ++r) {
        const int64_t q = q0 + 32 * r + lane;
        if (q >= sp.s && q < end) {
          const float z = server_value(rows, row_stride, world, scales + sp.p, pc.n, q, err[q]);
          err[q] = z;
          acc += z * z;
        }
      }
    });
    block_add(out, sp.p, acc);
  });
}

cudaStream_t stream_of(const Exec& ex) { return static_cast<cudaStream_t>(ex.stream); }

bool aligned(const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

}  // namespace

namespace cuda {

void onebit_unpack_table(const Exec& ex, const uint8_t* packed, DType out_type, const void* table, void* out,
                         int64_t n) {
  with_type(out_type, [&](auto tt) {
    using T = typename std::decay_t<decltype(tt)>::type;
    const bool vector = aligned(out, 16) && aligned(table, 16);
    const int64_t work = vector ? n / (16 / sizeof(T)) : n;
    const int blocks = static_cast<int>(std::min<int64_t>((work + kThreads - 1) / kThreads + 1, 65535 * 8));
    unpack_table_kernel<T><<<blocks, kThreads, 0, stream_of(ex)>>>(packed, static_cast<const T*>(table),
                                                                  static_cast<T*>(out), n, vector);
  });
  cuda_detail::check(cudaGetLastError(), "onebit_unpack_table");
}

void onebit_seg_sumsq(const Exec& ex, const float* x, const float* err, const Pieces& pc, double* out) {
  if (pc.total == 0) return;
  seg_sumsq_kernel<<<blocks_for_span(pc.total), kThreads, 0, stream_of(ex)>>>(x, err, pc, out);
  cuda_detail::check(cudaGetLastError(), "onebit_seg_sumsq");
}

void onebit_seg_compress(const Exec& ex, const float* x, float* err, uint8_t* packed, const Pieces& pc,
                         const float* scales, Ef mode) {
  if (pc.total == 0) return;
  const int blocks = blocks_for_span(pc.total);
  const bool words = aligned(packed, 4);
  cudaStream_t st = stream_of(ex);
  switch (mode) {
    case Ef::None: seg_compress_kernel<Ef::None><<<blocks, kThreads, 0, st>>>(x, err, packed, pc, scales, words); break;
    case Ef::Residual: seg_compress_kernel<Ef::Residual><<<blocks, kThreads, 0, st>>>(x, err, packed, pc, scales, words); break;
    case Ef::Feedback: seg_compress_kernel<Ef::Feedback><<<blocks, kThreads, 0, st>>>(x, err, packed, pc, scales, words); break;
  }
  cuda_detail::check(cudaGetLastError(), "onebit_seg_compress");
}

void onebit_seg_unpack(const Exec& ex, const uint8_t* packed, const Pieces& pc, const float* scales, DType out_type,
                       void* out) {
  if (pc.total == 0) return;
  with_type(out_type, [&](auto tt) {
    using T = typename std::decay_t<decltype(tt)>::type;
    seg_unpack_kernel<T><<<blocks_for_span(pc.total), kThreads, 0, stream_of(ex)>>>(packed, pc, scales, static_cast<T*>(out));
  });
  cuda_detail::check(cudaGetLastError(), "onebit_seg_unpack");
}

void onebit_server_mean(const Exec& ex, const uint8_t* rows, int64_t row_stride, int world, const float* scales,
                        float* err, const Pieces& pc, double* out) {
  if (pc.total == 0) return;
  server_mean_kernel<<<blocks_for_span(pc.total), kThreads, 0, stream_of(ex)>>>(rows, row_stride, world, scales, err,
                                                                               pc, out);
  cuda_detail::check(cudaGetLastError(), "onebit_server_mean");
}

}  // namespace cuda
}  // namespace lo
