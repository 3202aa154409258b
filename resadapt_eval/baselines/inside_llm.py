"""Visual-token pruning between the LLM's decoder layers (FastV, PyramidDrop), on the HF path.

A schedule is a list of `Stage(layer, keep)`: from decoder layer `layer` on, only `keep` visual
tokens remain. At each stage the visual tokens still present are ranked by the attention the
prompt's last token pays them in the layer before (mean over heads, softmax over every key, as
FastV and PyramidDrop rank them), and the top `keep` stay, in their original order.

Everything goes through forward pre-hooks on the decoder layers and their attention modules
(`LayerPruner.attached`), never by editing the model: at a stage's layer the hidden states lose
the pruned tokens; every later layer gets the rotary cos/sin, text positions and mask of the kept
tokens only, so a kept token keeps its original M-RoPE position. The KV cache of a pruned layer
holds only the kept tokens; in each decode step the mask (when the attention needs one) drops the
pruned prompt columns. Qwen3-VL adds deepstack features to the visual tokens after its first
layers: a stage must come after them (`first_layer`).

Retention (one rule for every method, see the README): R is the layer-averaged share of visual
tokens, sum over layers of the visual tokens in that layer / (layers x N); the schedules solve
for the keep counts whose layer average is the largest not above the target.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ..budget.plan import InfeasibleBudget
from ..compute.counting import counted_flops


@dataclass(frozen=True)
class Stage:
    """From decoder layer `layer` (0-based) on, `keep` visual tokens remain."""

    layer: int
    keep: int


def layer_counts(stages: list[Stage], num_layers: int, visual: int) -> list[int]:
    """Visual tokens in each decoder layer under `stages`."""
    counts, current = [], visual
    bounds = {s.layer: s.keep for s in stages}
    for layer in range(num_layers):
        current = bounds.get(layer, current)
        counts.append(current)
    return counts


def layer_average(stages: list[Stage], num_layers: int, visual: int) -> float:
    """The layer-averaged retention of a schedule: mean visual tokens per layer / N."""
    return sum(layer_counts(stages, num_layers, visual)) / (num_layers * visual)


def check_layers(layers: list[int], num_layers: int, first_layer: int) -> None:
    """Stage layers strictly increasing within [first_layer, num_layers - 1]."""
    if not layers or sorted(set(layers)) != list(layers):
        raise ValueError(f"prune_layers must be strictly increasing, got {layers}")
    if layers[0] < max(1, first_layer) or layers[-1] >= num_layers:
        raise ValueError(
            f"prune_layers {layers} must lie in [{max(1, first_layer)}, {num_layers - 1}] on this LLM of "
            f"{num_layers} layers (the first layers see every visual token: the ranking reads the layer "
            "before a stage, and Qwen3-VL's deepstack features are added after its first layers)"
        )


def infeasible(retention: float, stages: list[Stage], num_layers: int, visual: int, what: str) -> InfeasibleBudget:
    return InfeasibleBudget(retention, layer_average(stages, num_layers, visual), what)


def last_token_attention(attention: torch.nn.Module, hidden: torch.Tensor, cos, sin) -> torch.Tensor:
    """(L,) attention of the last of L tokens over all L (mean over heads), as `attention` (a
    Qwen2.5-VL / Qwen3-VL text attention module) computes it on its input `hidden` (1, L, H) with
    rotary `cos`, `sin` (1, L, d): only the last query row is formed."""
    rotary = sys.modules[type(attention).__module__].apply_rotary_pos_emb  # the module's own rotary
    d = attention.head_dim
    q = attention.q_proj(hidden[:, -1:]).view(1, 1, -1, d)
    k = attention.k_proj(hidden).view(1, hidden.shape[1], -1, d)
    if hasattr(attention, "q_norm"):  # Qwen3-VL normalises q and k per head before the rotary
        q, k = attention.q_norm(q), attention.k_norm(k)
    q, k = q.transpose(1, 2), k.transpose(1, 2)  # (1, heads, 1, d), (1, kv_heads, L, d)
    q, _ = rotary(q, q, cos[:, -1:], sin[:, -1:])
    _, k = rotary(k, k, cos, sin)
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scores = torch.softmax((q @ k.transpose(-1, -2)).float() * attention.scaling, dim=-1)  # (1, heads, 1, L)
    return scores[0, :, 0].mean(dim=0)


class LayerPruner:
    """Prunes one request's visual tokens inside the LLM during one `generate` call.

    language_model: the decoder stack (`model.model.language_model`); stages: the schedule;
    visual_positions: (N,) indices of the visual tokens in the prompt. After the call,
    `layer_tokens` holds the visual tokens each layer saw and `flops` the ranking's FLOPs."""

    def __init__(self, language_model, stages: list[Stage], visual_positions: torch.Tensor):
        self.layers = language_model.layers
        self.stages = {s.layer: s.keep for s in stages}
        self.visual = visual_positions.cpu()
        self.layer_tokens = layer_counts(stages, len(self.layers), len(self.visual))
        self.flops = 0

    @contextmanager
    def attached(self):
        self.kept = None  # prompt indices the current layer sees (None: all)
        self.kept_by_layer: dict[int, torch.Tensor] = {}
        self.scores = None
        handles = [
            layer.register_forward_pre_hook(self._layer_input(i), with_kwargs=True)
            for i, layer in enumerate(self.layers)
        ]
        handles += [
            self.layers[s - 1].self_attn.register_forward_pre_hook(self._rank, with_kwargs=True) for s in self.stages
        ]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()

    def _rank(self, module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        if hidden.shape[1] > 1:  # prefill: rank by the last token's attention
            cos, sin = kwargs["position_embeddings"]
            self.scores, flops = counted_flops(last_token_attention, module, hidden, cos, sin)
            self.flops += flops

    def _layer_input(self, index: int):
        def hook(module, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            prefill = hidden.shape[1] > 1
            if prefill and index in self.stages:
                hidden = self._prune(hidden, self.stages[index])
            if prefill and self.kept is not None:
                self.kept_by_layer[index] = self.kept
            kept = self.kept_by_layer.get(index)
            if kept is None:
                return None
            kwargs = dict(kwargs)
            if prefill:
                kwargs["position_embeddings"] = tuple(t[:, kept.to(t.device)] for t in kwargs["position_embeddings"])
                if torch.is_tensor(kwargs.get("position_ids")):
                    kwargs["position_ids"] = kwargs["position_ids"][:, kept.to(kwargs["position_ids"].device)]
            mask = kwargs.get("attention_mask")
            if torch.is_tensor(mask):
                columns = torch.cat([kept, torch.arange(self.prompt_length, mask.shape[-1])]).to(mask.device)
                mask = mask[..., columns]
                kwargs["attention_mask"] = mask[..., kept.to(mask.device), :] if prefill else mask
            args = (hidden, *args[1:]) if args else args
            if not args:
                kwargs["hidden_states"] = hidden
            return args, kwargs

        return hook

    def _prune(self, hidden: torch.Tensor, keep: int) -> torch.Tensor:
        """Keep the `keep` visual tokens of the current sequence with the highest scores."""
        if self.kept is None:
            self.prompt_length = hidden.shape[1]
            self.kept = torch.arange(self.prompt_length)
        is_visual = torch.isin(self.kept, self.visual)
        local_visual = torch.nonzero(is_visual).flatten()
        scores = self.scores.cpu()[local_visual]
        top = local_visual[torch.argsort(scores, descending=True, stable=True)[:keep]]
        local = torch.cat([torch.nonzero(~is_visual).flatten(), top]).sort().values
        self.kept = self.kept[local]
        return hidden[:, local.to(hidden.device)]
