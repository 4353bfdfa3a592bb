// StableAdamW (lightning_optim/optim/stableadamw.py) in two phases.
//
// Phase 1 (StableMomentsOp): m <- lerp(m, g, 1 - beta1);  v <- beta2 v + (1 - beta2) g^2 and, when
//   RMS, the per-tensor sum of g^2 / max(v / bc2, eps^2) (the caller turns it into a clipped lr).
// Phase 2 (StableApplyOp): delta = scale[tensor] * m / (sqrt(v / bc2) + eps), scale = -lr_t / bc1,
//   with the per-tensor decoupled decay, Kahan for 16-bit params.
#pragma once

#include "apply_math.h"

namespace lo {

struct StableHyper {
  float w1, beta2, c2, bc2, eps, eps_sq;
  const float* scale;      // phase 2: one per tensor
  const float* keep;       // phase 2: 1 - c per tensor
  const float* neg_decay;  // phase 2: -c per tensor
};

// Lists: 0 param (unused), 1 grad (G), 2 exp_avg, 3 exp_avg_sq.
template <typename G, bool RMS>
struct StableMomentsOp {
  static constexpr int depth = 4;
  static constexpr int n_acc = 1;
  using lists = ListAccess<Unused, In<G>, InOut<float>, InOut<float>>;
  struct Ptrs { const G* g; float* m; float* v; };
  StableHyper h;

  HOST_DEVICE Ptrs bind(void* const* b, int64_t) const {
    return Ptrs{static_cast<const G*>(b[1]), static_cast<float*>(b[2]), static_cast<float*>(b[3])};
  }

  HOST_DEVICE LO_INLINE void operator()(const Ptrs& t, int64_t i, float& ratio, float&) const {
    float g = to_float(t.g[i]);
    float v = t.v[i] * h.beta2 + (h.c2 * g) * g;
    t.m[i] = lerp(t.m[i], g, h.w1);
    t.v[i] = v;
    if constexpr (RMS) {
      float vh = v / h.bc2;
      vh = vh < h.eps_sq ? h.eps_sq : vh;
      ratio += (g * g) / vh;
    }
  }
};

// Lists: 0 param (P), 1 exp_avg, 2 exp_avg_sq, 3 kahan_comp (P).
template <typename P, bool KAHAN>
struct StableApplyOp {
  static constexpr int depth = 4;
  using lists = ListAccess<InOut<P>, In<float>, In<float>, UsedIf<KAHAN, InOut<P>>>;
  struct Ptrs { P* p; const float* m; const float* v; P* comp; float scale; Decay decay; };
  StableHyper h;

  HOST_DEVICE Ptrs bind(void* const* b, int64_t tensor) const {
    return Ptrs{static_cast<P*>(b[0]), static_cast<const float*>(b[1]), static_cast<const float*>(b[2]),
                static_cast<P*>(b[3]), h.scale[tensor], Decay{h.keep[tensor], h.neg_decay[tensor]}};
  }

  HOST_DEVICE LO_INLINE void operator()(const Ptrs& t, int64_t i) const {
    float denom = sqrtf(t.v[i] / h.bc2) + h.eps;
    apply_delta<P, KAHAN>(t.p, t.comp, i, (t.m[i] / denom) * t.scale, t.decay);
  }
};

}  // namespace lo
