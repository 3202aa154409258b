"""Entry point `lmms_eval.models`: the model names this package adds to the lmms-eval CLI.

Every registered method (`methods.py`) gets `<method>_<backbone>` (plus its aliases), a class
that fixes the method, so runs of every method are separate lmms-eval models that still share the
default prompt; `resadapt_<backbone>` takes any `method=`, and `resadapt_<backbone>_vllm` runs the
methods the vLLM engine can (a method only vLLM runs, such as `evs`, has its `<method>_<backbone>`
class there). This module imports nothing from lmms-eval at import time (importing
`lmms_eval.models` runs the entry points, which would then see this module half-initialised).
"""

from ..methods import METHODS, Method

BACKBONES = {"qwen25vl": "Qwen25VL", "qwen3vl": "Qwen3VL"}
MODULE = "resadapt_eval.lmms.models"
VLLM_MODULE = "resadapt_eval.lmms.vllm_models"


def class_name(method: Method, backbone: str) -> str:
    """ToMe's `Method`, `qwen25vl` -> `ToMeQwen25VL`."""
    return method.class_stem + BACKBONES[backbone]


def method_class(name: str, bases: dict[str, type], hf: bool) -> type:
    """The model class `name` of a registered method (`class_name`, e.g. ToMeQwen25VL): the
    backbone's class from `bases` (backbone -> class) with `fixed_method` set, in the module of
    the bases; `hf`: the HF engine's classes (else vLLM's, for the methods only vLLM runs).
    AttributeError for a name no method has there."""
    for method in METHODS.values():
        for backbone, base in bases.items():
            if method.hf == hf and class_name(method, backbone) == name:
                namespace = dict(fixed_method=method.name, __module__=base.__module__)
                return type(name, (base,), {**namespace, "__doc__": f"{base.__name__} with method={method.name}."})
    raise AttributeError(f"module {next(iter(bases.values())).__module__!r} has no attribute {name!r}")


def model_names() -> dict[str, tuple[str, list[str]]]:
    """lmms-eval model name -> (class path, aliases)."""
    names = {}
    for method in METHODS.values():
        for backbone in BACKBONES:
            primary, *aliases = method.model_names(backbone)
            module = MODULE if method.hf else VLLM_MODULE
            names[primary] = (f"{module}.{class_name(method, backbone)}", aliases)
    for backbone, stem in BACKBONES.items():
        names[f"resadapt_{backbone}_vllm"] = (f"{VLLM_MODULE}.ResAdapt{stem}VLLM", [])
    return names


def manifests() -> list:
    from lmms_eval.models.registry_v2 import ModelManifest

    return [
        ModelManifest(model_id=name, chat_class_path=path, aliases=tuple(aliases))
        for name, (path, aliases) in model_names().items()
    ]
