"""Entry point `lmms_eval.models`: the model names this package adds to the lmms-eval CLI.

Kept import-light: lmms-eval loads every entry point inside one try/except at start-up.
"""

from lmms_eval.models.registry_v2 import ModelManifest

MODELS = {
    "resadapt_qwen25vl": "resadapt_eval.lmms.models.ResAdaptQwen25VL",
    "resadapt_qwen3vl": "resadapt_eval.lmms.models.ResAdaptQwen3VL",
}


def manifests() -> list[ModelManifest]:
    return [ModelManifest(model_id=name, chat_class_path=path) for name, path in MODELS.items()]
