"""FlashVid (Fan et al., ICLR 2026), vision side, on Qwen's merged tokens with pairs as frames.

1. Segments: consecutive pairs whose mean features have cosine >= SEGMENT_THRESHOLD share a segment.
2. Attention- and diversity-based selection: ALPHA of each pair's budget goes to tokens chosen
   greedily for diversity (max-min cosine distance), starting from the token that received the
   most attention in the last ViT block.
3. Tree-based spatiotemporal merging of the rest of each segment: a token joins its most similar
   unselected token of the previous pair when their cosine exceeds TEMPORAL_THRESHOLD (most
   similar first, while the segment keeps more roots than its remaining budget); the surviving
   roots are clustered to exactly that budget (farthest-point centres, nearest-centre merging).
   Merged tokens sit at their root's / centre's position.

Budgets: the published method also prunes inside the LLM (FastV-style) and quotes a
layer-averaged retention, so about 1.25 R tokens enter the LLM there. This port has no in-LLM
pruning: exactly floor(R * N) tokens enter the LLM, and that is the R recorded.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .common import DROPPED, VisualTokens, per_pair_budget

SEGMENT_THRESHOLD = 0.9
TEMPORAL_THRESHOLD = 0.8
ALPHA = 0.7


def segments(pair_means: torch.Tensor) -> list[list[int]]:
    """Consecutive pair indices grouped where adjacent pairs are similar."""
    sim = F.cosine_similarity(pair_means[:-1], pair_means[1:], dim=-1)
    groups = [[0]]
    for p, s in enumerate(sim.tolist(), start=1):
        if s >= SEGMENT_THRESHOLD:
            groups[-1].append(p)
        else:
            groups.append([p])
    return groups


def diverse_selection(feats: torch.Tensor, attention: torch.Tensor | None, k: int) -> list[int]:
    """k indices: the most attended token, then greedily the one farthest (cosine) from the chosen."""
    if k <= 0:
        return []
    first = int(attention.argmax()) if attention is not None else int((feats @ feats.mean(0)).argmin())
    chosen = [first]
    distance = 1 - feats @ feats[first]
    while len(chosen) < k:
        distance[chosen] = -math.inf
        nxt = int(distance.argmax())
        chosen.append(nxt)
        distance = torch.minimum(distance, 1 - feats @ feats[nxt])
    return chosen


def cluster(feats: torch.Tensor, k: int) -> torch.Tensor:
    """Centre (row index) for each row: k farthest-point centres, nearest-centre assignment."""
    centres = diverse_selection(feats, None, k)
    nearest = (feats @ feats[centres].T).argmax(dim=1)
    owner = torch.tensor(centres)[nearest]
    owner[centres] = torch.tensor(centres)
    return owner


def compress(tokens: VisualTokens, keep: int, seed: int = 0) -> torch.Tensor:
    feats = F.normalize(tokens.features.float(), dim=-1)
    starts, sizes = tokens.pair_starts, tokens.pair_sizes
    budget = per_pair_budget(sizes, keep)
    assignment = torch.arange(feats.shape[0])
    pair_means = torch.stack([tokens.features[s : s + n].float().mean(0) for s, n in zip(starts, sizes)])
    for seg in segments(pair_means):
        rest, remaining_budget = [], 0
        for p in seg:
            index = torch.arange(starts[p], starts[p] + sizes[p])
            attention = tokens.received_attention[index] if tokens.received_attention is not None else None
            n_sel = min(budget[p], max(1, round(ALPHA * budget[p])))
            chosen = set(index[diverse_selection(feats[index], attention, n_sel)].tolist())
            rest.append([i for i in index.tolist() if i not in chosen])
            remaining_budget += budget[p] - n_sel
        roots = {i: i for part in rest for i in part}
        # temporal merging into the previous pair's tokens, most similar first
        edges = []
        for prev, cur in zip(rest[:-1], rest[1:]):
            if prev and cur:
                sim = feats[cur] @ feats[prev].T
                best, at = sim.max(dim=1)
                edges += [(float(b), c, prev[int(a)]) for b, c, a in zip(best, cur, at)]
        live = len(roots)
        for sim, child, parent in sorted(edges, reverse=True):
            if sim <= TEMPORAL_THRESHOLD or live <= remaining_budget:
                break
            roots[child] = parent
            live -= 1

        def root(i):
            while roots[i] != i:
                i = roots[i]
            return i

        for i in roots:
            assignment[i] = root(i)
        survivors = sorted({root(i) for i in roots})
        if remaining_budget < len(survivors):
            # spatial merging of the surviving roots down to exactly the segment's remaining budget
            if remaining_budget > 0:
                owner = cluster(feats[survivors], remaining_budget)
                centre_of = {r: survivors[int(o)] for r, o in zip(survivors, owner)}
            else:
                centre_of = {r: DROPPED for r in survivors}
            for i in roots:
                assignment[i] = centre_of[int(assignment[i])]
    return assignment
