// CPU 1-bit compression: error feedback + sign packing, unpacking. The element math is
// include/onebit_math.h; here it runs over 32K-element chunks (whole bytes) on OpenMP threads,
// 16 (AVX-512) or 8 (AVX2) elements per step, the tail with the portable byte function.
#include <cmath>
#include <utility>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "../include/onebit_math.h"
#include "cpu_loop.h"

namespace lo {
namespace cpu {
namespace {

// One flat buffer as a one-tensor list, so that the chunking and scheduling are the optimizers'.
ListArgs flat(const int64_t* numel, void* const* ptrs, int depth) {
  ListArgs a;
  a.n = *numel > 0 ? 1 : 0;
  a.numel = numel;
  for (int l = 0; l < depth; ++l) a.ptr[l] = ptrs + l;
  return a;
}

// Streaming stores skip reading the output lines first: worth it once the output leaves the caches.
bool use_stream(const void* out, int64_t bytes) {
  return bytes >= (int64_t{16} << 20) && reinterpret_cast<uintptr_t>(out) % 64 == 0;
}

// Elements [begin, end) of a chunk (begin is a multiple of 8).
template <Ef MODE>
void compress_range(const float* x, float* err, uint8_t* packed, int64_t begin, int64_t end, float scale) {
  int64_t i = begin;
#if defined(__AVX512F__)
  const __m512 zero = _mm512_setzero_ps();
  const __m512 pos = _mm512_set1_ps(scale), neg = _mm512_set1_ps(-scale);
  for (; i + 16 <= end; i += 16) {
    __m512 z = _mm512_loadu_ps(x + i);
    if constexpr (MODE == Ef::Feedback) z = _mm512_add_ps(z, _mm512_loadu_ps(err + i));
    __mmask16 m = _mm512_cmp_ps_mask(z, zero, _CMP_GE_OQ);
    if constexpr (MODE != Ef::None) _mm512_storeu_ps(err + i, _mm512_sub_ps(z, _mm512_mask_blend_ps(m, neg, pos)));
    uint16_t bits = static_cast<uint16_t>(m);
    std::memcpy(packed + i / 8, &bits, 2);
  }
#elif defined(__AVX2__)
  const __m256 zero = _mm256_setzero_ps();
  const __m256 pos = _mm256_set1_ps(scale), neg = _mm256_set1_ps(-scale);
  for (; i + 8 <= end; i += 8) {
    __m256 z = _mm256_loadu_ps(x + i);
    if constexpr (MODE == Ef::Feedback) z = _mm256_add_ps(z, _mm256_loadu_ps(err + i));
    __m256 ge = _mm256_cmp_ps(z, zero, _CMP_GE_OQ);
    if constexpr (MODE != Ef::None) _mm256_storeu_ps(err + i, _mm256_sub_ps(z, _mm256_blendv_ps(neg, pos, ge)));
    packed[i / 8] = static_cast<uint8_t>(_mm256_movemask_ps(ge));
  }
#endif
  for (; i < end; i += 8) {
    int count = static_cast<int>(end - i < 8 ? end - i : 8);
    packed[i / 8] = compress_byte<MODE>(x + i, MODE == Ef::None ? nullptr : err + i, count, scale);
  }
}

void unpack_f32(const uint8_t* packed, float* out, int64_t begin, int64_t end, float scale, bool stream) {
  int64_t i = begin;
#if defined(__AVX512F__)
  const __m512 pos = _mm512_set1_ps(scale), neg = _mm512_set1_ps(-scale);
  for (; i + 16 <= end; i += 16) {
    uint16_t bits;
    std::memcpy(&bits, packed + i / 8, 2);
    __m512 v = _mm512_mask_blend_ps(static_cast<__mmask16>(bits), neg, pos);
    if (stream) _mm512_stream_ps(out + i, v);  // chunks start at multiples of 128 KiB: aligned
    else _mm512_storeu_ps(out + i, v);
  }
#endif
  for (; i < end; ++i) out[i] = unpack_value(packed[i / 8], static_cast<int>(i % 8), scale);
}

template <typename T>
void unpack_typed(const uint8_t* packed, T* out, int64_t begin, int64_t end, float scale) {
  const T pos = from_float<T>(scale), neg = from_float<T>(-scale);
#pragma omp simd
  for (int64_t i = begin; i < end; ++i) out[i] = ((packed[i / 8] >> (i % 8)) & 1u) ? pos : neg;
}

void table_f32(const uint8_t* packed, const float* table, float* out, int64_t begin, int64_t end, bool stream) {
  int64_t i = begin;
#if defined(__AVX512F__)
  for (; i + 16 <= end; i += 16) {
    __m256 lo = _mm256_loadu_ps(table + 8 * packed[i / 8]);
    __m256 hi = _mm256_loadu_ps(table + 8 * packed[i / 8 + 1]);
    __m512 v = _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1);
    if (stream) _mm512_stream_ps(out + i, v);
    else _mm512_storeu_ps(out + i, v);
  }
#endif
  for (; i < end; ++i) out[i] = table[8 * packed[i / 8] + i % 8];
}

template <typename T>
void table_typed(const uint8_t* packed, const T* table, T* out, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) out[i] = table[8 * packed[i / 8] + i % 8];
}

}  // namespace

