"""The run spec: a run's settings resolved once, at model build, into one frozen value.

`config_from_model_args` parses lmms-eval's model_args into a `VideoPipelineConfig` (names and
strings); `RunSpec.resolve` turns that into the `Method` object, its kind for this run, the
retention and budget rule with their pair bounds (`BudgetSpec`), the operator as an `Operator`,
the stage layers as numbers, and the other settings as given, checking them all (every bad setting
stops here, naming its argument).
Everything downstream (the pipeline and its kinds, the record builder, the FLOPs table, the vLLM
classes) receives the spec; no method, operator or stage is looked up by name or compared with a
string outside the registry (`methods.py`) and this module.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import get_args, get_type_hints

import torch
from loguru import logger

from .allocator import BUDGET_FILE, UNTRAINED, budget_source, check_checkpoint, training_budget
from .backbones.layout import RESIZES
from .budget.policies import BudgetSpec
from .budget.selection import OPERATORS, Operator
from .kinds import FRAME_SELECTION, MethodKind
from .methods import NO_RETENTION, REQUIRED_RETENTION, Method, get_method

ALLOCATOR_QUERIES = ("question", "empty")


@dataclass
class VideoPipelineConfig:
    """Per-run settings. min_pixels/max_pixels bound one frame's base (vanilla) area in pixels;
    strict: raise a failed sample's exception instead of recording it; num_threads: torch's
    intra-op threads for this process (None: torch's default for one process, the machine's CPUs
    divided among the processes when several run, see `apply_num_threads`); prune_layers: the
    decoder layers where an inside-the-LLM method prunes, comma-separated (None: the method's own);
    tower_layers: the vision blocks after which an inside-the-tower method merges (iLLaVA), or before
    which it prunes (IPCV's K), comma-separated (None: the method's own);
    allocator_query: what the Allocator reads as the query, `question` or `empty` (the ablation);
    allocator_transfer: run an Allocator whose `backbone.json` names another backbone on purpose (as
    the paper runs its Qwen2.5-VL Allocator on Qwen3-VL; without it such a checkpoint stops at start;
    methods without an Allocator ignore it, so a card can set it for every cell); resize: how frames
    are resized to their planned sizes and to the Allocator's square input, `exact` (torchvision's
    float path, as qwen-vl-utils) or `fast` (its uint8 kernels, a few uint8 levels off;
    `backbones.layout.resize_frames`, `allocator.encoders.coarse_frames`); either runs on the model's
    device.
    These are the parsed model_args; the pipeline runs with them resolved (`RunSpec.resolve`)."""

    method: str = "vanilla"
    max_num_frames: int = 32
    min_pixels: int | None = None
    max_pixels: int | None = None
    budget: BudgetSpec = field(default_factory=BudgetSpec)
    allocator: str | None = None
    allocator_inference: str = "mean"
    allocator_quantile: float = 0.5
    allocator_seed: int = 0
    allocator_query: str = "question"
    allocator_transfer: bool = False
    resize: str = "exact"
    compression_seed: int = 0
    operator: str = "resize"
    candidates: int = 128
    top_k: int | None = 32
    score_threshold: float | None = None
    strict: bool = False
    num_threads: int | None = None
    prune_layers: str | None = None
    tower_layers: str | None = None

    def __post_init__(self):
        RunSpec.resolve(self)  # every bad setting stops here, naming its argument

    def apply_num_threads(self, processes: int) -> int:
        """Set torch's intra-op threads for this process and return them: `num_threads` if given;
        else, with `processes` > 1 data-parallel processes (assumed on one machine), the CPUs this
        process may use divided among them (at least 1), since each process taking all of them
        oversubscribes the cores; else torch's default, unchanged."""
        threads = self.num_threads
        if threads is None and processes > 1:
            threads = max(1, len(os.sched_getaffinity(0)) // processes)
        if threads is not None:
            torch.set_num_threads(threads)
        return torch.get_num_threads()


@dataclass(frozen=True)
class RunSpec:
    """One run's resolved settings (see `VideoPipelineConfig` for each one's meaning).

    method: the registered `Method`; kind: what this run does (`method.kind`, or frame selection
    under a selecting operator); budget: the retention, budget rule and pair bounds; operator: the
    budget operator; prune_layers: the decoder layers of an in-LLM stage (None: the method's own),
    prune_layers_text: the same as given (for messages); tower_layers, tower_layers_text: the same for
    the vision blocks of an inside-the-tower method."""

    method: Method
    budget: BudgetSpec
    operator: Operator
    prune_layers: tuple[int, ...] | None
    prune_layers_text: str | None
    max_num_frames: int
    candidates: int
    top_k: int | None
    score_threshold: float | None
    min_pixels: int | None
    max_pixels: int | None
    allocator: str | None
    allocator_inference: str
    allocator_quantile: float
    allocator_seed: int
    allocator_query: str
    compression_seed: int
    strict: bool
    allocator_transfer: bool = False
    resize: str = "exact"
    tower_layers: tuple[int, ...] | None = None
    tower_layers_text: str | None = None
    kind: MethodKind = field(init=False)

    def __post_init__(self):
        object.__setattr__(self, "kind", FRAME_SELECTION if self.operator.selects_frames else self.method.kind)

    @property
    def retention(self) -> float | None:
        """The target R (None: the method's own budget)."""
        return self.budget.retention

    @property
    def stage_layers(self) -> list[int] | None:
        """`prune_layers` as the schedules take them (None: the method's defaults)."""
        return None if self.prune_layers is None else list(self.prune_layers)

    @property
    def vision_blocks(self) -> list[int] | None:
        """`tower_layers` as the in-tower methods take them (None: the method's defaults)."""
        return None if self.tower_layers is None else list(self.tower_layers)

    @property
    def frames_to_decode(self) -> int:
        """Frames decoded per video: every candidate when selecting frames, else `max_num_frames`."""
        return self.candidates if self.operator.selects_frames else self.max_num_frames

    @property
    def reads_question(self) -> bool:
        """The Allocator reads the request's question (`allocator_query=question`), not an empty query."""
        return self.allocator_query == ALLOCATOR_QUERIES[0]

    @classmethod
    def named(cls, method: str, retention: float | None = None, prune_layers: list[int] | None = None) -> RunSpec:
        """The spec of registered method `method` at `retention` with the other settings at their
        defaults (the config-only FLOPs table plans with it; a method scored by the Allocator names
        the untrained one, which the table never loads)."""
        allocator = UNTRAINED if get_method(method).needs_allocator else None
        layers = None if prune_layers is None else ",".join(str(layer) for layer in prune_layers)
        config = VideoPipelineConfig(
            method, budget=BudgetSpec(retention=retention), allocator=allocator, prune_layers=layers
        )
        return cls.resolve(config)

    @classmethod
    def resolve(cls, config: VideoPipelineConfig | RunSpec) -> RunSpec:
        """The spec of parsed model_args `config` (a spec is returned as is); a bad setting is a
        ValueError naming its argument."""
        if isinstance(config, RunSpec):
            return config
        method = get_method(config.method)
        layers = _prune_layers(config, method)
        tower = method.tower_merge or method.tower_prune
        tower_layers = _layer_list(
            "tower_layers", config.tower_layers, config.method, tower is not None, "act inside the vision tower",
            "vision block", "block", "acts", None if tower is None else tower.layer_count,
        )  # fmt: skip
        if config.operator not in OPERATORS:
            raise ValueError(f"operator must be one of {OPERATORS}, got {config.operator!r}")
        operator = Operator(config.operator)
        if operator.selects_frames and not method.needs_allocator:
            raise ValueError(
                f"operator={config.operator} ranks frames by the Allocator's scales: it needs method=resadapt"
            )
        if config.allocator is not None and not method.needs_allocator:
            raise ValueError(f"allocator= is only used by method=resadapt, not {config.method!r}")
        if config.allocator is None and method.needs_allocator:
            raise ValueError(
                f"method={config.method} needs model_args allocator=<checkpoint folder> (an Allocator trained with "
                f"this backbone: resadapt-eval train), or allocator={UNTRAINED} to run the untrained Allocator on "
                "purpose"
            )
        if method.retention == REQUIRED_RETENTION and config.budget.retention is None:
            raise ValueError(f"method={config.method} needs a target retention (model_args retention=...)")
        if method.retention == NO_RETENTION and config.budget.retention is not None:
            raise ValueError(
                f"method={config.method} has no retention target; drop retention={config.budget.retention}"
            )
        at_least_one = dict(
            max_num_frames=config.max_num_frames,
            candidates=config.candidates,
            top_k=config.top_k,
            num_threads=config.num_threads,
        )
        for name, value in at_least_one.items():
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        if config.resize not in RESIZES:
            raise ValueError(f"resize must be one of {', '.join(RESIZES)}, got {config.resize!r}")
        if config.allocator_query not in ALLOCATOR_QUERIES:
            raise ValueError(f"allocator_query must be one of {ALLOCATOR_QUERIES}, got {config.allocator_query!r}")
        if config.allocator_query != ALLOCATOR_QUERIES[0] and not method.needs_allocator:
            raise ValueError(f"allocator_query= is only used by method=resadapt, not {config.method!r}")
        if not 0 < config.allocator_quantile < 1:
            raise ValueError(f"allocator_quantile must be in (0, 1), got {config.allocator_quantile}")
        if config.min_pixels is not None and config.max_pixels is not None and config.min_pixels > config.max_pixels:
            raise ValueError(f"min_pixels={config.min_pixels} exceeds max_pixels={config.max_pixels}")
        return cls(
            method,
            config.budget,
            operator,
            layers,
            config.prune_layers,
            config.max_num_frames,
            config.candidates,
            config.top_k,
            config.score_threshold,
            config.min_pixels,
            config.max_pixels,
            config.allocator,
            config.allocator_inference,
            config.allocator_quantile,
            config.allocator_seed,
            config.allocator_query,
            config.compression_seed,
            config.strict,
            config.allocator_transfer,
            config.resize,
            tower_layers,
            config.tower_layers,
        )


def _prune_layers(config: VideoPipelineConfig, method: Method) -> tuple[int, ...] | None:
    """`config.prune_layers` (comma- or ';'-separated layer indices) as numbers, checked against the
    method: only a method with stages inside the LLM takes them, as many as it has stages."""
    return _layer_list(
        "prune_layers", config.prune_layers, config.method, method.prune is not None, "prune inside the LLM",
        "decoder layer", "layer", "prunes", method.prune_layer_count,
    )  # fmt: skip


def _layer_list(
    name: str, given, method: str, takes: bool, where: str, what: str, noun: str, verb: str, count: int | None
) -> tuple[int, ...] | None:
    """Model arg `name` (comma- or ';'-separated `what` indices) as numbers: only a method that
    `takes` them (the methods that `where`), `count` of them (None: any number; a method that
    `verb` at `count` `noun`s)."""
    if given is None:
        return None
    if not takes:
        raise ValueError(f"{name}= is only used by methods that {where}, not {method!r}")
    if not str(given).strip(" ,;"):
        raise ValueError(
            f"{name} is empty: give {what} indices (e.g. {name}=2, or 3;6;9: lmms-eval splits model_args at "
            f"commas), or leave it out for the method's own {noun}s"
        )
    try:
        layers = tuple(int(v) for v in str(given).replace(";", ",").split(",") if v.strip())
    except ValueError:
        raise ValueError(
            f"{name} must be comma-separated {noun} indices (';'-separated in lmms-eval's model_args), got {given!r}"
        ) from None
    if count is not None and len(layers) != count:
        raise ValueError(
            f"{name}={given!r} names {len(layers)} {noun}s; method={method} {verb} at {count} {noun}"
            f"{'s' if count > 1 else ''}"
        )
    return layers


def config_from_model_args(**model_args) -> VideoPipelineConfig:
    """`VideoPipelineConfig` from lmms-eval model_args (strings or numbers): every field of the
    config and of its `BudgetSpec` is a model_arg of the same name, cast to the field's type
    (`none` for an optional one); an unknown name or a value of the wrong type is an error naming it.
    An Allocator checkpoint's training budget (`budget.json`) fills the settings not given, and a
    given one that differs from it is warned about."""
    fields = {**get_type_hints(VideoPipelineConfig), **get_type_hints(BudgetSpec)}
    fields.pop("budget")
    unknown = sorted(set(model_args) - set(fields))
    if unknown:
        raise ValueError(
            f"unknown model_args {', '.join(unknown)}; known: pretrained, device, dtype, attn_implementation, "
            f"sidecar_dir, {', '.join(fields)}"
        )
    for name in ("prune_layers", "tower_layers"):  # lmms-eval reads `-1` as -1.0
        if isinstance(model_args.get(name), float) and model_args[name].is_integer():
            model_args[name] = int(model_args[name])
    values = {name: cast_model_arg(name, value, fields[name]) for name, value in model_args.items()}
    values = _with_training_budget(values)
    budget = BudgetSpec(**{name: values.pop(name) for name in get_type_hints(BudgetSpec) if name in values})
    return VideoPipelineConfig(budget=budget, **values)


def _with_training_budget(values: dict) -> dict:
    """`values` with the settings of the Allocator checkpoint's training budget that were not given
    (its config.json checked too); a checkpoint without one is warned about."""
    trained = training_budget(values.get("allocator"))
    check_checkpoint(values.get("allocator"))
    if budget_source(values.get("allocator")) == "missing":
        given = {k: values[k] for k in ("s_min", "s_max") if k in values}
        s_range = given or "the default s in [0.2, 1.8]"
        logger.warning(
            f"the Allocator {values['allocator']} has no {BUDGET_FILE}: the budget it was trained under (scale "
            f"range, token bounds, frames, pixels) is unknown, so this run uses model_args and the defaults "
            f"({s_range}); every sidecar record says allocator_budget=missing"
        )
    taken = {key: value for key, value in trained.items() if key not in values}
    for key, value in trained.items():
        if key in values and values[key] != value:
            logger.warning(
                f"model_args {key}={values[key]} differs from the {key}={value} the Allocator {values['allocator']} "
                f"was trained with (its {BUDGET_FILE}); running with {key}={values[key]}"
            )
    if taken:
        settings = ", ".join(f"{k}={v}" for k, v in taken.items())
        logger.info(f"budget settings from the Allocator's training ({values['allocator']}/{BUDGET_FILE}): {settings}")
    return {**values, **taken}


def cast_model_arg(name: str, value, hint):
    """`value` as type `hint` (`int`, `float`, `str`, `bool` or one of them `| None`)."""
    options = [t for t in get_args(hint) if t is not type(None)] or [hint]
    if len(options) < len(get_args(hint)) and (value is None or str(value).strip().lower() == "none"):
        return None
    try:
        return _flag(value) if options[0] is bool else options[0](value)
    except (TypeError, ValueError):
        raise ValueError(f"model_args {name}={value!r}: expected {' or '.join(t.__name__ for t in options)}") from None


def _flag(value) -> bool:
    """A boolean model_arg: true/false, 1/0, yes/no (lmms-eval passes them as strings or bools)."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "yes"):
        return True
    if text in ("false", "0", "no"):
        return False
    raise ValueError(f"expected true or false, got {value!r}")
