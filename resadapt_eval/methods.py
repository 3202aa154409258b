"""The method registry: every budget method is declared here once, with its properties and its code.

lmms-eval model names (`lmms/manifests.py`), the sweep grid (`sweep.py`), tables and plots
(`report/`), the CLI defaults and the pipeline's validation all read `METHODS`. Adding a method is
one module (a scale policy in `budget/policies.py` or a compressor in `baselines/`) plus one
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
    divprune,
    dycoke,
    fastv,
    fastvid,
    flashvid,
    holitom,
    prunevid,
    pyramiddrop,
    random_drop,
    tome,
    vidcom2,
    visionzip,
)
from .budget import policies

# Where a method acts on the visual budget.
BEFORE_ENCODER = "before_encoder"  # resizes frames: fewer pixels enter the vision encoder
AFTER_MERGER = "after_merger"  # encodes the vanilla plan, then drops/merges tokens before the LLM
INSIDE_LLM = "inside_llm"  # prunes visual tokens between decoder layers
IN_ENGINE = "in_engine"  # the serving engine drops merged tokens before the LLM (vLLM's video pruning)
STAGES = (BEFORE_ENCODER, AFTER_MERGER, INSIDE_LLM, IN_ENGINE)

# What `retention=` means to a method.
NO_RETENTION = "none"  # the method has no target (vanilla): a retention is an error
OPTIONAL_RETENTION = "optional"  # without a target the method picks its own budget (resadapt)
REQUIRED_RETENTION = "required"
RETENTION_RULES = (NO_RETENTION, OPTIONAL_RETENTION, REQUIRED_RETENTION)


@dataclass(frozen=True)
class Method:
    """One budget method.

    name: the `method=` value and the stem of its lmms-eval model names (`<name>_<backbone>`);
    aliases: older model-name stems that still resolve; display_name: its row and legend label;
    class_stem: the stem of its lmms-eval class names (`<class_stem>Qwen25VL`); stage: where it
    acts (BEFORE_ENCODER, AFTER_MERGER, INSIDE_LLM); retention: NO/OPTIONAL/REQUIRED_RETENTION;
    needs_allocator: its scales come from the Allocator (`allocator=`, frame selection);
    needs_attention: its compressor reads the attention received in the last ViT block;
    hf: the HF classes can run it; vllm: the vLLM engine can run it; images: it serves image
    requests; in_paper: one of the seven methods the paper compares (the demo's default set).
    policy: per-frame scales `(num_frames, base_hw, grid, spec) -> (T,)` for methods that do not
    use the Allocator; compress: `(VisualTokens, keep, seed) -> Compression` for AFTER_MERGER methods;
    prune: `(num_layers, visual, retention, layers, first_layer) -> [Stage]` for INSIDE_LLM methods
    (`baselines/inside_llm.py`: retention is layer-averaged), and for an AFTER_MERGER method with
    a second stage inside the LLM (its own share of the tokens that entered; the compressor keeps
    what leaves the layer average within R); decode_prune: `(num_layers, visual, retention, first_layer)
    -> DecodeStage` for an AFTER_MERGER method that also prunes the KV cache while decoding
    (`baselines/decode_pruning.py`: the prefill, and so R, is the compressor's); engine_pruning: for IN_ENGINE
    methods, vLLM's `video_pruning_method`, run at `video_pruning_rate` = 1 - retention.
    prune_layer_count: how many decoder layers `prune_layers=` names for a method with stages
    inside the LLM (one per stage; None: any number, PyramidDrop's pyramid).
    """

    name: str
    display_name: str
    class_stem: str
    stage: str
    retention: str
    needs_allocator: bool = False
    needs_attention: bool = False
    hf: bool = True
    vllm: bool = False
    images: bool = False
    policy: Callable | None = None
    compress: Callable | None = None
    prune: Callable | None = None
    engine_pruning: str | None = None
    decode_prune: Callable | None = None
    aliases: tuple[str, ...] = ()
    in_paper: bool = False
    prune_layer_count: int | None = 1

    def __post_init__(self):
        if self.stage not in STAGES:
            raise ValueError(f"{self.name}: stage must be one of {STAGES}, got {self.stage!r}")
        if self.retention not in RETENTION_RULES:
            raise ValueError(f"{self.name}: retention must be one of {RETENTION_RULES}, got {self.retention!r}")
        if (self.compress is not None) != (self.stage == AFTER_MERGER):
            raise ValueError(f"{self.name}: a compressor is what an {AFTER_MERGER} method runs, and only it")
        if self.decode_prune is not None and self.stage != AFTER_MERGER:
            raise ValueError(f"{self.name}: only a compressor prunes while decoding")
        if self.stage == INSIDE_LLM and self.prune is None:
            raise ValueError(f"{self.name}: an {INSIDE_LLM} method runs a pruning schedule")
        if self.prune is not None and self.stage not in (AFTER_MERGER, INSIDE_LLM):
            raise ValueError(f"{self.name}: only a compressor or an {INSIDE_LLM} method has stages inside the LLM")
        if (self.engine_pruning is not None) != (self.stage == IN_ENGINE):
            raise ValueError(f"{self.name}: an engine's pruning method is what an {IN_ENGINE} method runs, and only it")
        if self.stage == IN_ENGINE and (self.hf or not self.vllm):
            raise ValueError(f"{self.name}: an {IN_ENGINE} method runs on the vLLM engine only")
        if (self.policy is None) != self.needs_allocator:
            raise ValueError(f"{self.name}: give a scale policy, or take the scales from the Allocator")

    def pruning_rate(self, retention: float) -> float:
        """An IN_ENGINE method's `video_pruning_rate` for a target retention R: 1 - R, or the float
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


def _compressor(
    name: str,
    display_name: str,
    class_stem: str,
    module,
    needs_attention: bool = False,
    in_paper: bool = False,
    inside_llm: bool = False,
    decoding: bool = False,
) -> Method:
    """A compressor after the merger (`module.compress`); `inside_llm`: its own LLM stage too (`module.stages`);
    `decoding`: it also prunes while decoding (`module.decode_stage`)."""
    return Method(
        name,
        display_name,
        class_stem,
        AFTER_MERGER,
        REQUIRED_RETENTION,
        compress=module.compress,
        prune=module.stages if inside_llm else None,
        decode_prune=module.decode_stage if decoding else None,
        policy=policies.vanilla,
        needs_attention=needs_attention,
        in_paper=in_paper,
    )


def _pruner(name: str, display_name: str, class_stem: str, module, prune_layer_count: int | None = 1) -> Method:
    return Method(
        name,
        display_name,
        class_stem,
        INSIDE_LLM,
        REQUIRED_RETENTION,
        prune=module.stages,
        policy=policies.vanilla,
        prune_layer_count=prune_layer_count,
    )


register(
    Method(
        "vanilla",
        "Vanilla",
        "Vanilla",
        BEFORE_ENCODER,
        NO_RETENTION,
        policy=policies.vanilla,
        vllm=True,
        images=True,
        in_paper=True,
    )
)
register(_compressor("random_drop", "Random Drop", "RandomDrop", random_drop, in_paper=True))
register(_compressor("tome", "ToMe", "ToMe", tome, in_paper=True))
register(_compressor("visionzip", "VisionZip", "VisionZip", visionzip, needs_attention=True, in_paper=True))
register(_compressor("flashvid", "FlashVid", "FlashVid", flashvid, needs_attention=True, in_paper=True))
register(_compressor("divprune", "DivPrune", "DivPrune", divprune))
register(_compressor("vidcom2", "VidCom2", "VidCom2", vidcom2))
register(_compressor("dycoke", "DyCoke", "DyCoke", dycoke, decoding=True))
register(_compressor("prunevid", "PruneVid", "PruneVid", prunevid, inside_llm=True))
register(_compressor("fastvid", "FastVID", "FastVID", fastvid, needs_attention=True))
register(_compressor("holitom", "HoliTom", "HoliTom", holitom, needs_attention=True, inside_llm=True))
register(_pruner("fastv", "FastV", "FastV", fastv))
register(_pruner("pyramiddrop", "PyramidDrop", "PyramidDrop", pyramiddrop, prune_layer_count=None))
register(
    Method(
        "evs",
        "EVS",
        "EVS",
        IN_ENGINE,
        REQUIRED_RETENTION,
        policy=policies.vanilla,
        hf=False,
        vllm=True,
        engine_pruning="evs",
    )
)
register(
    Method(
        "fixed_scale",
        "FixedScale",
        "FixedScale",
        BEFORE_ENCODER,
        REQUIRED_RETENTION,
        policy=policies.fixed_scale,
        vllm=True,
        images=True,
        aliases=("fixedscale",),
        in_paper=True,
    )
)
register(
    Method(
        "resadapt",
        "ResAdapt",
        "ResAdapt",
        BEFORE_ENCODER,
        OPTIONAL_RETENTION,
        needs_allocator=True,
        vllm=True,
        images=True,
        in_paper=True,
    )
)
