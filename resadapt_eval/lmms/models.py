"""lmms-eval chat model classes: parse `model_args`, run `VideoPipeline`, write sidecar records.

Registered through the `lmms_eval.models` entry point (see `manifests.py`) as
`resadapt_qwen25vl` and `resadapt_qwen3vl`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from loguru import logger
from tqdm import tqdm

from lmms_eval.api.instance import GenerationResult, Instance, TokenCounts
from lmms_eval.api.model import lmms
from lmms_eval.models.model_utils.gen_metrics import log_metrics
from lmms_eval.protocol import ChatMessages
from lmms_eval.utils import sanitize_model_name

from ..backbones.qwen import Qwen3VLAdapter, Qwen25VLAdapter, QwenVideoAdapter
from ..budget.policies import BudgetSpec
from ..pipeline import SampleRecord, VideoPipeline, VideoPipelineConfig
from .manifests import METHOD_PREFIXES, class_name


def _none_or(value, cast):
    return None if value is None or str(value).lower() == "none" else cast(value)


def lmms_eval_output_path() -> str | None:
    """`--output_path` of the running `lmms-eval` command, if it was given one."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--output_path", default=None)
    known, _ = parser.parse_known_args(sys.argv[1:])
    return known.output_path


class ResAdaptQwen(lmms):
    """Qwen video model whose visual budget is set per frame pair by `method`.

    model_args: pretrained (path or hub id), method (vanilla | fixed_scale | resadapt), retention
    (target R; for resadapt the Allocator's scales are projected onto it), allocator (checkpoint
    folder or `builtin`), allocator_inference (mean | quantile | sample), allocator_quantile,
    allocator_seed, compression_seed (random_drop's subset; token compressors: random_drop | tome |
    visionzip | flashvid compress the vanilla plan's merged tokens to round(R * N)), operator
    (resize | select | select_resize; selection scores `candidates` frames with the Allocator and
    keeps `top_k` and/or those with scale >= `score_threshold`),
    max_num_frames, min_pixels / max_pixels (one frame's base area in pixels), s_min / s_max
    (scale range), min_tokens_per_pair / max_tokens_per_pair, pair_reduction (mean | max | min),
    device, dtype, attn_implementation, strict (raise on a bad sample instead of recording it),
    sidecar_dir (where per-sample JSONL records go; default: the run's `--output_path/<model>`
    folder, else ./resadapt_sidecars).
    """

    is_simple = False
    adapter_cls: type[QwenVideoAdapter]
    fixed_method: str | None = None  # set on the `<method>_<backbone>` classes

    def __init__(
        self,
        pretrained: str,
        method: str | None = None,
        retention: float | None = None,
        max_num_frames: int = 32,
        min_pixels: int | None = None,
        max_pixels: int | None = None,
        s_min: float = 0.2,
        s_max: float = 1.8,
        min_tokens_per_pair: int = 1,
        max_tokens_per_pair: int | None = None,
        pair_reduction: str = "mean",
        device: str | None = None,
        dtype: str = "auto",
        attn_implementation: str | None = None,
        strict: bool = False,
        sidecar_dir: str | None = None,
        allocator: str | None = None,
        allocator_inference: str = "mean",
        allocator_quantile: float = 0.5,
        allocator_seed: int = 0,
        compression_seed: int = 0,
        operator: str = "resize",
        candidates: int = 128,
        top_k: int | None = 32,
        score_threshold: float | None = None,
        batch_size: int | str = 1,
        max_batch_size: int | None = None,
        **unknown,
    ):
        super().__init__()
        if unknown:
            raise ValueError(f"unknown model_args for {type(self).__name__}: {', '.join(sorted(unknown))}")
        if self.fixed_method and method not in (None, self.fixed_method):
            raise ValueError(f"{type(self).__name__} runs method={self.fixed_method}; use resadapt_<backbone> for method={method}")
        method = method or self.fixed_method or "vanilla"
        if int(batch_size) != 1:
            raise ValueError("resadapt models run batch_size=1 (each sample has its own per-pair sizes)")
        from accelerate import Accelerator

        self.accelerator = Accelerator()
        if self.accelerator.num_processes > 1:
            device = f"cuda:{self.accelerator.local_process_index}"
            self._rank = self.accelerator.process_index
            self._world_size = self.accelerator.num_processes
        device = device or ("cuda" if _cuda_available() else "cpu")
        self.method = method
        self.strict = bool(strict)
        config = VideoPipelineConfig(
            method=method,
            max_num_frames=int(max_num_frames),
            min_pixels=_none_or(min_pixels, int),
            max_pixels=_none_or(max_pixels, int),
            budget=BudgetSpec(
                retention=_none_or(retention, float),
                s_min=float(s_min),
                s_max=float(s_max),
                min_tokens_per_pair=int(min_tokens_per_pair),
                max_tokens_per_pair=_none_or(max_tokens_per_pair, int),
                pair_reduction=pair_reduction,
            ),
            allocator=_none_or(allocator, str),
            allocator_inference=allocator_inference,
            allocator_quantile=float(allocator_quantile),
            allocator_seed=int(allocator_seed),
            compression_seed=int(compression_seed),
            operator=operator,
            candidates=int(candidates),
            top_k=_none_or(top_k, int),
            score_threshold=_none_or(score_threshold, float),
        )
        backbone = self._build_backbone(str(pretrained), config, device=device, dtype=dtype, attn_implementation=_none_or(attn_implementation, str))
        self.pipeline = VideoPipeline(backbone, config)
        self.batch_size_per_gpu = 1
        self.sidecar_path = self._sidecar_path(sidecar_dir, str(pretrained))

    def _build_backbone(self, pretrained: str, config: VideoPipelineConfig, device: str, dtype: str, attn_implementation: str | None):
        """The engine `VideoPipeline` drives: here the HF adapter."""
        return self.adapter_cls.from_pretrained(pretrained, device=device, dtype=dtype, attn_implementation=attn_implementation)

    def _sidecar_path(self, sidecar_dir: str | None, pretrained: str) -> Path:
        if sidecar_dir is None:
            output_path = lmms_eval_output_path()
            sidecar_dir = Path(output_path) / sanitize_model_name(pretrained) if output_path else Path("resadapt_sidecars")
        stamp = time.strftime("%Y%m%dT%H%M%S")
        return Path(sidecar_dir) / f"resadapt_samples_{stamp}_rank{self.rank}.jsonl"

    # ------------------------------------------------------------------ lmms-eval API
    def generate_until(self, requests: list[Instance]) -> list[GenerationResult]:
        self.sidecar_path.parent.mkdir(parents=True, exist_ok=True)
        results, records = [], []
        with open(self.sidecar_path, "a", encoding="utf-8") as sidecar:
            for request in tqdm(requests, disable=self.rank != 0, desc=f"{type(self).__name__} [{self.method}]"):
                text, record = self._answer(request)
                sidecar.write(json.dumps(record.to_dict()) + "\n")
                sidecar.flush()
                records.append(record)
                results.append(GenerationResult(text=text, token_counts=TokenCounts(input_tokens=record.input_tokens, output_tokens=record.output_tokens)))
        self._log_run(records)
        return results

    def _parse(self, request: Instance) -> tuple[str, str, list, list, dict]:
        """(chat prompt text, user query, images, videos, lmms-eval gen_kwargs) of a request."""
        _, doc_to_messages, gen_kwargs, doc_id, task, split = request.args
        messages = ChatMessages(messages=doc_to_messages(self.task_dict[task][split][doc_id]))
        images, videos, _ = messages.extract_media()
        if (images and videos) or len(videos) > 1 or not (images or videos):
            raise ValueError(f"expected one video or one or more images, got {len(videos)} video(s) and {len(images)} image(s)")
        hf_messages = messages.to_hf_messages()
        prompt = self.pipeline.adapter.processor.apply_chat_template(hf_messages, tokenize=False, add_generation_prompt=True)
        query = " ".join(part["text"] for m in hf_messages if m["role"] == "user" for part in m["content"] if part["type"] == "text")
        return prompt, query, images, videos, gen_kwargs

    def _new_record(self, request: Instance) -> SampleRecord:
        _, _, _, doc_id, task, _ = request.args
        return SampleRecord(doc_id=doc_id, task=task, method=self.method)

    def _failed(self, record: SampleRecord, exc: Exception | None = None) -> tuple[str, SampleRecord]:
        """Record a failed sample, from `exc` or its `record.error` (or raise, with strict=True);
        the run goes on."""
        if self.strict:
            raise exc or RuntimeError(record.error)
        if exc is not None:
            record.error = f"{type(exc).__name__}: {exc}"
        logger.warning(f"doc {record.doc_id} of {record.task} failed, recorded in {self.sidecar_path}: {record.error}")
        return "", record

    def _answer(self, request: Instance) -> tuple[str, SampleRecord]:
        record = self._new_record(request)
        try:
            prompt, query, images, videos, gen_kwargs = self._parse(request)
            if videos:
                text, record = self.pipeline.run(videos[0], prompt, query=query, gen_kwargs=_generation_args(gen_kwargs), record=record)
            else:
                text, record = self.pipeline.run_images(images, prompt, query=query, gen_kwargs=_generation_args(gen_kwargs), record=record)
            return _cut_at_stop(text, gen_kwargs.get("until")), record
        except Exception as exc:
            return self._failed(record, exc)

    def _log_run(self, records: list[SampleRecord]) -> None:
        """Run totals into lmms-eval's results JSON (`throughput`, as avg_resadapt_* keys)."""
        done = [r for r in records if r.error is None]
        visual = sum(r.visual_tokens for r in done)
        reference = sum(r.reference_tokens for r in done)
        log_metrics(
            total_elapsed_time=sum(r.generate_s for r in done),
            total_gen_tokens=sum(r.output_tokens for r in done),
            avg_speed=0.0,
            additional_metrics={
                "resadapt_samples": len(records),
                "resadapt_failed_samples": len(records) - len(done),
                "resadapt_visual_tokens": visual,
                "resadapt_reference_tokens": reference,
                "resadapt_mean_retention": sum(r.achieved_retention for r in done) / len(done) if done else 0.0,
                "resadapt_pooled_retention": visual / reference if reference else 0.0,
            },
        )

    def loglikelihood(self, requests):
        raise NotImplementedError("resadapt models generate answers; loglikelihood tasks are not supported")

    def generate_until_multi_round(self, requests):
        raise NotImplementedError("resadapt models answer single-round requests")


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _generation_args(gen_kwargs: dict) -> dict:
    """lmms-eval generation kwargs -> `QwenVideoAdapter.generate` arguments (greedy by default)."""
    temperature = float(gen_kwargs.get("temperature") or 0.0)
    if not gen_kwargs.get("do_sample", temperature > 0):
        temperature = 0.0
    return dict(
        max_new_tokens=int(gen_kwargs.get("max_new_tokens", 128)),
        temperature=temperature,
        top_p=gen_kwargs.get("top_p"),
        num_beams=int(gen_kwargs.get("num_beams", 1)),
    )


def _cut_at_stop(text: str, until) -> str:
    """Truncate `text` at the first of the task's stop strings."""
    for stop in [until] if isinstance(until, str) else until or []:
        if stop and stop in text:
            text = text[: text.index(stop)]
    return text


class ResAdaptQwen25VL(ResAdaptQwen):
    adapter_cls = Qwen25VLAdapter


class ResAdaptQwen3VL(ResAdaptQwen):
    adapter_cls = Qwen3VLAdapter


def _fixed_method_classes() -> dict[str, type]:
    """`<method>_<backbone>` model classes (e.g. TomeQwen25VL), named as the manifest names them."""
    bases = {"qwen25vl": ResAdaptQwen25VL, "qwen3vl": ResAdaptQwen3VL}
    classes = {}
    for method in METHOD_PREFIXES:
        if method == "resadapt":
            continue  # resadapt_<backbone> is the any-method class itself
        for backbone, base in bases.items():
            name = class_name(method, backbone)
            classes[name] = type(name, (base,), {"fixed_method": method, "__module__": __name__, "__doc__": f"{base.__name__} with method={method}."})
    return classes


globals().update(_fixed_method_classes())
