"""FasterVLM against its reference rule, written out here from the authors' code.

Reference: Theia-4869/FasterVLM, branch `video` @ eca4cd5 (Video-LLaVA):
- `videollava/model/multimodal_encoder/languagebind/__init__.py:204-232`: scores are the [CLS]
  row of layer -2's attention, `attentions[:, :, :, 0, 1:]`, shape (B, T, heads, patches);
- `videollava/model/llava_arch.py:141-157` (`encode_videos`): mean over heads (`:145`), per frame
  `torch.topk(..., k=visual_token_num, dim=2)` (`:151`), the indices sorted (`:152`), the
  features gathered (`:154-155`), then projected (`:157`).
And main @ f5d5f12 (LLaVA, images): `llava/model/llava_arch.py:141-157` (mean over heads `:148`,
top-k `:149`, a boolean mask `:152-153`) and `:245` (`image_feature[index_mask]`).

Documented deviations applied to the reference: Qwen has no [CLS], so the scores are one per
merged token (our `received_attention`, already a mean over heads: the test gives ours the head
mean of the same per-head scores the reference means at `:145`); each pair keeps its
`per_pair_budget` share of `keep` (equal pairs and keep = P L: L each, the reference's setting);
ties go to the lower index (`torch.topk` leaves them open: the random float64 scores here have none).
"""

import random

import pytest
import torch

from resadapt_eval.baselines import fastervlm
from resadapt_eval.baselines.common import DROPPED, VisualTokens, merge_groups, per_pair_budget
from resadapt_eval.measure.syncs import counting_syncs

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def reference_video(video_features, video_attentions, visual_token_num: int):
    """encode_videos, Theia-4869/FasterVLM@eca4cd5 `videollava/model/llava_arch.py:141-155`,
    without the projector: video_features (B, T, N, C), video_attentions (B, T, M heads, N)."""
    video_attentions = video_attentions.mean(dim=2)  # :145, (B, T, N)
    B, T, N, C = video_features.shape  # :147
    token_indices = torch.topk(video_attentions, k=visual_token_num, dim=2)[1]  # :151, (B, T, L)
    token_indices = torch.sort(token_indices, dim=2)[0]  # :152
    token_indices_expand = token_indices.unsqueeze(-1).expand(-1, -1, -1, C)  # :154
    video_features = torch.gather(video_features, dim=2, index=token_indices_expand)  # :155, (B, T, L, C)
    return token_indices, video_features


def reference_image(image_feature, image_attention, visual_token_num: int):
    """encode_images + the flat path, Theia-4869/FasterVLM@f5d5f12 `llava/model/llava_arch.py:
    141-153, 245`, one image without the projector: image_feature (N, C), image_attention (M, N)."""
    image_attentions = image_attention[None].mean(dim=1)  # :148, (1, N)
    token_indices = torch.topk(image_attentions, k=visual_token_num, dim=1)[1]  # :149
    index_masks = torch.zeros(1, image_feature.shape[0], dtype=torch.bool)  # :152
    index_masks.scatter_(1, token_indices, True)  # :153
    return torch.arange(image_feature.shape[0])[index_masks[0]], image_feature[index_masks[0]]  # :245


def ours(pair_sizes, feats, scores, keep):
    tokens = VisualTokens(feats, pair_sizes, [(1, 1, s) for s in pair_sizes], scores)
    compression = fastervlm.compress(tokens, keep)
    destinations, sizes, (merged,) = merge_groups(compression, feats)
    return compression, destinations, sizes, merged


@pytest.mark.parametrize("frames,n", [(1, 7), (2, 16), (4, 9), (8, 36)])
def test_fidelity_fastervlm_video_path_every_per_frame_count(frames, n):
    """Equal pairs, keep = frames * L for every L: the reference's batched video code, identical
    kept tokens (original order) and features."""
    gen = torch.Generator().manual_seed(frames * 100 + n)
    heads, dim = 3, 5
    feats = torch.randn(1, frames, n, dim, generator=gen, dtype=torch.float64)
    attentions = torch.rand(1, frames, heads, n, generator=gen, dtype=torch.float64)
    scores = attentions.mean(dim=2).reshape(-1)  # the stand-in is already a head mean
    for per_frame in range(1, n + 1):
        keep = frames * per_frame
        assert per_pair_budget([n] * frames, keep) == [per_frame] * frames  # the reference's setting
        indices, gathered = reference_video(feats, attentions, per_frame)
        expected = (indices[0] + torch.arange(frames)[:, None] * n).reshape(-1)
        compression, destinations, sizes, merged = ours([n] * frames, feats.reshape(-1, dim), scores, keep)
        assert torch.equal(compression.kept, expected)
        assert torch.equal(destinations, expected)
        assert sizes.tolist() == [1] * keep  # nothing merged
        assert torch.equal(merged, gathered.reshape(-1, dim))
        dropped = torch.ones(frames * n, dtype=torch.bool)
        dropped[expected] = False
        assert (compression.assignment[dropped] == DROPPED).all()
        assert compression.weights is None


