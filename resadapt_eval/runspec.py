"""The run spec: a run's settings resolved once, at model build, into one frozen value.

`RunSpec.resolve` turns the parsed model_args (`pipeline.VideoPipelineConfig`, names and strings)
into the `Method` object, its kind for this run, the retention and budget rule with their pair
bounds (`BudgetSpec`), the operator as an `Operator`, the stage layers as numbers, and the other
settings as given, checking them all (every bad setting stops here, naming its argument).
Everything downstream (the pipeline and its kinds, the record builder, the FLOPs table, the vLLM
classes) receives the spec; no method, operator or stage is looked up by name or compared with a
string outside the registry (`methods.py`) and this module.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .budget.policies import BudgetSpec
from .budget.selection import OPERATORS, Operator
from .kinds import FRAME_SELECTION, MethodKind
from .methods import NO_RETENTION, REQUIRED_RETENTION, Method, get_method

if TYPE_CHECKING:
    from .pipeline import VideoPipelineConfig

ALLOCATOR_QUERIES = ("question", "empty")


@dataclass(frozen=True)
class RunSpec:
    """One run's resolved settings (see `pipeline.VideoPipelineConfig` for each one's meaning).

    method: the registered `Method`; kind: what this run does (`method.kind`, or frame selection
    under a selecting operator); budget: the retention, budget rule and pair bounds; operator: the
    budget operator; prune_layers: the decoder layers of an in-LLM stage (None: the method's own),
    prune_layers_text: the same as given (for messages)."""

    method: Method
    budget: BudgetSpec = field(default_factory=BudgetSpec)
    operator: Operator = Operator.RESIZE
    prune_layers: tuple[int, ...] | None = None
    prune_layers_text: str | None = None
    max_num_frames: int = 32
    candidates: int = 128
    top_k: int | None = 32
    score_threshold: float | None = None
    min_pixels: int | None = None
    max_pixels: int | None = None
    allocator: str | None = None
    allocator_inference: str = "mean"
    allocator_quantile: float = 0.5
    allocator_seed: int = 0
    allocator_query: str = "question"
    compression_seed: int = 0
    strict: bool = False
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
        defaults (the config-only FLOPs table plans with it)."""
        layers = None if prune_layers is None else tuple(prune_layers)
        return cls(get_method(method), BudgetSpec(retention=retention), prune_layers=layers)

    @classmethod
    def resolve(cls, config: VideoPipelineConfig | RunSpec) -> RunSpec:
        """The spec of parsed model_args `config` (a spec is returned as is); a bad setting is a
        ValueError naming its argument."""
        if isinstance(config, RunSpec):
            return config
        method = get_method(config.method)
        layers = _prune_layers(config, method)
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
            from .allocator import UNTRAINED, known_allocators

            known = "; ".join(known_allocators()) or "none in this installation"
            raise ValueError(
                f"method={config.method} needs model_args allocator=<checkpoint folder> (committed: {known}), "
                f"or allocator={UNTRAINED} to run the untrained Allocator on purpose"
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
        )


def _prune_layers(config: VideoPipelineConfig, method: Method) -> tuple[int, ...] | None:
    """`config.prune_layers` (comma- or ';'-separated layer indices) as numbers, checked against the
    method: only a method with stages inside the LLM takes them, as many as it has stages."""
    given = config.prune_layers
    if given is None:
        return None
    if method.prune is None:
        raise ValueError(f"prune_layers= is only used by methods that prune inside the LLM, not {config.method!r}")
    if not str(given).strip(" ,;"):
        raise ValueError(
            "prune_layers is empty: give decoder layer indices (e.g. prune_layers=2, or 3;6;9: lmms-eval "
            "splits model_args at commas), or leave it out for the method's own layers"
        )
    try:
        layers = tuple(int(v) for v in str(given).replace(";", ",").split(",") if v.strip())
    except ValueError:
        raise ValueError(
            f"prune_layers must be comma-separated layer indices (';'-separated in lmms-eval's model_args), "
            f"got {given!r}"
        ) from None
    count = method.prune_layer_count
    if count is not None and len(layers) != count:
        raise ValueError(
            f"prune_layers={given!r} names {len(layers)} layers; method={config.method} "
            f"prunes at {count} layer{'s' if count > 1 else ''}"
        )
    return layers
