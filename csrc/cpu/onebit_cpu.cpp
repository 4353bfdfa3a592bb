// CPU 1-bit compression: error feedback + sign packing, unpacking. The element math is
// include/onebit_math.h; here it runs over 32K-element chunks (whole bytes) on OpenMP threads,
// 16 (AVX-512) or 8 (AVX2) elements per step, the tail with the portable byte function.
#include <cmath>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "../include/onebit_math.h"
#include "cpu_loop.h"

namespace lo {
namespace cpu {
namespace {

struct SumsqOp {
  static constexpr int depth = 2;
  struct Ptrs { const float* x; const float* err; };
  Ptrs bind(void* const* b, int64_t) const {
    return Ptrs{static_cast<const float*>(b[0]), static_cast<const float*>(b[1])};
  }
  LO_INLINE void operator()(const Ptrs& t, int64_t i, float& acc, float&) const {
    float z = ef_input(t.x[i], t.err[i]);
    acc += z * z;
  }
};

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

template <Ef MODE>
void compress(const Exec& ex, const float* x, float* err, uint8_t* packed, int64_t n, float scale) {
  void* ptrs[2] = {const_cast<float*>(x), err};
  ListArgs a = flat(&n, ptrs, 2);
  cpu_detail::for_each_segment(ex, a, [&](const cpu_detail::Segment& sg, int64_t) {
    compress_range<MODE>(x, err, packed, sg.begin, sg.begin + sg.len, scale);
  });
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

void onebit_sumsq(const Exec& ex, const float* x, const float* err, int64_t n, double* out) {
  void* ptrs[2] = {const_cast<float*>(x), const_cast<float*>(err)};
  cpu_reduce(ex, flat(&n, ptrs, 2), SumsqOp{}, out);  // out[0] += sum, out[1] untouched
}

void onebit_compress(const Exec& ex, const float* x, float* err, uint8_t* packed, int64_t n, float scale, Ef mode) {
  switch (mode) {
    case Ef::None: compress<Ef::None>(ex, x, nullptr, packed, n, scale); break;
    case Ef::Residual: compress<Ef::Residual>(ex, x, err, packed, n, scale); break;
    case Ef::Feedback: compress<Ef::Feedback>(ex, x, err, packed, n, scale); break;
  }
}

void onebit_unpack(const Exec& ex, const uint8_t* packed, DType out_type, void* out, int64_t n, float scale) {
  void* ptrs[1] = {out};
  const bool stream = use_stream(out, n * 4);
  cpu_detail::for_each_segment(ex, flat(&n, ptrs, 1), [&](const cpu_detail::Segment& sg, int64_t) {
    const int64_t begin = sg.begin, end = sg.begin + sg.len;
    switch (out_type) {
      case DType::F32: unpack_f32(packed, static_cast<float*>(out), begin, end, scale, stream); break;
      case DType::BF16: unpack_typed(packed, static_cast<bf16_t*>(out), begin, end, scale); break;
      case DType::F16: unpack_typed(packed, static_cast<f16_t*>(out), begin, end, scale); break;
    }
  });
#if defined(__AVX512F__)
  if (stream) _mm_sfence();
#endif
}

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
