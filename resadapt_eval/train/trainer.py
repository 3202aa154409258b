"""The Allocator trainer (paper Algorithm 1): sample M allocations per prompt, N rollouts each,
CAPO advantages, PPO epochs on the Allocator; optionally a token-level PPO step on the backbone.

Checkpoints go to `output_dir/checkpoints/step-XXXXXX/` (`allocator/` loadable by
`method=resadapt,allocator=...`, `trainer.pt` with optimiser and RNG state, `backbone/` when the
backbone is trained); per-step metrics to `output_dir/metrics.jsonl`.
"""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from ..allocator import Allocator
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

CHECKPOINTS = "checkpoints"
COMPLETE = "complete"  # written last in a checkpoint folder
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


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    done = sorted(p.parent for p in Path(output_dir, CHECKPOINTS).glob(f"step-*/{COMPLETE}"))
    return done[-1] if done else None


class AllocatorTrainer:
    def __init__(
        self, allocator: Allocator, engine, samples: list, config: TrainConfig, capo: CAPOConfig, backbone=None
    ):
        from accelerate import Accelerator

        self.config, self.capo, self.engine, self.samples = config, capo, engine, samples
        torch.manual_seed(config.seed)  # the sampled allocations (a resume restores the saved RNG state)
        self.accelerator = Accelerator(cpu=not torch.cuda.is_available())
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
    def batch_for_step(self, step: int) -> list:
        """The prompts of `step` for this process: position k of the stream is item k % n of
        a seeded shuffle for pass k // n over the n samples (so a resumed run sees the same order)."""
        n = len(self.samples)
        positions = range(step * self.config.batch_size, (step + 1) * self.config.batch_size)
        batch = [
            self.samples[np.random.default_rng(self.config.seed + k // n).permutation(n)[k % n]] for k in positions
        ]
        return batch[self.accelerator.process_index :: self.accelerator.num_processes]

    # ------------------------------------------------------------------ one step
    def train_step(self) -> dict:
        cfg, capo = self.config, self.capo
        s_min, s_max = self.allocator.config.s_min, self.allocator.config.s_max
        collected = []
        for sample in self.batch_for_step(self.step):
            prompt = self.engine.prompt(sample)
            feats = self.allocator.encode([torch.from_numpy(np.ascontiguousarray(prompt.frames))], [prompt.query])
            with torch.no_grad():
                dist = self.allocator.make_distribution(*self.model(**feats))  # (1, T)
                a = dist.sample((cfg.num_allocations,))[:, 0].clamp(LATENT_EPS, 1 - LATENT_EPS)  # (M, T)
                logp_old = dist.log_prob(a)
            scales = self.allocator.to_scale(a)
            rollouts = self.engine.rollouts(
                prompt,
                scales.double().cpu().numpy(),
                cfg.rollouts_per_allocation,
                keep_backbone_inputs=cfg.train_backbone,
            )
            cost = proxy_cost(scales, s_min, s_max)
            advantage = rollout_advantage(rollouts.task_reward.float(), cost, rollouts.correct.float(), capo)
            collected.append(
                dict(feats=feats, a=a, logp_old=logp_old, scales=scales, advantage=advantage, rollouts=rollouts)
            )

        for _ in range(cfg.ppo_epochs):
            losses = {"policy": 0.0, "sim": 0.0, "con": 0.0}
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
                total = total + (policy + capo.lambda_sim * sim + capo.lambda_con * con) / len(collected)
                for name, value in (("policy", policy), ("sim", sim), ("con", con)):
                    losses[name] += value.item() / len(collected)
            self.optimizer.zero_grad()
            self.accelerator.backward(total)
            self.accelerator.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
            self.optimizer.step()

        if cfg.train_backbone:
            losses["backbone"] = self.backbone_step(collected)
        self.step += 1
        return self.metrics(collected, losses)

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

    def metrics(self, collected: list, losses: dict) -> dict:
        with torch.no_grad():
            policy_means = [
                self.allocator.to_scale(self.allocator.latent_actions(*self.model(**c["feats"])))[0].cpu().numpy()
                for c in collected
            ]
        sampled = torch.cat([c["scales"] for c in collected]).cpu().numpy()
        return dict(
            step=self.step,
            mean_scale=float(np.mean([m.mean() for m in policy_means])),
            scale_std=float(np.mean([m.std() for m in policy_means])),
            gini=float(np.mean([gini(m) for m in policy_means])),
            sampled_mean_scale=float(sampled.mean()),
            achieved_retention=float(torch.cat([c["rollouts"].retention for c in collected]).mean()),
            reward=float(torch.cat([c["rollouts"].task_reward.flatten() for c in collected]).float().mean()),
            accuracy=float(torch.cat([c["rollouts"].correct.flatten() for c in collected]).float().mean()),
            **{f"loss_{k}": v for k, v in losses.items()},
        )

    # ------------------------------------------------------------------ checkpoints
    def save(self) -> Path:
        folder = self.output_dir / CHECKPOINTS / f"step-{self.step:06d}"
        if self.accelerator.is_main_process:
            if folder.exists():
                shutil.rmtree(folder)
            self.accelerator.unwrap_model(self.model).save_pretrained(folder / "allocator")
            state = dict(
                step=self.step,
                optimizer=self.optimizer.state_dict(),
                torch_rng=torch.get_rng_state(),
                numpy_rng=np.random.get_state(),
                python_rng=random.getstate(),
                config=asdict(self.config),
            )
            if self.config.train_backbone:
                self.backbone.model.save_pretrained(folder / "backbone")
                self.backbone.processor.save_pretrained(folder / "backbone")
                state["backbone_optimizer"] = self.backbone_optimizer.state_dict()
            torch.save(state, folder / "trainer.pt")
            (folder / COMPLETE).write_text(f"{self.step}\n")
        self.accelerator.wait_for_everyone()
        return folder

    def resume(self, folder: Path) -> None:
        state = torch.load(folder / "trainer.pt", weights_only=False)
        loaded = Allocator.from_pretrained(folder / "allocator", encoders=self.allocator.encoders)
        self.accelerator.unwrap_model(self.model).load_state_dict(loaded.state_dict())
        self.optimizer.load_state_dict(state["optimizer"])
        if self.config.train_backbone:
            self.backbone.model.load_state_dict(
                type(self.backbone.model).from_pretrained(folder / "backbone").state_dict()
            )
            self.backbone_optimizer.load_state_dict(state["backbone_optimizer"])
        torch.set_rng_state(state["torch_rng"])
        np.random.set_state(state["numpy_rng"])
        random.setstate(state["python_rng"])
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
        with open(self.output_dir / "metrics.jsonl", "a", encoding="utf-8") as log:
            while self.step < self.config.steps:
                metrics = self.train_step()
                history.append(metrics)
                if self.accelerator.is_main_process:
                    log.write(json.dumps(metrics) + "\n")
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
