"""Rollouts through vLLM (`rollout.engine: vllm`): a whole CAPO step in one batched call.

Every (prompt, allocation) pair is planned with the same `Planner` and realised as the same vLLM
request the evaluation path builds (`VLLMBackbone.build_inputs`: one video item per frame pair,
the HF path's positions and metadata). All of a step's requests go to `LLM.generate` together:
`generate` asks for N answers per request (`SamplingParams(n=N)`, seeded per request from the
prompt's seed); `choice_logits` asks for one token with the option letters' log-probabilities
(`logprob_token_ids`) and samples the letters as the HF engine does, from the same seeded
generator. Rewards, correctness, R and token counts come from the code the HF engine uses.

The backbone stays frozen: vLLM holds its own copy of the weights, so backbone co-training
(`train_backbone: true`) is refused; it runs on the HF engine.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

import numpy as np
import torch

from ..backbones.vllm_engine import VLLMBackbone
from ..budget.policies import BudgetSpec
from .caches import StepClock
from .engines import PlannedRollouts, Prompt, Rollouts

STALE_WEIGHTS = (
    "rollout.engine vllm keeps the backbone frozen: vLLM serves its own copy of the weights, which a "
    "backbone update (train_backbone: true) would leave stale; train the backbone with rollout.engine hf"
)


@contextmanager
def pin_engine_gpu(device: str, num_processes: int, tensor_parallel_size: int):
    """While a vLLM engine starts in this block: under `accelerate launch` with one process per GPU,
    each process's engine runs on the GPU of its Allocator, `device` (`cuda:i`). vLLM takes no device
    argument; its engine process uses the GPUs visible when it is spawned, so only for the spawn
    this process's CUDA_VISIBLE_DEVICES names that one GPU by its UUID (which torch reports for the
    devices this process sees, whatever made them visible), and it is restored afterwards. Nothing
    is read from the environment; this process's own CUDA devices, already initialised, are
    unaffected."""
    if num_processes == 1:
        yield
        return
    if tensor_parallel_size != 1:
        raise ValueError(
            f"rollout.vllm.tensor_parallel_size {tensor_parallel_size} with {num_processes} processes: under "
            "`accelerate launch` each process's engine takes its own GPU; for tensor parallel engines run one "
            "process per node"
        )
    uuid = torch.cuda.get_device_properties(torch.device(device)).uuid
    previous = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = f"GPU-{uuid}"  # what the engine process vLLM spawns inherits
    try:
        yield
    finally:
        if previous is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = previous


def request_seed(seed: int | None, allocation: int) -> int | None:
    """vLLM's sampling seed for allocation `allocation` of the prompt seeded by `seed`."""
    return None if seed is None else int(np.random.SeedSequence([seed, allocation]).generate_state(1)[0])


class VLLMRolloutEngine(PlannedRollouts):
    """`PlannedRollouts` answered by a `VLLMBackbone` (which names the family and checkpoint)."""

    def __init__(
        self,
        backbone: VLLMBackbone,
        family: str,
        pretrained: str,
        max_num_frames: int,
        budget: BudgetSpec,
        **kwargs,
    ):
        super().__init__(backbone.layout, family, pretrained, max_num_frames, budget, **kwargs)
        self.backbone = backbone

    def sampling_params(self, n: int, seed: int | None, allocation: int):
        from vllm import SamplingParams

        if self.answer == "choice_logits":
            return SamplingParams(max_tokens=1, temperature=0.0, logprob_token_ids=self.choice_ids.tolist())
        if self.temperature <= 0:  # greedy: vLLM takes n = 1, and all N answers are that one
            return SamplingParams(max_tokens=self.max_new_tokens, temperature=0.0)
        return SamplingParams(
            n=n, max_tokens=self.max_new_tokens, temperature=self.temperature, seed=request_seed(seed, allocation)
        )

    def choice_logprobs(self, output) -> torch.Tensor:
        """The option letters' log-probabilities at the first answer token, (len(choices),)."""
        (first,) = output.outputs[0].logprobs[:1]
        return torch.tensor([first[token].logprob for token in self.choice_ids.tolist()])

    def answers_of(self, output, n: int, generator: torch.Generator) -> list[tuple[str, torch.Tensor]]:
        if self.answer == "choice_logits":
            return self.pick_choices(self.choice_probs_from(self.choice_logprobs(output)), n, generator)
        answers = [(c.text, torch.tensor(list(c.token_ids), dtype=torch.long)) for c in output.outputs]
        return answers * n if len(answers) == 1 and n > 1 else answers

    def rollouts(
        self,
        prompt: Prompt,
        scales: np.ndarray,
        n: int,
        keep_backbone_inputs: bool = False,
        seed: int | None = None,
        clock: StepClock | None = None,
    ) -> Rollouts:
        return self.rollout_batch([prompt], [scales], n, keep_backbone_inputs, [seed], clock)[0]

    def rollout_batch(
        self,
        prompts: list[Prompt],
        scales: list[np.ndarray],
        n: int,
        keep_backbone_inputs: bool = False,
        seeds: list[int | None] | None = None,
        clock: StepClock | None = None,
    ) -> list[Rollouts]:
        """Rollouts of every prompt of a step from one `LLM.generate` call; scales[i] (M, T)."""
        if keep_backbone_inputs:
            raise ValueError(STALE_WEIGHTS)
        clock = clock or StepClock()
        seeds = seeds if seeds is not None else [None] * len(prompts)
        generators = [self.generator if s is None else torch.Generator().manual_seed(s) for s in seeds]
        with clock.phase("rollout_build"):
            plans = [self.plans(p, s, g) for p, s, g in zip(prompts, scales, generators)]
            requests, params = [], []
            for prompt, prompt_plans, seed in zip(prompts, plans, seeds):
                for m, plan in enumerate(prompt_plans):
                    pairs = self.resized_pairs(prompt, plan)
                    requests.append(
                        self.backbone.build_inputs(prompt.state["chat"], prompt.state["video"], plan, pairs)
                    )
                    params.append(self.sampling_params(n, seed, m))
        with clock.phase("rollout_generate"):
            outputs = self.backbone.llm.generate(requests, params, use_tqdm=False)
        with clock.phase("rewards"):
            results, start = [], 0
            for prompt, prompt_plans, generator in zip(prompts, plans, generators):
                mine = outputs[start : start + len(prompt_plans)]
                start += len(prompt_plans)
                answers = [self.answers_of(output, n, generator) for output in mine]
                tokens = [len(output.prompt_token_ids) for output in mine]
                results.append(self.scored(prompt.sample, prompt_plans, tokens, answers))
        return results
