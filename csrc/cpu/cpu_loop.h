// OpenMP driver over tensor lists of any layout.
//
// The tensors of a call are laid end to end in one virtual index space and cut into work items of
// kChunk elements; an item covers one or more segments (pieces of tensors). 2000 small tensors and
// 8 huge ones both become ~equal items, scheduled dynamically over the threads (the machine may be
// shared). Inside a segment the functor runs in an `omp simd` loop: its typed pointers never alias,
// the 16-bit conversions are integer bit operations, so the compiler vectorises the whole update.
#pragma once

#include <omp.h>

#include <algorithm>
#include <vector>

#include "../include/kernel_api.h"

namespace lo {
namespace cpu_detail {

constexpr int64_t kChunk = 32768;

struct Segment {
  int64_t tensor, begin, len;
};

struct Plan {
  std::vector<Segment> segs;
  std::vector<int64_t> item_begin;  // item k owns segs[item_begin[k], item_begin[k + 1])

  Plan(const ListArgs& a, int64_t chunk) {
    int64_t pos = 0;  // virtual index of the next element
    int64_t item_end = chunk;
    item_begin.push_back(0);
    for (int64_t t = 0; t < a.n; ++t) {
      int64_t begin = 0, size = a.numel[t];
      while (begin < size) {
        int64_t len = std::min(size - begin, item_end - pos);
        segs.push_back(Segment{t, begin, len});
        begin += len;
        pos += len;
        if (pos == item_end) {
          item_begin.push_back(static_cast<int64_t>(segs.size()));
          item_end += chunk;
        }
      }
    }
    if (item_begin.back() != static_cast<int64_t>(segs.size())) item_begin.push_back(static_cast<int64_t>(segs.size()));
  }
  int64_t items() const { return static_cast<int64_t>(item_begin.size()) - 1; }
};

template <int D>
LO_INLINE void base_pointers(const ListArgs& a, int64_t t, void** base) {
  for (int l = 0; l < D; ++l) base[l] = a.ptr[l] ? a.ptr[l][t] : nullptr;
}

template <class SegmentFn>
void for_each_segment(const Exec& ex, const ListArgs& a, SegmentFn fn) {
  Plan plan(a, kChunk);
  const int64_t items = plan.items();
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(ex.threads, items)));
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1)
  for (int64_t k = 0; k < items; ++k) {
    for (int64_t s = plan.item_begin[k]; s < plan.item_begin[k + 1]; ++s) fn(plan.segs[s], s);
  }
}

}  // namespace cpu_detail

// Element-wise update: op(ptrs, i) for every element of every tensor.
template <class Op>
void cpu_foreach(const Exec& ex, const ListArgs& a, const Op& op) {
  cpu_detail::for_each_segment(ex, a, [&](const cpu_detail::Segment& sg, int64_t) {
    void* base[Op::depth];
    cpu_detail::base_pointers<Op::depth>(a, sg.tensor, base);
    // Local copies: the hyper-parameters (floats) could otherwise alias the float stores, and be
    // reloaded every iteration, which stops the vectoriser.
    const Op f = op;
    const auto t = f.bind(base, sg.tensor);
    const int64_t end = sg.begin + sg.len;
#pragma omp simd
    for (int64_t i = sg.begin; i < end; ++i) f(t, i);
  });
}

// Update with two per-tensor sums: op(ptrs, i, acc0, acc1). Each segment sums in fp32 (at most
// kChunk terms, in vector lanes), segments are added in double in a fixed order: deterministic.
template <class Op>
void cpu_reduce(const Exec& ex, const ListArgs& a, const Op& op, double* out) {
  cpu_detail::Plan plan(a, cpu_detail::kChunk);
  std::vector<double> partial(plan.segs.size() * 2, 0.0);
  const int64_t items = plan.items();
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(ex.threads, items)));
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1)
  for (int64_t k = 0; k < items; ++k) {
    for (int64_t s = plan.item_begin[k]; s < plan.item_begin[k + 1]; ++s) {
      const cpu_detail::Segment& sg = plan.segs[s];
      void* base[Op::depth];
      cpu_detail::base_pointers<Op::depth>(a, sg.tensor, base);
      const Op f = op;  // local copy, see cpu_foreach
      const auto t = f.bind(base, sg.tensor);
      float acc0 = 0.0f, acc1 = 0.0f;
      const int64_t end = sg.begin + sg.len;
#pragma omp simd reduction(+ : acc0, acc1)
      for (int64_t i = sg.begin; i < end; ++i) f(t, i, acc0, acc1);
      partial[2 * s] = acc0;
      partial[2 * s + 1] = acc1;
    }
  }
  for (size_t s = 0; s < plan.segs.size(); ++s) {
    out[2 * plan.segs[s].tensor] += partial[2 * s];
    out[2 * plan.segs[s].tensor + 1] += partial[2 * s + 1];
  }
}

}  // namespace lo
