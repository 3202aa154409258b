"""Fidelity of DyCoke (issue 30) against the public code, KD-TAO/DyCoke@dd74634: both stages.

Temporal token merging (TTM), `dycole_ttm` in llava/model/llava_arch.py:35-91, written out below in float64: the
frames in pairs (i, i+1) for i = 0, 2, ..., F - 2 (:41-65): frame i stays whole, frame i + 1 keeps its k tokens of
lowest cosine to the same position of frame i, in topk order (ascending similarity); then for i = 0, 4, ...
< F - 4 (:69-87), frame i + 2 is replaced by its k tokens of lowest cosine to the same position of frame i.
k = int((1 - dycoke_k) T) (:38, :61, :83). Pruned tokens are dropped, nothing is merged.

Documented deviations, applied to the reference (`fixed=True`) and their exact effect checked:
- budget: our compared pairs keep per_pair_budget(compared sizes, keep - reference-pair tokens), handed to the
  reference as its per-frame counts (equal pairs and keep = references + c k: every compared pair keeps k);
- the 3rd frame of every window of 4 is compared with its 1st (the reference's range(0, F - 4, 4) at :69, :78
  skips the last window's);
- an odd number of frames: the reference's pair loop (:41, :56) never appends the last frame, which is lost;
  ours keeps it as the window rule says (a window reference, or the 3rd frame of its window);
- the reference orders a frame's kept tokens by similarity (topk order), ours keeps positions and order.
Budgets below TTM's reach (fewer than the reference pairs plus one token per compared pair) recurse over the
reference pairs: the reference has no such case, so they are not compared here (tests/test_dycoke.py has them).

The decoding stage (KV-cache pruning while decoding), llava/model/language_model/modeling_qwen2.py, written out as
a cache plus layer hooks on tiny random language models (Qwen2, the reference's LLM; Qwen3, whose q_norm Qwen3-VL
has), float64, eager attention:
- :1136-1141: layers below dycoke_l reset the selection (attend to every cached token); at layer dycoke_l of a
  decoding step (one query), `dycoke_pruning` ranks with the attention of layer dycoke_l - 1;
- :97-114: the current token's attention row of that layer, mean over heads (:98; the reference runs SDPA, whose
  weights are softmax(q k^T / sqrt(d)) over every cached key, :762-763, :695-702), restricted to the visual tokens
  (:99-101); its cosine to the previous step's row (first step: 0) below 0.9 re-selects (:103-114), otherwise the
  step attends to every token; the previous row is updated at every step (:111);
- :76-95: the selection is every non-visual token plus the top int(n (1 - dycoke_p)) visual tokens; :54-75 layers
  from dycoke_l on read only those keys and values (the cache keeps every token).
Deviations applied: dycoke_l = 3 of 28 layers at the same relative depth (round(3 L / 28)); dycoke_p = 0.7 (the
README's setting) and int(R n) visual tokens where R is larger than 0.3, at least one; the visual range is exactly
the visual tokens (the reference's image_token_length is one short, llava_arch.py:390); the previous step's row
starts afresh with each request.
"""

import pytest
import torch
import torch.nn.functional as F

from resadapt_eval.backbones.decode_pruning import DecodePruner
from resadapt_eval.baselines import dycoke
from resadapt_eval.baselines.common import VisualTokens, merge_groups, per_pair_budget

CASES = 20
# (frames, tokens per frame): odd and even frame counts and token counts, 2 to 10 frames
TTM_SETTINGS = [(5, 6), (6, 5), (7, 4), (8, 5), (9, 6), (10, 3), (3, 5), (2, 4)]


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """torch.nn.functional.cosine_similarity of same-position rows, (T,)."""
    return (a * b).sum(dim=1) / (a.norm(dim=1) * b.norm(dim=1))


