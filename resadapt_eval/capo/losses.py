"""Cost-Aware Policy Optimization (paper Sec. 3.3-3.4 and appendix "Derivation").

Shapes, for one prompt: M allocations, N rollouts each, T frames, L tokens.
Every function maps onto one equation; the equation's label is in its comment.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

ADVANTAGES = ("capo", "direct_cost", "accuracy_only")


@dataclass
class CAPOConfig:
    """CAPO hyper-parameters (defaults from the paper's public reference code).

    eta_sim is not given in the paper; 0 means adjacent similar frames are penalised once
    s_t * s_{t+1} > 1.
    """

    k_mix: float = 0.5  # kappa_mix, Eq. capo_pivot
    tau_fix: float = 0.4  # fixed cost target, Eq. capo_pivot
    tau_s: float = 0.15  # sigmoid temperature, Eq. capo_shaping
    lambda_pos: float = 0.7  # lambda_+, Eq. capo_shaping
    lambda_neg: float = 1.3  # lambda_-, Eq. capo_shaping
    lambda_capo: float = 0.25  # Eq. capo_adv
    gamma: float = 0.05  # residual cost pressure, Eq. capo_adv
    eps_pos: float = 0.001  # floor on correct rollouts, Eq. capo_adv
    tau_sim: float = 0.55
    gamma_sim: float = 0.12
    eta_sim: float = 0.0
    lambda_sim: float = 1e-3
    kappa_max: float = 20.0
    lambda_con: float = 5e-4
    clip_low: float = 0.2  # PPO clip epsilon below 1
    clip_high: float = 0.28  # PPO clip epsilon above 1 (asymmetric clip)
    advantage: str = "capo"  # capo | direct_cost (GRPO on Q - lambda_cost C) | accuracy_only
    lambda_cost: float = 1.0  # lambda of the direct-cost ablation
    grpo_eps: float = 1e-6

    def __post_init__(self):
        if self.advantage not in ADVANTAGES:
            raise ValueError(f"advantage must be one of {ADVANTAGES}, got {self.advantage!r}")
        if not self.lambda_neg > self.lambda_pos > 0:
            raise ValueError("CAPO needs lambda_neg > lambda_pos > 0")


def proxy_cost(scales: torch.Tensor, s_min: float, s_max: float, mask: torch.Tensor | None = None) -> torch.Tensor:
    """c(s) = (mean_t s_t - s_min) / (s_max - s_min)   [proxy cost]; scales (..., T) -> (...)."""
    if mask is None:
        mean = scales.mean(dim=-1)
    else:
        mean = (scales * mask).sum(dim=-1) / mask.sum(dim=-1)
    return (mean - s_min) / (s_max - s_min)


def grpo_advantage(task_reward: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """A^base_{m,n} = (R_{m,n} - mean(R)) / (std(R) + eps) over the prompt's M x N rollouts."""
    return (task_reward - task_reward.mean()) / (task_reward.std(unbiased=False) + eps)


def dynamic_pivot(cost: torch.Tensor, k_mix: float, tau_fix: float) -> torch.Tensor:
    """tau_dyn = k_mix * mean_m(c_m) + (1 - k_mix) * tau_fix   [Eq. capo_pivot]; cost (M,)."""
    return k_mix * cost.mean() + (1 - k_mix) * tau_fix


def asymmetric_shaping(cost: torch.Tensor, correct: torch.Tensor, pivot: torch.Tensor, cfg: CAPOConfig) -> torch.Tensor:
    """S_{m,n}   [Eq. capo_shaping]; cost (M,), correct (M, N) -> (M, N).

    correct:    +lambda_+ * sigmoid((tau_dyn - c_m) / tau_s)
    incorrect:  -lambda_- * sigmoid((c_m - tau_dyn) / tau_s)
    """
    c = cost[:, None]
    bonus = cfg.lambda_pos * torch.sigmoid((pivot - c) / cfg.tau_s)
    penalty = -cfg.lambda_neg * torch.sigmoid((c - pivot) / cfg.tau_s)
    return torch.where(correct.bool(), bonus, penalty)


def capo_advantage(
    task_reward: torch.Tensor, cost: torch.Tensor, correct: torch.Tensor, cfg: CAPOConfig
) -> torch.Tensor:
    """A_{m,n}   [Eq. capo_adv]; task_reward (M, N), cost (M,), correct (M, N) -> (M, N).

    A~ = A^base + lambda_capo * S - gamma * c_m;  A = max(A~, eps_+) on correct rollouts.
    """
    base = grpo_advantage(task_reward, cfg.grpo_eps)
    pivot = dynamic_pivot(cost, cfg.k_mix, cfg.tau_fix)
    shaped = base + cfg.lambda_capo * asymmetric_shaping(cost, correct, pivot, cfg) - cfg.gamma * cost[:, None]
    return torch.where(correct.bool(), shaped.clamp(min=cfg.eps_pos), shaped)


def rollout_advantage(
    task_reward: torch.Tensor, cost: torch.Tensor, correct: torch.Tensor, cfg: CAPOConfig
) -> torch.Tensor:
    """Per-rollout advantage (M, N) under the configured variant (CAPO or an ablation)."""
    if cfg.advantage == "capo":
        return capo_advantage(task_reward, cost, correct, cfg)
    if cfg.advantage == "direct_cost":  # Eq. ideal_rollout_reward, Q - lambda C, GRPO-normalised
        return grpo_advantage(task_reward - cfg.lambda_cost * cost[:, None], cfg.grpo_eps)
    return grpo_advantage(task_reward, cfg.grpo_eps)  # accuracy only


def allocation_advantage(advantage: torch.Tensor) -> torch.Tensor:
    """A^CAPO_m = (1/N) sum_n A_{m,n}; (M, N) -> (M,)."""
    return advantage.mean(dim=-1)


def allocator_ppo_loss(
    logp_new: torch.Tensor,
    logp_old: torch.Tensor,
    advantage: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
) -> torch.Tensor:
    """L_theta   [Eq. loss_theta]: per-frame clipped surrogate.

    logp_new, logp_old: log Beta(a_t^(m)) under theta and theta_old, (M, T); advantage (M,);
    mask (M, T) True on real frames. -(1/MT) sum min(r A, clip(r, 1-eps_low, 1+eps_high) A).
    """
    ratio = torch.exp(logp_new - logp_old)
    adv = advantage[:, None]
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - clip_low, 1 + clip_high) * adv)
    return -(surrogate * mask).sum() / mask.sum()


