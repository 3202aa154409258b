"""The memory plan (`compute/memory.py`, `resadapt-eval flops --memory`): weights equal to the HF
models' parameters (tiny backbones, and the 7B / 8B configs built on the meta device), the KV term
equal to transformers' DynamicCache after a real prefill and generation (tiny backbones under
vanilla and in-LLM pruning, real attention widths), the table and its bad input, and where the
sidecar's peak_memory_mb comes from."""

import copy

import pytest
import torch
from transformers import AutoConfig, AutoModelForImageTextToText, DynamicCache

from resadapt_eval.budget.policies import BudgetSpec
from resadapt_eval.cli import main
from resadapt_eval.compute.configs import KNOWN_CONFIGS
from resadapt_eval.compute.flops import dims_from_config, load_dims
from resadapt_eval.compute.memory import kv_cache_bytes, parameter_count, weight_bytes
from resadapt_eval.estimates import row_memory, row_plan
from resadapt_eval.measure import clock
from resadapt_eval.pipeline import VideoPipeline, VideoPipelineConfig

from .helpers import video_request

BACKBONES = ["qwen25vl", "qwen3vl"]
# the published models' parameter counts (their model cards: 8.29B, 8.77B)
PUBLISHED_PARAMETERS = {"qwen25vl-7b": 8_292_166_656, "qwen3vl-8b": 8_767_123_696}
GIB = 2**30


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def meta_model(config, dtype=torch.bfloat16):
    """The HF model of `config` with its parameters on the meta device (nothing allocated)."""
    with torch.device("meta"):
        return AutoModelForImageTextToText.from_config(config, dtype=dtype)


def cache_bytes(cache) -> int:
    return tensor_bytes(t for layer in cache.layers for t in (layer.keys, layer.values))


# ---------------------------------------------------------------- weights


@pytest.mark.parametrize("backbone", BACKBONES)
def test_weights_equal_the_tiny_models_parameters(adapters, backbone):
    model = adapters[backbone].model  # loaded in float32
    dims = dims_from_config(model.config)
    assert weight_bytes(dims, "float32") == tensor_bytes(model.parameters())
    # the same model in bfloat16: half the bytes, still every parameter
    bf16 = meta_model(model.config)
    assert weight_bytes(dims, "bfloat16") == tensor_bytes(bf16.parameters()) == 2 * parameter_count(dims)


@pytest.mark.parametrize("backbone", BACKBONES)
@pytest.mark.parametrize("top, text", [(True, None), (False, True), (None, True), (True, False), (False, False)])
def test_a_tied_lm_head_is_counted_once(fixtures_dir, backbone, top, text):
    """transformers ties Qwen2.5-VL's lm_head by either config's flag, Qwen3-VL's by the top one."""
    raw = AutoConfig.from_pretrained(fixtures_dir / backbone).to_dict()
    raw.pop("tie_word_embeddings", None)
    raw["text_config"].pop("tie_word_embeddings", None)
    if top is not None:
        raw["tie_word_embeddings"] = top
    if text is not None:
        raw["text_config"]["tie_word_embeddings"] = text
    model = meta_model(AutoConfig.for_model(**raw))
    dims = dims_from_config(raw)
    assert weight_bytes(dims) == tensor_bytes(model.parameters())  # parameters() lists a tied matrix once
    tied = model.lm_head.weight is model.model.language_model.embed_tokens.weight
    assert dims.text.tied == tied


@pytest.mark.parametrize("backbone", list(KNOWN_CONFIGS))
@pytest.mark.parametrize("depth", ["full", "reduced"])
def test_weights_equal_the_real_width_models_parameters(backbone, depth):
    """Qwen2.5-VL-7B and Qwen3-VL-8B built from their configs on the meta device, at full depth and
    with 3 decoder layers and 4 vision blocks (every width real)."""
    raw = copy.deepcopy(KNOWN_CONFIGS[backbone])
    if depth == "reduced":
        raw["text_config"]["num_hidden_layers"] = 3
        raw["vision_config"]["depth"] = 4
    model = meta_model(AutoConfig.for_model(**raw))
    dims = dims_from_config(raw)
    assert weight_bytes(dims, "bfloat16") == tensor_bytes(model.parameters())
    if depth == "full":
        assert parameter_count(load_dims(backbone)) == PUBLISHED_PARAMETERS[backbone]


# ---------------------------------------------------------------- KV cache


@pytest.fixture
def captured_caches(monkeypatch):
    """Run generation into a DynamicCache of ours (or the decoding-time pruner's own) and keep it."""
    caches = []

    def capture(adapter):
        original = adapter.generate_ids

        def generate_ids(inputs, *args, past_key_values=None, **kwargs):
            if past_key_values is None:
                past_key_values = DynamicCache(config=adapter.model.config)
            caches.append(past_key_values)
            return original(inputs, *args, past_key_values=past_key_values, **kwargs)

        monkeypatch.setattr(adapter, "generate_ids", generate_ids)
        return caches

    return capture