def reference_ttm(
    features: torch.Tensor, tokens_per_frame: int, counts: dict[int, int] | int, fixed: bool = True
) -> list[list[int]]:
    """KD-TAO/DyCoke@dd74634 llava/model/llava_arch.py:35-91. Returns, per output frame, the kept token indices
    (into the video) in the reference's output order. `counts`: tokens a compared frame keeps, one number (the
    reference's int((1 - dycoke_k) T)) or per frame (the documented budget). `fixed` applies the documented
    deviations: every window's 3rd frame is compared, and the last of an odd number of frames is kept."""
    t = tokens_per_frame
    frames = features.shape[0] // t

    def frame(i: int) -> torch.Tensor:
        return features[i * t : (i + 1) * t].double()

    def count(i: int) -> int:
        return counts if isinstance(counts, int) else counts[i]

    def least_similar(i: int, partner: int) -> list[int]:
        similarity = cosine(frame(partner), frame(i))  # :43-49, :70-73
        order = sorted(range(t), key=lambda j: similarity[j].item())  # topk(k, largest=False): ascending
        return [i * t + j for j in order[: count(i)]]

    out: list[list[int]] = []
    for i in range(0, frames - 1, 2):  # :56-65
        out.append([i * t + j for j in range(t)])
        out.append(least_similar(i + 1, i))
    if fixed and frames % 2 == 1:  # documented: the last of an odd number of frames is kept
        out.append([(frames - 1) * t + j for j in range(t)])
    for i in range(0, frames - 2 if fixed else frames - 4, 4):  # :78-87 (documented: every window's 3rd frame)
        out[i + 2] = least_similar(i + 2, i)
    return out


def window_roles(frames: int) -> tuple[list[int], list[int]]:
    """Reference frames (1st of each window of 4) and compared frames, for the documented (fixed) rule."""
    references = list(range(0, frames, 4))
    return references, [f for f in range(frames) if f % 4 != 0]


def ttm_case(frames: int, t: int, index: int) -> VisualTokens:
    g = torch.Generator().manual_seed(65537 * index + 101 * frames + t)
    # consecutive frames alike (a drifting scene), so similarities spread as in a video
    base = torch.randn(t, 12, generator=g, dtype=torch.float64)
    rows = []
    for _ in range(frames):
        base = base + 0.6 * torch.randn(t, 12, generator=g, dtype=torch.float64)
        rows.append(base.clone())
    return VisualTokens(features=torch.cat(rows), pair_sizes=[t] * frames, grids=[(1, 1, t)] * frames)


