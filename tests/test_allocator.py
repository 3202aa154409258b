import json
import math

import numpy as np
import pytest
import torch
from torch.distributions import Beta

from resadapt_eval.allocator import (
    Allocator,
    AllocatorPolicy,
    CheckpointError,
    beta_actions,
    logit_normal_actions,
)
from resadapt_eval.allocator.model import FORMAT_VERSION
from resadapt_eval.budget.plan import QWEN3VL_GRID, QWEN25VL_GRID, base_size, plan_from_scales, project_to_retention
from resadapt_eval.budget.planner import Planner
from resadapt_eval.budget.policies import BudgetSpec

from .helpers import allocator_frames, tiny_allocator_config


def scales_of(allocator, video_frames, query, mode="mean"):
    feats = allocator.encode([video_frames], [query])
    p1, p2 = allocator(**feats)
    return allocator.to_scale(allocator.latent_actions(p1[0], p2[0], mode)).detach()


def test_log_density_is_the_sum_of_per_frame_beta_log_densities_by_hand():
    alpha = torch.tensor([[2.0, 3.0, 1.5]])
    beta = torch.tensor([[3.0, 2.0, 4.0]])
    a = torch.tensor([[0.25, 0.5, 0.9]])

    def log_beta_pdf(x, p, q):  # (p-1) log x + (q-1) log(1-x) - log B(p, q)
        return (
            (p - 1) * math.log(x) + (q - 1) * math.log(1 - x) - (math.lgamma(p) + math.lgamma(q) - math.lgamma(p + q))
        )

    # Beta(2, 3) at 0.25: 0.25 * 0.75^2 * 12 = 1.6875
    assert log_beta_pdf(0.25, 2.0, 3.0) == pytest.approx(math.log(1.6875))
    by_hand = [log_beta_pdf(0.25, 2, 3), log_beta_pdf(0.5, 3, 2), log_beta_pdf(0.9, 1.5, 4)]
    all_frames = Allocator.log_prob(Beta(alpha, beta), a, torch.ones(1, 3, dtype=torch.bool))
    assert all_frames.item() == pytest.approx(sum(by_hand), rel=1e-6)
    # A padded frame does not count.
    two_frames = Allocator.log_prob(Beta(alpha, beta), a, torch.tensor([[True, True, False]]))
    assert two_frames.item() == pytest.approx(sum(by_hand[:2]), rel=1e-6)


def test_beta_head_keeps_alpha_beta_above_one_and_clamped():
    allocator = Allocator(tiny_allocator_config(head_init_std=50.0, max_concentration=30.0))
    alpha, beta = allocator(**allocator.encode([allocator_frames()], ["what happens?"]))
    assert (alpha > 1).all() and (beta > 1).all()
    assert alpha.max() <= 30.0 and beta.max() <= 30.0


def test_initial_mean_scale_is_one():
    allocator = Allocator(tiny_allocator_config(head_init_std=0.0))
    s = scales_of(allocator, allocator_frames(), "what happens?")
    assert torch.allclose(s, torch.ones_like(s), atol=1e-6)
    # With random head weights the average stays near 1.0 over many inputs.
    allocator = Allocator(tiny_allocator_config(head_init_std=0.02))
    mean = torch.cat([scales_of(allocator, allocator_frames(seed=i), f"question {i}") for i in range(8)]).mean()
    assert mean.item() == pytest.approx(1.0, abs=0.05)
    # Other scale ranges map the initial mean to 1.0 too.
    cfg = tiny_allocator_config(head_init_std=0.0, s_min=0.5, s_max=3.0)
    assert scales_of(Allocator(cfg), allocator_frames(), "q").mean().item() == pytest.approx(1.0, abs=1e-6)


def test_gradients_reach_only_trainable_parameters():
    allocator = Allocator(tiny_allocator_config())
    feats = allocator.encode([allocator_frames()], ["which colour?"])
    dist = allocator.distribution(**feats)
    a = dist.sample()
    loss = -Allocator.log_prob(dist, a, feats["frame_mask"]).sum()
    loss.backward()
    names = [name for name, _ in allocator.named_parameters()]
    assert any(n.startswith("encoders.") for n in names) and any(not n.startswith("encoders.") for n in names)
    for name, p in allocator.named_parameters():
        if name.startswith("encoders."):
            assert not p.requires_grad and p.grad is None, name
        else:
            assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_changing_only_the_query_changes_the_scales():
    allocator = Allocator(tiny_allocator_config())
    video = allocator_frames()
    s1 = scales_of(allocator, video, "Which colour is the square?")
    s2 = scales_of(allocator, video, "How many people are dancing at the end?")
    assert (s1 - s2).abs().max() > 1e-4
    assert torch.equal(s1, scales_of(allocator, video, "Which colour is the square?"))


