"""Visual-token pruning of the KV cache during decoding (DyCoke's second stage), on the HF path:
the engine side of a `baselines.inside_llm.DecodeStage`.

At each decoding step, from decoder layer `layer` on, the step attends to the prompt's text, the
tokens generated so far and only the `keep` visual tokens the current token attends to most in the
layer before (its attention row, mean over heads). The cache itself keeps every token, so the
selection can change from step to step: a step re-selects when its attention over the visual tokens
has a cosine similarity below `threshold` to the previous step's, and otherwise attends to all of
them, as DyCoke's reference does (its selection is reset in the first layers of every step). The
prefill is not touched.

It works through a `DynamicCache` subclass passed to `generate` (`SelectingCache`: the layers from
`layer` on read the selected keys and values) and forward pre-hooks on the decoder layers (the
ranking, and a mask, where the attention takes one, cut to the selected columns): no file of
transformers is changed. `keys_dropped` counts the key columns the steps did not attend to, for
the FLOPs.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from ..baselines.inside_llm import DecodeStage
from ..measure.clock import Spans, Stopwatch
from ..measure.counting import counted_flops
from .layer_pruning import grouped_logits


class SelectingCache(DynamicCache):
    """A `DynamicCache` whose layers from `from_layer` on return only the `selection` columns
    (None: all) of their keys and values; every token stays cached."""

    def __init__(self, from_layer: int, **kwargs):
        super().__init__(**kwargs)
        self.from_layer, self.selection = from_layer, None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        if self.selection is None or layer_idx < self.from_layer:
            return keys, values
        selection = self.selection.to(keys.device)
        return keys[:, :, selection], values[:, :, selection]


def current_token_attention(attention: torch.nn.Module, hidden: torch.Tensor, cos, sin, keys: torch.Tensor):
    """(K,) attention of the one current token `hidden` (1, 1, H) over the layer's cached `keys`
    (1, kv_heads, K, d; rotary applied, the current token's included), mean over heads."""
    rotary = sys.modules[type(attention).__module__].apply_rotary_pos_emb  # the module's own rotary
    q = attention.q_proj(hidden).view(1, 1, -1, attention.head_dim)
    if hasattr(attention, "q_norm"):  # Qwen3-VL normalises q per head before the rotary
        q = attention.q_norm(q)
    q, _ = rotary(q.transpose(1, 2), q.transpose(1, 2)[:, :0], cos, sin)
    scores = torch.softmax(grouped_logits(q, keys).float() * attention.scaling, dim=-1)  # (1, heads, 1, K)
    return scores[0, :, 0].mean(dim=0)


class DecodePruner:
    """Prunes one request's visual tokens from the attention of its decoding steps.

    language_model: the decoder stack; stage: the `DecodeStage`; visual_positions: (N,) indices of
    the visual tokens in the prompt; stopwatch: the engine's clock (default: wall clock). After
    `generate`, `selections` holds each re-selecting step's (step, kept visual positions),
    `keys_dropped` the key columns not attended to (over layers and steps), `flops` the ranking's
    FLOPs and `seconds()` the time its steps' ranking and selection took (in decoding, not the
    prefill: `in_prefill`). `layer_tokens` is None: every layer's prefill sees
    every token. The selection is index bookkeeping on the CPU (a step's attention row comes over
    with one `.cpu()`, the one sync a step, as in the reference); it moves to the cache's device
    once a step, and every layer from the stage on reads it there."""

    layer_tokens = None
    in_prefill = False

    def __init__(
        self, language_model, stage: DecodeStage, visual_positions: torch.Tensor, stopwatch: Stopwatch | None = None
    ):
        self.layers, self.stage = language_model.layers, stage
        self.work = Spans(stopwatch or Stopwatch("cpu"))
        self.visual = visual_positions.cpu()
        self.cache = SelectingCache(stage.layer)
        self.keys_dropped = self.flops = 0
        self.selections: list[tuple[int, torch.Tensor]] = []

    def seconds(self) -> float:
        """Seconds its decoding steps' ranking and selection took so far."""
        return self.work.seconds()

    def held_stages(self) -> None:
        """None: its tokens change at every decoding step; no prefill stage holds fewer."""
        return None

    def generate_kwargs(self) -> dict:
        """What `generate` takes from this pruner: its cache."""
        return dict(past_key_values=self.cache)

    @contextmanager
    def attached(self):
        self.previous, self.query, self.step = None, None, 0
        before = self.layers[self.stage.layer - 1].self_attn
        handles = [before.register_forward_pre_hook(self._capture, with_kwargs=True)]
        handles.append(self.layers[self.stage.layer].register_forward_pre_hook(self._select, with_kwargs=True))
        handles += [
            layer.register_forward_pre_hook(self._cut_mask, with_kwargs=True)
            for layer in self.layers[self.stage.layer :]
        ]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()

    def _capture(self, module, args, kwargs):
        """The layer before the stage: its input, for the current token's query."""
        hidden = args[0] if args else kwargs["hidden_states"]
        self.query = (module, hidden, kwargs["position_embeddings"]) if hidden.shape[1] == 1 else None

    def _select(self, module, args, kwargs):
        """A decoding step at the stage's layer: rank the visual tokens and select (or attend to all)."""
        self.cache.selection = None
        if self.query is None:  # prefill
            return None
        with self.work.timed():
            self._rank_and_select()
        return None

    def _rank_and_select(self) -> None:
        self.step += 1
        attention, hidden, (cos, sin) = self.query
        keys = self.cache.layers[self.stage.layer - 1].keys  # the layer before, this step's key included
        row, flops = counted_flops(current_token_attention, attention, hidden, cos, sin, keys)
        self.flops += flops
        visual = row.cpu()[self.visual]
        similar = (
            self.previous is not None and F.cosine_similarity(visual, self.previous, dim=0) >= self.stage.threshold
        )
        self.previous = visual
        if similar:
            return
        top = self.visual[torch.argsort(visual, descending=True, stable=True)[: self.stage.keep]]
        others = torch.ones(keys.shape[2], dtype=torch.bool)  # cpu: indexed by self.visual, a CPU index
        others[self.visual] = False
        selection = torch.cat([torch.nonzero(others).flatten(), top]).sort().values
        self.cache.selection = selection.to(keys.device)  # once a step, not once a layer
        self.selections.append((self.step, top.sort().values))
        self.keys_dropped += (len(self.visual) - len(top)) * (len(self.layers) - self.stage.layer)

    def _cut_mask(self, module, args, kwargs):
        mask = kwargs.get("attention_mask")
        if self.cache.selection is None or not torch.is_tensor(mask):
            return None
        return args, dict(kwargs, attention_mask=mask[..., self.cache.selection.to(mask.device)])
