"""Rollout engines: given one prompt and M sampled allocations, produce N scored rollouts each.

- `HFRolloutEngine`: the real backbone through `backbones/` (per-pair sizes), task rewards from
  `capo.rewards`, exact plan R per allocation; keeps what the backbone update needs. Answers come
  from HF generate, or (`answer="choice_logits"`, multiple choice) from one forward pass: the
  option letter with the highest next-token logit (temperature 0) or sampled from the softmax
  over the option letters' logits / temperature. With `retention` set (one R, or a range
  [lo, hi] from which each prompt draws its own R), every sampled allocation is first projected
  onto that R within [budget.s_min, budget.s_max] (as `method=resadapt,retention=R` does at
  inference), so the reward teaches where the pixels go at a fixed budget.
- `SimulatedBackbone`: a stand-in whose chance of answering correctly rises with the scale of
  the frames that hold the evidence (and, weakly, with the mean scale), for fast CPU studies of
  the optimiser. The evidence frames carry a visible pattern, so the Allocator can find them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ..allocator import backbone_identity
from ..backbones.qwen import QwenVideoAdapter
from ..budget.plan import ResizePlan
from ..budget.planner import Planner
from ..budget.policies import BudgetSpec
from ..capo.rewards import is_correct, task_reward, task_score
from ..video import decode_video
from .caches import FrameCache, PairCache, StepClock
from .data import TrainSample


@dataclass
class Prompt:
    """One training prompt as the trainer sees it: uint8 frames (T, H, W, 3) and the query."""

    frames: np.ndarray
    query: str
    sample: object
    state: dict = field(default_factory=dict)  # engine-private (decoded video, base size, chat text)
    video_key: tuple | None = None  # (path, frame indices): identifies the frames for the feature cache


@dataclass
class Rollouts:
    """Scored rollouts of one prompt: task_reward and correct (M, N); retention (M,), the R each
    allocation achieved; visual_tokens and prompt_tokens (M,), the video tokens and the whole
    prompt's tokens entering the LLM; response_tokens (M, N), tokens of each answer; backbone:
    per-rollout (inputs, response ids) for the joint update."""

    task_reward: torch.Tensor
    correct: torch.Tensor
    retention: torch.Tensor
    backbone: list[list[tuple[dict, torch.Tensor]]] | None = None
    visual_tokens: torch.Tensor | None = None
    prompt_tokens: torch.Tensor | None = None
    response_tokens: torch.Tensor | None = None


ANSWER_MODES = ("generate", "choice_logits")


class RolloutEngine:
    """What the trainer calls: `prompt(sample)`, `rollout_batch(prompts, scales, n, ...)` for a
    whole step, `budget_settings()` and `backbone_identity()` for the checkpoint. The default
    `rollout_batch` answers one prompt after another through `rollouts` (HF generate is not
    batched across prompts). frames / pairs: the engine's caches of decoded videos and resized
    pairs, None where it keeps none."""

    frames: FrameCache | None = None
    pairs: PairCache | None = None

    def rollout_batch(
        self,
        prompts: list[Prompt],
        scales: list[np.ndarray],
        n: int,
        keep_backbone_inputs: bool = False,
        seeds: list[int] | None = None,
        clock: StepClock | None = None,
    ) -> list[Rollouts]:
        """Rollouts of every prompt of a step: scales[i] (M, T) for prompts[i], seeded by seeds[i];
        `rollouts` times its phases on `clock`."""
        seeds = seeds if seeds is not None else [None] * len(prompts)
        return [
            self.rollouts(prompt, allocation, n, keep_backbone_inputs, seed, clock)
            for prompt, allocation, seed in zip(prompts, scales, seeds)
        ]

    def backbone_identity(self) -> dict | None:
        """`backbone.json` of a checkpoint trained with this engine; None without a real backbone."""
        return None


class PlannedRollouts(RolloutEngine):
    """Rollouts on a real backbone's per-pair inputs: the planning, prompts and scoring the HF and
    vLLM engines share. `layout` is the backbone's input layout (`grid`, `processor`).

    answer: `generate` (`max_new_tokens` sampled tokens) or `choice_logits` (the option letters'
    next-token logits after the prompt; multiple-choice samples only). retention: None, R, or
    (lo, hi). seed: for the choice sampler and the per-prompt R (a call given its own seed draws
    from a generator seeded by it instead: the trainer's per-prompt seeds). frames: a `FrameCache`
    (decoded videos kept across steps), or None to decode every time; pairs: a `PairCache` (resized
    frame pairs kept across allocations and steps), or None to resize every time.
    """

    def __init__(
        self,
        layout,
        family: str,
        pretrained: str,
        max_num_frames: int,
        budget: BudgetSpec,
        min_pixels: int | None = None,
        max_pixels: int | None = None,
        max_new_tokens: int = 32,
        temperature: float = 1.0,
        check_format: bool = False,
        answer: str = "generate",
        choices: str = "ABCD",
        retention: float | tuple[float, float] | None = None,
        seed: int = 0,
        frames: FrameCache | None = None,
        pairs: PairCache | None = None,
    ):
        if answer not in ANSWER_MODES:
            raise ValueError(f"answer must be one of {ANSWER_MODES}, got {answer!r}")
        self.layout, self.family, self.pretrained = layout, family, pretrained
        self.max_num_frames, self.budget = max_num_frames, budget
        self.planner = Planner(layout.grid, budget, min_pixels, max_pixels)  # plans as the inference pipeline does
        self.max_new_tokens, self.temperature, self.check_format = max_new_tokens, temperature, check_format
        self.answer, self.choices = answer, choices
        if answer == "choice_logits":
            tokenizer = layout.processor.tokenizer
            ids = [tokenizer(letter, add_special_tokens=False)["input_ids"] for letter in choices]
            if any(len(i) != 1 for i in ids):
                raise ValueError(f"every choice letter must be one token; got {dict(zip(choices, ids))}")
            self.choice_ids = torch.tensor([i[0] for i in ids])
        self.retention = (
            None
            if retention is None
            else tuple(retention)
            if isinstance(retention, (list, tuple))
            else (retention, retention)
        )
        if self.retention is not None and not 0 < self.retention[0] <= self.retention[1]:
            raise ValueError(f"retention must be R > 0 or a range 0 < lo <= hi, got {retention}")
        self.generator = torch.Generator().manual_seed(seed)
        self.frames, self.pairs = frames, pairs

    def budget_settings(self) -> dict:
        """The budget the rollouts are planned under, keyed as the inference model_args."""
        spec = self.budget
        return dict(
            s_min=spec.s_min,
            s_max=spec.s_max,
            min_tokens_per_pair=spec.min_tokens_per_pair,
            max_tokens_per_pair=spec.max_tokens_per_pair,
            pair_reduction=spec.pair_reduction,
            max_num_frames=self.max_num_frames,
            min_pixels=self.planner.min_pixels,
            max_pixels=self.planner.max_pixels,
        )

    def backbone_identity(self) -> dict:
        return backbone_identity(self.family, self.pretrained)

    def prompt(self, sample: TrainSample) -> Prompt:
        video = self.frames.decode(sample.video) if self.frames else decode_video(sample.video, self.max_num_frames)
        base = self.planner.base_hw(video.frames.shape[1:3])
        messages = [
            {
                "role": "user",
                "content": [{"type": "video", "video": sample.video}, {"type": "text", "text": sample.question}],
            }
        ]
        chat = self.layout.processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return Prompt(
            frames=video.frames,
            query=sample.question,
            sample=sample,
            state=dict(video=video, base=base, chat=chat),
            video_key=(str(sample.video), tuple(video.indices)),
        )

    def plans(self, prompt: Prompt, scales: np.ndarray, generator: torch.Generator) -> list[ResizePlan]:
        """The plan of each allocation in `scales` (M, T); with `retention`, each is first projected
        onto this prompt's R (drawn from `generator`)."""
        sample: TrainSample = prompt.sample
        if self.answer == "choice_logits" and sample.task_type != "multiple_choice":
            raise ValueError(
                f"answer=choice_logits scores multiple-choice samples only; {sample.video} is {sample.task_type!r}"
            )
        base = prompt.state["base"]
        if self.retention is not None:
            lo, hi = self.retention
            target = lo + (hi - lo) * float(torch.rand((), generator=generator))
        plans = []
        for allocation in scales:
            if self.retention is not None:
                (allocation,) = self.planner.fit([allocation], [base], target)
            plans.append(self.planner.plan(allocation, base))
        return plans

    def resized_pairs(self, prompt: Prompt, plan: ResizePlan) -> list[torch.Tensor]:
        """The prompt's frame pairs at the plan's sizes (from the pair cache when there is one)."""
        if self.pairs is None:
            return self.layout.resized_pairs(prompt.state["video"], plan)
        return self.pairs.resized_pairs(prompt.state["video"], plan, prompt.video_key)

    def choice_probs_from(self, choice_logits: torch.Tensor) -> torch.Tensor:
        """Softmax over the option letters' logits (or log-probabilities: the same up to a constant)
        / temperature, (len(choices),); at temperature 0 (or below) a one-hot on the highest."""
        choice_logits = choice_logits.float()
        if self.temperature <= 0:
            return torch.nn.functional.one_hot(choice_logits.argmax(), len(self.choices)).float()
        return torch.softmax(choice_logits / self.temperature, dim=-1)

    def pick_choices(self, probs: torch.Tensor, n: int, generator: torch.Generator) -> list[tuple[str, torch.Tensor]]:
        picks = torch.multinomial(probs, n, replacement=True, generator=generator)
        return [(self.choices[k], self.choice_ids[k : k + 1]) for k in picks.tolist()]

    def scored(
        self,
        sample: TrainSample,
        plans: list[ResizePlan],
        prompt_tokens: list[int],
        answers: list[list[tuple[str, torch.Tensor]]],
        inputs: list | None = None,
    ) -> Rollouts:
        """Rewards and correctness of each allocation's answers (text, token ids)."""
        rewards, correct, lengths, backbone = [], [], [], []
        for m, row in enumerate(answers):
            row_r, row_u = [], []
            for text, _ in row:
                score = task_score(sample.task_type, text, sample.answer, sample.segments)
                row_r.append(task_reward(score, text, self.check_format))
                row_u.append(is_correct(sample.task_type, score))
            rewards.append(row_r), correct.append(row_u), lengths.append([len(ids) for _, ids in row])
            if inputs is not None:
                backbone.append([(inputs[m], ids) for _, ids in row])
        return Rollouts(
            torch.tensor(rewards),
            torch.tensor(correct),
            torch.tensor([plan.retention for plan in plans]),
            backbone if inputs is not None else None,
            visual_tokens=torch.tensor([plan.visual_tokens for plan in plans]),
            prompt_tokens=torch.tensor(prompt_tokens),
            response_tokens=torch.tensor(lengths),
        )


class HFRolloutEngine(PlannedRollouts):
    """Rollouts from a Qwen backbone on the real per-pair inputs, one HF call per answer (generate)
    or per allocation (choice_logits). Keeps what the backbone update needs."""

    def __init__(self, adapter: QwenVideoAdapter, max_num_frames: int, budget: BudgetSpec, **kwargs):
        layout = adapter.layout
        super().__init__(layout, layout.family, adapter.model.config._name_or_path, max_num_frames, budget, **kwargs)
        self.adapter = adapter

    @torch.inference_mode()
    def choice_probs(self, inputs: dict) -> torch.Tensor:
        """`choice_probs_from` the option letters' next-token logits after the prompt."""
        self.adapter.model.model.rope_deltas = None
        logits = self.adapter.model(**inputs).logits[0, -1, self.choice_ids.to(self.adapter.device)].float().cpu()
        return self.choice_probs_from(logits)

    def answers(self, inputs: dict, n: int, generator: torch.Generator) -> list[tuple[str, torch.Tensor]]:
        """n responses (text, token ids) to one built input (HF generate samples from torch's
        global RNG; the choice sampler from `generator`)."""
        if self.answer == "generate":
            return [
                self.adapter.generate_ids(inputs, max_new_tokens=self.max_new_tokens, temperature=self.temperature)
                for _ in range(n)
            ]
        return self.pick_choices(self.choice_probs(inputs), n, generator)

    def rollouts(
        self,
        prompt: Prompt,
        scales: np.ndarray,
        n: int,
        keep_backbone_inputs: bool = False,
        seed: int | None = None,
        clock: StepClock | None = None,
    ) -> Rollouts:
        """n scored rollouts for each allocation in `scales` (M, T); with `seed`, this prompt's
        draws (its R, the option letters, HF generate's samples) are seeded by it."""
        clock = clock or StepClock()
        generator = self.generator if seed is None else torch.Generator().manual_seed(seed)
        if seed is not None:
            torch.manual_seed(seed)  # HF generate samples from torch's global RNG
        with clock.phase("rollout_build"):
            plans = self.plans(prompt, scales, generator)
            state = prompt.state
            inputs = [
                self.adapter.build_inputs(state["chat"], state["video"], p, self.resized_pairs(prompt, p))
                for p in plans
            ]
        with clock.phase("rollout_generate"):
            answers = [self.answers(x, n, generator) for x in inputs]
        with clock.phase("rewards"):
            return self.scored(
                prompt.sample,
                plans,
                [int(x["input_ids"].shape[1]) for x in inputs],
                answers,
                inputs if keep_backbone_inputs else None,
            )


@dataclass
class SimSample:
    """A synthetic video: frames (T, 32, 32, 3) uint8 and the indices of its evidence frames."""

    frames: np.ndarray
    evidence: list[int]
    query: str = "What does the marked frame show?"


def make_sim_samples(count: int, num_frames: int = 8, size: int = 32, seed: int = 0) -> list[SimSample]:
    """Smooth near-duplicate frames (one background per video, small noise) with 1-2 evidence
    frames carrying a high-contrast checkerboard."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:size, 0:size]
    checker = (((yy // 4) + (xx // 4)) % 2 * 255).astype(np.float64)
    samples = []
    for _ in range(count):
        background = rng.uniform(60, 180, 3)
        frames = np.repeat(np.broadcast_to(background, (size, size, 3))[None], num_frames, axis=0).copy()
        frames += rng.normal(0, 4, frames.shape)
        evidence = sorted(rng.choice(num_frames, size=int(rng.integers(1, 3)), replace=False).tolist())
        for t in evidence:
            frames[t] = checker[..., None]
        samples.append(SimSample(frames=frames.clip(0, 255).astype(np.uint8), evidence=evidence))
    return samples


class SimulatedBackbone(RolloutEngine):
    """A stand-in backbone with a continuous task score, like temporal IoU:

        q(s) = p_min + (p_max - p_min) * sigmoid(k_ev (mean evidence scale - s_read) + k_ctx (mean scale - 1))
        score = clip(q(s) + N(0, noise^2), 0, 1),   u = score > 0.35

    so the evidence frames' scale decides the answer and the other frames help only a little.
    R per allocation is the paper's approximation mean(s_t^2)."""

    def __init__(
        self,
        s_read: float = 0.7,
        k_ev: float = 15.0,
        k_ctx: float = 0.3,
        p_min: float = 0.1,
        p_max: float = 0.9,
        noise: float = 0.1,
        threshold: float = 0.35,
        seed: int = 0,
    ):
        self.s_read, self.k_ev, self.k_ctx, self.p_min, self.p_max = s_read, k_ev, k_ctx, p_min, p_max
        self.noise, self.threshold = noise, threshold
        self.rng = np.random.default_rng(seed)

    def prompt(self, sample: SimSample) -> Prompt:
        return Prompt(frames=sample.frames, query=sample.query, sample=sample)

    def quality(self, scales: np.ndarray, evidence: list[int]) -> np.ndarray:
        """Expected score q(s) of each allocation, scales (M, T) -> (M,)."""
        logit = self.k_ev * (scales[:, evidence].mean(axis=1) - self.s_read) + self.k_ctx * (scales.mean(axis=1) - 1.0)
        return self.p_min + (self.p_max - self.p_min) / (1 + np.exp(-logit))

    def budget_settings(self) -> None:
        """No token budget: R is approximated by mean(s^2)."""
        return None

    def rollouts(
        self,
        prompt: Prompt,
        scales: np.ndarray,
        n: int,
        keep_backbone_inputs: bool = False,
        seed: int | None = None,
        clock: StepClock | None = None,
    ) -> Rollouts:
        """With `seed`, the noise comes from a generator seeded by it (the trainer's per-prompt seeds)."""
        rng = self.rng if seed is None else np.random.default_rng(seed)
        clock = clock or StepClock()
        with clock.phase("rollout_generate"):
            q = self.quality(scales, prompt.sample.evidence)
            score = np.clip(q[:, None] + rng.normal(0, self.noise, (len(scales), n)), 0, 1).astype(np.float32)
        return Rollouts(
            torch.from_numpy(score),
            torch.from_numpy((score > self.threshold).astype(np.float32)),
            torch.from_numpy((scales**2).mean(axis=1)),
        )