def similarity_loss(frame_features: torch.Tensor, scales: torch.Tensor, cfg: CAPOConfig) -> torch.Tensor:
    """L_sim   [Sec. 3.4]: frame_features (T, d), scales (T,) of one allocation -> scalar.

    w_t = sigmoid((cos(f_t, f_{t+1}) - tau_sim) / gamma_sim);
    L = 1/(T-1) sum_t w_t * max(0, log s_t + log s_{t+1} + eta_sim).
    """
    cos = F.cosine_similarity(frame_features[:-1], frame_features[1:], dim=-1)
    weight = torch.sigmoid((cos - cfg.tau_sim) / cfg.gamma_sim)
    log_s = torch.log(scales)
    return (weight * F.relu(log_s[:-1] + log_s[1:] + cfg.eta_sim)).mean()


def concentration_loss(alpha: torch.Tensor, beta: torch.Tensor, kappa_max: float) -> torch.Tensor:
    """L_con   [Sec. 3.4]: (1/T) sum_t max(0, alpha_t + beta_t - kappa_max)."""
    return F.relu(alpha + beta - kappa_max).mean()


def backbone_ppo_loss(
    logp_new: torch.Tensor,
    logp_old: torch.Tensor,
    advantage: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
    allocation_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """L_phi   [Eq. loss_phi]: token-level clipped surrogate; logp_* (MN, L), advantage (MN,), mask (MN, L).

    -(1/MN) sum_{m,n} (1/L_{m,n}) sum_j min(r_j A, clip(r_j, 1-eps_low, 1+eps_high) A).
    allocation_weight (MN,): omega_theta = q_theta'(a|x) / q_theta_old(a|x), multiplied into A when
    the backbone is updated after the Allocator on the same batch (appendix, sequential updates).
    """
    adv = advantage if allocation_weight is None else advantage * allocation_weight
    ratio = torch.exp(logp_new - logp_old)
    surrogate = torch.minimum(ratio * adv[:, None], ratio.clamp(1 - clip_low, 1 + clip_high) * adv[:, None])
    per_rollout = (surrogate * mask).sum(dim=-1) / mask.sum(dim=-1)
    return -per_rollout.mean()
