"""`vllm.general_plugins` entry point: registers our vLLM model classes by name.

vLLM calls `register` in every process it starts. The class itself (`vllm_qwen.py`) is named by
a `module:Class` string, so it is imported only when a model uses it.
"""

QWEN25VL_ARCHITECTURE = "ResAdaptQwen2_5_VLForConditionalGeneration"
QWEN3VL_ARCHITECTURE = "ResAdaptQwen3VLForConditionalGeneration"
ARCHITECTURES = {"qwen25vl": QWEN25VL_ARCHITECTURE, "qwen3vl": QWEN3VL_ARCHITECTURE}


def register() -> None:
    from vllm import ModelRegistry

    for architecture in ARCHITECTURES.values():
        if architecture not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(architecture, f"resadapt_eval.backbones.vllm_qwen:{architecture}")