@pytest.mark.parametrize("frames,t", TTM_SETTINGS, ids=lambda v: str(v))
def test_fidelity_dycoke_ttm_matches_the_reference(frames, t):
    references, compared = window_roles(frames)
    n = frames * t
    whole = len(references) * t
    for index in range(CASES):
        tokens = ttm_case(frames, t, index)
        for keep in range(whole + len(compared), n):  # TTM's reach: one token per compared pair, to all but one
            budget = per_pair_budget([t] * len(compared), keep - whole)  # the documented split
            if (keep - whole) % len(compared) == 0:  # one pruning rate: the reference's single k
                assert budget == [(keep - whole) // len(compared)] * len(compared)
            out = reference_ttm(tokens.features, t, dict(zip(compared, budget)))
            compression = compress_checked(tokens, keep)
            # the same tokens; the reference orders a frame's kept tokens by similarity, ours by position
            assert compression.kept.tolist() == [i for block in out for i in sorted(block)]
            _, sizes, (merged,) = merge_groups(compression, tokens.features)
            assert sizes.tolist() == [1] * keep
            reference_features = tokens.features[[i for block in out for i in block]]
            order = torch.tensor([i for block in out for i in block]).argsort()
            torch.testing.assert_close(merged, reference_features[order], rtol=0, atol=1e-6)


def compress_checked(tokens: VisualTokens, keep: int):
    compression = dycoke.compress(tokens, keep)
    assert compression.weights is None
    assert len(compression.kept) == keep
    return compression


@pytest.mark.parametrize("frames", [5, 6, 7, 8, 9, 10, 11, 12])
def test_fidelity_dycoke_ttm_differs_from_the_reference_exactly_as_documented(frames):
    """The unfixed reference (it runs from 5 frames: below, torch.stack of an empty list fails at :76) differs from
    the fixed one, which ours matches, only in the last window's 3rd frame (whole in the reference when its window
    has one) and in the last of an odd number of frames (absent from the reference's output)."""
    t, k = 5, 2  # the reference's k = int((1 - 0.7) * 5) = 1 would do too; 2 leaves an order to compare
    last_third = next((i + 2 for i in range(0, frames, 4) if i + 2 < frames and i >= frames - 4), None)
    lost = frames - 1 if frames % 2 == 1 else None
    for index in range(CASES):
        tokens = ttm_case(frames, t, index)
        fixed = reference_ttm(tokens.features, t, k, fixed=True)
        plain = reference_ttm(tokens.features, t, k, fixed=False)
        frame_of = {block[0] // t: block for block in fixed}
        expected = [
            list(range(f * t, (f + 1) * t)) if f == last_third else frame_of[f] for f in range(frames) if f != lost
        ]
        assert plain == expected
        references, compared = window_roles(frames)
        keep = len(references) * t + len(compared) * k
        assert dycoke.compress(tokens, keep).kept.tolist() == sorted(i for block in fixed for i in block)


# ---------------------------------------------------------------------------------------------------------------
# The decoding stage


def tiny_language_model(kind: str, layers: int, seed: int):
    """A random tiny Qwen2 / Qwen3 causal LM in float64 with eager attention (its attention weights are the
    reference's `attn[1]`); a wide initialisation makes its attention rows peaked and varied, as trained ones are."""
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    config_class, model_class = (Qwen2Config, Qwen2ForCausalLM) if kind == "qwen2" else (Qwen3Config, Qwen3ForCausalLM)
    config = config_class(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        max_position_embeddings=128,
        initializer_range=0.4,
        attn_implementation="eager",
    )
    torch.manual_seed(seed)
    return model_class(config).double().eval()


class ReferenceCache:
    """KD-TAO/DyCoke@dd74634 modeling_qwen2.py:47-114 (`PrunableDynamicCache`) and the layer loop's calls
    (:1136-1141), as hooks on a transformers model: every key and value is cached; while `kv_cache` is set, layers
    read only its columns (:72-75); layers below dycoke_l reset it (:1138-1139); at layer dycoke_l of a decoding
    step it is chosen from layer dycoke_l - 1's attention (:1140-1141)."""

    def __init__(self, model, layer: int, start: int, length: int, keep: int, threshold: float = 0.9):
        from transformers import DynamicCache

        reference = self

        class Cache(DynamicCache):
            def update(self, key_states, value_states, layer_idx, *args, **kwargs):
                keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
                if reference.kv_cache is None:  # :72-73
                    return keys, values
                index = torch.tensor(reference.kv_cache)  # :75, a gather along the sequence
                return keys[:, :, index], values[:, :, index]

        self.cache = Cache()
        self.layers = model.model.layers
        self.layer, self.start, self.length, self.keep, self.threshold = layer, start, length, keep, threshold
        self.kv_cache, self.attention_score, self.attention = None, None, None
        self.step, self.selections, self.similarities = 0, [], []

    def _before_layer(self, index: int):
        def hook(module, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            decoding = hidden.shape[1] == 1
            if index < self.layer:  # :1138-1139
                self.kv_cache = None
            elif index == self.layer and self.kv_cache is None and decoding:  # :1140-1141
                self.step += 1
                self.dycoke_pruning(self.attention)
            if decoding:  # :1143-1150: the layers get attention_mask=None (one query attends to every key it reads)
                return args, dict(kwargs, attention_mask=None)
            return None  # the prefill keeps the causal mask (the reference's SDPA is causal without one, :773)

        return hook

    def _capture(self, module, args, output):
        self.attention = output[1]  # (1, heads, queries, keys): softmax(q k^T / sqrt(d)) over every cached key

    def dycoke_pruning(self, attn: torch.Tensor) -> None:
        """:97-114, with the documented deviations already in `start`, `length` (exactly the visual tokens) and
        `keep`."""
        attention_avg = attn.mean(1)[0, -1]  # :98, mean over heads, the current token's row
        image_attention = attention_avg[self.start : self.start + self.length]  # :99-101
        if self.attention_score is not None:  # :103-110
            similarity = F.cosine_similarity(image_attention, self.attention_score, dim=0).item()
        else:
            similarity = 0.0
        self.similarities.append(similarity)
        self.attention_score = image_attention  # :111
        if similarity < self.threshold:  # :113-114
            self.update_cache(image_attention)

    def update_cache(self, image_attention: torch.Tensor) -> None:
        """:76-95: every token but the visual ones, plus the top `keep` visual tokens."""
        top = torch.topk(image_attention, self.keep, sorted=False)[1] + self.start  # :83
        # attention does not depend on the order of its keys: in position order, as ours reads them, the float32
        # softmax of eager attention rounds alike and the logits agree to 1e-12 (in topk order to ~3e-6)
        top = top.sort().values
        total = self.cache.get_seq_length()  # seq_length_with_past (:1137): this step's token is cached already
        full = torch.arange(total)
        self.kv_cache = torch.cat([full[: self.start], top, full[self.start + self.length :]]).tolist()  # :87-95
        self.selections.append((self.step, sorted(top.tolist())))

    def __enter__(self):
        self.handles = [
            layer.register_forward_pre_hook(self._before_layer(i), with_kwargs=True)
            for i, layer in enumerate(self.layers)
        ]
        self.handles.append(self.layers[self.layer - 1].self_attn.register_forward_hook(self._capture))
        return self

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()


def decode(model, prompt: torch.Tensor, continuation: torch.Tensor, cache) -> torch.Tensor:
    """Logits (steps + 1, vocab): the prefill's last row, then one decoding step per continuation token."""
    with torch.no_grad():
        out = model(input_ids=prompt[None], past_key_values=cache, use_cache=True)
        logits = [out.logits[0, -1]]
        for token in continuation:
            out = model(input_ids=token.view(1, 1), past_key_values=cache, use_cache=True)
            logits.append(out.logits[0, -1])
    return torch.stack(logits)


# (language model, layers, retention): the reference's 28 layers (dycoke_l = 3 exactly) at R below 0.3 (keep
# int(0.3 n)); a 12-layer Qwen3 (q_norm; dycoke_l = round(36 / 28) = 1) at R = 0.5 (keep int(R n))
DECODE_SETTINGS = [("qwen2", 28, 0.25), ("qwen3", 12, 0.5)]
STEPS = 6


@pytest.mark.parametrize("kind,layers,retention", DECODE_SETTINGS, ids=lambda v: str(v))
def test_fidelity_dycoke_decoding_matches_the_reference(kind, layers, retention):
    model = tiny_language_model(kind, layers, seed=layers)
    # the documented deviations, written out: dycoke_l at the same relative depth, keep int(max(0.3, R) n)
    reference_layer = max(1, round(3 * layers / 28))
    reselected = similar = 0
    for index in range(CASES):
        g = torch.Generator().manual_seed(9973 * index + layers)
        prefix, visual, suffix = 3 + index % 3, 12 + index % 5, 4  # odd and even visual counts
        prompt = torch.randint(0, 64, (prefix + visual + suffix,), generator=g)
        continuation = torch.randint(0, 64, (STEPS,), generator=g)
        stage = dycoke.decode_stage(layers, visual, retention)
        # modeling_qwen2.py:80 with dycoke_p = 0.7, or int(R n) where R is larger (documented)
        keep = int(visual * (1 - 0.7)) if retention <= 1 - 0.7 else int(visual * retention)
        assert (stage.layer, stage.keep, stage.threshold) == (reference_layer, keep, 0.9)

        pruner = DecodePruner(model.model, stage, torch.arange(prefix, prefix + visual))
        with pruner.attached():
            ours = decode(model, prompt, continuation, pruner.cache)
        reference = ReferenceCache(model, reference_layer, prefix, visual, keep)
        with reference:
            expected = decode(model, prompt, continuation, reference.cache)

        assert [(step, kept.tolist()) for step, kept in pruner.selections] == reference.selections
        torch.testing.assert_close(ours, expected, rtol=0, atol=1e-12)
        assert pruner.keys_dropped == len(reference.selections) * (visual - keep) * (layers - reference_layer)
        reselected += len(reference.selections) - 1
        similar += sum(s >= 0.9 for s in reference.similarities)
    assert reselected > 0 and similar > 0  # both branches of the 0.9 threshold were taken


def test_fidelity_dycoke_decoding_keeps_at_least_one_visual_token():
    # documented: at least one; the reference's int(3 * (1 - 0.7)) = 0 would attend to no visual token
    assert int(3 * (1 - 0.7)) == 0
    assert dycoke.decode_stage(28, 3, 0.25).keep == 1 and dycoke.decode_stage(28, 4, 0.25).keep == int(4 * 0.3)
