"""CAPO equations against values computed by hand (sigmoids written out with math.exp)."""

import math

import pytest
import torch

from resadapt_eval.capo.losses import (
    CAPOConfig,
    allocation_advantage,
    allocator_ppo_loss,
    asymmetric_shaping,
    backbone_ppo_loss,
    capo_advantage,
    concentration_loss,
    dynamic_pivot,
    grpo_advantage,
    proxy_cost,
    rollout_advantage,
    similarity_loss,
)
from resadapt_eval.capo.rewards import (
    choice_letter,
    exact_match,
    format_ok,
    is_correct,
    numeric,
    parse_segments,
    rouge_l,
    task_reward,
    task_score,
    temporal_grounding,
)


def sig(x):
    return 1 / (1 + math.exp(-x))


CFG = CAPOConfig()


def test_proxy_cost():
    # mean s = 1.0 over [0.2, 1.8] -> 0.5; mean 0.6 -> 0.25; masked frame ignored.
    s = torch.tensor([[0.5, 1.5], [0.4, 0.8]])
    assert proxy_cost(s, 0.2, 1.8).tolist() == pytest.approx([0.5, 0.25])
    masked = proxy_cost(torch.tensor([[0.6, 1.8]]), 0.2, 1.8, mask=torch.tensor([[True, False]]))
    assert masked.item() == pytest.approx(0.25)


def test_pivot_and_shaping_on_both_sides():
    cost = torch.tensor([0.2, 0.6])
    pivot = dynamic_pivot(cost, k_mix=0.5, tau_fix=0.4)
    assert pivot.item() == pytest.approx(0.5 * 0.4 + 0.5 * 0.4)
    correct = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    S = asymmetric_shaping(cost, correct, pivot, CFG)
    # below the pivot (c=0.2): correct gets the larger bonus, incorrect the smaller penalty
    assert S[0, 0].item() == pytest.approx(0.7 * sig((0.4 - 0.2) / 0.15))
    assert S[0, 1].item() == pytest.approx(-1.3 * sig((0.2 - 0.4) / 0.15))
    # above the pivot (c=0.6): small bonus, strong penalty
    assert S[1, 0].item() == pytest.approx(0.7 * sig((0.4 - 0.6) / 0.15))
    assert S[1, 1].item() == pytest.approx(-1.3 * sig((0.6 - 0.4) / 0.15))
    assert S[1, 1] < S[0, 1] < 0 < S[1, 0] < S[0, 0]


def test_grpo_and_capo_advantage_by_hand():
    reward = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    cost = torch.tensor([0.2, 0.6])
    std = math.sqrt(0.1875)  # population std of (1, 0, 1, 1)
    base = grpo_advantage(reward)
    assert base[0, 0].item() == pytest.approx(0.25 / std, rel=1e-5)
    assert base[0, 1].item() == pytest.approx(-0.75 / std, rel=1e-5)
    A = capo_advantage(reward, cost, reward, CFG)
    assert A[0, 0].item() == pytest.approx(0.25 / std + 0.25 * 0.7 * sig(0.2 / 0.15) - 0.05 * 0.2, rel=1e-5)
    assert A[0, 1].item() == pytest.approx(-0.75 / std + 0.25 * (-1.3) * sig(-0.2 / 0.15) - 0.05 * 0.2, rel=1e-5)
    assert A[1, 0].item() == pytest.approx(0.25 / std + 0.25 * 0.7 * sig(-0.2 / 0.15) - 0.05 * 0.6, rel=1e-5)
    assert allocation_advantage(A).tolist() == pytest.approx([(A[0, 0] + A[0, 1]).item() / 2, A[1, 0].item()])


def test_floor_keeps_correct_rollouts_positive():
    # All correct -> A^base = 0; the expensive allocation's shaped advantage is negative and floored.
    reward = torch.ones(2, 2)
    cost = torch.tensor([0.2, 0.9])
    pivot = 0.5 * 0.55 + 0.5 * 0.4
    A = capo_advantage(reward, cost, reward, CFG)
    cheap = 0.25 * 0.7 * sig((pivot - 0.2) / 0.15) - 0.05 * 0.2
    expensive = 0.25 * 0.7 * sig((pivot - 0.9) / 0.15) - 0.05 * 0.9
    assert expensive < 0
    assert A[0, 0].item() == pytest.approx(cheap, rel=1e-5)
    assert A[1, 0].item() == pytest.approx(0.001)
    # Incorrect rollouts are never floored.
    wrong = capo_advantage(torch.zeros(1, 2), torch.tensor([0.9]), torch.zeros(1, 2), CFG)
    assert (wrong < 0).all()


def test_ablation_advantages():
    reward = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    cost = torch.tensor([0.2, 0.6])
    direct = rollout_advantage(reward, cost, reward, CAPOConfig(advantage="direct_cost", lambda_cost=1.0))
    assert torch.allclose(direct, grpo_advantage(reward - cost[:, None]))
    acc = rollout_advantage(reward, cost, reward, CAPOConfig(advantage="accuracy_only"))
    assert torch.allclose(acc, grpo_advantage(reward))
    with pytest.raises(ValueError, match="advantage must be one of"):
        CAPOConfig(advantage="greedy")


