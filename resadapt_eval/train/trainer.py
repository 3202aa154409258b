"""The Allocator trainer (paper Algorithm 1): sample M allocations per prompt, N rollouts each,
CAPO advantages, PPO epochs on the Allocator; optionally a token-level PPO step on the backbone.

Checkpoints go to `output_dir/checkpoints/step-XXXXXX/` (`allocator/` loadable by
`method=resadapt,allocator=...`, with `budget.json`: the rollout engine's budget settings, and
`backbone.json`: the backbone the rollouts ran on (family, pretrained);
`trainer.pt` with the step and optimiser state; `backbone/` when the backbone is trained);
per-step metrics to `output_dir/metrics.jsonl`.

Data parallel (`accelerate launch --num_processes W ... -m resadapt_eval.cli train ...`): each step's
global batch of `batch_size` prompts is split over the W processes (prompt j goes to process
j % W); every prompt's randomness (its M sampled allocations, the backbone's sampled answers, the
engine's draws) is seeded by (seed, step, j) alone (`prompt_seed`), so W processes draw what one
process draws; each process's loss is the mean over its equal share, and DDP averages the
gradients, which is the single-process mean. Metrics are gathered from every process before
process 0 writes them; process 0 writes the checkpoints; a resume loads the same checkpoint on
every process (no RNG state is needed: it is re-derived from the step).
"""

from __future__ import annotations

import json
import math
import shutil
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from ..allocator import BACKBONE_FILE, BUDGET_FILE, Allocator
from ..capo.losses import (
    CAPOConfig,
    allocation_advantage,
    allocator_ppo_loss,
    backbone_ppo_loss,
    concentration_loss,
    proxy_cost,
    rollout_advantage,
    similarity_loss,
)
from ..manifest import write_json
from .caches import FeatureCache, StepClock

CHECKPOINTS = "checkpoints"
COMPLETE = "complete"  # written last in a checkpoint folder
# One row per prompt in `AllocatorTrainer.metrics`, gathered across processes; `index` first (the sort key).
METRIC_COLUMNS = (
    "index",
    "mean",
    "std",
    "gini",
    "scale_sum",
    "scale_n",
    "retention_sum",
    "retention_n",
    "reward_sum",
    "reward_n",
    "correct_sum",
    "correct_n",
    "loss_policy",
    "loss_sim",
    "loss_con",
)
LATENT_EPS = 1e-4  # sampled Beta actions are kept inside [eps, 1 - eps] so log-densities stay finite


@dataclass
class TrainConfig:
    """Loop settings. batch_size: prompts per step (split over processes); num_allocations: M;
    rollouts_per_allocation: N; lr / backbone_lr: AdamW learning rates."""

    output_dir: str = "runs/allocator"
    steps: int = 100
    batch_size: int = 8
    num_allocations: int = 8
    rollouts_per_allocation: int = 1
    ppo_epochs: int = 1
    lr: float = 2e-5
    backbone_lr: float = 1e-6
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    save_every: int = 50
    seed: int = 0
    train_backbone: bool = False


def gini(x: np.ndarray) -> float:
    """Gini coefficient of non-negative values: sum_ij |x_i - x_j| / (2 n^2 mean(x))."""
    x = np.asarray(x, dtype=np.float64)
    return float(np.abs(x[:, None] - x[None, :]).sum() / (2 * len(x) ** 2 * x.mean()))


def prompt_seed(seed: int, step: int, index: int) -> int:
    """The seed of prompt `index` of step `step`'s global batch: independent of the process that
    handles it, so 1 and W processes draw the same allocations and answers."""
    return int(np.random.SeedSequence([seed, step, index]).generate_state(1)[0])


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    done = sorted(p.parent for p in Path(output_dir, CHECKPOINTS).glob(f"step-*/{COMPLETE}"))
    return done[-1] if done else None


