"""lmms-eval chat model classes: parse `model_args`, run `VideoPipeline`, write sidecar records.

Registered through the `lmms_eval.models` entry point (see `manifests.py`): `resadapt_qwen25vl`
and `resadapt_qwen3vl` (any method), and one class per registered method and backbone.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict
from pathlib import Path

from lmms_eval.api.instance import GenerationResult, Instance, TokenCounts
from lmms_eval.api.model import lmms
from lmms_eval.models.model_utils.gen_metrics import log_metrics
from lmms_eval.protocol import ChatMessages, ChatVideoContent
from lmms_eval.utils import sanitize_model_name
from loguru import logger
from tqdm import tqdm

from ..allocator import (
    budget_source,
    check_backbone,
    training_backbone,
    training_budget,
)
from ..backbones.qwen import ADAPTERS, Qwen3VLAdapter, Qwen25VLAdapter, QwenVideoAdapter
from ..budget.plan import TokenGrid
from ..budget.planner import Planner, check_base_grid
from ..manifest import git_revision, merge_totals, run_summary, sample_totals, versions, write_json
from ..methods import Method
from ..pipeline import Request, VideoPipeline, VideoPipelineConfig
from ..record import SampleRecord, build_record, sidecar_line
from ..runspec import RunSpec, config_from_model_args
from ..video import is_moving_video
from .manifests import method_class


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

    model_args: pretrained (path or hub id), device, dtype, attn_implementation, sidecar_dir (where
    per-sample JSONL records go; default: the run's `--output_path/<model>` folder, else
    ./resadapt_sidecars), and every field of `VideoPipelineConfig` and its `BudgetSpec` by name
    (method, retention, allocator, operator, max_num_frames, s_min, ...; docs/usage.md's model_args
    table), parsed by `config_from_model_args`.
    """

    is_simple = False
    adapter_cls: type[QwenVideoAdapter]
    fixed_method: str | None = None  # set on the `<method>_<backbone>` classes
    chunk_size = 1  # requests per `VideoPipeline.run_batch` call: the HF path answers one at a time

    def __init__(
        self,
        pretrained: str,
        device: str | None = None,
        dtype: str = "auto",
        attn_implementation: str | None = None,
        sidecar_dir: str | None = None,
        batch_size: int | str = 1,
        max_batch_size: int | None = None,
        **model_args,
    ):
        super().__init__()
        config = self.checked_config(batch_size=batch_size, max_batch_size=max_batch_size, dtype=dtype, **model_args)
        _check_pretrained(str(pretrained))
        from accelerate import Accelerator

        device = device or ("cuda" if _cuda_available() else "cpu")
        _check_loading(device, dtype)
        self.accelerator = Accelerator()  # lmms-eval's: data parallel when launched by `accelerate launch`
        self._rank, self._world_size = self.accelerator.process_index, self.accelerator.num_processes
        config.apply_num_threads(self._world_size)
        if device == "cuda" and self._world_size > 1:
            device = f"cuda:{self.accelerator.local_process_index}"  # one GPU per process
        spec = RunSpec.resolve(config)  # the settings resolved once; everything below receives the spec
        self.method, self.strict = spec.method.name, spec.strict
        differences = check_backbone(spec.allocator, self.backbone_family(), str(pretrained), spec.allocator_transfer)
        if differences:
            logger.warning(
                f"the Allocator {spec.allocator} was trained with another backbone: {'; '.join(differences)}; "
                "running it on this one on purpose (allocator_transfer=true)"
            )
        backbone = self._build_backbone(
            str(pretrained), spec, device=device, dtype=dtype, attn_implementation=_none_or(attn_implementation, str)
        )
        self.pipeline = VideoPipeline(backbone, spec)
        self.batch_size_per_gpu = 1
        self.sidecar_dir = self._sidecar_dir(sidecar_dir, str(pretrained))
        self.started = self._run_stamp()
        self.model_args = dict(
            pretrained=str(pretrained),
            device=device,
            dtype=dtype,
            attn_implementation=attn_implementation,
            **{k: v for k, v in asdict(config).items() if k != "budget"},
            **asdict(config.budget),
        )
        self.allocator_budget = training_budget(spec.allocator)
        self.allocator_backbone = training_backbone(spec.allocator)
        self._totals: list[dict] = []  # per generate_until call, summed over processes

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None):
        """lmms-eval's constructor from `--model_args` and the command line's `--batch_size`,
        `--max_batch_size`, `--device`: a setting given both ways is taken once (the same value) or
        refused naming both, where lmms-eval's own raises a TypeError; a batch size other than 1,
        from either, is refused saying why (`checked_config`)."""
        from lmms_eval.utils import simple_parse_args_string

        args = simple_parse_args_string(arg_string)
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None}
        if "batch_size" in extra:
            _check_batch_size(extra["batch_size"], f"--batch_size {extra.pop('batch_size')}")
        for key in sorted(set(args) & set(extra)):
            if str(args[key]) != str(extra.pop(key)):
                raise ValueError(
                    f"model_args {key}={args[key]!r} and the command line's --{key} {additional_config[key]!r} "
                    "disagree; give it once"
                )
        return cls(**args, **extra)

    @classmethod
    def checked_config(
        cls, batch_size: int | str = 1, max_batch_size: int | None = None, dtype: str = "auto", **model_args
    ) -> VideoPipelineConfig:
        """The pipeline settings of these model_args (as lmms-eval hands them over, without
        `pretrained`, `device`, `attn_implementation`, `sidecar_dir`), checked as far as they can be
        without loading weights: every bad setting stops here, naming its argument. The sweep calls
        it on every cell before the first one runs."""
        method = model_args.pop("method", None)
        if cls.fixed_method and method not in (None, cls.fixed_method):
            raise ValueError(
                f"{cls.__name__} runs method={cls.fixed_method}; use resadapt_<backbone> for method={method}"
            )
        _check_batch_size(batch_size, f"model_args batch_size={batch_size!r}")
        if dtype != "auto" and not _is_torch_dtype(dtype):
            raise ValueError(f"model_args dtype={dtype!r}: expected auto or a torch dtype (float32, bfloat16, float16)")
        config = config_from_model_args(method=method or cls.fixed_method or "vanilla", **model_args)
        spec = RunSpec.resolve(config)
        cls.check_engine(spec.method)
        check_base_grid(config.budget, cls.layout_grid())
        # a retention no video reaches (the floors that need the LLM's depth are checked when the model is built)
        planner = Planner(cls.layout_grid(), spec.budget, spec.min_pixels, spec.max_pixels)
        spec.kind.check_retention(spec, planner, None)
        return config

    @classmethod
    def backbone_family(cls) -> str:
        """`qwen25vl` or `qwen3vl`."""
        return next(name for name, adapter in ADAPTERS.items() if adapter is cls.adapter_cls)

    @classmethod
    def layout_grid(cls) -> TokenGrid:
        """The token grid of this class's backbone family."""
        return ADAPTERS[cls.backbone_family()].layout_cls.grid

    @classmethod
    def check_engine(cls, method: Method) -> None:
        """Stop before loading anything when this class's engine cannot run `method`."""
        if not method.hf:
            raise ValueError(
                f"method={method.name} acts {method.stage.replace('_', ' ')}: it runs on the vLLM classes "
                f"({method.name}_<backbone>, or resadapt_<backbone>_vllm with method={method.name})"
            )

    def _build_backbone(self, pretrained: str, spec: RunSpec, device: str, dtype: str, attn_implementation: str | None):
        """The engine `VideoPipeline` drives under `spec`: here the HF adapter."""
        return self.adapter_cls.from_pretrained(
            pretrained, device=device, dtype=dtype, attn_implementation=attn_implementation
        )

    def _run_stamp(self) -> str:
        """The run's start time, the same on every process (rank 0's), naming its sidecars and manifest."""
        stamp = [time.strftime("%Y%m%dT%H%M%S")]
        if self._world_size > 1:
            from accelerate.utils import broadcast_object_list

            broadcast_object_list(stamp, from_process=0)
        return stamp[0]

    @staticmethod
    def _sidecar_dir(sidecar_dir: str | None, pretrained: str) -> Path:
        if sidecar_dir is not None:
            return Path(sidecar_dir)
        output_path = lmms_eval_output_path()
        return Path(output_path) / sanitize_model_name(pretrained) if output_path else Path("resadapt_sidecars")

    @property
    def sidecar_path(self) -> Path:
        """This process's sidecar JSONL; read when generating, after lmms-eval has set the rank."""
        return self.sidecar_dir / f"resadapt_samples_{self.started}_rank{self.rank}.jsonl"

    # ------------------------------------------------------------------ lmms-eval API
    def generate_until(self, requests: list[Instance]) -> list[GenerationResult]:
        self.sidecar_path.parent.mkdir(parents=True, exist_ok=True)
        results, records = [], []
        desc = f"{type(self).__name__} [{self.method}]"
        with (
            open(self.sidecar_path, "a", encoding="utf-8") as sidecar,
            tqdm(total=len(requests), disable=self.rank != 0, desc=desc) as bar,
        ):
            for start in range(0, len(requests), self.chunk_size):
                chunk = requests[start : start + self.chunk_size]
                # lmms-eval pads a rank's shard with copies it discards: not run, not recorded
                padding = [bool((r.metadata or {}).get("__padding_only__")) for r in chunk]
                answers = iter(self._answer_chunk([r for r, pad in zip(chunk, padding) if not pad]))
                for pad in padding:
                    text, record = ("", None) if pad else next(answers)
                    if record is not None:
                        sidecar.write(sidecar_line(record))
                        records.append(record)
                    counts = TokenCounts(
                        input_tokens=record.input_tokens if record else 0,
                        output_tokens=record.output_tokens if record else 0,
                    )
                    results.append(GenerationResult(text=text, token_counts=counts))
                sidecar.flush()
                bar.update(len(chunk))
        self._log_run(records)
        return results

    @property
    def device(self):
        """Where this process's model runs (lmms-eval's evaluator gathers counts on it)."""
        return self.pipeline.backbone.device

    def _answer_chunk(self, instances: list[Instance]) -> list[tuple[str, SampleRecord]]:
        """Answers in request order; a request that fails is recorded (or raised, with strict) and
        the chunk goes on."""
        requests, stops = [], []
        for instance in instances:
            _, doc_to_messages, gen_kwargs, doc_id, task, split = instance.args
            try:
                requests.append(
                    self._request(doc_to_messages(self.task_dict[task][split][doc_id]), gen_kwargs, doc_id, task)
                )
            except Exception as exc:
                if self.strict:
                    raise
                requests.append(exc)  # recorded by the pipeline's record builder below
            stops.append(gen_kwargs.get("until"))
        ready = [r for r in requests if isinstance(r, Request)]
        answered = iter(self.pipeline.run_batch(ready) if ready else [])
        answers = []
        for instance, request, until in zip(instances, requests, stops):
            if isinstance(request, Request):
                text, record = next(answered)
            else:
                _, _, _, doc_id, task, _ = instance.args
                failed = Request("", doc_id=doc_id, task=task)
                record = build_record(failed, self.pipeline.spec, self.pipeline.layout, *[None] * 6, request)
                text = ""
            if record.error is not None:
                logger.warning(
                    f"doc {record.doc_id} of {record.task} failed, recorded in {self.sidecar_path}: {record.error}"
                )
            answers.append((_cut_at_stop(text, until), record))
        return answers

    def _request(self, messages: list, gen_kwargs: dict, doc_id: int, task: str) -> Request:
        """The pipeline request of one lmms-eval document's chat messages. lmms-eval files `.webm`
        paths under audio and every `.gif` under image: a path to a file of more than one video frame
        is a video here; other image paths are read by the pipeline."""
        messages = ChatMessages(messages=messages)
        for message in messages.messages:
            message.content = [
                ChatVideoContent(url=part.url)
                if part.type in ("image", "audio") and isinstance(part.url, str) and is_moving_video(part.url)
                else part
                for part in message.content
            ]
        images, videos, _ = messages.extract_media()
        if (images and videos) or len(videos) > 1 or not (images or videos):
            raise ValueError(
                f"expected one video or one or more images, got {len(videos)} video(s) and {len(images)} image(s)"
            )
        hf_messages = messages.to_hf_messages()
        prompt = self.pipeline.layout.processor.apply_chat_template(
            hf_messages, tokenize=False, add_generation_prompt=True
        )
        query = " ".join(
            part["text"] for m in hf_messages if m["role"] == "user" for part in m["content"] if part["type"] == "text"
        )
        return Request(
            prompt,
            video=videos[0] if videos else None,
            images=tuple(images),
            query=query,
            gen_kwargs=_generation_args(gen_kwargs),
            doc_id=doc_id,
            task=task,
        )

    def _log_run(self, records: list[SampleRecord]) -> None:
        """Run totals, summed over every process of a data-parallel run: into lmms-eval's results
        JSON (`throughput`, as avg_resadapt_* keys; retention keys only when a sample succeeded)
        and, from the main process, into the run manifest beside it."""
        totals = sample_totals(records)
        if self.world_size > 1:
            from accelerate.utils import gather_object

            totals = merge_totals(gather_object([totals]))
        self._totals.append(totals)
        summary = run_summary(totals)
        retention = {
            f"resadapt_{k}": summary[k] for k in ("mean_retention", "pooled_retention") if summary[k] is not None
        }
        log_metrics(
            total_elapsed_time=totals["generate_s"],
            total_gen_tokens=totals["output_tokens"],
            avg_speed=0.0,
            additional_metrics={
                "resadapt_samples": summary["samples"],
                "resadapt_failed_samples": summary["failed_samples"],
                "resadapt_visual_tokens": summary["visual_tokens"],
                "resadapt_reference_tokens": summary["reference_tokens"],
                "resadapt_tflops": summary["total_tflops"],
                **retention,
            },
        )
        if self.rank == 0:
            write_json(self.manifest_path, self.manifest())

    @property
    def manifest_path(self) -> Path:
        return self.sidecar_dir / f"resadapt_run_{self.started}.json"

    def manifest(self) -> dict:
        """What this run was asked (resolved model_args), what ran it and what it produced so far."""
        return dict(
            model=type(self).__name__,
            model_args=self.model_args,
            allocator_budget=self.allocator_budget,
            allocator_budget_source=budget_source(self.pipeline.spec.allocator),
            allocator_backbone=self.allocator_backbone,
            world_size=self.world_size,
            versions=versions(),
            git_revision=git_revision(),
            started=self.started,
            sidecars=f"resadapt_samples_{self.started}_rank*.jsonl",
            **run_summary(merge_totals(self._totals)),
        )

    def loglikelihood(self, requests):
        raise NotImplementedError("resadapt models generate answers; loglikelihood tasks are not supported")

    def generate_until_multi_round(self, requests):
        raise NotImplementedError("resadapt models answer single-round requests")


