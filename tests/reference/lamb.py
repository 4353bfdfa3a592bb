"""Reference LAMB (You et al. 2019, "Large Batch Optimization for Deep Learning: Training BERT in
76 minutes", arXiv 1904.00962), with the union of the flags of DeepSpeed ``FusedLamb``,
ColossalAI ``Lamb`` and ColossalAI/apex ``FusedLAMB``.

Per step (t counts optimizer steps; wd, r are per parameter tensor):

    0. global grad-norm clipping (apex FusedLAMB / ColossalAI FusedLAMB):
       N = sqrt(sum over ALL params of ||g||^2)            (raw grads, before weight decay)
       if max_grad_norm > 0 and N > max_grad_norm:  g <- g / (N / max_grad_norm)
       (max_grad_norm = 0 disables clipping.)
    1. L2 mode (adam_w_mode=False):  g <- g + wd * p
    2. m <- b1 m + c g,  c = (1 - b1) if grad_averaging else 1
       v <- b2 v + (1 - b2) g^2
    3. bias_correction:  m_hat = m / (1 - b1^t),  v_hat = v / (1 - b2^t);  else m_hat = m, v_hat = v
    4. denom = sqrt(v_hat + eps) if eps_inside_sqrt else sqrt(v_hat) + eps
       u = m_hat / denom
       adam_w_mode=True:  u <- u + wd * p
    5. trust ratio r:
         adam=True                                   -> r = 1 (Adam with LAMB's update form)
         use_nvlamb=False and wd == 0                -> r = 1 (apex/NVIDIA semantics: the trust
                                                        ratio is applied only to tensors with wd != 0)
         ||p|| == 0 or ||u|| == 0                    -> r = 1
         otherwise                                   -> r = clamp(||p|| / ||u||, min_coeff, max_coeff)
       (||p|| is taken before this step's update.)
    6. p <- p - lr * r * u

Mapping to the libraries checked (via their source):
  * apex / ColossalAI FusedLAMB (multi_tensor_lamb.cu): exactly steps 0-6 with no clamp
    -> use ``max_coeff=inf, min_coeff=0``.
  * DeepSpeed FusedLamb: trust ratio on every tensor (-> ``use_nvlamb=True``) clamped to
    [min_coeff, max_coeff] (defaults 10 / 0.01), ``eps_inside_sqrt`` flag; decoupled wd only.
    Its CUDA kernel differs when ``bias_correction=True``: it computes u (and the trust ratio)
    from the *uncorrected* m, v and folds sqrt(1-b2^t)/(1-b1^t) into the step size; its
    clipping uses (norm + 1e-6) / max_grad_norm. This reference does NOT reproduce those two
    kernel quirks; with ``bias_correction=False`` and no clipping it matches DeepSpeed exactly.
  * ColossalAI Lamb (pytorch-lamb port): no bias correction, eps outside sqrt, decoupled wd,
    trust ratio on every tensor, no clamp -> ``bias_correction=False, use_nvlamb=True,
    max_coeff=inf, min_coeff=0``; its ``adam=True`` flag is our ``adam``.

``weight_decay`` may be a float or a sequence with one value per parameter (so "param groups"
with and without decay can share one global grad-norm clip). ``self.lr`` may be changed between
steps. ``None`` grads are skipped (and excluded from the global norm).
"""

from __future__ import annotations

import math

import torch

from ._common import as_param_list, check_grads, lazy_state, with_grads


class RefLAMB:
    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay=0.0,
        bias_correction: bool = True,
        eps_inside_sqrt: bool = False,
        adam_w_mode: bool = True,
        grad_averaging: bool = True,
        max_grad_norm: float = 0.0,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        use_nvlamb: bool = False,
        adam: bool = False,
    ):
        self.params = as_param_list(params)
        self.lr = lr
        self.beta1, self.beta2 = betas
        self.eps = eps
        if isinstance(weight_decay, (int, float)):
            self.weight_decays = [float(weight_decay)] * len(self.params)
        else:
            self.weight_decays = [float(w) for w in weight_decay]
            if len(self.weight_decays) != len(self.params):
                raise ValueError("weight_decay sequence must have one value per param")
        self.bias_correction = bias_correction
        self.eps_inside_sqrt = eps_inside_sqrt
        self.adam_w_mode = adam_w_mode
        self.grad_averaging = grad_averaging
        self.max_grad_norm = max_grad_norm
        self.max_coeff = max_coeff
        self.min_coeff = min_coeff
        self.use_nvlamb = use_nvlamb
        self.adam = adam
        self.t = 0
        self.state: dict[int, dict] = {}
        self.last_trust_ratios: list[float | None] = [None] * len(self.params)

    @torch.no_grad()
    def step(self, grads) -> None:
        grads = check_grads(self.params, grads)
        self.t += 1
        t = self.t

        # 0. global gradient-norm clipping over all params
        clip_divisor = 1.0
        if self.max_grad_norm > 0:
            total_sq = 0.0
            for g in grads:
                if g is not None:
                    total_sq += float(torch.sum(g.double() * g.double()))
            global_norm = math.sqrt(total_sq)
            if global_norm > self.max_grad_norm:
                clip_divisor = global_norm / self.max_grad_norm

        for i, p, g in with_grads(self.params, grads):
            wd = self.weight_decays[i]
            st = lazy_state(self.state, i,
                            lambda: {"exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)})

            g = g / clip_divisor
            if not self.adam_w_mode and wd != 0:
                g = g + wd * p

            m = st["exp_avg"]
            v = st["exp_avg_sq"]
            c = (1 - self.beta1) if self.grad_averaging else 1.0
            m.copy_(self.beta1 * m + c * g)
            v.copy_(self.beta2 * v + (1 - self.beta2) * g * g)

            if self.bias_correction:
                m_hat = m / (1 - self.beta1**t)
                v_hat = v / (1 - self.beta2**t)
            else:
                m_hat = m
                v_hat = v

            if self.eps_inside_sqrt:
                denom = torch.sqrt(v_hat + self.eps)
            else:
                denom = torch.sqrt(v_hat) + self.eps
            u = m_hat / denom
            if self.adam_w_mode and wd != 0:
                u = u + wd * p

            r = 1.0
            if not self.adam and (self.use_nvlamb or wd != 0):
                p_norm = float(torch.linalg.vector_norm(p))
                u_norm = float(torch.linalg.vector_norm(u))
                if p_norm != 0 and u_norm != 0:
                    r = min(max(p_norm / u_norm, self.min_coeff), self.max_coeff)
            self.last_trust_ratios[i] = r

            p.sub_(self.lr * r * u)
