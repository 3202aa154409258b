"""FastV (Chen et al., ECCV 2024, "An Image is Worth 1/2 Tokens After Layer 2"; code:
github.com/pkunlp-icler/FastV, read at d165972: `fastv_forward` in its llava-hf
`modeling_llama.py`, lines 1040-1058 and 1105-1108): after decoder layer K - 1, rank the visual
tokens by the attention the last token pays them in that layer (eager attention, softmax over every
key, mean over heads) and keep the top ones, at their original positions, for every later layer.
The paper's setting is K = 2, keeping 50% (its R is the share kept after layer K); the repository's
demo uses K = 3 and drops 75%.

Deviations from the reference:
- the keep count is solved from the layer-averaged target R (`inside_llm`): the K first layers see
  all N tokens, the rest k = floor((R L - K) N / (L - K)), so (K N + (L - K) k) / (L N) <= R (the
  reference keeps round(N (1 - r))), so that every method is compared at the same R;
- on Qwen3-VL the default K is after the deepstack layers (3 on Qwen3-VL-8B), which add features
  to every visual token;
- only the last token's attention row is computed, from layer K - 1's own q/k projections and
  rotary (no eager attention map of the whole sequence is materialised), in float32; the reference
  rounds the scores and the softmax to the model dtype before the head mean, so in bfloat16 near-
  equal scores can rank differently;
- ties go to the earlier token (the reference's `topk` leaves their order unspecified);
- every visual token of the request is ranked (a video's pairs, or several images), where the
  reference ranks one contiguous image block;
- decoding keeps the pruned KV cache, as FastV's KV-cache variant does.
"""

from __future__ import annotations

from .inside_llm import LAST_TOKEN, Stage, one_stage

DEFAULT_LAYER = 2  # K


def stages(
    num_layers: int, visual: int, retention: float, layers: list[int] | None = None, first_layer: int = 0
) -> list[Stage]:
    """One stage at K (`layers`, default max(2, first_layer)) keeping the most tokens whose
    layer-averaged retention is not above `retention`."""
    return one_stage(num_layers, visual, retention, layers, first_layer, DEFAULT_LAYER, LAST_TOKEN, "FastV")