def _check_loading(device: str, dtype: str) -> None:
    """Stop at start on a device or dtype the model cannot be loaded with."""
    import torch

    if str(device).startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"model_args device={device!r}: no CUDA device is available here (use device=cpu)")
    if dtype != "auto" and not isinstance(getattr(torch, str(dtype), None), torch.dtype):
        raise ValueError(f"model_args dtype={dtype!r}: expected auto or a torch dtype (float32, bfloat16, float16)")


def _check_batch_size(value, given: str) -> None:
    """Batch size 1 only (`given`: how it was given, model_args `batch_size` or lmms-eval's `--batch_size`)."""
    if str(value).strip() != "1":
        raise ValueError(
            f"{given}: resadapt models answer one request at a time per process (batch size 1): each "
            "sample has its own per-pair frame sizes and visual token count, so requests are not padded into "
            "one batch; for throughput run data parallel (`accelerate launch --num_processes N -m lmms_eval`)"
        )


def _check_pretrained(pretrained: str) -> None:
    """Stop at start on a `pretrained` that is neither a model folder nor a hub id that can be
    read: a path that does not exist (said as such, not as a malformed hub id), a file, a folder
    without config.json, or, with the Hugging Face hub offline (HF_HUB_OFFLINE), a hub id with no
    cached copy."""
    from huggingface_hub import constants, try_to_load_from_cache

    path = Path(pretrained).expanduser()
    where = f"model_args pretrained={pretrained!r}"
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"{where}: the folder has no config.json, so it holds no saved model")
        return
    if path.exists():
        raise ValueError(f"{where} is a file; expected a model folder (config.json and weights) or a hub id")
    offline = bool(constants.HF_HUB_OFFLINE)
    looks_local = path.is_absolute() or pretrained.startswith((".", "~")) or pretrained.count("/") > 1
    if looks_local:
        hub = ", and the Hugging Face hub is offline (HF_HUB_OFFLINE)" if offline else ", and it is not a hub id"
        raise ValueError(f"{where}: no such folder{hub}")
    if offline and not isinstance(try_to_load_from_cache(pretrained, "config.json"), str):
        raise ValueError(
            f"{where}: no such folder, and the Hugging Face hub is offline (HF_HUB_OFFLINE) with no cached copy "
            "of that hub id"
        )


def _is_torch_dtype(name) -> bool:
    import torch

    return isinstance(getattr(torch, str(name), None), torch.dtype)


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


def __getattr__(name: str) -> type:
    """The `<Method><Backbone>` classes (e.g. ToMeQwen25VL; every one is listed in docs/models.md):
    made on first use by `manifests.method_class` (PEP 562 module attribute)."""
    cls = globals()[name] = method_class(name, {"qwen25vl": ResAdaptQwen25VL, "qwen3vl": ResAdaptQwen3VL}, hf=True)
    return cls