class AllocatorTrainer:
    def __init__(
        self,
        allocator: Allocator,
        engine,
        samples: list,
        config: TrainConfig,
        capo: CAPOConfig,
        backbone=None,
        features: FeatureCache | None = None,
    ):
        """engine: a `RolloutEngine`; backbone: the HF adapter the joint update trains (with
        `train_backbone`); features: the frozen-encoder feature cache (None: none kept)."""
        from accelerate import Accelerator

        self.config, self.capo, self.engine, self.samples = config, capo, engine, samples
        self.features = features if features is not None else FeatureCache(max_mb=0)
        # The Allocator's device decides (under `accelerate launch` on GPUs: this process's GPU).
        self.accelerator = Accelerator(cpu=next(allocator.parameters()).device.type == "cpu")
        processes = self.accelerator.num_processes
        if config.batch_size % processes:
            raise ValueError(
                f"train.batch_size {config.batch_size} is not divisible by the {processes} processes; "
                "choose a batch_size that is a multiple of --num_processes (every process takes an equal share)"
            )
        if config.train_backbone and processes > 1:
            raise ValueError(
                f"train_backbone runs in one process only (got {processes} processes): the backbone is not "
                "wrapped for data parallel training"
            )
        self.allocator = allocator
        params = [p for p in allocator.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
        self.model, self.optimizer = self.accelerator.prepare(allocator, self.optimizer)
        self.backbone = backbone  # a QwenVideoAdapter when the backbone is trained jointly
        if config.train_backbone:
            if backbone is None:
                raise ValueError("train_backbone needs a real backbone (the HF rollout engine)")
            backbone.model.train()
            self.backbone_optimizer = torch.optim.AdamW(
                backbone.model.parameters(), lr=config.backbone_lr, weight_decay=config.weight_decay
            )
        self.step = 0
        self.output_dir = Path(config.output_dir)

    # ------------------------------------------------------------------ data order
    def batch_for_step(self, step: int) -> list[tuple[int, object]]:
        """This process's (index in the global batch, prompt) pairs of `step`: position k of the
        stream is item k % n of a seeded shuffle for pass k // n over the n samples (so a resumed
        run sees the same order); global index j goes to process j % num_processes."""
        n = len(self.samples)
        positions = range(step * self.config.batch_size, (step + 1) * self.config.batch_size)
        batch = [
            self.samples[np.random.default_rng(self.config.seed + k // n).permutation(n)[k % n]] for k in positions
        ]
        return list(enumerate(batch))[self.accelerator.process_index :: self.accelerator.num_processes]

    # ------------------------------------------------------------------ one step
    def train_step(self) -> dict:
        cfg, capo = self.config, self.capo
        s_min, s_max = self.allocator.config.s_min, self.allocator.config.s_max
        clock = StepClock()
        started = time.perf_counter()
        batch = self.batch_for_step(self.step)
        seeds = [prompt_seed(cfg.seed, self.step, index) for index, _ in batch]
        prompts, collected = [], []
        for (index, sample), seed in zip(batch, seeds):
            torch.manual_seed(seed)  # the allocations below
            with clock.phase("decode"):
                prompt = self.engine.prompt(sample)
            with clock.phase("features"):
                feats = self.features.encode(self.allocator, prompt.frames, prompt.query, prompt.video_key)
            with torch.no_grad(), clock.phase("allocation"):
                dist = self.allocator.make_distribution(*self.model(**feats))  # (1, T)
                a = dist.sample((cfg.num_allocations,))[:, 0].clamp(LATENT_EPS, 1 - LATENT_EPS)  # (M, T)
                logp_old = dist.log_prob(a)
            prompts.append(prompt)
            collected.append(dict(index=index, feats=feats, a=a, logp_old=logp_old, scales=self.allocator.to_scale(a)))

        # Every prompt's rollouts at once: the vLLM engine answers the whole step in one call.
        all_rollouts = self.engine.rollout_batch(
            prompts,
            [item["scales"].double().cpu().numpy() for item in collected],
            cfg.rollouts_per_allocation,
            keep_backbone_inputs=cfg.train_backbone,
            seeds=seeds,
            clock=clock,
        )
        for item, rollouts in zip(collected, all_rollouts):
            cost = proxy_cost(item["scales"], s_min, s_max)
            item["advantage"] = rollout_advantage(rollouts.task_reward.float(), cost, rollouts.correct.float(), capo)
            item["rollouts"] = rollouts

        with clock.phase("update"):
            losses = self.update(collected)
            backbone_loss = self.backbone_step(collected) if cfg.train_backbone else None
        self.step += 1
        clock.seconds["step"] = time.perf_counter() - started
        metrics = self.metrics(collected, losses)
        metrics.update(self.step_costs(clock, all_rollouts))
        if backbone_loss is not None:
            metrics["loss_backbone"] = backbone_loss
        return metrics

    def update(self, collected: list) -> list[dict]:
        """PPO epochs of the Allocator on a step's collected prompts; the last epoch's losses per prompt."""
        cfg, capo = self.config, self.capo
        for _ in range(cfg.ppo_epochs):
            losses = []  # per prompt, of the last epoch
            total = 0.0
            for item in collected:
                p1, p2 = self.model(**item["feats"])
                dist = self.allocator.make_distribution(p1, p2)
                logp_new = dist.log_prob(item["a"])
                mask = torch.ones_like(logp_new, dtype=torch.bool)
                policy = allocator_ppo_loss(
                    logp_new,
                    item["logp_old"],
                    allocation_advantage(item["advantage"]),
                    mask,
                    capo.clip_low,
                    capo.clip_high,
                )
                mean_scales = self.allocator.to_scale(self.allocator.latent_actions(p1, p2))[0]
                sim = similarity_loss(item["feats"]["frame_features"][0], mean_scales, capo)
                # L_con caps the Beta's concentration alpha + beta; the logit-normal has none.
                con = (
                    concentration_loss(p1, p2, capo.kappa_max)
                    if self.allocator.config.policy == "beta"
                    else torch.zeros(())
                )
                # The mean over this process's share; DDP averages the equal shares' gradients.
                total = total + (policy + capo.lambda_sim * sim + capo.lambda_con * con) / len(collected)
                losses.append(dict(loss_policy=policy.item(), loss_sim=sim.item(), loss_con=con.item()))
            self.optimizer.zero_grad()
            self.accelerator.backward(total)
            self.accelerator.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
            self.optimizer.step()
        return losses

    def backbone_step(self, collected: list) -> float:
        """Token-level PPO (Eq. loss_phi) on this step's rollouts, advantages weighted by the
        Allocator's importance ratio omega_theta (it was updated first on the same batch)."""
        capo = self.capo
        rows = []
        for item in collected:
            with torch.no_grad():
                dist = self.allocator.make_distribution(*self.model(**item["feats"]))
                omega = torch.exp((dist.log_prob(item["a"]) - item["logp_old"]).sum(dim=-1))  # (M,)
            for m, allocation in enumerate(item["rollouts"].backbone):
                for n, (inputs, ids) in enumerate(allocation):
                    if ids.numel():
                        rows.append((inputs, ids, item["advantage"][m, n], omega[m]))
        if not rows:
            return 0.0
        with torch.no_grad():
            old = [self.backbone.sequence_logprobs(inputs, ids) for inputs, ids, _, _ in rows]
        new = [self.backbone.sequence_logprobs(inputs, ids) for inputs, ids, _, _ in rows]
        length = max(len(x) for x in new)

        def pad(xs):
            return torch.stack([torch.nn.functional.pad(x, (0, length - len(x))) for x in xs])

        mask = pad([torch.ones_like(x) for x in new]).bool()
        loss = backbone_ppo_loss(
            pad(new),
            pad(old),
            torch.stack([r[2] for r in rows]),
            mask,
            capo.clip_low,
            capo.clip_high,
            torch.stack([r[3] for r in rows]),
        )
        self.backbone_optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.backbone.model.parameters(), self.config.grad_clip)
        self.backbone_optimizer.step()
        return loss.item()

    def metrics(self, collected: list, losses: list[dict]) -> dict:
        """Step metrics over the whole global batch: one row of per-prompt statistics
        (`METRIC_COLUMNS`) per prompt, gathered from every process and put back in global-batch
        order, so 1 and W processes reduce the same numbers in the same order."""
        rows = []
        with torch.no_grad():
            for c, loss in zip(collected, losses):
                mean = self.allocator.to_scale(self.allocator.latent_actions(*self.model(**c["feats"])))[0]
                mean = mean.cpu().numpy()
                r = c["rollouts"]
                stats = dict(
                    index=c["index"],
                    mean=mean.mean(),
                    std=mean.std(),
                    gini=gini(mean),
                    scale_sum=float(c["scales"].double().sum()),
                    scale_n=c["scales"].numel(),
                    retention_sum=float(r.retention.double().sum()),
                    retention_n=r.retention.numel(),
                    reward_sum=float(r.task_reward.double().sum()),
                    reward_n=r.task_reward.numel(),
                    correct_sum=float(r.correct.double().sum()),
                    correct_n=r.correct.numel(),
                    **loss,
                )
                rows.append([stats[name] for name in METRIC_COLUMNS])
        local = torch.tensor(rows, dtype=torch.float64, device=self.accelerator.device)
        table = self.accelerator.gather(local).cpu().numpy()
        table = table[np.argsort(table[:, 0], kind="stable")]
        column = dict(zip(METRIC_COLUMNS, table.T))
        return dict(
            step=self.step,
            mean_scale=float(np.mean(column["mean"])),
            scale_std=float(np.mean(column["std"])),
            gini=float(np.mean(column["gini"])),
            sampled_mean_scale=float(column["scale_sum"].sum() / column["scale_n"].sum()),
            achieved_retention=float(column["retention_sum"].sum() / column["retention_n"].sum()),
            reward=float(column["reward_sum"].sum() / column["reward_n"].sum()),
            accuracy=float(column["correct_sum"].sum() / column["correct_n"].sum()),
            **{k: float(np.mean(column[k])) for k in ("loss_policy", "loss_sim", "loss_con")},
        )

    def step_costs(self, clock: StepClock, rollouts: list) -> dict:
        """The step's seconds per phase (the slowest process's); its rollouts, their answers' tokens
        and the caches' hits and misses so far (summed over processes), for `metrics.jsonl`."""
        phases = ("decode", "features", "allocation", "rollout_build", "rollout_generate", "rewards", "update", "step")
        frames, pairs = self.engine.frames, self.engine.pairs
        answered = sum(r.task_reward.numel() for r in rollouts)
        tokens = sum(int(r.response_tokens.sum()) for r in rollouts if r.response_tokens is not None)
        counts = [
            *self.features.cache.counts(),
            *(frames.cache.counts() if frames else (0, 0)),
            *(pairs.cache.counts() if pairs else (0, 0)),
            answered,
            tokens,
        ]
        local = torch.tensor(
            [[clock.seconds.get(p, 0.0) for p in phases] + counts], dtype=torch.float64, device=self.accelerator.device
        )
        table = self.accelerator.gather(local).cpu()
        seconds, counts = table[:, : len(phases)].max(dim=0).values, table[:, len(phases) :].sum(dim=0)
        return dict(
            seconds={p: round(float(v), 6) for p, v in zip(phases, seconds)},
            cache=dict(
                features_hits=int(counts[0]),
                features_misses=int(counts[1]),
                frames_hits=int(counts[2]),
                frames_misses=int(counts[3]),
                pairs_hits=int(counts[4]),
                pairs_misses=int(counts[5]),
            ),
            rollouts=int(counts[6]),
            response_tokens=int(counts[7]),
        )

    # ------------------------------------------------------------------ checkpoints
    def save(self) -> Path:
        folder = self.output_dir / CHECKPOINTS / f"step-{self.step:06d}"
        if self.accelerator.is_main_process:
            if folder.exists():
                shutil.rmtree(folder)
            self.accelerator.unwrap_model(self.model).save_pretrained(folder / "allocator")
            budget = self.engine.budget_settings()
            if budget is not None:  # the budget the Allocator was trained under, keyed as model_args
                write_json(folder / "allocator" / BUDGET_FILE, budget)
            identity = self.engine.backbone_identity()
            if identity is not None:  # its backbone: evaluation on another stops unless allocator_transfer=true
                write_json(folder / "allocator" / BACKBONE_FILE, identity)
            # No RNG state: every prompt's randomness is re-derived from (seed, step, index).
            state = dict(step=self.step, optimizer=self.optimizer.state_dict(), config=asdict(self.config))
            if self.config.train_backbone:
                self.backbone.model.save_pretrained(folder / "backbone")
                self.backbone.processor.save_pretrained(folder / "backbone")
                state["backbone_optimizer"] = self.backbone_optimizer.state_dict()
            torch.save(state, folder / "trainer.pt")
            (folder / COMPLETE).write_text(f"{self.step}\n")
        self.accelerator.wait_for_everyone()
        return folder

    def resume(self, folder: Path) -> None:
        """Every process loads the same checkpoint (save() returns only once it is complete)."""
        state = torch.load(folder / "trainer.pt", map_location="cpu", weights_only=False)
        loaded = Allocator.from_pretrained(folder / "allocator", encoders=self.allocator.encoders)
        self.accelerator.unwrap_model(self.model).load_state_dict(loaded.state_dict())
        self.optimizer.load_state_dict(state["optimizer"])
        if self.config.train_backbone:
            self.backbone.model.load_state_dict(
                type(self.backbone.model).from_pretrained(folder / "backbone").state_dict()
            )
            self.backbone_optimizer.load_state_dict(state["backbone_optimizer"])
        self.step = state["step"]

    def train(self, resume: bool = False, progress: bool = True) -> list[dict]:
        """Run to `config.steps`; with `resume`, continue from the latest complete checkpoint."""
        checkpoint = latest_checkpoint(self.output_dir)
        if checkpoint and not resume:
            raise FileExistsError(
                f"{self.output_dir} already holds checkpoints (latest {checkpoint}); "
                "pass --resume or choose another output_dir"
            )
        if resume and checkpoint:
            self.resume(checkpoint)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        history = []
        bar = tqdm(
            total=self.config.steps,
            initial=self.step,
            disable=not (progress and self.accelerator.is_main_process),
            desc="allocator",
        )
        main = self.accelerator.is_main_process
        with open(self.output_dir / "metrics.jsonl", "a", encoding="utf-8") if main else nullcontext() as log:
            while self.step < self.config.steps:
                metrics = self.train_step()  # the same on every process (gathered)
                diverged = sorted(k for k, v in metrics.items() if isinstance(v, float) and not math.isfinite(v))
                if diverged:
                    raise RuntimeError(
                        f"step {self.step}: {', '.join(diverged)} not finite, training diverged "
                        f"(last checkpoint: {latest_checkpoint(self.output_dir)})"
                    )
                history.append(metrics)
                if main:
                    log.write(json.dumps(metrics, allow_nan=False) + "\n")
                    log.flush()
                bar.update(1)
                bar.set_postfix(
                    scale=f"{metrics['mean_scale']:.2f}",
                    acc=f"{metrics['accuracy']:.2f}",
                    R=f"{metrics['achieved_retention']:.2f}",
                )
                if self.step % self.config.save_every == 0 or self.step == self.config.steps:
                    self.save()
        bar.close()
        return history