def test_fidelity_fastervlm_unequal_pairs_image_path():
    """Pairs of different sizes, any keep: each pair is the reference's image rule with its
    `per_pair_budget` share."""
    rng = random.Random(0)
    for case in range(60):
        sizes = [rng.randint(1, 50) for _ in range(rng.randint(1, 6))]
        total = sum(sizes)
        keep = rng.randint(len(sizes), total)
        gen = torch.Generator().manual_seed(case)
        feats = torch.randn(total, 4, generator=gen, dtype=torch.float64)
        heads = torch.rand(2, total, generator=gen, dtype=torch.float64)
        compression, destinations, _, merged = ours(sizes, feats, heads.mean(dim=0), keep)
        kept, features, start = [], [], 0
        for size, k in zip(sizes, per_pair_budget(sizes, keep)):
            at, x = reference_image(feats[start : start + size], heads[:, start : start + size], k)
            kept.append(at + start)
            features.append(x)
            start += size
        assert torch.equal(destinations, torch.cat(kept))
        assert torch.equal(merged, torch.cat(features))


def test_fidelity_fastervlm_ties_go_to_the_lower_index():
    """Equal scores (the documented difference: topk leaves their order open), in pairs of
    different sizes, -inf included (the padding after a short pair's end never outranks it)."""
    inf = float("inf")
    scores = torch.tensor([0.5, 0.5, 0.9, -inf, -inf, 0.1, 0.1, 0.1, 0.1])
    compression, *_ = ours([5, 4], torch.randn(9, 3), scores, 5)
    assert per_pair_budget([5, 4], 5) == [3, 2]
    assert compression.kept.tolist() == [0, 1, 2, 5, 6]
    compression, *_ = ours([5, 4], torch.randn(9, 3), torch.full((9,), -inf), 9)
    assert compression.kept.tolist() == list(range(9))
    compression, *_ = ours([3, 6], torch.randn(9, 3), torch.full((9,), -inf), 4)
    assert compression.kept.tolist() == [0, 3, 4, 5]


def test_fastervlm_keeps_exactly_keep_and_every_pair():
    sizes = [5, 1, 8, 3, 12]
    gen = torch.Generator().manual_seed(1)
    feats, scores = torch.randn(sum(sizes), 2, generator=gen), torch.rand(sum(sizes), generator=gen)
    pair = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    for keep in range(len(sizes), sum(sizes) + 1):
        compression, destinations, sizes_out, _ = ours(sizes, feats, scores, keep)
        assert len(destinations) == keep and sizes_out.sum() == keep
        assert set(pair[destinations].tolist()) == set(range(len(sizes)))
        assert torch.bincount(pair[destinations], minlength=len(sizes)).tolist() == per_pair_budget(sizes, keep)


def test_fastervlm_r1_keeps_everything_unchanged():
    sizes = [6, 6, 5]
    feats, scores = torch.randn(17, 4), torch.rand(17)
    compression, destinations, _, merged = ours(sizes, feats, scores, 17)
    assert torch.equal(compression.assignment, torch.arange(17))
    assert torch.equal(merged, feats)


def test_fastervlm_bfloat16():
    gen = torch.Generator().manual_seed(2)
    feats = torch.randn(3 * 16, 8, generator=gen).to(torch.bfloat16)
    scores = torch.rand(3 * 16, generator=gen).to(torch.bfloat16)
    compression, destinations, _, merged = ours([16] * 3, feats, scores, 12)
    assert compression.assignment.device == feats.device and len(destinations) == 12
    assert merged.dtype == torch.bfloat16 and torch.equal(merged, feats[destinations])
    ranked = [torch.sort(scores[i : i + 16].double(), descending=True, stable=True).indices + i for i in (0, 16, 32)]
    expected = torch.cat([r[:4] for r in ranked]).sort().values
    assert torch.equal(destinations, expected)


def test_fastervlm_host_syncs_are_zero_whatever_the_pairs():
    counts = []
    for pairs in (4, 16):
        gen = torch.Generator().manual_seed(pairs)
        n = pairs * 36
        tokens = VisualTokens(torch.randn(n, 16, generator=gen), [36] * pairs, [(1, 6, 6)] * pairs, torch.rand(n))
        with counting_syncs() as syncs:
            fastervlm.compress(tokens, n // 4)
        counts.append(syncs["n"])
    assert counts == [0, 0]
    # the reference: 0 in its video path (:151-155), one boolean mask per image in the image path (:245)
    feats, attentions = torch.randn(1, 4, 36, 16), torch.rand(1, 4, 2, 36)
    with counting_syncs() as syncs:
        reference_video(feats, attentions, 9)
    assert syncs["n"] == 0


def test_fastervlm_errors():
    tokens = VisualTokens(torch.zeros(8, 2), [4, 4], [(1, 2, 2)] * 2, torch.rand(8))
    for keep in (0, 1, 9):
        with pytest.raises(ValueError, match=f"keep={keep} tokens is outside"):
            fastervlm.compress(tokens, keep)
    with pytest.raises(ValueError, match="received attention"):
        fastervlm.compress(VisualTokens(torch.zeros(8, 2), [4, 4], [(1, 2, 2)] * 2), 4)