def test_save_load_gives_identical_scales(tmp_path):
    allocator = Allocator(tiny_allocator_config(seed=3))
    allocator.save_pretrained(tmp_path / "ckpt")
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["config.json", "model.safetensors"]
    loaded = Allocator.from_pretrained(tmp_path / "ckpt")
    video = allocator_frames()
    assert torch.equal(scales_of(allocator, video, "q"), scales_of(loaded, video, "q"))
    from safetensors.torch import load_file

    assert not any(k.startswith("encoders.") for k in load_file(str(tmp_path / "ckpt" / "model.safetensors")))


def test_bad_checkpoints_give_clear_errors_naming_the_file(tmp_path):
    good = Allocator(tiny_allocator_config()).save_pretrained(tmp_path / "good")
    weights, config = good / "model.safetensors", good / "config.json"

    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "config.json").write_text(config.read_text())
    (corrupt / "model.safetensors").write_bytes(b"\x00\x01 definitely not safetensors")
    with pytest.raises(CheckpointError, match=f"{corrupt / 'model.safetensors'}: not a readable safetensors file"):
        Allocator.from_pretrained(corrupt)

    wider = tmp_path / "wider"
    Allocator(tiny_allocator_config(width=64)).save_pretrained(wider)
    (wider / "config.json").write_text(config.read_text())  # weights for width 64, config says 32
    with pytest.raises(CheckpointError, match="model.safetensors: .*shape"):
        Allocator.from_pretrained(wider)

    missing_key = tmp_path / "missing"
    Allocator(tiny_allocator_config(num_layers=1)).save_pretrained(missing_key)
    (missing_key / "config.json").write_text(config.read_text())
    with pytest.raises(CheckpointError, match="missing keys .*layers.1"):
        Allocator.from_pretrained(missing_key)

    raw = json.loads(config.read_text())
    for field, value, message in [
        ("format_version", FORMAT_VERSION + 1, "newer than this resadapt-eval reads"),
        ("encoder", "clip-giant", "unknown encoder 'clip-giant'"),
        ("colour", "blue", "unknown config keys"),
    ]:
        bad = tmp_path / f"bad_{field}"
        bad.mkdir()
        (bad / "model.safetensors").write_bytes(weights.read_bytes())
        (bad / "config.json").write_text(json.dumps({**raw, field: value}))
        with pytest.raises(CheckpointError, match=f"{bad / 'config.json'}: .*{message}"):
            Allocator.from_pretrained(bad)
    with pytest.raises(CheckpointError, match="missing Allocator config"):
        Allocator.from_pretrained(tmp_path / "nowhere")


def test_inference_modes():
    alpha, beta = torch.tensor([2.0, 5.0]), torch.tensor([2.0, 1.5])
    assert torch.allclose(beta_actions(alpha, beta, "mean"), torch.tensor([0.5, 5 / 6.5]))
    # The median of a symmetric Beta is 0.5; the 0.25 quantile of Beta(2, 2) solves 3x^2 - 2x^3 = 0.25.
    q = beta_actions(torch.tensor([2.0]), torch.tensor([2.0]), "quantile", quantile=0.25).item()
    assert 3 * q**2 - 2 * q**3 == pytest.approx(0.25, abs=1e-6)
    assert beta_actions(torch.tensor([3.0]), torch.tensor([3.0]), "quantile", 0.5).item() == pytest.approx(0.5)
    s1 = beta_actions(alpha, beta, "sample", seed=7)
    assert torch.equal(s1, beta_actions(alpha, beta, "sample", seed=7))
    assert not torch.equal(s1, beta_actions(alpha, beta, "sample", seed=8))
    with pytest.raises(ValueError, match="inference must be one of"):
        beta_actions(alpha, beta, "mode")