def test_allocator_ppo_clip_both_ways():
    logp_old = torch.zeros(2, 2)
    logp_new = torch.log(torch.tensor([[1.5, 0.5], [1.5, 0.5]]))
    mask = torch.ones(2, 2, dtype=torch.bool)
    A = torch.tensor([1.0, -1.0])
    loss = allocator_ppo_loss(logp_new, logp_old, A, mask, clip_low=0.2, clip_high=0.28)
    # A=+1: min(1.5, 1.28)=1.28, min(0.5, 0.8)=0.5; A=-1: min(-1.5, -1.28)=-1.5, min(-0.5, -0.8)=-0.8
    assert loss.item() == pytest.approx(-(1.28 + 0.5 - 1.5 - 0.8) / 4)
    sym = allocator_ppo_loss(logp_new, logp_old, A, mask, clip_low=0.2, clip_high=0.2)
    assert sym.item() == pytest.approx(-(1.2 + 0.5 - 1.5 - 0.8) / 4)
    # padded frames do not count
    half = allocator_ppo_loss(logp_new, logp_old, A, torch.tensor([[True, False], [True, False]]), 0.2, 0.28)
    assert half.item() == pytest.approx(-(1.28 - 1.5) / 2)


def test_similarity_and_concentration_losses():
    feats = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
    scales = torch.tensor([1.5, 1.2, 0.5])
    # pair 0: cos 1 -> w = sig(0.45/0.12), log 1.5 + log 1.2 = log 1.8 > 0; pair 1: log 0.6 < 0 -> 0
    expected = sig((1 - 0.55) / 0.12) * math.log(1.8) / 2
    assert similarity_loss(feats, scales, CFG).item() == pytest.approx(expected, rel=1e-5)
    # eta shifts the hinge: with eta = 1 pair 1 (log 0.6 + 1 > 0) counts, weighted by sig(-0.55/0.12)
    shifted = similarity_loss(feats, scales, CAPOConfig(eta_sim=1.0)).item()
    assert shifted == pytest.approx(
        (sig(0.45 / 0.12) * (math.log(1.8) + 1) + sig(-0.55 / 0.12) * (math.log(0.6) + 1)) / 2, rel=1e-5
    )
    alpha, beta = torch.tensor([10.0, 15.0]), torch.tensor([5.0, 10.0])
    assert concentration_loss(alpha, beta, kappa_max=20.0).item() == pytest.approx(2.5)


def test_backbone_token_ppo_and_importance_weight():
    logp_old = torch.zeros(2, 3)
    logp_new = torch.log(torch.tensor([[2.0, 1.0, 1.0], [0.5, 1.0, 1.0]]))
    mask = torch.tensor([[True, True, False], [True, True, True]])
    A = torch.tensor([1.0, -2.0])
    loss = backbone_ppo_loss(logp_new, logp_old, A, mask, 0.2, 0.2)
    # rollout 0 (2 tokens): min(2, 1.2)=1.2, 1 -> mean 1.1; rollout 1: min(-1, -1.6)=-1.6, -2, -2 -> -5.6/3
    assert loss.item() == pytest.approx(-(1.1 + (-5.6 / 3)) / 2)
    weighted = backbone_ppo_loss(logp_new, logp_old, A, mask, 0.2, 0.2, allocation_weight=torch.tensor([0.5, 1.0]))
    assert weighted.item() == pytest.approx(-(0.55 + (-5.6 / 3)) / 2)


def test_rewards():
    assert exact_match("  The Eiffel Tower. ", "the eiffel tower") == 1.0
    assert exact_match("<think>hmm</think><answer>\\boxed{Paris}</answer>", "paris") == 1.0
    for text, letter in [
        ("B", "B"),
        ("(C) a dog", "C"),
        ("D. blue", "D"),
        ("The answer is A", "A"),
        ("Answer: b", "B"),
        ("no idea", None),
    ]:
        assert choice_letter(text) == letter, text
    assert numeric("about 3.141", "3.14") == 1.0 and numeric("3.16", "3.14") == 0.0
    assert numeric("1,000.004", "1000") == 1.0 and numeric("none", "1") == 0.0
    assert rouge_l("the cat is on the mat", "the cat sat on the mat") == pytest.approx(5 / 6)
    assert parse_segments("from 1:05 to 1:20") == [(65.0, 80.0)]
    assert parse_segments("[2.5, 7.5] and 10 - 12 seconds") == [(2.5, 7.5), (10.0, 12.0)]
    # tIoU([2.5, 7.5], [5, 10]) = 2.5 / 7.5; the best pair wins; nothing parsable -> 0
    assert temporal_grounding("2.5 - 7.5", [(5.0, 10.0)]) == pytest.approx(1 / 3)
    assert temporal_grounding("2.5 - 7.5 or 5 - 9", [(5.0, 10.0)]) == pytest.approx(0.8)
    assert temporal_grounding("somewhere in the middle", [(5.0, 10.0)]) == 0.0
    assert task_score("grounding_qa", "B, 5 - 9", "B", [(5.0, 10.0)]) == pytest.approx(1.8)
    good = "<think>look</think><answer>\\boxed{B}</answer>"
    assert format_ok(good) == 1.0 and format_ok("<answer>\\boxed{B}</answer>") == 0.0
    assert format_ok(good + "<answer>\\boxed{C}</answer>") == 0.0
    assert task_reward(1.0, "B", check_format=True) == pytest.approx(0.8)
    assert task_reward(1.0, good, check_format=True) == 1.0
    assert is_correct("multiple_choice", 1.0) == 1.0 and is_correct("temporal_grounding", 0.36) == 1.0
    assert is_correct("temporal_grounding", 0.35) == 0.0 and is_correct("free_form", 0.2) == 0.0
