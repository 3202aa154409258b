"""Entry point `lmms_eval.models`: the model names this package adds to the lmms-eval CLI.

`resadapt_<backbone>` takes any `method=`; `<method>_<backbone>` fixes the method, so runs of
every method are separate lmms-eval models that still share the default prompt. Kept
import-light: lmms-eval loads every entry point inside one try/except at start-up, and this
module imports nothing from lmms-eval at import time (importing `lmms_eval.models` runs the
entry points, which would then see this module half-initialised).
"""

BACKBONES = {"qwen25vl": "Qwen25VL", "qwen3vl": "Qwen3VL"}
# method -> (model-name prefix, class-name stem) of its models
METHOD_PREFIXES = {
    "vanilla": ("vanilla", "Vanilla"),
    "fixed_scale": ("fixedscale", "FixedScale"),
    "resadapt": ("resadapt", "ResAdapt"),
    "random_drop": ("random_drop", "RandomDrop"),
    "tome": ("tome", "ToMe"),
    "visionzip": ("visionzip", "VisionZip"),
    "flashvid": ("flashvid", "FlashVid"),
}
MODULE = "resadapt_eval.lmms.models"
VLLM_MODULE = "resadapt_eval.lmms.vllm_models"


def class_name(method: str, backbone: str) -> str:
    """`tome`, `qwen25vl` -> `ToMeQwen25VL`."""
    return METHOD_PREFIXES[method][1] + BACKBONES[backbone]


def model_names() -> dict[str, str]:
    """lmms-eval model name -> class path. `resadapt_<backbone>` is the any-method class;
    `resadapt_<backbone>_vllm` the same on the vLLM engine (vanilla, fixed_scale, resadapt)."""
    names = {f"{prefix}_{backbone}": f"{MODULE}.{class_name(method, backbone)}" for method, (prefix, _) in METHOD_PREFIXES.items() for backbone in BACKBONES}
    names.update({f"resadapt_{backbone}_vllm": f"{VLLM_MODULE}.ResAdapt{stem}VLLM" for backbone, stem in BACKBONES.items()})
    return names


def manifests() -> list:
    from lmms_eval.models.registry_v2 import ModelManifest

    return [ModelManifest(model_id=name, chat_class_path=path) for name, path in model_names().items()]