void onebit_unpack_table(const Exec& ex, const uint8_t* packed, DType out_type, const void* table, void* out,
                         int64_t n) {
  void* ptrs[1] = {out};
  const bool stream = out_type == DType::F32 && use_stream(out, n * 4);
  cpu_detail::for_each_segment(ex, flat(&n, ptrs, 1), [&](const cpu_detail::Segment& sg, int64_t) {
    const int64_t begin = sg.begin, end = sg.begin + sg.len;
    switch (out_type) {
      case DType::F32:
        table_f32(packed, static_cast<const float*>(table), static_cast<float*>(out), begin, end, stream);
        break;
      case DType::BF16:
        table_typed(packed, static_cast<const bf16_t*>(table), static_cast<bf16_t*>(out), begin, end);
        break;
      case DType::F16:
        table_typed(packed, static_cast<const f16_t*>(table), static_cast<f16_t*>(out), begin, end);
        break;
    }
  });
#if defined(__AVX512F__)
  if (stream) _mm_sfence();
#endif
}

namespace {
struct RoofOp {
  static constexpr int depth = 4;
  struct Ptrs { float* a; float* b; float* c; const float* d; };
  Ptrs bind(void* const* p, int64_t) const {
    return Ptrs{static_cast<float*>(p[0]), static_cast<float*>(p[1]), static_cast<float*>(p[2]),
                static_cast<const float*>(p[3])};
  }
  LO_INLINE void operator()(const Ptrs& t, int64_t i) const {
    const float d = t.d[i];
    t.a[i] += d;
    t.b[i] += d;
    t.c[i] += d;
  }
};
}  // namespace

void roof(const Exec& ex, float* a, float* b, float* c, const float* d, int64_t n) {
  void* ptrs[4] = {a, b, c, const_cast<float*>(d)};
  cpu_foreach(ex, flat(&n, ptrs, 4), RoofOp{});
}

}  // namespace cpu
}  // namespace lo

// ------------------------------------------------------------------ pieces (per-tensor scales)
namespace lo {
namespace cpu {
namespace {

// Runs fn(item, piece, begin, end) over 32K-element items of the pos space; begin/end are relative to
// the piece and begin is a multiple of 8 (items start at multiples of kChunk, pieces at multiples of 8).
template <class Fn>
void for_each_piece(const Exec& ex, const Pieces& pc, Fn fn) {
  const int64_t chunk = cpu_detail::kChunk;
  const int64_t items = (pc.total + chunk - 1) / chunk;
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(ex.threads, items)));
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1)
  for (int64_t k = 0; k < items; ++k) {
    const int64_t lo = k * chunk, hi = std::min(lo + chunk, pc.total);
    int64_t p = std::upper_bound(pc.pos, pc.pos + pc.n, lo) - pc.pos - 1;
    for (p = std::max<int64_t>(p, 0); p < pc.n && pc.pos[p] < hi; ++p) {
      const int64_t b = std::max(lo, pc.pos[p]), e = std::min(hi, pc.pos[p] + pc.len[p]);
      if (b < e) fn(k, p, b - pc.pos[p], e - pc.pos[p]);
    }
  }
}

// Per-piece sums: each (item, piece) part sums in fp32 lanes, parts are added in double in item
// order, so the result does not depend on the thread count.
template <class PartFn>
void piece_sums(const Exec& ex, const Pieces& pc, double* out, PartFn part) {
  const int64_t items = (pc.total + cpu_detail::kChunk - 1) / cpu_detail::kChunk;
  std::vector<std::vector<std::pair<int64_t, double>>> parts(items);
  for_each_piece(ex, pc, [&](int64_t k, int64_t p, int64_t b, int64_t e) { parts[k].emplace_back(p, part(p, b, e)); });
  for (const auto& item : parts)
    for (const auto& pr : item) out[pr.first] += pr.second;
}

bool aligned64(const void* p) { return reinterpret_cast<uintptr_t>(p) % 64 == 0; }

}  // namespace

void onebit_seg_sumsq(const Exec& ex, const float* x, const float* err, const Pieces& pc, double* out) {
  piece_sums(ex, pc, out, [&](int64_t p, int64_t b, int64_t e) {
    const float* xs = x + pc.off[p];
    const float* es = err ? err + pc.pos[p] : nullptr;
    float acc = 0.0f;
    if (es) {
#pragma omp simd reduction(+ : acc)
      for (int64_t j = b; j < e; ++j) {
        const float z = ef_input(xs[j], es[j]);
        acc += z * z;
      }
    } else {
#pragma omp simd reduction(+ : acc)
      for (int64_t j = b; j < e; ++j) acc += xs[j] * xs[j];
    }
    return static_cast<double>(acc);
  });
}

