"""The Allocator (paper Sec. 3.2): frozen encoders -> shallow decoder -> per-frame Beta policy.

    f_t = W_v LN(enc_v(coarse frame t)) + PE(t)    q_l = W_q enc_q(query tokens)_l [+ PE(l)]
    (LN: `frame_norm` only; PE(l) on the query: `text_positions` only)
    h   = L x [ temporal self-attention over frames ; gated cross-attention to q ; FFN ]
    alpha_t, beta_t = clamp(softplus(W_h h_t) + 1, 1 + 1e-4, max_concentration)   (alpha, beta > 1)
    a_t ~ Beta(alpha_t, beta_t),   s_t = s_min + a_t (s_max - s_min)               (Eq. scale_map)
    log q(a | x) = sum_t log Beta(a_t; alpha_t, beta_t)                            (Eq. logprob)

`policy="logit_normal"` is the N-CAPO ablation: a_t = sigmoid(z_t), z_t ~ Normal(mu_t, sigma_t)
(a Gaussian policy kept inside (0, 1)); its deterministic action is the mean E[sigmoid(z_t)]
(`logit_normal_mean`, by quadrature); `median` gives sigmoid(mu_t), which differs when mu_t != 0.

Checkpoints: `save_pretrained(dir)` writes `config.json` (with the encoder's name/path) and
`model.safetensors` holding only the trainable weights; `from_pretrained(dir)` rebuilds the frozen
encoders from the config. No remote code.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributions import Beta, Distribution, Normal, TransformedDistribution
from torch.distributions.transforms import SigmoidTransform

from .encoders import ENCODERS, FrozenEncoders, build_encoders

FORMAT_VERSION = 1
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
MIN_EXCESS = 1e-4  # alpha, beta >= 1 + MIN_EXCESS
MIN_SIGMA = 1e-3  # logit-normal sigma floor
POLICIES = ("beta", "logit_normal")


class CheckpointError(ValueError):
    """An Allocator checkpoint that cannot be loaded; the message names the file."""


@dataclass
class AllocatorConfig:
    """Everything that defines an Allocator. Widths in features; scales are linear factors.

    encoder / encoder_path: frozen encoders by name (`minilm-effnet`, `smolvlm`, `tiny`,
    `tiny-colour`) and path.
    policy: `beta` (the paper's head) or `logit_normal` (N-CAPO); init_sigma: its initial sigma.
    width: shared width D; num_layers / num_heads: decoder depth and heads; ffn_mult: FFN width / D.
    gate_init: initial sigmoid gate of the cross-attention. s_min, s_max: scale range.
    init_concentration: alpha + beta at initialisation (the mean scale starts at 1.0);
    head_init_std: std of the head's initial weights (0 gives every frame exactly scale 1.0).
    max_concentration: clamp on alpha and beta. seed: initialisation seed.
    frame_norm: layer-normalise each frame's frozen features (no weights) before W_v, for encoders
    whose raw features are small next to the positional encoding (the `tiny` CNN's are ~0.05).
    text_positions: add the sinusoidal encoding of token order to the projected query tokens, for
    text encoders whose token states carry no order (the `tiny` byte embeddings: without it a query
    is a bag of bytes, and "red" and "green" differ only in byte counts).
    """

    encoder: str = "minilm-effnet"
    encoder_path: str | None = None
    width: int = 1024
    num_layers: int = 2
    num_heads: int = 8
    ffn_mult: int = 4
    gate_init: float = 0.25
    s_min: float = 0.2
    s_max: float = 1.8
    init_concentration: float = 8.0
    head_init_std: float = 0.02
    max_concentration: float = 100.0
    policy: str = "beta"
    init_sigma: float = 0.5
    seed: int = 0
    frame_norm: bool = False
    text_positions: bool = False
    format_version: int = FORMAT_VERSION

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if not 0 < self.s_min < 1 < self.s_max:
            raise ValueError(f"need 0 < s_min < 1 < s_max, got [{self.s_min}, {self.s_max}]")
        if self.width % self.num_heads:
            raise ValueError(f"width {self.width} is not divisible by num_heads {self.num_heads}")
        m = self.initial_mean
        if self.init_concentration * min(m, 1 - m) <= 1:
            raise ValueError(
                f"init_concentration {self.init_concentration} cannot give alpha, beta > 1 at mean {m:.3f}"
            )

    @property
    def initial_mean(self) -> float:
        """Beta mean E[a] that maps to scale 1.0."""
        return (1.0 - self.s_min) / (self.s_max - self.s_min)


def sinusoidal_positions(length: int, width: int, device) -> torch.Tensor:
    """Fixed sinusoidal encoding of order (frames or query tokens), (length, width); any length."""
    position = torch.arange(length, device=device, dtype=torch.float32)[:, None]
    freq = torch.exp(torch.arange(0, width, 2, device=device, dtype=torch.float32) * (-math.log(10000.0) / width))
    pe = torch.zeros(length, width, device=device)
    pe[:, 0::2] = torch.sin(position * freq)
    pe[:, 1::2] = torch.cos(position * freq)
    return pe


class DecoderLayer(nn.Module):
    """Pre-norm: temporal self-attention, gated cross-attention to the query, FFN."""

    def __init__(self, width: int, heads: int, ffn_mult: int, gate_init: float):
        super().__init__()
        self.norm_self = nn.LayerNorm(width)
        self.self_attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.norm_cross = nn.LayerNorm(width)
        self.cross_attn = nn.MultiheadAttention(width, heads, batch_first=True)
        # sigmoid(gate) = gate_init; on the default device, as nn.Linear's weights (`.to(device)` moves them all)
        self.gate = nn.Parameter(torch.tensor(math.log(gate_init / (1 - gate_init))))  # cpu: a new parameter
        self.norm_ffn = nn.LayerNorm(width)
        self.ffn = nn.Sequential(nn.Linear(width, ffn_mult * width), nn.GELU(), nn.Linear(ffn_mult * width, width))

    def forward(self, x, frame_mask, text, text_mask):
        h = self.norm_self(x)
        x = x + self.self_attn(h, h, h, key_padding_mask=~frame_mask, need_weights=False)[0]
        h = self.norm_cross(x)
        x = (
            x
            + torch.sigmoid(self.gate)
            * self.cross_attn(h, text, text, key_padding_mask=~text_mask, need_weights=False)[0]
        )
        return x + self.ffn(self.norm_ffn(x))


class Allocator(nn.Module):
    """Query-aware per-frame scale policy. Trainable: projections, decoder, head; encoders frozen."""

    def __init__(self, config: AllocatorConfig, encoders: FrozenEncoders | None = None):
        super().__init__()
        self.config = config
        self.encoders = (
            encoders if encoders is not None else build_encoders(config.encoder, config.encoder_path, config.seed)
        )
        D = config.width
        generator_state = torch.random.get_rng_state()
        torch.manual_seed(config.seed)
        self.frame_proj = nn.Linear(self.encoders.frame_dim, D)
        self.text_proj = nn.Linear(self.encoders.text_dim, D)
        self.layers = nn.ModuleList(
            DecoderLayer(D, config.num_heads, config.ffn_mult, config.gate_init) for _ in range(config.num_layers)
        )
        self.norm_out = nn.LayerNorm(D)
        self.head = nn.Linear(D, 2)
        nn.init.normal_(self.head.weight, std=config.head_init_std)
        m = config.initial_mean
        with torch.no_grad():
            if config.policy == "beta":  # softplus(b) + 1 = alpha0 / beta0  =>  b = softplus^-1(alpha0 - 1)
                alpha0, beta0 = config.init_concentration * m, config.init_concentration * (1 - m)
                self.head.bias.copy_(torch.tensor([alpha0 - 1, beta0 - 1], device=self.head.bias.device).expm1().log())
            else:  # mu such that the mean action maps to scale 1.0 (logit(m) at m = 0.5); softplus(b) = init_sigma
                mu0 = logit_normal_mu_for_mean(m, config.init_sigma)
                sigma0 = math.log(math.expm1(config.init_sigma))
                self.head.bias.copy_(torch.tensor([mu0, sigma0], device=self.head.bias.device))
        torch.random.set_rng_state(generator_state)

    # ------------------------------------------------------------------ policy
    def forward(self, frame_features, frame_mask, text_features, text_mask) -> tuple[torch.Tensor, torch.Tensor]:
        """Policy parameters, each (B, T): Beta (alpha, beta), or logit-normal (mu, sigma).

        frame_features (B, T, frame_dim) with frame_mask (B, T); text_features (B, L, text_dim)
        with text_mask (B, L); masks are True on real entries.
        """
        B, T, _ = frame_features.shape
        if self.config.frame_norm:
            frame_features = F.layer_norm(frame_features, frame_features.shape[-1:])
        x = self.frame_proj(frame_features) + sinusoidal_positions(T, self.config.width, frame_features.device)
        text = self.text_proj(text_features)
        if self.config.text_positions:
            text = text + sinusoidal_positions(text.shape[1], self.config.width, text.device)
        for layer in self.layers:
            x = layer(x, frame_mask, text, text_mask)
        raw = self.head(self.norm_out(x))
        if self.config.policy == "logit_normal":
            return raw[..., 0], F.softplus(raw[..., 1]).clamp(min=MIN_SIGMA)
        # softplus underflows to 0 for very negative inputs: keep alpha, beta strictly above 1.
        conc = (F.softplus(raw) + 1.0).clamp(min=1.0 + MIN_EXCESS, max=self.config.max_concentration)
        return conc[..., 0], conc[..., 1]

    def make_distribution(self, p1: torch.Tensor, p2: torch.Tensor) -> Distribution:
        """The latent policy q(a | x) over (0, 1) from `forward`'s parameters."""
        if self.config.policy == "logit_normal":
            return TransformedDistribution(Normal(p1, p2), SigmoidTransform())
        return Beta(p1, p2)

    def latent_actions(
        self, p1: torch.Tensor, p2: torch.Tensor, mode: str = "mean", quantile: float = 0.5, seed: int = 0
    ) -> torch.Tensor:
        """Per-frame latent a_t in (0, 1): the policy's mean or median, a quantile, or a sample
        seeded by `seed` (`INFERENCE_MODES`)."""
        if self.config.policy == "logit_normal":
            return logit_normal_actions(p1, p2, mode, quantile, seed)
        return beta_actions(p1, p2, mode, quantile, seed)

    def encode(self, frames: list[torch.Tensor], queries: list[str]) -> dict:
        """Frozen features for a batch of videos: uint8 frames (T_i, H_i, W_i, 3) and query strings."""
        with torch.no_grad():
            text, text_mask = self.encoders.encode_text(queries)
            per_video = [self.encoders.encode_frames(f) for f in frames]
        T = max(f.shape[0] for f in per_video)
        feats = torch.zeros(len(per_video), T, self.encoders.frame_dim, device=text.device)
        mask = torch.zeros(len(per_video), T, dtype=torch.bool, device=text.device)
        for i, f in enumerate(per_video):
            feats[i, : len(f)] = f
            mask[i, : len(f)] = True
        return dict(frame_features=feats, frame_mask=mask, text_features=text, text_mask=text_mask)

    def decoder_flops(self, frames: int, text_tokens: int) -> int:
        """FLOPs of `forward` for one video of T = `frames` frames and a query of L = `text_tokens`
        tokens (2 per multiply-add; D = width, F = ffn_mult): the projections 2 T d_v D + 2 L d_q D;
        per layer self-attention 2 T D 3D + 4 T^2 D + 2 T D^2, cross-attention 2 T D^2 + 2 L D 2D
        + 4 T L D + 2 T D^2, FFN 4 T F D^2; the head 2 T D 2."""
        D, T, L = self.config.width, frames, text_tokens
        self_attention = 2 * T * D * 3 * D + 4 * T * T * D + 2 * T * D * D
        cross_attention = 2 * T * D * D + 2 * L * D * 2 * D + 4 * T * L * D + 2 * T * D * D
        ffn = 4 * T * self.config.ffn_mult * D * D
        projections = 2 * T * self.encoders.frame_dim * D + 2 * L * self.encoders.text_dim * D
        return projections + self.config.num_layers * (self_attention + cross_attention + ffn) + 2 * T * D * 2

    def flops(self, frames: int, text_tokens: int) -> int:
        """FLOPs of scoring one video of `frames` frames for a query of `text_tokens` tokens: the
        frozen encoders (counted once per frame and per query length) and the decoder."""
        encoders = frames * self.encoders.frame_flops() + self.encoders.text_flops(text_tokens)
        return encoders + self.decoder_flops(frames, text_tokens)

    def distribution(self, frame_features, frame_mask, text_features, text_mask) -> Distribution:
        """Per-frame latent policy q(a_t | x) with batch shape (B, T)."""
        return self.make_distribution(*self(frame_features, frame_mask, text_features, text_mask))

    def to_scale(self, a: torch.Tensor) -> torch.Tensor:
        """Eq. scale_map: s = s_min + a (s_max - s_min)."""
        return self.config.s_min + a * (self.config.s_max - self.config.s_min)

    @staticmethod
    def log_prob(dist: Distribution, a: torch.Tensor, frame_mask: torch.Tensor) -> torch.Tensor:
        """Eq. logprob: log q(a | x) = sum over real frames of log Beta(a_t; alpha_t, beta_t), shape (B,)."""
        return (dist.log_prob(a) * frame_mask).sum(dim=-1)

    # ------------------------------------------------------------------ checkpoints
    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.state_dict().items() if not k.startswith("encoders.")}

    def save_pretrained(self, directory: str | Path) -> Path:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / CONFIG_NAME).write_text(json.dumps(asdict(self.config), indent=2) + "\n")
        save_file({k: v.contiguous() for k, v in self.trainable_state_dict().items()}, str(directory / WEIGHTS_NAME))
        return directory

    @classmethod
    def from_pretrained(cls, directory: str | Path, encoders: FrozenEncoders | None = None) -> "Allocator":
        directory = Path(directory)
        config = load_config(directory / CONFIG_NAME)
        weights = directory / WEIGHTS_NAME
        if not weights.is_file():
            raise CheckpointError(f"{weights}: missing Allocator weights")
        try:
            state = load_file(str(weights))
        except (SafetensorError, OSError, ValueError) as exc:
            raise CheckpointError(f"{weights}: not a readable safetensors file ({exc})") from exc
        model = cls(config, encoders=encoders)
        expected = model.trainable_state_dict()
        missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
        if missing or unexpected:
            raise CheckpointError(
                f"{weights}: missing keys {missing[:5]}, unexpected keys {unexpected[:5]} "
                f"for encoder {config.encoder!r}, width {config.width}"
            )
        for key, value in state.items():
            if value.shape != expected[key].shape:
                raise CheckpointError(
                    f"{weights}: {key} has shape {tuple(value.shape)}, the config expects {tuple(expected[key].shape)}"
                )
            if value.is_floating_point() and not bool(torch.isfinite(value).all()):
                bad = int((~torch.isfinite(value)).sum())
                raise CheckpointError(
                    f"{weights}: tensor {key} holds {bad} non-finite value(s) (NaN or inf) of {value.numel()}; "
                    "this checkpoint cannot give scales (retrain it, or take an earlier step's checkpoint)"
                )
        model.load_state_dict(state, strict=False)
        return model