@pytest.mark.parametrize("num_frames", [8, 32, 33])
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("target", [0.25, 0.10, 0.5])
def test_projection_lands_within_one_pair_grid_step_below_target(num_frames, seed, target):
    rng = np.random.default_rng(seed)
    grid = [QWEN25VL_GRID, QWEN3VL_GRID][seed % 2]
    px = grid.token_px
    aspect = rng.uniform(0.4, 2.5)
    base = base_size(int(600 * aspect), 600, grid, 4 * px * px, 768 * px * px)
    raw = rng.uniform(0.3, 1.7, num_frames)
    projected = project_to_retention(raw, target, base, grid, s_min=0.2, s_max=1.8)
    plan = plan_from_scales(projected, base, grid)
    assert plan.retention <= target
    # One pair-grid step: growing any one pair by a token row and column.
    step = max((h + 1) * (w + 1) - h * w for _, h, w in plan.grids) / plan.reference_tokens
    assert target - plan.retention < step
    # Relative allocation kept: one global factor on unclipped frames.
    free = (projected > 0.2 + 1e-9) & (projected < 1.8 - 1e-9)
    ratios = projected[free] / raw[free]
    assert np.allclose(ratios, ratios[0])


def test_projection_rejects_infeasible_targets():
    base = (252, 308)
    with pytest.raises(ValueError, match=r"retention 0.001 is below the reachable floor R=0\.0404 "):
        project_to_retention([1.0] * 8, 0.001, base, QWEN25VL_GRID, 0.2, 1.8)
    with pytest.raises(ValueError, match="above the largest plan"):
        project_to_retention([1.0] * 8, 5.0, base, QWEN25VL_GRID, 0.2, 1.8)


def test_policy_scales_are_projected_to_the_target_and_stage_times_recorded():
    allocator = Allocator(tiny_allocator_config())
    policy = AllocatorPolicy(allocator)
    video_frames = allocator_frames(9, height=240, width=320).numpy()
    raw, seconds = policy.raw_scales(video_frames, "what colour?")
    assert raw.shape == (9,)
    assert set(seconds) == {"allocator_text_s", "allocator_visual_s", "allocator_predict_s"}
    assert all(v > 0 for v in seconds.values())
    planner = Planner(QWEN25VL_GRID, BudgetSpec(retention=0.25))
    base = planner.base_hw((240, 320))
    assert base == base_size(240, 320, QWEN25VL_GRID, 4 * 784, 768 * 784)
    (scales,) = planner.fit([raw], [base], 0.25)
    plan = planner.plan(scales, base)
    assert plan.retention <= 0.25
    assert len(set(np.round(scales, 6))) > 1
    # Without a target the raw scales are used (clipped to the range).
    (free,) = planner.fit([raw], [base], None)
    assert np.allclose(free, np.clip(raw, 0.2, 1.8))


def test_smolvlm_encoders_on_a_tiny_offline_smolvlm(fixtures_dir, tmp_path):
    config = tiny_allocator_config(encoder="smolvlm", encoder_path=str(fixtures_dir / "smolvlm"))
    allocator = Allocator(config)
    assert allocator.encoders.frame_size == 64 and allocator.encoders.frame_dim == 48
    s1 = scales_of(allocator, allocator_frames(), "Which colour is the square?")
    s2 = scales_of(allocator, allocator_frames(), "How many dancers?")
    assert s1.shape == (8,) and (s1 - s2).abs().max() > 1e-5
    allocator.save_pretrained(tmp_path / "smol")
    assert json.loads((tmp_path / "smol" / "config.json").read_text())["encoder_path"] == str(fixtures_dir / "smolvlm")
    assert torch.equal(
        scales_of(Allocator.from_pretrained(tmp_path / "smol"), allocator_frames(), "How many dancers?"), s2
    )


def test_minilm_effnet_encoders_load_offline_and_embed():
    from resadapt_eval.allocator import build_encoders

    enc = build_encoders("minilm-effnet")
    f = enc.encode_frames(allocator_frames(4, height=120, width=160))
    assert f.shape == (4, 1280) and torch.isfinite(f).all()
    t, mask = enc.encode_text(["a red square", "how many people dance in the last scene?"])
    assert t.shape[0] == 2 and t.shape[2] == 384 and mask.sum(1).tolist()[0] < mask.sum(1).tolist()[1]
    # Pretrained, not random: related sentences are closer than unrelated ones (mean-pooled MiniLM).
    emb, m = enc.encode_text(["a red square moves", "a crimson box is moving", "stock prices fell sharply"])
    pooled = torch.nn.functional.normalize((emb * m[..., None]).sum(1) / m.sum(1, keepdim=True), dim=-1)
    assert pooled[0] @ pooled[1] > pooled[0] @ pooled[2] + 0.2


