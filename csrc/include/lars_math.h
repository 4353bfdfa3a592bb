// LARS (lightning_optim/optim/lars.py, ColossalAI semantics) in two phases.
//
// Phase 1 (LarsNormOp): per-tensor sums of p^2 and g^2 (raw gradient) for the trust ratio.
// Phase 2 (LarsOp): d = clamp(g + wd p, lo, hi);  b <- d (first) | mu b + d;  d <- b (momentum)
//   delta = scale[tensor] d  with scale = -lr * trust, then apply_delta (Kahan, no decay).
#pragma once

#include "apply_math.h"

namespace lo {

struct LarsHyper {
  float wd, lo, hi, momentum;
  bool first;
  const float* scale;  // one per tensor (phase 2 with APPLY)
};

// Lists: 0 param (P), 1 grad (G).
template <typename P, typename G>
struct LarsNormOp {
  static constexpr int depth = 2;
  static constexpr int n_acc = 2;
  using lists = ListAccess<In<P>, In<G>>;
  struct Ptrs { const P* p; const G* g; };
  LarsHyper h;

  HOST_DEVICE Ptrs bind(void* const* b, int64_t) const {
    return Ptrs{static_cast<const P*>(b[0]), static_cast<const G*>(b[1])};
  }

  HOST_DEVICE LO_INLINE void operator()(const Ptrs& t, int64_t i, float& p_sq, float& g_sq) const {
    float pc = to_float(t.p[i]);
    float g = to_float(t.g[i]);
    p_sq += pc * pc;
    g_sq += g * g;
  }
};

// Lists: 0 param (P), 1 grad (G), 2 momentum_buffer, 3 kahan_comp (P).
template <typename P, typename G, bool MOMENTUM, bool KAHAN, bool APPLY>
struct LarsOp {
  static constexpr int depth = 4;
  using lists = ListAccess<Access<P, true, APPLY>, In<G>, UsedIf<MOMENTUM, InOut<float>>, UsedIf<KAHAN && APPLY, InOut<P>>>;
  struct Ptrs { P* p; const G* g; float* buf; P* comp; float scale; };
  LarsHyper h;

  HOST_DEVICE Ptrs bind(void* const* b, int64_t tensor) const {
    return Ptrs{static_cast<P*>(b[0]), static_cast<const G*>(b[1]), static_cast<float*>(b[2]),
                static_cast<P*>(b[3]), APPLY ? h.scale[tensor] : 0.0f};
  }

  HOST_DEVICE LO_INLINE void operator()(const Ptrs& t, int64_t i) const {
    float pc = to_float(t.p[i]);
    float d = to_float(t.g[i]) + h.wd * pc;
    d = d < h.lo ? h.lo : d;  // NaN passes through, as torch.clamp
    d = d > h.hi ? h.hi : d;
    if constexpr (MOMENTUM) {
      float b = t.buf[i] * h.momentum + d;
      b = h.first ? d : b;
      t.buf[i] = b;
      d = b;
    }
    if constexpr (APPLY) apply_delta<P, KAHAN>(t.p, t.comp, i, d * t.scale, Decay{1.0f, -0.0f});
  }
};

}  // namespace lo