void onebit_momentum_sumsq(const Exec& ex, float* x, const float* const* grads, float w1, const float* err,
                           const Pieces& pc, double* out) {
  // torch's lerp with its branch on the weight taken once, so that the loop vectorizes
  const bool small = w1 < 0.5f && w1 > -0.5f;
  const float w_end = 1.0f - w1;
  piece_sums(ex, pc, out, [&](int64_t p, int64_t b, int64_t e) {
    float* __restrict__ xs = x + pc.off[p];
    const float* __restrict__ gs = grads[p];
    const float* __restrict__ es = err + pc.pos[p];
    float acc = 0.0f;
    if (small) {
#pragma omp simd reduction(+ : acc)
      for (int64_t j = b; j < e; ++j) {
        const float m = xs[j] + w1 * (gs[j] - xs[j]);
        xs[j] = m;
        const float z = ef_input(m, es[j]);
        acc += z * z;
      }
    } else {
#pragma omp simd reduction(+ : acc)
      for (int64_t j = b; j < e; ++j) {
        const float m = gs[j] - (gs[j] - xs[j]) * w_end;
        xs[j] = m;
        const float z = ef_input(m, es[j]);
        acc += z * z;
      }
    }
    return static_cast<double>(acc);
  });
}

void onebit_seg_compress(const Exec& ex, const float* x, float* err, uint8_t* packed, const Pieces& pc,
                         const float* scales, Ef mode) {
  for_each_piece(ex, pc, [&](int64_t, int64_t p, int64_t b, int64_t e) {
    const float* xs = x + pc.off[p];
    float* es = err ? err + pc.pos[p] : nullptr;
    uint8_t* ps = packed + pc.pos[p] / 8;
    switch (mode) {
      case Ef::None: compress_range<Ef::None>(xs, nullptr, ps, b, e, scales[p]); break;
      case Ef::Residual: compress_range<Ef::Residual>(xs, es, ps, b, e, scales[p]); break;
      case Ef::Feedback: compress_range<Ef::Feedback>(xs, es, ps, b, e, scales[p]); break;
    }
  });
}

void onebit_seg_unpack(const Exec& ex, const uint8_t* packed, const Pieces& pc, const float* scales, DType out_type,
                       void* out) {
  bool streamed = false;
  for_each_piece(ex, pc, [&](int64_t, int64_t p, int64_t b, int64_t e) {
    const uint8_t* ps = packed + pc.pos[p] / 8;
    switch (out_type) {
      case DType::F32: {
        float* os = static_cast<float*>(out) + pc.off[p];
        const bool stream = e - b == cpu_detail::kChunk && aligned64(os + b);  // whole aligned items only
        if (stream) streamed = true;
        unpack_f32(ps, os, b, e, scales[p], stream);
        break;
      }
      case DType::BF16: unpack_typed(ps, static_cast<bf16_t*>(out) + pc.off[p], b, e, scales[p]); break;
      case DType::F16: unpack_typed(ps, static_cast<f16_t*>(out) + pc.off[p], b, e, scales[p]); break;
    }
  });
#if defined(__AVX512F__)
  if (streamed) _mm_sfence();
#endif
}

void onebit_server_mean(const Exec& ex, const uint8_t* rows, int64_t row_stride, int world, const float* scales,
                        float* err, const Pieces& pc, double* out) {
  piece_sums(ex, pc, out, [&](int64_t p, int64_t b, int64_t e) {
    const int64_t base = pc.pos[p];
    float* es = err + base;
    float acc = 0.0f;
    int64_t j = b;
#if defined(__AVX512F__)
    const __m512 divisor = _mm512_set1_ps(static_cast<float>(world));
    __m512 vacc = _mm512_setzero_ps();
    for (; j + 16 <= e; j += 16) {
      __m512 sum = _mm512_setzero_ps();
      for (int w = 0; w < world; ++w) {
        uint16_t bits;
        std::memcpy(&bits, rows + w * row_stride + (base + j) / 8, 2);
        const float s = scales[w * pc.n + p];
        const __m512 v = _mm512_mask_blend_ps(static_cast<__mmask16>(bits), _mm512_set1_ps(-s), _mm512_set1_ps(s));
        sum = w == 0 ? v : _mm512_add_ps(sum, v);
      }
      const __m512 z = _mm512_add_ps(_mm512_div_ps(sum, divisor), _mm512_loadu_ps(es + j));
      _mm512_storeu_ps(es + j, z);
      vacc = _mm512_add_ps(vacc, _mm512_mul_ps(z, z));
    }
    acc = _mm512_reduce_add_ps(vacc);
#endif
    for (; j < e; ++j) {
      const float z = server_value(rows, row_stride, world, scales + p, pc.n, base + j, es[j]);
      es[j] = z;
      acc += z * z;
    }
    return static_cast<double>(acc);
  });
}

}  // namespace cpu
}  // namespace lo
