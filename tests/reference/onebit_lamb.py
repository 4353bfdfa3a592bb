"""Reference 1-bit LAMB (Li et al. 2021, arXiv 2104.06069; DeepSpeed ``OnebitLamb``) run by W
simulated workers in one process, with bias correction and eps placement switches working.
Step t is 1-based; all norms are per param tensor; lr per param.

Warmup (t <= freeze_step), gbar = mean_w g_w (all workers alike):
    m <- b1 m + (1 - b1) gbar,  v <- b2 v + (1 - b2) gbar^2
    u = m_hat / (sqrt(v_hat) + eps) + wd p
    r = clamp(|p| / |u|, min_coeff, max_coeff)   (1, and no EMA update, if a norm is 0)
    c <- coeff_beta c + (1 - coeff_beta) r          (c starts at 0)
    p <- p - lr r u
    after step freeze_step: v_fresh = copy of v
Compression (t > freeze_step):
    first time: s_j = mean_k(sigma_k) / sigma_j, sigma_j = |m_j| / sqrt(numel_j)  (1 if sigma_j = 0)
    m_prev = m;  m_w <- b1 m + (1 - b1) g_w
    m <- mask * C(s m_0 .. s m_{W-1}) / s          (C: 1-bit allreduce of the flat concatenation)
    g~ = (m - b1 m_prev) / (1 - b1);  v_fresh <- b2 v_fresh + (1 - b2) g~^2
    d = sqrt(v_hat) + eps (frozen v),  q = m_hat / d,  u = q + wd p
    f = max(d / (sqrt(v_fresh_hat) + eps));  if wd > 0: rho = min(1, |q| / |u|), f = f rho + 1 - rho
    f = clamp(f, factor_min, factor_max);  f = clamp(f, last (1 - thr), last (1 + thr));  last = f
    p <- p - lr c f u
Bias correction: m_hat = m / (1 - b1^t), v_hat = v / (1 - b2^min(t, freeze_step)),
v_fresh_hat = v_fresh / (1 - b2^t).
"""

from __future__ import annotations

import math

import torch

from ._onebit_workers import Workers


class RefOnebitLamb:
    def __init__(self, params, world_size, lr=1e-3, freeze_step=100, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=0.0, max_coeff=10.0, min_coeff=0.01, coeff_beta=0.9, factor_max=4.0,
                 factor_min=0.5, factor_threshold=0.1, bias_correction=True, lrs=None, masks=None):
        self.w = Workers(params, world_size, lrs, masks)
        self.lr, self.freeze_step, self.betas, self.eps, self.weight_decay = lr, freeze_step, betas, eps, weight_decay
        self.max_coeff, self.min_coeff, self.coeff_beta = max_coeff, min_coeff, coeff_beta
        self.factor_max, self.factor_min, self.factor_threshold = factor_max, factor_min, factor_threshold
        self.bias_correction = bias_correction
        n = len(self.w.shapes)
        self.m, self.v = self.w.zeros(), self.w.zeros()
        self.v_fresh = None
        self.coeff_ema = [0.0] * n
        self.last_factor = [1.0] * n
        self.scaling = None
        self.coeffs = [1.0] * n
        self.t = 0

    @property
    def params(self):
        return self.w.params

    def _lr(self, j):
        return self.w.lrs[j] if self.w.lrs else self.lr

    def step(self, grads):
        b1, b2 = self.betas
        W, n = self.w.world, len(self.w.shapes)
        self.t += 1
        t = self.t
        grads = [[g.float() for g in gs] for gs in grads]
        bc = self.bias_correction
        bc1 = 1 - b1**t if bc else 1.0
        if t <= self.freeze_step:
            bc2 = 1 - b2**t if bc else 1.0
            for j in range(n):
                gbar = Workers.mean([grads[w][j] for w in range(W)])
                for w in range(W):
                    self.m[w][j] = b1 * self.m[w][j] + (1 - b1) * gbar
                    self.v[w][j] = b2 * self.v[w][j] + (1 - b2) * gbar * gbar
                    p = self.w.params[w][j]
                    u = (self.m[w][j] / bc1) / (torch.sqrt(self.v[w][j] / bc2) + self.eps) + self.weight_decay * p
                    p_norm, u_norm = p.norm().item(), u.norm().item()
                    r = 1.0
                    if p_norm > 0 and u_norm > 0:
                        r = min(max(p_norm / u_norm, self.min_coeff), self.max_coeff)
                        if w == 0:
                            self.coeff_ema[j] = self.coeff_beta * self.coeff_ema[j] + (1 - self.coeff_beta) * r
                    self.coeffs[j] = r
                    self.w.params[w][j] = p - self._lr(j) * r * u
            if t == self.freeze_step:
                self.v_fresh = [[x.clone() for x in vs] for vs in self.v]
            return
        if self.v_fresh is None:
            self.v_fresh = [[x.clone() for x in vs] for vs in self.v]
        if self.scaling is None:
            sigma = [self.m[0][j].norm().item() / math.sqrt(self.m[0][j].numel()) for j in range(n)]
            mean = sum(sigma) / n
            self.scaling = [mean / s if s > 0 else 1.0 for s in sigma]
        m_prev = self.m
        local = [[(b1 * m_prev[w][j] + (1 - b1) * grads[w][j]) * self.scaling[j] for j in range(n)] for w in range(W)]
        agreed = self.w.compressed_mean(local, masked=False)
        agreed = [agreed[j] / self.scaling[j] for j in range(n)]
        agreed = [a * self.w.masks[j] if self.w.masks[j] is not None else a for j, a in enumerate(agreed)]
        self.m = [[a.clone() for a in agreed] for _ in range(W)]
        bc2 = 1 - b2**self.freeze_step if bc and self.freeze_step else 1.0
        bc2_fresh = 1 - b2**t if bc else 1.0
        for j in range(n):
            factor = None
            for w in range(W):
                g_rec = (self.m[w][j] - b1 * m_prev[w][j]) / (1 - b1)
                self.v_fresh[w][j] = b2 * self.v_fresh[w][j] + (1 - b2) * g_rec * g_rec
                p = self.w.params[w][j]
                d = torch.sqrt(self.v[w][j] / bc2) + self.eps
                q = (self.m[w][j] / bc1) / d
                u = q + self.weight_decay * p
                if factor is None:  # identical on every worker
                    f = (d / (torch.sqrt(self.v_fresh[w][j] / bc2_fresh) + self.eps)).max().item()
                    if self.weight_decay > 0:
                        u_norm = u.norm().item()
                        rho = min(1.0, q.norm().item() / u_norm) if u_norm > 0 else 1.0
                        f = f * rho + (1 - rho)
                    f = min(max(f, self.factor_min), self.factor_max)
                    last = self.last_factor[j]
                    f = max(min(f, last * (1 + self.factor_threshold)), last * (1 - self.factor_threshold))
                    self.last_factor[j] = factor = f
                    self.coeffs[j] = self.coeff_ema[j] * f
                self.w.params[w][j] = p - self._lr(j) * self.coeffs[j] * u
