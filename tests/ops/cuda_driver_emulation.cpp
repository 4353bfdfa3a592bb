// The CUDA multi-tensor driver (csrc/cuda/multi_tensor_body.h: launch plan, staged 16-byte loads,
// scalar tails) run on the host, block by block and thread by thread, against the plain element loop
// of the CPU kernels (op(t, i) over every element of every tensor). Element results must be bitwise
// equal: the same math on the same values, only the driver differs. Catches a wrong `lists` entry of
// an op (a written list declared In stays unchanged, an Unused list that is touched crashes), index
// and tail errors, tensors cut wrongly across launches. Built by tests/ops/test_cuda_driver_emulation.py
// with g++ alone (no CUDA, no torch). Prints one line per case and exits non-zero on a mismatch.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "cuda/multi_tensor_body.h"

using namespace lo;

namespace {

std::mt19937 rng(1234);

template <typename T> void fill(T* p, int64_t n, float lo, float hi) {
  std::uniform_real_distribution<float> u(lo, hi);
  for (int64_t i = 0; i < n; ++i) p[i] = from_float<T>(u(rng));
}

// One list of one tensor: a 64-byte aligned buffer, the tensor starting `shift` elements into it.
struct Buffer {
  std::vector<unsigned char> bytes;
  size_t start = 0, size = 0;  // start >= 64: a guard before, 64 bytes after
  void* data() { return bytes.data() + start; }
  // the tensor's bytes and 64 guard bytes either side (nothing may be written there)
  bool same(const Buffer& o) const {
    return size == o.size && std::memcmp(bytes.data() + start - 64, o.bytes.data() + o.start - 64, size + 128) == 0;
  }
};

template <class Op>
struct Lists {
  static constexpr int D = Op::depth;
  std::vector<Buffer> buf[D];  // [list][tensor]
  size_t elem[D] = {};
};

template <int L, class Op>
void allocate(Lists<Op>& ls, const std::vector<int64_t>& sizes, const std::vector<int>& shifts, int shifted_list) {
  if constexpr (L < Op::depth) {
    using A = typename ListAt<L, typename Op::lists>::access;
    if constexpr (A::used) {
      using T = typename A::type;
      ls.elem[L] = sizeof(T);
      for (size_t t = 0; t < sizes.size(); ++t) {
        Buffer b;
        const int shift = (shifted_list < 0 || shifted_list == L) ? shifts[t] : 0;
        b.bytes.resize((sizes[t] + 4) * sizeof(T) + 192);
        const size_t misalign = reinterpret_cast<uintptr_t>(b.bytes.data()) % 64;
        b.start = (misalign ? 64 - misalign : 0) + 64 + shift * sizeof(T);
        b.size = sizes[t] * sizeof(T);
        // states (fp32 lists past the first two) stay positive: exp_avg_sq under a square root
        fill(static_cast<T*>(b.data()), sizes[t], L >= 2 && sizeof(T) == 4 ? 0.01f : -2.0f, 2.0f);
        ls.buf[L].push_back(std::move(b));
      }
    }
    allocate<L + 1>(ls, sizes, shifts, shifted_list);
  }
}

template <class Op> struct Args {
  std::vector<void*> ptrs[Op::depth];
  ListArgs a;
};

template <class Op> void args_of(Lists<Op>& ls, const std::vector<int64_t>& sizes, Args<Op>& out) {
  out.a.n = static_cast<int64_t>(sizes.size());
  out.a.numel = sizes.data();
  for (int l = 0; l < Op::depth; ++l) {
    if (ls.buf[l].empty()) continue;
    for (auto& b : ls.buf[l]) out.ptrs[l].push_back(b.data());
    out.a.ptr[l] = out.ptrs[l].data();
  }
}

template <bool SUMS, class Op>
void reference(const Op& op, const ListArgs& a, std::vector<double>& sums) {
  for (int64_t t = 0; t < a.n; ++t) {
    void* base[Op::depth];
    for (int l = 0; l < Op::depth; ++l) base[l] = a.ptr[l] ? a.ptr[l][t] : nullptr;
    const auto b = op.bind(base, t);
    for (int64_t i = 0; i < a.numel[t]; ++i) {
      if constexpr (SUMS) {  // each term alone, added in double: a reference sum, not one of its orders
        float a0 = 0.0f, a1 = 0.0f;
        op(b, i, a0, a1);
        sums[2 * t] += a0;
        sums[2 * t + 1] += a1;
      } else {
        op(b, i);
      }
    }
  }
}

template <bool SUMS, class Op>
int emulated(const Op& op, const ListArgs& a, std::vector<double>& sums) {
  int launches = 0;
  mta::for_each_launch<typename Op::lists>(a, [&](const mta::Meta<Op::lists::used>& meta, int64_t blocks) {
    ++launches;
    for (int b = 0; b < blocks; ++b) {
      const int64_t k = meta.tensor_index[mta::slot_of(meta, b)];
      for (int th = 0; th < mta::kBlock; ++th) {
        float a0 = 0.0f, a1 = 0.0f;
        mta::run_thread<SUMS>(meta, op, b, th, a0, a1);
        sums[2 * k] += a0;
        sums[2 * k + 1] += a1;
      }
    }
  });
  return launches;
}

int failures = 0;

// shifted_list: -1 shifts every list of the shifted tensors, l >= 0 only list l
template <bool SUMS = false, class Op>
void check(const char* name, const Op& op, int shifted_list = -1) {
  std::vector<int64_t> sizes = {5, 0, 4, 16384, 16385, 40003, 1, 8, 3 * 16384, 2, 4099, 16391, 7, 33000};
  for (int i = 0; i < 150; ++i) sizes.push_back((i * 37) % 700);  // more tensors than one launch holds
  std::vector<int> shifts(sizes.size(), 0);
  shifts[4] = 1;   // 16385 elements, not 16-byte aligned: the scalar loop
  shifts[11] = 2;  // 16391
  shifts[20] = 3;
  Lists<Op> ref, emu;
  rng.seed(42);
  allocate<0>(ref, sizes, shifts, shifted_list);
  rng.seed(42);
  allocate<0>(emu, sizes, shifts, shifted_list);
  Args<Op> ra, ea;
  args_of(ref, sizes, ra);
  args_of(emu, sizes, ea);
  std::vector<double> rs(2 * sizes.size(), 0.0), es(2 * sizes.size(), 0.0);
  reference<SUMS>(op, ra.a, rs);
  const int launches = emulated<SUMS>(op, ea.a, es);
  int bad = 0;
  for (int l = 0; l < Op::depth; ++l) {
    for (size_t t = 0; t < ref.buf[l].size(); ++t) {
      if (!ref.buf[l][t].same(emu.buf[l][t])) {
        if (bad < 5) std::printf("  %s: list %d tensor %zu (%lld elements) differs\n", name, l, t, (long long)sizes[t]);
        ++bad;
      }
    }
  }
  if (SUMS) {
    for (size_t k = 0; k < rs.size(); ++k) {
      const double tol = 1e-5 * std::fabs(rs[k]) + 1e-6;
      if (!(std::fabs(rs[k] - es[k]) <= tol)) {
        if (bad < 5) std::printf("  %s: sum %zu: %.9g vs %.9g\n", name, k, es[k], rs[k]);
        ++bad;
      }
    }
  }
  std::printf("%s %s (%d launches)\n", bad ? "FAIL" : "ok  ", name, launches);
  failures += bad ? 1 : 0;
}

const Decay kDecay{0.99f, -0.01f};
const AdamHyper kAdam{0.1f, 0.999f, 0.001f, -1e-3f, 0.97f, 1e-8f, 0.01f, kDecay};

}  // namespace

