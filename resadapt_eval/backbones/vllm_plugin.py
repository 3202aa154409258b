"""`vllm.general_plugins` entry point: registers our vLLM model classes by name.

vLLM calls `register` in every process it starts. The class itself (`vllm_qwen.py`) is named by
a `module:Class` string, so it is imported only when a model uses it.
"""

QWEN25VL_ARCHITECTURE = "ResAdaptQwen2_5_VLForConditionalGeneration"


def register() -> None:
    from vllm import ModelRegistry

    if QWEN25VL_ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(
            QWEN25VL_ARCHITECTURE, f"resadapt_eval.backbones.vllm_qwen:{QWEN25VL_ARCHITECTURE}"
        )
