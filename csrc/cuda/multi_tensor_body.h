// The multi-tensor apply of the CUDA kernels, written without CUDA: the launch plan (which tensors a
// launch covers, block -> tensor chunk) and what one thread of one block does. multi_tensor_apply.cuh
// wraps it in kernels; tests/ops/cuda_driver_emulation.cpp runs the same code on the host, thread by
// thread, to check it against the plain element loop without a GPU.
//
// Per launch a Meta struct (passed by value: kernel parameters are limited to 4 KB) holds up to
// `capacity` tensors with the pointers of the lists the op uses only (ListAccess), so an fp32 Adam call
// (4 of its 7 lists) packs ~80 tensors per launch. Tensor s owns blocks [first_block[s], first_block[s + 1]),
// one per kChunk elements; a launch has as many blocks as its tensors need (no tensor is cut across launches).
//
// Each thread moves kPerThread elements per step: G groups of W contiguous elements, W = 16 bytes / the
// smallest element type (4 for fp32 lists, 8 with a 16-bit list), groups a block-width apart so that a
// warp's access to each list is one contiguous run. Loads and stores are 16 bytes (two for fp32 lists
// in a W = 8 op) when every list of the tensor is 16-byte aligned; the chunk's last < W elements and
// unaligned tensors take the scalar loop. The element math is the op's (include/*_math.h): it runs on
// registers staged from the used lists, and only the written lists are stored back.
#pragma once

#include <cstdint>
#include <cstring>
#include <utility>

#include "../include/kernel_api.h"

