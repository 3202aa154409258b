"""The method registry: every budget method is declared here once, as a kind plus its code and defaults.

lmms-eval model names (`lmms/manifests.py`), the sweep grid (`sweep.py`), tables and plots
(`report/`), the CLI defaults and the run spec (`runspec.py`) all read `METHODS`. What a method
does to a request is its kind's code (`kinds.py`: planning, token rule, input building), run with
the method's algorithm. Adding a method of an existing kind is one module (a scale policy in
`budget/policies.py` or a compressor or pruning schedule in `baselines/`) plus one
`register(Method(...))` call below. Registration order is the paper's row order.

Kept free of lmms-eval imports: the `lmms_eval.models` entry point reads this module while
lmms-eval is still importing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Callable

from .baselines import (
    cdpruner,
    dart,
    divprune,
    dycoke,
    fastervlm,
    fastv,
    fastvid,
    flashvid,
    framefusion,
    gprune,
    holitom,
    illava,
    ipcv,
    mustdrop,
    pooling,
    prumerge_plus,
    prunevid,
    pyramiddrop,
    random_drop,
    sparsevlm,
    tome,
    vcast,
    vidcom2,
    vidcom2_engine,
    visionzip,
    vispruner,
)
from .baselines.common import TokenCompressor
from .baselines.illava import TowerMerging
from .baselines.inside_llm import AdaptiveSchedule
from .baselines.ipcv import TowerPruning
from .budget import policies
from .kinds import (
    ADAPTIVE_IN_LLM_PRUNER,
    AFTER_MERGER,
    BEFORE_ENCODER,
    COMPRESSOR,
    COMPRESSOR_THEN_PRUNER,
    DECODE_PRUNER,
    ENGINE_COMPRESSOR,
    ENGINE_PRUNER,
    IN_ENGINE,
    IN_LLM_PRUNER,
    IN_TOWER_MERGER,
    IN_TOWER_THEN_PRUNER,
    INSIDE_LLM,
    INSIDE_TOWER,
    RESIZE_POLICY,
    STAGES,
    MethodKind,
)

__all__ = [  # the stage names are re-exported: benchmarks and tests read them from here
    "AFTER_MERGER",
    "BEFORE_ENCODER",
    "IN_ENGINE",
    "INSIDE_LLM",
    "INSIDE_TOWER",
    "METHODS",
    "NO_RETENTION",
    "OPTIONAL_RETENTION",
    "REQUIRED_RETENTION",
    "RETENTION_RULES",
    "STAGES",
    "Method",
    "get_method",
    "register",
]

# What `retention=` means to a method.
NO_RETENTION = "none"  # the method has no target (vanilla): a retention is an error
OPTIONAL_RETENTION = "optional"  # without a target the method picks its own budget (resadapt)
REQUIRED_RETENTION = "required"
RETENTION_RULES = (NO_RETENTION, OPTIONAL_RETENTION, REQUIRED_RETENTION)


@dataclass(frozen=True)
class Method:
    """One budget method: a kind (`kinds.py`) plus its algorithm and defaults.

    name: the `method=` value and the stem of its lmms-eval model names (`<name>_<backbone>`);
    display_name: its row and legend label; class_stem: the stem of its lmms-eval class names
    (`<class_stem>Qwen25VL`); kind: what it does to a request (`kinds.RESIZE_POLICY`, `COMPRESSOR`,
    ...), which also decides where it acts (`stage`), the engines that run it (`hf`, `vllm`) and
    whether it serves images (`images`); retention: NO/OPTIONAL/REQUIRED_RETENTION.
    The algorithm, in the slots its kind fills (`kinds.SLOTS`; the kind refuses a declaration that
    leaves one of them empty or fills another): policy: per-frame scales `(num_frames, base_hw,
    grid, spec) -> (T,)` of a resize policy (None with needs_allocator: the Allocator's scales);
    compressor: a `baselines.common.TokenCompressor`, its `compress` `(VisualTokens, keep, seed) ->
    Compression` with what it reads (attention, the question), holds and costs; prune: `(num_layers, visual, retention,
    layers, first_layer) -> [Stage]`, an in-LLM schedule (`baselines/inside_llm.py`: retention is
    layer-averaged; after a compressor, its own share of the tokens that entered); adaptive_prune: an
    `inside_llm.AdaptiveSchedule`, an in-LLM method whose counts follow from the hidden states; decode_prune:
    `(num_layers, visual, retention, first_layer) -> DecodeStage` (`baselines/inside_llm.py`, run
    by `backbones/decode_pruning.py`);
    engine_pruning: vLLM's `video_pruning_method`, run at `video_pruning_rate` = `pruning_rate(R)`;
    tower_merge: a `baselines.illava.TowerMerging`, merging between vision-tower blocks;
    tower_prune: a `baselines.ipcv.TowerPruning`, pruning between vision-tower blocks and restoring.
    Defaults: needs_allocator: its scales come from the Allocator (`allocator=`, frame selection);
    prune_layer_count: how many decoder layers `prune_layers=` names (one per stage; None: any
    number, PyramidDrop's pyramid); aliases: older model-name stems that still resolve; in_paper:
    one of the seven methods the paper compares (the demo's default set).
    """

    name: str
    display_name: str
    class_stem: str
    kind: MethodKind
    retention: str
    policy: Callable | None = None
    compressor: TokenCompressor | None = None
    prune: Callable | None = None
    adaptive_prune: AdaptiveSchedule | None = None
    decode_prune: Callable | None = None
    engine_pruning: str | None = None
    tower_merge: TowerMerging | None = None
    tower_prune: TowerPruning | None = None
    needs_allocator: bool = False
    prune_layer_count: int | None = 1
    aliases: tuple[str, ...] = ()
    in_paper: bool = False

    def __post_init__(self):
        if self.retention not in RETENTION_RULES:
            raise ValueError(f"{self.name}: retention must be one of {RETENTION_RULES}, got {self.retention!r}")
        self.kind.check(self)

    @property
    def compress(self) -> Callable | None:
        """Its compressor's `compress`, or None."""
        return self.compressor.compress if self.compressor else None

    @property
    def needs_attention(self) -> bool:
        """Its compressor reads the attention received in the last ViT block."""
        return bool(self.compressor and self.compressor.reads_attention)

    @property
    def needs_query(self) -> bool:
        """Its compressor reads the question's embeddings."""
        return bool(self.compressor and self.compressor.reads_query)

    @property
    def stage(self) -> str:
        """Where it acts on the visual budget (`kinds.STAGES`)."""
        return self.kind.stage

    @property
    def hf(self) -> bool:
        """The HF classes run it."""
        return self.kind.hf

    @property
    def vllm(self) -> bool:
        """The vLLM engine runs it."""
        return self.kind.vllm

    @property
    def vllm_compressor(self) -> bool:
        """A compressor the vLLM engine runs inside its model (`backbones/vllm_compression.py`)."""
        return self.vllm and self.compressor is not None

    @property
    def images(self) -> bool:
        """It serves image requests."""
        return self.kind.images

    @property
    def full_budget(self) -> bool:
        """It keeps every visual token (no retention target): the reference tables compare against."""
        return self.retention == NO_RETENTION

    def pruning_rate(self, retention: float) -> float:
        """An engine-side pruner's `video_pruning_rate` for a target retention R: 1 - R, or the float
        just below it where the engine's 1 - rate falls short of the R meant (0.35 is 7/20, 1/3 is
        1/3: the fraction of denominator at most 10^6 nearest R), so that the engine's int(N (1 -
        rate)) is floor(R N), the most tokens within R, as every compressor here keeps (`kept_count`)."""
        meant = Fraction(retention).limit_denominator(10**6)
        rate = 1.0 - retention
        while rate > 0.0 and Fraction(1.0 - rate) < meant:
            rate = math.nextafter(rate, 0.0)
        return rate

    def model_names(self, backbone: str) -> list[str]:
        """lmms-eval model names of this method on `backbone`, the primary name first."""
        return [f"{stem}_{backbone}" for stem in (self.name, *self.aliases)]


METHODS: dict[str, Method] = {}


def register(method: Method) -> Method:
    """Add `method` to the registry (after the methods already there)."""
    if method.name in METHODS:
        raise ValueError(f"method {method.name!r} is already registered")
    METHODS[method.name] = method
    return method


def get_method(name: str) -> Method:
    """The registered method called `name`; an unknown name is an error listing the known ones."""
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; known methods: {', '.join(METHODS)}")
    return METHODS[name]


def _compressor(name: str, display_name: str, class_stem: str, module, in_paper: bool = False) -> Method:
    """A compressor after the merger (`module.COMPRESSOR`)."""
    return Method(
        name, display_name, class_stem, COMPRESSOR, REQUIRED_RETENTION, compressor=module.COMPRESSOR, in_paper=in_paper
    )


def _pruner(name: str, display_name: str, class_stem: str, module, prune_layer_count: int | None = 1) -> Method:
    """A schedule of stages inside the LLM (`module.stages`)."""
    return Method(
        name,
        display_name,
        class_stem,
        IN_LLM_PRUNER,
        REQUIRED_RETENTION,
        prune=module.stages,
        prune_layer_count=prune_layer_count,
    )


register(Method("vanilla", "Vanilla", "Vanilla", RESIZE_POLICY, NO_RETENTION, policy=policies.vanilla, in_paper=True))
register(_compressor("random_drop", "Random Drop", "RandomDrop", random_drop, in_paper=True))
register(_compressor("tome", "ToMe", "ToMe", tome, in_paper=True))
register(_compressor("visionzip", "VisionZip", "VisionZip", visionzip, in_paper=True))
register(_compressor("flashvid", "FlashVid", "FlashVid", flashvid, in_paper=True))
register(_compressor("divprune", "DivPrune", "DivPrune", divprune))
register(_compressor("vidcom2", "VidCom2", "VidCom2", vidcom2))
register(
    Method(
        "dycoke",
        "DyCoke",
        "DyCoke",
        DECODE_PRUNER,
        REQUIRED_RETENTION,
        compressor=dycoke.COMPRESSOR,
        decode_prune=dycoke.decode_stage,
    )
)
register(
    Method(
        "prunevid",
        "PruneVid",
        "PruneVid",
        COMPRESSOR_THEN_PRUNER,
        REQUIRED_RETENTION,
        compressor=prunevid.COMPRESSOR,
        prune=prunevid.stages,
    )
)
register(_compressor("fastvid", "FastVID", "FastVID", fastvid))
register(
    Method(
        "holitom",
        "HoliTom",
        "HoliTom",
        COMPRESSOR_THEN_PRUNER,
        REQUIRED_RETENTION,
        compressor=holitom.COMPRESSOR,
        prune=holitom.stages,
    )
)
register(
    Method(
        "mustdrop",
        "MustDrop",
        "MustDrop",
        COMPRESSOR_THEN_PRUNER,
        REQUIRED_RETENTION,
        compressor=mustdrop.COMPRESSOR,
        prune=mustdrop.stages,
        prune_layer_count=None,
    )
)
register(_compressor("pooling", "Pooling", "Pooling", pooling))
register(_compressor("prumerge_plus", "PruMerge+", "PruMergePlus", prumerge_plus))
register(_compressor("vispruner", "VisPruner", "VisPruner", vispruner))
register(_compressor("fastervlm", "FasterVLM", "FasterVLM", fastervlm))
register(_compressor("gprune", "G-Prune", "GPrune", gprune))
register(_compressor("cdpruner", "CDPruner", "CDPruner", cdpruner))
register(_compressor("vcast", "V-CAST", "VCAST", vcast))
register(_pruner("fastv", "FastV", "FastV", fastv))
register(_pruner("pyramiddrop", "PyramidDrop", "PyramidDrop", pyramiddrop, prune_layer_count=None))
register(_pruner("dart", "DART", "DART", dart))
register(_pruner("sparsevlm", "SparseVLM", "SparseVLM", sparsevlm, prune_layer_count=None))
register(
    Method(
        "framefusion",
        "FrameFusion",
        "FrameFusion",
        ADAPTIVE_IN_LLM_PRUNER,
        REQUIRED_RETENTION,
        adaptive_prune=framefusion.SCHEDULE,
    )
)
register(Method("evs", "EVS", "EVS", ENGINE_PRUNER, REQUIRED_RETENTION, engine_pruning="evs"))
register(
    Method(
        "vidcom2_engine",
        "VidCom2 (vLLM)",
        "VidCom2Engine",
        ENGINE_COMPRESSOR,
        REQUIRED_RETENTION,
        compressor=vidcom2_engine.COMPRESSOR,
    )
)
register(Method("illava", "iLLaVA", "ILLaVA", IN_TOWER_MERGER, REQUIRED_RETENTION, tower_merge=illava.MERGING))
register(
    Method(
        "ipcv", "IPCV", "IPCV", IN_TOWER_THEN_PRUNER, REQUIRED_RETENTION, tower_prune=ipcv.PRUNING, prune=dart.stages
    )
)
register(
    Method(
        "fixed_scale",
        "FixedScale",
        "FixedScale",
        RESIZE_POLICY,
        REQUIRED_RETENTION,
        policy=policies.fixed_scale,
        aliases=("fixedscale",),
        in_paper=True,
    )
)
register(
    Method("resadapt", "ResAdapt", "ResAdapt", RESIZE_POLICY, OPTIONAL_RETENTION, needs_allocator=True, in_paper=True)
)


def vllm_compressors() -> dict[str, str]:
    """{method name: `TokenCompressor.location`} of every compressor the vLLM engine runs inside its model:
    the `token_compression` table of one engine serving them all."""
    return {name: m.compressor.location for name, m in METHODS.items() if m.vllm_compressor}
