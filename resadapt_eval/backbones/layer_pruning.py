"""Visual-token pruning between the LLM's decoder layers on the HF path: the engine side of a
schedule of `baselines.inside_llm.Stage`s (FastV, PyramidDrop, the second stages of PruneVid and
HoliTom). How each `rank_by` ranks the tokens is in `baselines/inside_llm.py`.

Everything goes through forward pre-hooks on the decoder layers and their attention modules
(`LayerPruner.attached`), never by editing the model: at a stage's layer the hidden states lose
the pruned tokens; every later layer gets the rotary cos/sin, text positions and mask of the kept
tokens only, so a kept token keeps its original M-RoPE position. The KV cache of a pruned layer
holds only the kept tokens; in each decode step the mask (when the attention needs one) drops the
pruned prompt columns. Qwen3-VL adds deepstack features to the visual tokens after its first
layers: a stage must come after them (`first_layer`).

Cost in memory: a ranking forms the keys of its L tokens in blocks of at most `BLOCK_ROWS` tokens
(PyramidDrop's input_layernorm included), so it holds the (L, kv_heads d) keys and one block's work,
never an (L, H) copy; HoliTom's merge forms its similarity a block of dropped tokens at a time. The
blocks change no bit of the keys, scores or merged features (`projected_qk`).
"""

from __future__ import annotations

import math
import sys
from contextlib import contextmanager

import numpy as np
import torch
import torch.nn.functional as F

from ..baselines import dart, framefusion, mustdrop, sparsevlm
from ..baselines.inside_llm import (
    BLOCK_ROWS,
    DUAL_FILTER,
    DUPLICATION,
    RATERS,
    STAGE_INPUT,
    TEXT_AFTER_VISUAL,
    Stage,
    layer_counts,
)
from ..budget.plan import InfeasibleBudget
from ..measure.clock import Spans, Stopwatch
from ..measure.counting import counted_flops