namespace lo {
namespace mta {

constexpr int kBlock = 256;            // threads per block: 256 keeps occupancy steps fine at ~64 registers
constexpr int kPerThread = 8;          // elements in flight per thread and step (two float4 or one bf16x8 per list)
constexpr int64_t kChunk = 16384;      // elements per block: 8 steps of kBlock * kPerThread
constexpr int kMetaBytes = 3840;       // of the 4096 bytes of kernel parameters (the op's scalars take the rest)
static_assert(kChunk % (kBlock * kPerThread) == 0, "a chunk is whole steps");

template <int U>  // U: the number of lists the op uses
struct Meta {
  static constexpr int capacity = (kMetaBytes - 8) / (8 * U + 8 + 4 + 4 + 1);
  void* ptr[U][capacity];
  int64_t numel[capacity];
  int32_t tensor_index[capacity];  // index in the caller's lists (per-tensor arrays, sums)
  int32_t first_block[capacity];
  uint8_t aligned[capacity];       // every used list 16-byte aligned: vector loads allowed
  int32_t count;
};
static_assert(sizeof(Meta<1>) <= kMetaBytes && sizeof(Meta<4>) <= kMetaBytes && sizeof(Meta<7>) <= kMetaBytes,
              "a launch's Meta fits its share of the 4 KB of kernel parameters");

// -------------------------------------------------------------------- host: the launch plan
inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// The used lists' pointers of tensor t into slot s of meta.
template <class Lists, int L = 0, int U>
void fill_slot(Meta<U>& meta, int s, const ListArgs& a, int64_t t, bool& aligned) {
  if constexpr (L < Lists::depth) {
    constexpr int slot = ListAt<L, Lists>::slot;
    if constexpr (slot >= 0) {
      void* p = a.ptr[L] ? a.ptr[L][t] : nullptr;
      meta.ptr[slot][s] = p;
      aligned = aligned && aligned16(p);
    }
    fill_slot<Lists, L + 1>(meta, s, a, t, aligned);
  }
}

// Calls launch(meta, blocks) for each Meta-full of tensors (empty tensors skipped).
template <class Lists, class Launch>
void for_each_launch(const ListArgs& a, Launch launch) {
  constexpr int U = Lists::used;
  Meta<U> meta;
  meta.count = 0;
  int64_t blocks = 0;
  for (int64_t t = 0; t < a.n; ++t) {
    const int64_t n = a.numel[t];
    if (n == 0) continue;
    const int64_t chunks = (n + kChunk - 1) / kChunk;
    if (meta.count == Meta<U>::capacity || blocks + chunks > int64_t{0x7FFFFFFF}) {
      launch(meta, blocks);
      meta.count = 0;
      blocks = 0;
    }
    const int s = meta.count++;
    bool aligned = true;
    fill_slot<Lists>(meta, s, a, t, aligned);
    meta.numel[s] = n;
    meta.tensor_index[s] = static_cast<int32_t>(t);
    meta.first_block[s] = static_cast<int32_t>(blocks);
    meta.aligned[s] = aligned ? 1 : 0;
    blocks += chunks;
  }
  if (meta.count > 0) launch(meta, blocks);
}

// -------------------------------------------------------------------- one thread's work
// 16 bytes between memory and registers: one vector access on the GPU (cached in L2 only: every
// byte is used once), memcpy on the host (the emulation).
HOST_DEVICE LO_INLINE void load16(void* reg, const void* mem) {
#if defined(__CUDA_ARCH__)
  const uint4 u = __ldcg(static_cast<const uint4*>(mem));
  memcpy(reg, &u, 16);
#else
  std::memcpy(reg, mem, 16);
#endif
}
HOST_DEVICE LO_INLINE void store16(void* mem, const void* reg) {
#if defined(__CUDA_ARCH__)
  uint4 u;
  memcpy(&u, reg, 16);
  __stcg(static_cast<uint4*>(mem), u);
#else
  std::memcpy(mem, reg, 16);
#endif
}

// The registers of one list (nothing for an unused one).
template <typename T, bool USED, int N>
struct Regs {
  alignas(16) T v[N];
  HOST_DEVICE LO_INLINE void* data() { return v; }
};
template <typename T, int N>
struct Regs<T, false, N> {
  HOST_DEVICE LO_INLINE void* data() { return nullptr; }
};

template <int N, class... A> struct Stage {};
template <int N, class A, class... R>
struct Stage<N, A, R...> {
  Regs<typename A::type, A::used, N> head;
  Stage<N, R...> tail;
};
template <class Lists, int N> struct StageOf;
template <class... A, int N> struct StageOf<ListAccess<A...>, N> { using type = Stage<N, A...>; };

template <int L, class S> HOST_DEVICE LO_INLINE auto& regs_at(S& s) {
  if constexpr (L == 0) return s.head;
  else return regs_at<L - 1>(s.tail);
}

template <int... L, class F> HOST_DEVICE LO_INLINE void each_list(std::integer_sequence<int, L...>, F&& f) {
  (f(std::integral_constant<int, L>{}), ...);
}

// Moves W elements of list L between memory (element i) and registers (from r): loads when LOAD, else stores.
template <bool LOAD, class A, int W, class R>
HOST_DEVICE LO_INLINE void move_group(R& regs, int r, void* base, int64_t i) {
  using T = typename A::type;
  constexpr int pieces = W * static_cast<int>(sizeof(T)) / 16;
  static_assert(W * sizeof(T) % 16 == 0, "a group is whole 16-byte pieces");
  char* mem = static_cast<char*>(base) + i * static_cast<int64_t>(sizeof(T));
  char* reg = reinterpret_cast<char*>(regs.v + r);
#pragma unroll
  for (int k = 0; k < pieces; ++k) {
    if constexpr (LOAD) load16(reg + 16 * k, mem + 16 * k);
    else store16(mem + 16 * k, reg + 16 * k);
  }
}

// The tensor slot of a block: the last s with first_block[s] <= block (a bisection, the same for the whole block).
template <int U>
HOST_DEVICE LO_INLINE int slot_of(const Meta<U>& meta, int block) {
  int lo = 0, hi = meta.count;
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (meta.first_block[mid] <= block) lo = mid;
    else hi = mid;
  }
  return lo;
}

// Thread `thread` of block `block`: the op on every element the thread owns. SUMS: op(t, i, a0, a1),
// the thread's partial sums returned in a0, a1 (the caller adds up the block).
template <bool SUMS, class Op, int U>
HOST_DEVICE LO_INLINE void run_thread(const Meta<U>& meta, const Op& op, int block, int thread, float& a0, float& a1) {
  using Lists = typename Op::lists;
  static_assert(Lists::depth == Op::depth, "one access entry per list");
  static_assert(Lists::used == U, "Meta sized for the used lists");
  constexpr int D = Op::depth;
  constexpr int W = 16 / Lists::min_size;
  constexpr int G = kPerThread / W;
  static_assert(G >= 1 && G * W == kPerThread, "whole groups per step");
  using Seq = std::make_integer_sequence<int, D>;

  const int s = slot_of(meta, block);
  const int64_t begin = static_cast<int64_t>(block - meta.first_block[s]) * kChunk;
  const int64_t n = meta.numel[s];
  const int64_t end = begin + kChunk < n ? begin + kChunk : n;
  const int64_t tensor = meta.tensor_index[s];
  void* base[D];
  each_list(Seq{}, [&](auto l) {
    constexpr int slot = ListAt<decltype(l)::value, Lists>::slot;
    if constexpr (slot >= 0) base[decltype(l)::value] = meta.ptr[slot][s];
    else base[decltype(l)::value] = nullptr;
  });

  const int64_t vec_end = meta.aligned[s] ? begin + (end - begin) / W * W : begin;
  if (vec_end > begin) {
    typename StageOf<Lists, kPerThread>::type stage;
    void* regs[D];
    each_list(Seq{}, [&](auto l) { regs[decltype(l)::value] = regs_at<decltype(l)::value>(stage).data(); });
    const auto t = op.bind(regs, tensor);
    for (int64_t i0 = begin + static_cast<int64_t>(thread) * W; i0 < vec_end; i0 += kBlock * kPerThread) {
      bool valid[G];
#pragma unroll
      for (int g = 0; g < G; ++g) {  // all loads of the step first: kPerThread elements in flight
        const int64_t i = i0 + static_cast<int64_t>(g) * kBlock * W;
        valid[g] = i < vec_end;
        if (valid[g]) {
          each_list(Seq{}, [&](auto l) {
            using A = typename ListAt<decltype(l)::value, Lists>::access;
            if constexpr (A::read) move_group<true, A, W>(regs_at<decltype(l)::value>(stage), g * W, base[decltype(l)::value], i);
          });
        }
      }
#pragma unroll
      for (int g = 0; g < G; ++g) {
        if (!valid[g]) continue;
#pragma unroll
        for (int e = g * W; e < g * W + W; ++e) {
          if constexpr (SUMS) op(t, e, a0, a1);
          else op(t, e);
        }
      }
#pragma unroll
      for (int g = 0; g < G; ++g) {
        if (!valid[g]) continue;
        const int64_t i = i0 + static_cast<int64_t>(g) * kBlock * W;
        each_list(Seq{}, [&](auto l) {
          using A = typename ListAt<decltype(l)::value, Lists>::access;
          if constexpr (A::write) move_group<false, A, W>(regs_at<decltype(l)::value>(stage), g * W, base[decltype(l)::value], i);
        });
      }
    }
  }
  // the chunk's last < W elements, or the whole chunk of a tensor that is not 16-byte aligned
  const auto t = op.bind(base, tensor);
  for (int64_t i = vec_end + thread; i < end; i += kBlock) {
    if constexpr (SUMS) op(t, i, a0, a1);
    else op(t, i);
  }
}

}  // namespace mta
}  // namespace lo
