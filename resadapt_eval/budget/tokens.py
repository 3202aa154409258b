"""The token budget: how many visual tokens a planned sample puts into the LLM, and into each layer.

A `TokenBudget` is a pure value, computed once per sample right after planning by the run's method
kind (`kinds.MethodKind.token_budget`) from its resize plans, before any model input is built. The
pipeline builds the inputs it describes and checks the engine's prompt against it, the sidecar
record reads its counts and R, and `estimates.row_plan` (the config-only FLOPs table,
`resadapt-eval flops`) plans through the same function.
"""

from __future__ import annotations

from dataclasses import dataclass

from .plan import InfeasibleBudget


@dataclass(frozen=True)
class TokenBudget:
    """reference: the vanilla tokens R is measured against; entering: the visual tokens that enter
    the LLM; layers: the visual tokens in each decoder layer, for a method that prunes inside the
    LLM (None: `entering` in every layer); share: what a compressor is asked to keep, as a share of
    the encoded tokens (None without a compressor); stages: the in-LLM pruning schedule
    (`inside_llm.Stage`s, empty without one); decode_stage: a decoding-time pruner's
    `baselines.inside_llm.DecodeStage` (None without one); tower: for a method that reduces tokens
    inside the vision tower, what its blocks and mergers ran (`compute.flops.TowerCounts`; None:
    every block sees every patch)."""

    reference: int
    entering: int
    layers: tuple[int, ...] | None = None
    share: float | None = None
    stages: tuple = ()
    decode_stage: object | None = None
    tower: object | None = None

    @property
    def layer_average(self) -> int | float:
        """Visual tokens averaged over the decoder layers (`entering`, an int, where every layer sees them all)."""
        return self.entering if self.layers is None else sum(self.layers) / len(self.layers)

    @property
    def achieved_retention(self) -> float:
        """R = layer-averaged visual tokens / reference tokens."""
        return self.layer_average / self.reference

    def prompt_tokens(self, text_tokens: int) -> int | list[int]:
        """The LLM's prompt length with `text_tokens` of text: one number, or one per decoder layer."""
        if self.layers is None:
            return text_tokens + self.entering
        return [text_tokens + n for n in self.layers]


def engine_kept_tokens(pair_tokens: list[int], rate: float, pruning_method: str) -> int:
    """Visual tokens vLLM's video pruning `pruning_method` (EVS) keeps of one video of equal pairs
    (`pair_tokens` each) at `video_pruning_rate` `rate`: int(N (1 - rate)), at least the first pair
    (vLLM's `compute_retained_tokens_count`, tests/test_fidelity_evs.py); `InfeasibleBudget` when
    the first pair alone is above 1 - rate of the N tokens."""
    total = sum(pair_tokens)
    keep = max(pair_tokens[0], int(total * (1 - rate)))
    if keep > total * (1 - rate) + 1e-9:
        raise InfeasibleBudget(
            round(1 - rate, 9),  # the target R (the rate is 1 - R, or the float just below)
            keep / total,
            f"vLLM's {pruning_method}, which keeps the first of {len(pair_tokens)} pairs whole",
        )
    return keep