def test_logit_normal_policy_for_the_n_capo_ablation(tmp_path):
    # Hand values: median sigmoid(mu); the 0.8413 quantile is sigmoid(mu + sigma) (Phi(1) = 0.8413).
    mu, sigma = torch.tensor([0.0, 1.0]), torch.tensor([0.5, 2.0])
    assert torch.allclose(logit_normal_actions(mu, sigma, "median"), torch.sigmoid(mu))
    assert torch.allclose(logit_normal_actions(mu, sigma, "quantile", quantile=0.5), torch.sigmoid(mu))
    q = logit_normal_actions(mu, sigma, "quantile", quantile=0.841344746)
    assert torch.allclose(q, torch.sigmoid(mu + sigma), atol=1e-5)
    # log q(a) = log N(logit a; mu, sigma) - log(a (1 - a)), summed over frames.
    allocator = Allocator(tiny_allocator_config(policy="logit_normal", head_init_std=0.0))
    feats = allocator.encode([allocator_frames(4)], ["q"])
    dist = allocator.distribution(**feats)
    a = torch.tensor([[0.2, 0.5, 0.7, 0.9]])
    mu0, sigma0 = allocator(**feats)
    z = torch.log(a / (1 - a))
    by_hand = (
        -0.5 * ((z - mu0) / sigma0) ** 2 - torch.log(sigma0) - 0.5 * math.log(2 * math.pi) - torch.log(a * (1 - a))
    ).sum()
    assert Allocator.log_prob(dist, a, torch.ones(1, 4, dtype=torch.bool)).item() == pytest.approx(
        by_hand.item(), rel=1e-5
    )
    # Initialised at mean scale 1.0, sigma = init_sigma; saves and loads like the Beta head.
    assert torch.allclose(scales_of(allocator, allocator_frames(4), "q"), torch.ones(4), atol=1e-5)
    assert torch.allclose(sigma0, torch.full_like(sigma0, 0.5), atol=1e-5)
    allocator.save_pretrained(tmp_path / "n")
    assert torch.equal(
        scales_of(Allocator.from_pretrained(tmp_path / "n"), allocator_frames(4), "q"),
        scales_of(allocator, allocator_frames(4), "q"),
    )