INFERENCE_MODES = ("mean", "median", "quantile", "sample")


def _sample(dist: Distribution, seed: int, device: torch.device) -> torch.Tensor:
    """A sample drawn under `seed`, leaving the global RNG state as it was."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        return dist.sample()


def beta_actions(
    alpha: torch.Tensor, beta: torch.Tensor, mode: str = "mean", quantile: float = 0.5, seed: int = 0
) -> torch.Tensor:
    """Beta mean, median or quantile (scipy's inverse regularised incomplete beta), or seeded sample."""
    if mode == "mean":
        return alpha / (alpha + beta)
    if mode in ("median", "quantile"):
        from scipy.special import betaincinv

        quantile = 0.5 if mode == "median" else quantile
        _check_quantile(quantile)
        a = betaincinv(alpha.double().cpu().numpy(), beta.double().cpu().numpy(), quantile)
        return torch.as_tensor(a, dtype=alpha.dtype, device=alpha.device)
    if mode == "sample":
        return _sample(Beta(alpha, beta), seed, alpha.device)
    raise ValueError(f"allocator inference must be one of {INFERENCE_MODES}, got {mode!r}")


def logit_normal_actions(
    mu: torch.Tensor, sigma: torch.Tensor, mode: str = "mean", quantile: float = 0.5, seed: int = 0
) -> torch.Tensor:
    """Logit-normal mean E[sigmoid(mu + sigma Z)] (`logit_normal_mean`), median sigmoid(mu),
    quantile sigmoid(mu + sigma Phi^-1(q)), or seeded sample."""
    if mode == "mean":
        return logit_normal_mean(mu, sigma)
    if mode == "median":
        return torch.sigmoid(mu)
    if mode == "quantile":
        _check_quantile(quantile)
        return torch.sigmoid(mu + sigma * Normal(0.0, 1.0).icdf(torch.tensor(quantile, device=mu.device)))
    if mode == "sample":
        return _sample(TransformedDistribution(Normal(mu, sigma), SigmoidTransform()), seed, mu.device)
    raise ValueError(f"allocator inference must be one of {INFERENCE_MODES}, got {mode!r}")


def logit_normal_mean(mu: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """E[sigmoid(mu + sigma Z)], Z ~ N(0, 1), elementwise, differentiable in mu and sigma.

    The logit-normal mean has no closed form. The trapezoidal rule on z in [-10, 10] with step
    h = min(0.25, 1 / max(sigma)) converges exponentially for this integrand (the nearest poles
    of sigmoid(mu + sigma z) sit pi / sigma off the real axis, error ~ exp(-2 pi^2 / (sigma h))):
    within 1e-8 of scipy's adaptive quadrature for sigma up to 200 (tests/test_allocator.py).
    Gauss-Hermite with 128 nodes, by comparison, is off by 1e-6 at sigma = 5 and 4e-4 at 10.
    Computed in float64 (float32 on MPS) and returned in mu's dtype.
    """
    dtype = torch.float32 if mu.device.type == "mps" else torch.float64
    mu_, sigma_ = mu.to(dtype), sigma.to(dtype)
    top = float(sigma_.detach().max()) if sigma_.numel() else 1.0
    h = max(min(0.25, 1.0 / max(top, 1e-12)), 5e-4)  # at most 40,001 nodes (sigma ~ 2000)
    n = math.ceil(10.0 / h)
    z = torch.arange(-n, n + 1, device=mu.device, dtype=dtype) * h
    w = torch.exp(-0.5 * z * z)
    w = w / w.sum()
    mean = (torch.sigmoid(mu_[..., None] + sigma_[..., None] * z) * w).sum(-1)
    return mean.to(mu.dtype)


def logit_normal_mu_for_mean(target: float, sigma: float) -> float:
    """The mu whose logit-normal mean at `sigma` is `target` (bisection; the mean rises with mu)."""
    if not 0 < target < 1:
        raise ValueError(f"target mean must be in (0, 1), got {target}")
    sigma_t = torch.tensor(float(sigma), dtype=torch.float64)  # cpu: a scalar search at construction

    def mean_at(mu: float) -> float:
        return float(logit_normal_mean(torch.tensor(mu, dtype=torch.float64), sigma_t))  # cpu: as sigma_t

    lo, hi = -50.0, 50.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        value = mean_at(mid)
        if abs(value - target) < 1e-13:
            return mid
        lo, hi = (mid, hi) if value < target else (lo, mid)
    return 0.5 * (lo + hi)


def _check_quantile(quantile: float) -> None:
    if not 0 < quantile < 1:
        raise ValueError(f"quantile must be in (0, 1), got {quantile}")


def load_config(path: Path) -> AllocatorConfig:
    """Read and validate an Allocator `config.json`."""
    expected = (
        "allocator= takes an Allocator checkpoint folder (config.json and model.safetensors, as "
        "`resadapt-eval train` saves them) or `untrained`"
    )
    if not path.is_file():
        found = "no such folder" if not path.parent.is_dir() else f"the folder has no {path.name}"
        raise CheckpointError(f"{path}: missing Allocator config ({found}); {expected}")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(raw, dict) or "format_version" not in raw:
        model = f", model_type {raw['model_type']!r}" if isinstance(raw, dict) and "model_type" in raw else ""
        raise CheckpointError(
            f"{path}: not an Allocator config (no format_version{model}: a model's config.json?); {expected}"
        )
    version = raw["format_version"]
    if not isinstance(version, int) or isinstance(version, bool):
        raise CheckpointError(f"{path}: format_version {version!r} is not a version number")
    if version > FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: format_version {version!r} is newer than this resadapt-eval reads ({FORMAT_VERSION}); "
            "upgrade resadapt-eval"
        )
    known = {f.name for f in fields(AllocatorConfig)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise CheckpointError(f"{path}: unknown config keys {unknown}")
    if raw.get("encoder") not in ENCODERS:
        raise CheckpointError(
            f"{path}: unknown encoder {raw.get('encoder')!r}; available: {', '.join(sorted(ENCODERS))}"
        )
    try:
        return AllocatorConfig(**raw)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{path}: invalid config ({exc})") from exc