@pytest.mark.parametrize("backbone", BACKBONES)
@pytest.mark.parametrize(
    "method, retention, prune_layers",
    [("vanilla", None, None), ("fastv", 0.25, "1"), ("holitom", 0.25, None), ("dycoke", 0.25, None)],
)
def test_kv_equals_the_dynamic_cache_after_generation(
    adapters, fixtures_dir, captured_caches, backbone, method, retention, prune_layers
):
    """After a real prefill and generation the cache holds, per layer, that layer's prompt tokens
    (FastV's and HoliTom's later layers only the kept ones) and every generated token but the last;
    the plan made before the run from the source size alone predicts the same per-layer prompt."""
    adapter = adapters[backbone]
    caches = captured_caches(adapter)
    config = VideoPipelineConfig(
        method=method, max_num_frames=8, budget=BudgetSpec(retention=retention), prune_layers=prune_layers
    )
    request = video_request(adapter, fixtures_dir)
    request.gen_kwargs["max_new_tokens"] = 6
    _, record = VideoPipeline(adapter, config).run(request)
    assert record.error is None and record.output_tokens >= 2  # decode steps ran
    (cache,) = caches
    layers = record.layer_visual_tokens or [record.visual_tokens] * adapter.num_text_layers
    text = record.input_tokens - record.visual_tokens
    prompt = [text + n for n in layers]
    # independently: the cache's own lengths are those tokens plus the fed generated ones
    assert [layer.keys.shape[-2] for layer in cache.layers] == [n + record.output_tokens - 1 for n in prompt]
    dims = dims_from_config(adapter.model.config)
    assert cache_bytes(cache) == kv_cache_bytes(dims.text, prompt, record.output_tokens, "float32")
    if method == "fastv":
        assert len(set(prompt)) == 2  # the stage shrank the later layers' cache
    # the memory plan from the source size alone plans the same tokens, hence the same cache
    given = [int(n) for n in prune_layers.split(",")] if prune_layers else None
    plan = row_plan(dims, method, 8, tuple(record.base_size), retention, text, given)
    expected = plan.prompt if isinstance(plan.prompt, list) else [plan.prompt] * len(prompt)
    assert expected == prompt
    size = tuple(record.base_size)
    memory, visual = row_memory(
        dims, method, 8, size, retention, text, record.output_tokens, "float32", prune_layers=given
    )
    assert visual == record.visual_tokens and memory.kv == cache_bytes(cache)


@pytest.mark.parametrize("backbone", list(KNOWN_CONFIGS))
def test_kv_equals_the_dynamic_cache_at_real_attention_widths(backbone):
    """The 7B / 8B attention (Qwen2.5-VL-7B: 4 KV heads of 128, Qwen3-VL-8B: 8 of 128) in bfloat16,
    2 decoder layers, a small MLP and vocabulary (neither touches the cache): 40 prompt tokens and
    6 generated."""
    raw = copy.deepcopy(KNOWN_CONFIGS[backbone])
    raw["text_config"].update(num_hidden_layers=2, intermediate_size=64, vocab_size=512)
    raw["vision_config"].update(depth=1, intermediate_size=64)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(AutoConfig.for_model(**raw), dtype=torch.bfloat16).eval()
    ids = torch.randint(0, 512, (1, 40))
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=6,
            min_new_tokens=6,
            do_sample=False,
            past_key_values=cache,
            pad_token_id=0,
        )
    assert out.shape[1] == 46
    text = dims_from_config(raw).text
    real = load_dims(backbone).text
    assert (text.kv_heads, text.head_dim) == (real.kv_heads, real.head_dim)
    assert cache_bytes(cache) == kv_cache_bytes(text, 40, 6, "bfloat16") == 2 * 2 * real.kv_heads * 128 * 45 * 2


# ---------------------------------------------------------------- the table


def memory_table(capsys, *argv) -> dict:
    assert main(["flops", "--memory", *argv]) == 0
    lines = capsys.readouterr().out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:2] == ["method", "frames"])
    header = lines[start].split()
    return {(r[0], int(r[1])): dict(zip(header, r)) for r in (line.split() for line in lines[start + 1 :])}


def test_memory_table_for_the_7b_at_720p(capsys):
    rows = memory_table(
        capsys,
        "--gpu-memory",
        "80GB",
        "--size",
        "1280x720",
        "--frames",
        "16,128",
        "--methods",
        "vanilla,fixed_scale",
        "--output-tokens",
        "128",
    )
    assert set(rows) == {(m, f) for m in ("vanilla", "fixed_scale") for f in (16, 128)}
    for (method, frames), row in rows.items():
        # bf16 weights: 2 bytes per parameter of the published count
        assert row["weights"] == f"{2 * PUBLISHED_PARAMETERS['qwen25vl-7b'] / GIB:.2f}"
        # 28 layers x (K and V) x 4 heads x 128 x (prompt + 127 fed tokens) x 2 bytes
        prompt = int(row["visual_tokens"]) + 24
        assert row["kv"] == f"{28 * 2 * 4 * 128 * (prompt + 127) * 2 / GIB:.2f}"
        assert row["fits"] == "yes"
        assert float(row["peak"]) >= float(row["weights"]) + float(row["kv"])
    # 720p is 720 tokens a pair: 16 frames are 8 pairs; fixed_scale keeps a quarter
    assert rows["vanilla", 16]["visual_tokens"] == "5760" and rows["fixed_scale", 16]["visual_tokens"] == "1440"
    assert float(rows["vanilla", 128]["peak"]) > float(rows["fixed_scale", 128]["peak"])


