"""What the vision tower's last block says about each merged visual token: the attention its
patches received, and their attention keys.

VisionZip, FlashVid, FastVID and HoliTom rank tokens by the received attention; VisionZip also
measures token similarity on the keys. The tower runs fused attention kernels, so both are
recomputed eagerly from the last block's captured input with one qkv projection.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch


@contextmanager
def last_block_input(model):
    """Capture the input of the last vision block's attention during a forward of `model`
    (a Qwen VL model): yields a dict filled with module, hidden_states, cu_seqlens and
    position_embeddings."""
    captured = {}

    def capture(module, args, kwargs):
        captured.update(
            module=module,
            hidden_states=args[0],
            cu_seqlens=kwargs["cu_seqlens"],
            position_embeddings=kwargs["position_embeddings"],
        )

    hook = model.model.visual.blocks[-1].attn.register_forward_pre_hook(capture, with_kwargs=True)
    try:
        yield captured
    finally:
        hook.remove()


def received_attention_and_keys(captured: dict, vision_rotary, merge_unit: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per merge unit of `merge_unit` patches, in the block's sequence order, from
    `last_block_input`'s capture (`vision_rotary`: the tower's rotary function):
    - (N,) float32 attention received (`received_attention`);
    - (N, head_dim) float32 keys: the qkv projection's keys *before* rotary, mean over heads, then
      over the unit's patches."""
    attn = captured["module"]
    hidden = captured["hidden_states"]
    cos, sin = captured["position_embeddings"]
    length = hidden.shape[0]
    q, k, _ = attn.qkv(hidden).reshape(length, 3, attn.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
    keys = k.float().mean(dim=1)
    q, k = vision_rotary(q, k, cos, sin)
    received = received_attention(q, k, captured["cu_seqlens"], attn.scaling)
    return per_unit(received, merge_unit), per_unit(keys, merge_unit)


def received_attention(q: torch.Tensor, k: torch.Tensor, cu_seqlens: torch.Tensor, scale: float) -> torch.Tensor:
    """(L,) float32 attention each patch receives: softmax(q k^T * scale) within each attention
    segment (`cu_seqlens`), mean over heads and query patches. q, k: (L, heads, head_dim), after rotary."""
    bounds = cu_seqlens.tolist()
    received = torch.zeros(q.shape[0], device=q.device)
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        scores = torch.einsum("qhd,khd->hqk", q[lo:hi].float(), k[lo:hi].float()) * scale
        received[lo:hi] = scores.softmax(dim=-1).mean(dim=(0, 1))
    return received


def per_unit(values: torch.Tensor, merge_unit: int) -> torch.Tensor:
    """(L, ...) per patch -> (L / merge_unit, ...) mean over each merge unit's consecutive patches."""
    return values.reshape(-1, merge_unit, *values.shape[1:]).mean(dim=1)