def projected_qk(attention: torch.nn.Module, hidden: torch.Tensor, first_query: int, rotary=None, norm=None):
    """(1, heads, Q, d) queries of the last Q = L - first_query of L tokens (None for Q = 0) and (1, kv_heads, L, d)
    keys of all L, as `attention` (a Qwen2.5-VL / Qwen3-VL text attention module) forms them from its
    input, `hidden` (1, L, H) or, when given, `norm(hidden)` (`norm`: the decoder layer's
    input_layernorm): only those query rows are projected, the key heads are not repeated
    (`grouped_logits` pairs each query head with its key head), and `rotary` (cos, sin), each
    (1, L, d), is applied when given. The keys are formed in ceil(L / BLOCK_ROWS) equal blocks of
    tokens (norm, k_proj, Qwen3-VL's per-head k_norm, rotary), each written into one tensor laid out
    as a single pass lays it out, so no (L, H) normed copy or (L, kv_heads d) temporary exists whole.
    Each step acts on each token alone, so the keys are bit for bit those of one pass (checked on CPU
    at 7B's and 8B's widths; a block of fewer than 12 rows can take another matmul path, hence no
    short last block)."""
    d, length = attention.head_dim, hidden.shape[1]
    apply = sys.modules[type(attention).__module__].apply_rotary_pos_emb  # the module's own rotary

    def heads(rows: slice, project, head_norm) -> torch.Tensor:
        """(1, n, heads, d): the `rows` of `hidden` normed, projected and normed per head."""
        x = hidden[:, rows] if norm is None else norm(hidden[:, rows])
        x = project(x).view(1, x.shape[1], -1, d)
        return x if head_norm is None else head_norm(x)  # Qwen3-VL's q_norm / k_norm, before the rotary

    q = None  # first_query == length: the keys alone
    if first_query < length:
        q = heads(slice(first_query, length), attention.q_proj, getattr(attention, "q_norm", None)).transpose(1, 2)
    if rotary is not None:
        cos, sin = rotary
        if q is not None:
            q, _ = apply(q, q[:, :0], cos[:, first_query:], sin[:, first_query:])  # (the empty slice: no work)
    keys, blocks = None, -(-length // BLOCK_ROWS)  # equal blocks: a short last one could change the matmul's path
    for i in range(blocks):
        rows = slice(i * length // blocks, (i + 1) * length // blocks)
        k = heads(rows, attention.k_proj, getattr(attention, "k_norm", None)).transpose(1, 2)  # (1, kv_heads, n, d)
        if rotary is not None:
            _, k = apply(k[:, :0], k, cos[:, rows], sin[:, rows])
        if keys is None:  # (1, L, kv_heads, d) in memory, as one pass's rotary leaves them
            keys = k.new_empty(1, length, k.shape[1], d).transpose(1, 2)
        keys[:, :, rows] = k
    return q, keys


def grouped_logits(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """q k^T for queries (1, heads, Q, d) and keys (1, kv_heads, L, d), each query head against its
    key head (heads // kv_heads consecutive query heads share one, as transformers' `repeat_kv`),
    without repeating the keys: (1, heads, Q, L)."""
    _, heads, queries, d = q.shape
    kv_heads = k.shape[1]
    logits = q.reshape(1, kv_heads, heads // kv_heads * queries, d) @ k.transpose(-1, -2)
    return logits.view(1, heads, queries, k.shape[2])


def query_attention(attention: torch.nn.Module, hidden: torch.Tensor, cos, sin, first_query: int) -> torch.Tensor:
    """(heads, Q, L) causal attention of the last Q = L - first_query of L tokens over all L, as
    `attention` computes it on its input `hidden` (1, L, H) with rotary `cos`, `sin` (1, L, d), in
    float32 (`projected_qk`)."""
    length = hidden.shape[1]
    q, k = projected_qk(attention, hidden, first_query, (cos, sin))
    logits = grouped_logits(q, k).float() * attention.scaling  # (1, heads, Q, L)
    rows = torch.arange(first_query, length, device=logits.device)[:, None]
    logits = logits.masked_fill(torch.arange(length, device=logits.device)[None, :] > rows, float("-inf"))
    return torch.softmax(logits, dim=-1)[0]


def last_token_attention(attention: torch.nn.Module, hidden: torch.Tensor, cos, sin) -> torch.Tensor:
    """(L,) attention of the last of L tokens over all L, mean over heads (FastV's ranking)."""
    return query_attention(attention, hidden, cos, sin, hidden.shape[1] - 1)[:, 0].mean(dim=0)


def stage_input_attention(layer: torch.nn.Module, hidden: torch.Tensor, cos, sin) -> torch.Tensor:
    """(L,) PyramidDrop's ranking row at a stage boundary: decoder `layer`'s own input_layernorm,
    then its attention's q/k projections (with Qwen3-VL's per-head q/k norms) and rotary `cos`, `sin`
    (1, L, d), on the hidden states `hidden` (1, L, H) entering that layer; the last token's query
    against all L keys, divided by sqrt(head_dim) in the model's dtype, softmax in float32 cast back
    to that dtype, mean over heads in that dtype (PyramidDrop's modeling_llama_pdrop.py, lines
    1321-1342 and 1395-1399; the last token sees every key, so the causal mask adds nothing)."""
    attention = layer.self_attn
    q, k = projected_qk(attention, hidden, hidden.shape[1] - 1, (cos, sin), layer.input_layernorm)
    logits = grouped_logits(q, k) / math.sqrt(attention.head_dim)  # (1, heads, 1, L)
    weights = torch.softmax(logits, dim=-1, dtype=torch.float32).to(q.dtype)
    return weights[0, :, 0].mean(dim=0)


def text_attention(attention: torch.nn.Module, hidden: torch.Tensor, cos, sin, first_query: int) -> torch.Tensor:
    """(L,) PruneVid's ranking by the question: the attention of the text tokens from `first_query` on
    (the text after the video) over all L, max over heads and those tokens, as the reference's stage
    reads it. That map is `attn_weights_wo_pos` (Visual-AI/PruneVid@b12600c models/pllava/llama.py
    :445-449, returned at :514 in the prefill; the SDPA layer, modeling_pllava.py :586, falls back to
    it at :645-660 since the stage's layer asks for attentions, :1417-1418): q k^T of the layer's
    projections WITHOUT rotary (applied only after, :451-452) and WITHOUT the causal mask (added only
    to the real attention, :478-480), divided by sqrt(head_dim) in the model's dtype, softmax over
    all L keys in float32 cast back to that dtype; then max over heads and over the query rows after
    the video, in that dtype (elastic_cache.py :163, :125). Each query head reads its GQA key head (the
    reference's LLaMA-7B has one per query head). `cos`, `sin` are unused (the other rankings'
    signature). Only the Q query rows are projected: a (heads, Q, L) map, never L x L."""
    q, k = projected_qk(attention, hidden, first_query)
    logits = grouped_logits(q, k) / math.sqrt(attention.head_dim)  # (1, heads, Q, L)
    weights = torch.softmax(logits, dim=-1, dtype=torch.float32).to(q.dtype)
    return weights[0].amax(dim=(0, 1))


def merge_into_nearest(hidden: torch.Tensor, kept: torch.Tensor, dropped: torch.Tensor) -> torch.Tensor:
    """`hidden` (1, L, H) with each `dropped` position (in increasing order) averaged into the
    `kept` position of highest cosine similarity: kept <- (kept + dropped) / 2, in turn. A kept
    token that takes m dropped ones d_1 < ... < d_m becomes kept / 2^m + sum_j d_j / 2^(m - j + 1).
    The (D, K) float32 similarity is formed for ceil(D / BLOCK_ROWS) equal blocks of dropped tokens
    at a time, each reduced to its argmax (rows bit for bit those of one product, as the keys in
    `projected_qk`)."""
    if len(dropped) == 0:
        return hidden
    h = hidden[0]
    unit_kept = F.normalize(h[kept].float(), dim=-1).T  # (H, K)
    target = torch.cat(  # (D,) index into kept, dropped in increasing order
        [
            (F.normalize(h[rows].float(), dim=-1) @ unit_kept).argmax(dim=-1)
            for rows in dropped.tensor_split(-(-len(dropped) // BLOCK_ROWS))
        ]
    )
    del unit_kept
    counts = torch.zeros(len(kept), dtype=torch.long, device=target.device).index_add_(
        0, target, torch.ones_like(target)
    )  # m per kept token (bincount would read its maximum on the host)
    order = torch.argsort(target, stable=True)  # dropped grouped by target, in token order
    rank = torch.empty_like(order)
    starts = torch.cumsum(counts, 0) - counts
    rank[order] = torch.arange(len(order), device=order.device) - starts[target[order]] + 1  # j, 1-based
    weights = torch.pow(0.5, (counts[target] - rank + 1).to(h.dtype))  # 2^-(m - j + 1)
    merged = h[kept] * torch.pow(0.5, counts.to(h.dtype))[:, None]
    merged = merged.index_add(0, target, h[dropped] * weights[:, None])
    out = hidden.clone()
    out[0, kept] = merged
    return out


class LayerPruner:
    """Prunes one request's visual tokens inside the LLM during one `generate` call.

    language_model: the decoder stack (`model.model.language_model`); stages: the schedule;
    visual_positions: (N,) indices of the visual tokens in the prompt; stopwatch: the engine's clock
    (default: wall clock). After the call, `layer_tokens` holds the visual tokens each layer saw,
    `flops` the ranking's FLOPs and `seconds()` the time its ranking and pruning took, all in the
    prefill (`in_prefill`). Its index bookkeeping runs on the hidden states' device from the first
    stage on (the visual and text positions copied there once): the ranking, the pick and every later
    layer's cut of the rotary, positions and mask read device indices, so a prefill makes no host
    sync (the text after the video, which PruneVid and DART read, is never pruned: its length is known
    on the host), but one for a DART stage (its 8 pivots' indices, `dart.select`).

    protected: (k,) prompt positions of visual tokens every stage keeps (MustDrop's key set). Stages
    with `cut_cache` (MustDrop's) also cut, once the prefill ends, the KV caches of
    `mustdrop.cut_layers` to the last stage's tokens; `keys_dropped` counts the key columns the
    decoding steps then skip (for the FLOPs)."""

    in_prefill = True

    def __init__(
        self,
        language_model,
        stages: list[Stage],
        visual_positions: torch.Tensor,
        stopwatch: Stopwatch | None = None,
        protected: torch.Tensor | None = None,
    ):
        self.layers = language_model.layers
        self.language_model = language_model
        self.schedule = list(stages)
        self.stages = {s.layer: s for s in stages}
        self.visual = visual_positions.cpu()  # host-side facts: the last visual position, the text positions
        self.first_after_visual = int(self.visual[-1]) + 1  # prompt index
        self.layer_tokens = layer_counts(stages, len(self.layers), len(self.visual))
        self.protected = protected
        self.cut_layers = mustdrop.cut_layers(self.schedule)
        self.keys_dropped = 0
        self.flops = 0
        self.work = Spans(stopwatch or Stopwatch("cpu"))

    def seconds(self) -> float:
        """Seconds its ranking and pruning took so far."""
        return self.work.seconds()

    def held_stages(self) -> list[tuple[int, list[int]]]:
        """After the call: for each layer whose input was reduced, the visual tokens held from there on,
        as ordinals among those that entered the LLM (read to the host once, after generation)."""
        return [(layer, np.searchsorted(self.visual.numpy(), kept.cpu().numpy()).tolist()) for layer, kept in self.held]

    def generate_kwargs(self) -> dict:
        """What `generate` takes from this pruner: nothing (it works through hooks alone)."""
        return {}

    @contextmanager
    def attached(self):
        self.kept = None  # prompt indices the current layer sees (None: all)
        self.visual_kept = None  # the prompt positions of the visual tokens it sees (None: all)
        self.held: list[tuple[int, torch.Tensor]] = []  # (layer, visual_kept) after each reduction
        self.kept_by_layer: dict[int, torch.Tensor] = {}  # the prompt positions each layer saw in the prefill
        self.cached: dict[int, torch.Tensor] = {}  # those its cache holds while decoding, where cut since
        self.dropped_columns: dict[int, int] = {}  # prompt columns each cut cache lost
        self.scores = None
        self.rater_weights = None  # SparseVLM's raters among the text after the video
        handles = [
            layer.register_forward_pre_hook(self._layer_input(i), with_kwargs=True)
            for i, layer in enumerate(self.layers)
        ]
        handles += self._ranking_hooks()
        if self.cut_layers:  # after the last layer of the prefill every layer's cache is filled
            handles.append(self.layers[-1].register_forward_hook(self._after_prefill, with_kwargs=True))
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()

    def _ranker(self, stage: Stage):
        def hook(module, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            if hidden.shape[1] == 1:  # decoding: the ranking is done
                return
            with self.work.timed():  # prefill: rank by the attention the stage asks for
                cos, sin = kwargs["position_embeddings"]
                if stage.rank_by == TEXT_AFTER_VISUAL:  # the text after the video: never pruned
                    self.scores, flops = counted_flops(text_attention, module, hidden, cos, sin, self._after(hidden))
                elif stage.rank_by == DUPLICATION:  # this layer's keys; the stage layer's input picks the tokens
                    (_, keys), flops = counted_flops(projected_qk, module, hidden, hidden.shape[1], (cos, sin))
                    self.key_l1 = dart.key_l1_norms(keys)
                elif stage.rank_by == DUAL_FILTER:  # the text after the video over every key, both filters
                    rows, flops = counted_flops(query_attention, module, hidden, cos, sin, self._after(hidden))
                    self.scores = mustdrop.dual_filter_scores(rows, self._visual_rows(hidden), stage.thresholds)
                elif stage.rank_by == RATERS:  # the text after the video over every key, read at the raters
                    rows, flops = counted_flops(query_attention, module, hidden, cos, sin, self._after(hidden))
                    self.scores, relation_flops = counted_flops(sparsevlm.relation, rows, self.rater_weights)
                    flops += relation_flops
                else:
                    self.scores, flops = counted_flops(last_token_attention, module, hidden, cos, sin)
                self.flops += flops

        return hook

    def _layer_input(self, index: int):
        def hook(module, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            prefill = hidden.shape[1] > 1
            if prefill:
                before = self.visual_kept
                hidden = self._reduce(index, module, hidden, kwargs)
                if self.visual_kept is not before and self.visual_kept is not None:
                    self.held.append((index, self.visual_kept))
            elif index in self.cut_layers:  # a decoding step skips the columns cut after the prefill
                self.keys_dropped += self.dropped_columns[index]
            if prefill and self.kept is not None:
                self.kept_by_layer[index] = self.kept
            kept = self.kept_by_layer.get(index) if prefill else self.cached.get(index, self.kept_by_layer.get(index))
            if kept is None:
                return None
            kwargs = dict(kwargs)
            if prefill:
                kwargs["position_embeddings"] = tuple(t[:, kept] for t in kwargs["position_embeddings"])
                if torch.is_tensor(kwargs.get("position_ids")):
                    kwargs["position_ids"] = kwargs["position_ids"][:, kept]
            mask = kwargs.get("attention_mask")
            if torch.is_tensor(mask):
                kwargs["attention_mask"] = self._mask_of(mask, kept, prefill)
            args = (hidden, *args[1:]) if args else args
            if not args:
                kwargs["hidden_states"] = hidden
            return args, kwargs

        return hook

    def _mask_of(self, mask: torch.Tensor, kept: torch.Tensor, prefill: bool) -> torch.Tensor:
        """The attention mask of a layer that sees the prompt positions `kept`. The prefill's mask spans
        the prompt; a decoding step's spans the first layer's cache (the prompt, or what a reduction at
        the first layer kept of it), then the generated tokens."""
        first = self.kept_by_layer.get(0) if prefill else self.cached.get(0, self.kept_by_layer.get(0))
        if prefill:
            return mask[..., kept, :][..., kept]
        if first is None:
            columns = torch.cat([kept, torch.arange(self.prompt_length, mask.shape[-1], device=kept.device)])
        else:
            generated = torch.arange(len(first), mask.shape[-1], device=kept.device)
            columns = torch.cat([torch.searchsorted(first, kept), generated])
        return mask[..., columns]

    def _reduce(self, index: int, layer, hidden: torch.Tensor, kwargs: dict) -> torch.Tensor:
        """The prefill's hidden states entering decoder layer `index` (`layer`, called with `kwargs`),
        after the schedule's stage there, if any."""
        if index == 0 and any(s.rank_by == RATERS for s in self.schedule):
            with self.work.timed():  # SparseVLM's raters, from the LLM's input
                visual = self.visual.to(hidden.device)
                after = torch.arange(self.first_after_visual, hidden.shape[1], device=hidden.device)
                self.rater_weights, flops = counted_flops(sparsevlm.raters, hidden[0], visual, after)
                self.flops += flops
        stage = self.stages.get(index)
        if stage is None:
            return hidden
        with self.work.timed():
            if stage.rank_by == STAGE_INPUT:
                rotary = kwargs["position_embeddings"]
                if self.kept is not None:  # the tokens entering this layer, at their own positions
                    rotary = tuple(t[:, self.kept] for t in rotary)
                self.scores, flops = counted_flops(stage_input_attention, layer, hidden, *rotary)
                self.flops += flops
            elif stage.rank_by == DUPLICATION:
                self.scores = self._duplication_scores(hidden, stage.keep)
            return self._prune(hidden, stage)

    def _ranking_hooks(self) -> list:
        """Forward pre-hooks on the attention modules whose input a stage ranks by."""
        return [
            self.layers[s.layer - 1].self_attn.register_forward_pre_hook(self._ranker(s), with_kwargs=True)
            for s in self.schedule
            if s.rank_by != STAGE_INPUT  # ranked in the stage layer's own input hook
        ]

    def _after(self, hidden: torch.Tensor) -> int:
        """Index in the current sequence of the first token after the last visual one (the text after
        the video, never pruned: its length is known on the host)."""
        prompt_length = hidden.shape[1] if self.kept is None else self.prompt_length
        return hidden.shape[1] - (prompt_length - self.first_after_visual)

    def _duplication_scores(self, hidden: torch.Tensor, keep: int) -> torch.Tensor:
        """(L,) 1 for the visual tokens DART keeps, else 0 (`dart.select` on the states entering the
        stage layer and the keys' L1 norms of the layer before)."""
        device = hidden.device
        self._start_cutting(hidden)
        visual = torch.searchsorted(self.kept, self.visual_kept)  # in the current sequence
        after = torch.arange(self._after(hidden), hidden.shape[1], device=device)
        taken, flops = counted_flops(dart.select, hidden, self.language_model.norm, self.key_l1, visual, after, keep)
        self.flops += flops
        scores = torch.zeros(hidden.shape[1], device=device)
        scores[visual] = taken.to(scores.dtype)
        return scores

    def _prune(self, hidden: torch.Tensor, stage: Stage) -> torch.Tensor:
        """Keep the `stage.keep` visual tokens of the current sequence with the highest scores, in
        sequence order, ties to the earlier token (the dropped ones merged into them first, with
        `stage.merge`). Prompt positions: `kept` (every token the layer sees), `visual_kept` (its
        visual ones) and `text` (never pruned), sorted, on the hidden states' device."""
        self._start_cutting(hidden)
        local_visual = torch.searchsorted(self.kept, self.visual_kept)
        scores = self.scores[local_visual]
        if self.protected is not None:  # the compressor's protected tokens first
            scores = scores.masked_fill(torch.isin(self.visual_kept, self.protected.to(scores.device)), math.inf)
        ranked = torch.argsort(scores, descending=True, stable=True)
        if stage.recycle:
            return self._recycle(hidden, stage, local_visual, ranked)
        top = self.visual_kept[ranked[: stage.keep]].sort().values
        if stage.merge:
            dropped = self.visual_kept[ranked[stage.keep :]].sort().values
            top_local, dropped_local = torch.searchsorted(self.kept, top), torch.searchsorted(self.kept, dropped)
            hidden, flops = counted_flops(merge_into_nearest, hidden, top_local, dropped_local)
            self.flops += flops
        return self._cut(hidden, top)

    def _recycle(self, hidden: torch.Tensor, stage: Stage, local_visual, ranked) -> torch.Tensor:
        """SparseVLM's stage: the keep - recycle top-ranked visual tokens stay; the best-ranked
        int(0.3 p) + 1 of the p others are clustered (`sparsevlm.cluster_and_merge`) into `recycle`
        tokens, each at its centre's prompt position. `ranked`: indices into the visual tokens, best first."""
        selected = stage.keep - stage.recycle
        members = ranked[selected : selected + sparsevlm.recycled_members(len(ranked) - selected)]
        (merged, centres), flops = counted_flops(
            sparsevlm.cluster_and_merge, hidden[0, local_visual[members]], stage.recycle
        )
        self.flops += flops
        centre_positions = self.visual_kept[members[centres]]
        out = self._cut(hidden, torch.cat([self.visual_kept[ranked[:selected]], centre_positions]).sort().values)
        out[0, torch.searchsorted(self.kept, centre_positions)] = merged
        return out

    def _visual_rows(self, hidden: torch.Tensor) -> torch.Tensor:
        """(n,) rows of the visual tokens in the current sequence, on the hidden states' device."""
        if self.kept is None:
            return self.visual.to(hidden.device)
        return torch.searchsorted(self.kept, self.visual_kept)

    def _after_prefill(self, module, args, kwargs, output) -> None:
        """After the prefill's last decoder layer: the KV caches of `cut_layers` keep only the last stage's
        tokens (MustDrop's decoding stage), so the decoding steps' masks (sized by the first layer's cache)
        follow. One copy of those layers' cached keys and values."""
        hidden = args[0] if args else kwargs["hidden_states"]
        cache = kwargs.get("past_key_values")
        if hidden.shape[1] == 1 or cache is None:  # a decoding step, or a forward that caches nothing
            return
        final = self.kept_by_layer[self.schedule[-1].layer]
        for index in self.cut_layers:
            held = self.kept_by_layer.get(index)  # None: the whole prompt, its positions its columns
            columns = final if held is None else torch.searchsorted(held, final)
            layer = cache.layers[index]
            layer.keys, layer.values = layer.keys[:, :, columns], layer.values[:, :, columns]
            self.dropped_columns[index] = (self.prompt_length if held is None else len(held)) - len(final)
            self.cached[index] = final

    def _start_cutting(self, hidden: torch.Tensor) -> None:
        """Before the first cut: every prompt position kept, the visual and text ones apart, on the
        hidden states' device."""
        if self.kept is None:
            self.prompt_length = hidden.shape[1]
            is_text = torch.ones(self.prompt_length, dtype=torch.bool)  # cpu: a mask of the cpu positions
            is_text[self.visual] = False
            self.kept = torch.arange(self.prompt_length, device=hidden.device)
            self.visual_kept = self.visual.to(hidden.device)
            self.text = torch.nonzero(is_text).flatten().to(hidden.device)

    def _cut(self, hidden: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
        """`hidden` with only the text and the visual tokens at prompt positions `top` (sorted)."""
        kept = torch.cat([self.text, top]).sort().values
        local = torch.searchsorted(self.kept, kept)
        self.kept, self.visual_kept = kept, top
        return hidden[:, local]


class FusionPruner(LayerPruner):
    """FrameFusion's reduction inside the LLM during one `generate` call (`baselines/framefusion.py`):
    from decoder layer `first_layer` on, each layer's input merges the visual tokens similar to the
    token at their position in the frame pair before, while a layer merges at least a tenth; the
    layer after the last merge ranks the rest by its last queries' attention, and the next one keeps
    its allowance of them. `budget`: the visual token-layers the prefill may hold (floor(R L N));
    patches: (N,) each visual token's position within its frame pair. `layer_tokens` is filled as the
    prefill runs (the counts follow from the hidden states). One host sync per merging layer (its
    merge count, which sets the sequence's length)."""

    def __init__(self, language_model, visual_positions, patches, budget: int, first_layer: int, stopwatch=None):
        super().__init__(language_model, [], visual_positions, stopwatch)
        self.patches = patches
        self.patch_count = int(patches.max()) + 1 if len(patches) else 0  # a frame pair's tokens
        self.budget = budget
        self.first_layer = first_layer

    def _infeasible(self, index: int, holding: int, layers_left: int) -> InfeasibleBudget:
        """The budget this video cannot meet: layer `index` holds `holding` visual tokens after its merge
        (every patch keeps its first token), the later layers at least one each."""
        total = len(self.layers) * len(self.visual)
        held = sum(self.layer_tokens) + holding + layers_left - 1
        return InfeasibleBudget(
            self.budget / total,
            held / total,
            f"FrameFusion on this video (layer {index} keeps {holding} visual tokens: one a patch at least)",
        )

    @contextmanager
    def attached(self):
        self.layer_tokens = []
        self.phase, self.left, self.rank_layer = "merge", self.budget, None
        self.patches_kept = None
        with super().attached():
            yield self

    def _ranking_hooks(self) -> list:
        return [
            layer.self_attn.register_forward_pre_hook(self._fusion_ranker(i), with_kwargs=True)
            for i, layer in enumerate(self.layers)
        ]

    def _fusion_ranker(self, index: int):
        def hook(module, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            if hidden.shape[1] == 1 or self.phase != "rank" or index != self.rank_layer:
                return
            with self.work.timed():  # the last queries' attention over every key, mean over heads and queries
                cos, sin = kwargs["position_embeddings"]
                first = hidden.shape[1] - framefusion.QUERY_ROWS
                rows, flops = counted_flops(query_attention, module, hidden, cos, sin, first)
                self.scores = rows.mean(dim=(0, 1))
                self.flops += flops

        return hook

    def _reduce(self, index: int, layer, hidden: torch.Tensor, kwargs: dict) -> torch.Tensor:
        layers_left = len(self.layers) - index
        if index >= self.first_layer and self.phase == "merge":
            with self.work.timed():
                hidden = self._merge(index, hidden, layers_left)
        elif self.phase == "rank" and index == self.rank_layer + 1:
            with self.work.timed():
                keep = framefusion.prune_keep(len(self.visual_kept), self.left, layers_left)
                hidden = self._prune(hidden, Stage(index, keep))
                self.phase = "done"
        visual = len(self.visual) if self.kept is None else len(self.visual_kept)
        self.layer_tokens.append(visual)
        self.left -= visual
        return hidden

    def _merge(self, index: int, hidden: torch.Tensor, layers_left: int) -> torch.Tensor:
        """Decoder layer `index`'s input, merging: the similar tokens averaged into their runs' first tokens and
        cut, the phase moved on as `framefusion.merge_decision` says."""
        self._start_cutting(hidden)
        if self.patches_kept is None:
            self.patches_kept = self.patches.to(hidden.device)
        local = torch.searchsorted(self.kept, self.visual_kept)
        order, similarity = framefusion.neighbour_similarity(hidden[0], local, self.patches_kept)
        merged, count, done_merging, done = framefusion.merge_decision(
            similarity, self.left, layers_left, self.patch_count
        )
        if not done and self.left - (len(merged) - count) < layers_left - 1:
            raise self._infeasible(index, len(merged) - count, layers_left)
        members, targets = framefusion.merge_groups(order, merged, count)
        gone = torch.zeros(len(local), dtype=torch.bool, device=local.device)
        gone[members] = True
        stay = torch.argsort(gone.to(torch.int8), stable=True)[: len(local) - count]  # in prompt order
        source, visual = hidden[0], self.visual_kept
        cut = self._cut(hidden, visual[stay])  # a copy: the members are then added into their targets
        position = torch.searchsorted(self.kept, visual)  # each visual token's row in the cut (a member's: unused)
        framefusion.average_into(cut[0], source, local[members], position[targets], position[stay])
        self.patches_kept = self.patches_kept[stay]
        self.phase = "done" if done else "rank" if done_merging else "merge"
        self.rank_layer = index if self.phase == "rank" else None
        return cut
