"""The published backbones' configs, in the Hugging Face config.json layout transformers 5 saves.

Transcribed from Qwen/Qwen2.5-VL-7B-Instruct and Qwen/Qwen3-VL-8B-Instruct: every field of the
architecture (FLOPs read the sizes, `flops.dims_from_config`; `fixtures.write_real_width` builds
random models from all of them). Token ids are left out: a model built from these takes its
tokenizer's. A `pretrained` folder's own config.json is read the same way (`flops.load_dims`).
"""

from __future__ import annotations

QWEN25VL_7B = dict(
    model_type="qwen2_5_vl",
    tie_word_embeddings=False,
    text_config=dict(
        hidden_size=3584,
        num_hidden_layers=28,
        intermediate_size=18944,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
        hidden_act="silu",
        rms_norm_eps=1e-6,
        max_position_embeddings=128000,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]},
        tie_word_embeddings=False,
    ),
    vision_config=dict(
        depth=32,
        hidden_size=1280,
        intermediate_size=3420,
        num_heads=16,
        in_channels=3,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        window_size=112,
        fullatt_block_indexes=[7, 15, 23, 31],
        out_hidden_size=3584,
        hidden_act="silu",
        tokens_per_second=2,
    ),
)

QWEN3VL_8B = dict(
    model_type="qwen3_vl",
    tie_word_embeddings=False,
    text_config=dict(
        hidden_size=4096,
        num_hidden_layers=36,
        intermediate_size=12288,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        hidden_act="silu",
        rms_norm_eps=1e-6,
        max_position_embeddings=262144,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 5000000.0,
            "mrope_section": [24, 20, 20],
            "mrope_interleaved": True,
        },
        attention_bias=False,
        tie_word_embeddings=False,
    ),
    vision_config=dict(
        depth=27,
        hidden_size=1152,
        intermediate_size=4304,
        num_heads=16,
        in_channels=3,
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        out_hidden_size=4096,
        deepstack_visual_indexes=[8, 16, 24],
        hidden_act="gelu_pytorch_tanh",
        num_position_embeddings=2304,
    ),
)

KNOWN_CONFIGS = {"qwen25vl-7b": QWEN25VL_7B, "qwen3vl-8b": QWEN3VL_8B}