def test_memory_table_marks_what_does_not_fit(capsys):
    # 16 GB less 10%: 13.4 GiB, under the 7B's 15.4 GiB of bf16 weights alone
    rows = memory_table(capsys, "--gpu-memory", "16GB", "--frames", "16", "--size", "1280x720")
    assert rows["vanilla", 16]["fits"] == "NO"
    # eager attention holds the prefill's L^2 scores: vanilla at 64 frames of 720p (23064 tokens,
    # 28 heads x 23064^2 x 6 bytes = 83 GiB) does not fit 80 GB; a quarter of the tokens fits
    argv = ["--gpu-memory", "80GB", "--frames", "64", "--size", "1280x720", "--methods", "vanilla,fixed_scale"]
    rows = memory_table(capsys, *argv, "--attention", "eager")
    assert rows["vanilla", 64]["fits"] == "NO" and rows["fixed_scale", 64]["fits"] == "yes"
    assert float(rows["vanilla", 64]["llm_act"]) > 28 * 23064**2 * 6 / GIB
    rows = memory_table(capsys, *argv)  # SDPA keeps no score matrix
    assert rows["vanilla", 64]["fits"] == "yes" and float(rows["vanilla", 64]["llm_act"]) < 10


def test_memory_table_rows_of_methods_it_cannot_plan(capsys):
    assert main(["flops", "--memory", "--frames", "16", "--methods", "vanilla,evs"]) == 0
    out = capsys.readouterr().out
    assert "method=evs runs inside vLLM, which preallocates its cache: no HF memory plan" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--gpu-memory", "abc"], "flops: --gpu-memory takes a positive size with its unit"),
        (["--gpu-memory", "80"], "flops: --gpu-memory takes a positive size with its unit"),
        (["--gpu-memory", "0GB"], "flops: --gpu-memory takes a positive size with its unit"),
        (["--gpu-memory", "80XB"], "flops: --gpu-memory takes a positive size with its unit"),
        (["--memory", "--headroom", "1.5"], "flops: --headroom takes a fraction in [0, 1)"),
        (["--memory", "--headroom", "lots"], "flops: --headroom takes a fraction in [0, 1)"),
        (["--memory", "--dtype", "int8"], "flops: --dtype takes one of bfloat16, float16, float32, got 'int8'"),
        (["--memory", "--attention", "flash"], "flops: --attention takes one of sdpa, eager, flash_attention_2"),
    ],
)
def test_memory_options_answer_bad_input_with_one_line_and_exit_2(capsys, argv, message):
    assert main(["flops", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(message) and len(captured.err.strip().splitlines()) == 1
    assert captured.out == ""


# ---------------------------------------------------------------- the sidecar's peak_memory_mb


def test_peak_memory_is_the_cuda_allocators_peak_on_cuda_and_the_rss_on_cpu(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: calls.append(("reset", device)))
    monkeypatch.setattr(
        torch.cuda, "max_memory_allocated", lambda device=None: calls.append(("peak", device)) or 3 << 20
    )
    cuda = torch.device("cuda", 0)
    clock.reset_peak_memory(cuda)
    assert clock.peak_memory_mb(cuda) == 3.0
    assert clock.peak_memory_mb("cuda:0") == 3.0  # a device string picks the same way
    assert calls == [("reset", cuda), ("peak", cuda), ("peak", "cuda:0")]
    calls.clear()
    clock.reset_peak_memory(torch.device("cpu"))
    assert clock.peak_memory_mb(torch.device("cpu")) > 0 and calls == []  # the process's peak RSS, no CUDA call


@pytest.mark.parametrize("method, windows", [("vanilla", 1), ("tome", 2), ("holitom", 2)])
def test_a_compressors_peak_covers_its_encoding(adapters, fixtures_dir, monkeypatch, method, windows):
    """A compressor encodes while the request is built, before the engine call: the record's peak is
    the larger of the two windows' (each read after its own reset), not the engine call's alone."""
    adapter = adapters["qwen25vl"]
    events, readings = [], iter([900.0, 500.0] if windows == 2 else [500.0])

    def reset(device):
        events.append("reset")

    def peak(device):
        events.append("peak")
        return next(readings)

    for module in ("resadapt_eval.kinds", "resadapt_eval.backbones.qwen"):  # a compressor, then the engine call
        monkeypatch.setattr(f"{module}.reset_peak_memory", reset)
        monkeypatch.setattr(f"{module}.peak_memory_mb", peak)
    retention = None if method == "vanilla" else 0.25
    config = VideoPipelineConfig(method=method, max_num_frames=8, budget=BudgetSpec(retention=retention))
    _, record = VideoPipeline(adapter, config).run(video_request(adapter, fixtures_dir))
    assert record.error is None
    assert events == ["reset", "peak"] * windows
    assert record.peak_memory_mb == (900.0 if windows == 2 else 500.0)