def test_logit_normal_mean_is_the_mean_not_the_median():
    from scipy.integrate import quad
    from scipy.special import expit

    from resadapt_eval.allocator.model import logit_normal_mu_for_mean

    # Reference: scipy's adaptive quadrature of sigmoid(mu + sigma z) against the N(0, 1) density,
    # independent of the trapezoidal rule `logit_normal_mean` uses.
    def by_quad(m, s):
        density = lambda z: expit(m + s * z) * math.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)  # noqa: E731
        return quad(density, -12, 12, points=[-m / s], epsabs=1e-13, epsrel=1e-12, limit=500)[0]

    cases = [(0.0, 0.5), (1.0, 2.0), (-2.0, 0.3), (2.5, 1.5), (-1.0, 5.0), (3.0, 10.0), (0.5, 40.0), (-6.0, 0.05)]
    mu = torch.tensor([m for m, _ in cases], dtype=torch.float64)
    sigma = torch.tensor([s for _, s in cases], dtype=torch.float64)
    mean = logit_normal_actions(mu, sigma, "mean")
    for got, (m, s) in zip(mean.tolist(), cases, strict=True):
        assert got == pytest.approx(by_quad(m, s), abs=1e-6)
    # A second, independent check: 1e6 samples; the Monte Carlo standard error is below 5e-4 here.
    z = torch.randn(1_000_000, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    mc = torch.sigmoid(mu[:, None] + sigma[:, None] * z).mean(1)
    assert torch.allclose(mean, mc, atol=2e-3)
    # Skewed (mu != 0): the mean is pulled towards 1/2 and is not the median sigmoid(mu).
    median = logit_normal_actions(mu, sigma, "median")
    assert mean[1].item() == pytest.approx(0.6477, abs=1e-4) and median[1].item() == pytest.approx(0.7311, abs=1e-4)
    assert (median[1:-1] - mean[1:-1]).abs().min() > 0.003  # the last case has sigma 0.05: nearly equal
    assert mean[0].item() == pytest.approx(0.5, abs=1e-12)  # symmetric: mean = median
    # Differentiable (the trainer's L_sim uses the policy mean) and float32 in, float32 out.
    mu32 = torch.tensor([1.0, -0.5], requires_grad=True)
    logit_normal_actions(mu32, torch.tensor([2.0, 0.7]), "mean").sum().backward()
    assert mu32.grad is not None and (mu32.grad > 0).all()
    # The head's initial mu makes the mean (not the median) land on scale 1.0 for an asymmetric range.
    config = tiny_allocator_config(policy="logit_normal", head_init_std=0.0, s_min=0.2, s_max=1.4)
    allocator = Allocator(config)
    scales = scales_of(allocator, allocator_frames(4), "q")
    assert torch.allclose(scales, torch.ones(4), atol=1e-5)
    assert not torch.allclose(scales_of(allocator, allocator_frames(4), "q", mode="median"), torch.ones(4), atol=1e-3)
    mu0 = logit_normal_mu_for_mean(config.initial_mean, config.init_sigma)
    assert by_quad(mu0, config.init_sigma) == pytest.approx(config.initial_mean, abs=1e-9)


def test_frame_norm_layer_normalises_the_frozen_features_before_the_projection():
    allocator = Allocator(tiny_allocator_config(frame_norm=True))
    plain = Allocator(tiny_allocator_config(frame_norm=False))  # same seed, same weights: frame_norm adds none
    assert set(allocator.trainable_state_dict()) == set(plain.trainable_state_dict())
    feats = allocator.encode([allocator_frames()], ["q"])
    raw = feats["frame_features"]  # (1, T, 32)
    normalised = (raw - raw.mean(-1, keepdim=True)) / torch.sqrt(raw.var(-1, unbiased=False, keepdim=True) + 1e-5)
    for a, b in zip(allocator(**feats), plain(**dict(feats, frame_features=normalised)), strict=True):
        assert torch.allclose(a, b, atol=1e-5)
    # a per-frame affine change of the features barely moves the normalised policy, but moves the plain one
    shifted = dict(feats, frame_features=raw * 7.0 + 3.0)
    assert (allocator(**feats)[0] - allocator(**shifted)[0]).abs().max() < 0.05
    assert (plain(**feats)[0] - plain(**shifted)[0]).abs().max() > 0.5


def test_text_positions_make_the_policy_read_the_query_s_token_order():
    """The tiny text encoder is a bag of byte embeddings: "red" and "der" look alike without
    `text_positions`, and differ with it."""
    ordered = Allocator(tiny_allocator_config(text_positions=True, head_init_std=1.0))
    bag = Allocator(tiny_allocator_config(text_positions=False, head_init_std=1.0))
    assert set(ordered.trainable_state_dict()) == set(bag.trainable_state_dict())  # no new weights
    video = allocator_frames()
    for allocator, differs in ((ordered, True), (bag, False)):
        a = allocator(**allocator.encode([video], ["the red border"]))[0]
        b = allocator(**allocator.encode([video], ["the der border"]))[0]
        assert bool((a - b).abs().max() > 1e-3) is differs


def test_tiny_colour_encoder_adds_the_joint_rgb_histogram_to_the_tiny_features():
    from resadapt_eval.allocator.encoders import build_encoders

    colour, tiny = build_encoders("tiny-colour"), build_encoders("tiny")
    frame = torch.zeros(1, 64, 64, 3, dtype=torch.uint8)
    frame[:, :, :32, 0] = 255  # left half red (bin r=3, g=0, b=0: 48)
    frame[:, :, 32:, 2] = 255  # right half blue (bin 3)
    features = colour.encode_frames(frame)
    assert features.shape == (1, colour.frame_dim) == (1, 32 + 64)
    assert torch.allclose(features[:, :32], tiny.encode_frames(frame))  # the same seeded CNN
    histogram = features[0, 32:]
    assert histogram.sum() == pytest.approx(1.0)
    # the antialiased 64 -> 32 resize blends one column at the seam: nearly half and half
    assert histogram[48] == pytest.approx(0.5, abs=0.04) and histogram[3] == pytest.approx(0.5, abs=0.04)
    assert histogram[48] + histogram[3] > 0.9