int main() {
  check("adam fp32", AdamOp<float, float, void, false, false, true>{kAdam});
  check("adam fp32, one list unaligned", AdamOp<float, float, void, false, false, true>{kAdam}, 3);
  check("adam fp32 amsgrad + bf16 copy", AdamOp<float, float, bf16_t, true, false, true>{kAdam});
  check("adam bf16 kahan, fp32 grads", AdamOp<bf16_t, float, void, false, true, true>{kAdam});
  check("adam f16/f16 amsgrad kahan", AdamOp<f16_t, f16_t, void, true, true, true>{kAdam});
  check("adam bf16 accumulate (no apply)", AdamOp<bf16_t, bf16_t, void, false, true, false>{kAdam});
  check("adam frozen bf16 kahan", AdamFrozenOp<bf16_t, true>{kAdam});
  check("adam frozen fp32", AdamFrozenOp<float, false>{kAdam});
  check("sgd momentum f16 kahan", SgdOp<f16_t, f16_t, true, true, true>{SgdHyper{0.9f, 0.9f, 0.01f, 0.0f, -0.1f, false, true, kDecay}});
  check("sgd plain fp32", SgdOp<float, float, false, false, true>{SgdHyper{0.0f, 1.0f, 0.0f, 0.01f, -0.1f, true, false, kDecay}});
  check("lion bf16 accumulate", LionOp<bf16_t, bf16_t, false, false>{LionHyper{0.1f, 0.01f, -1e-4f, kDecay}});
  check("lion fp32", LionOp<float, float, false, true>{LionHyper{0.1f, 0.01f, -1e-4f, kDecay}});
  AdanHyper adan{0.02f, 0.08f, 0.92f, 0.99f, 0.01f, 0.9f, 0.5f, 0.99f, 1e-8f, -1e-3f, false, kDecay};
  check("adan bf16/fp32 kahan", AdanOp<bf16_t, float, true, true>{adan});
  check("adan fp32", AdanOp<float, float, false, true>{adan});

  std::vector<float> scale(400), keep(400), neg(400);
  for (int i = 0; i < 400; ++i) scale[i] = -1e-3f * (1 + i % 7), keep[i] = 1.0f - 1e-3f * (i % 3), neg[i] = keep[i] - 1.0f;
  LambHyper lamb{1.5f, 0.0f, 0.9f, 0.1f, 0.999f, 0.001f, 0.9f, 0.99f, 1e-6f, 0.01f, false, scale.data()};
  check<true>("lamb moments fp32 (sums)", LambMomentsOp<float, float, true>{lamb});
  check<true>("lamb moments bf16/fp32 (sums)", LambMomentsOp<bf16_t, float, true>{lamb});
  check("lamb apply bf16 kahan", LambApplyOp<bf16_t, true>{lamb});
  check<true>("lars norms f16 (sums)", LarsNormOp<f16_t, f16_t>{});
  LarsHyper lars{0.01f, -1.0f, 1.0f, 0.9f, false, scale.data()};
  check("lars momentum fp32", LarsOp<float, float, true, false, true>{lars});
  StableHyper stable{0.1f, 0.99f, 0.01f, 0.9f, 1e-8f, 1e-16f, scale.data(), keep.data(), neg.data()};
  check<true>("stable moments bf16 grads (sums)", StableMomentsOp<bf16_t, true>{stable});
  check("stable apply f16 kahan", StableApplyOp<f16_t, true>{stable});
  std::printf(failures ? "%d case(s) failed\n" : "all cases equal\n", failures);
  return failures ? 1 : 0;
}
