"""Device safety of the model-side code, checked without a GPU, two ways.

1. A static check (`ast`): in `resadapt_eval/baselines`, `backbones`, `allocator`, `compute` and
   `pipeline.py`, every tensor factory (`torch.arange`, `ones`, `zeros`, `full`, `empty`, `tensor`,
   `as_tensor`, `eye`, `linspace`, `rand`, `randn`, `randint`, `randperm`) either passes `device=`
   or carries the marker `# cpu: <why>` on one of its lines: CPU-side bookkeeping on purpose. The
   `*_like` and `Tensor.new_*` factories inherit their device and are not checked.

   The CPU-side bookkeeping is a design, not an exemption: a compressor whose selection loop is
   data-dependent (Python loops over picks, `.tolist()`, `int(tensor)`) keeps its index tensors
   on the CPU, scores and picks crossing over by an explicit `.cpu()` or as Python ints (the
   feature math stays on the features' device), and returns a CPU `Compression`; `merge_groups`
   moves the assignment and weights to the features' device. The
   in-LLM and decode-time pruners keep the visual positions and the kept indices on the CPU
   (`visual_positions.cpu()`, `scores.cpu()`) and move each index to the tensor it indexes.

2. The shape-static tensor paths run on fake CUDA tensors (`fake_cuda`): inside
   `FakeTensorMode(allow_non_fake_inputs=True)` a tensor made with `device="cuda"` is a fake CUDA
   tensor (no GPU needed) and an op mixing it with a CPU tensor raises
   `FakeTensorDeviceMismatchError`; with a `ShapeEnv`, sizes that follow from the data (`nonzero`,
   boolean masks, `unique`, `.tolist()` of a size) become symbols, so only control flow on values
   (`int(t)`, `bool(t)`, `len()` of such a size) stops a run. `IndexDevices` adds the one rule the
   fake mode lets through and a GPU refuses: index tensors on the CPU or on the indexed tensor's
   device. Every output's device is asserted. Covered: `merge_groups` and the compressed prompt of
   `build_compressed_inputs` (`qwen.compressed_sequence`); `received_attention_and_keys` on each
   family's last vision block (captured on the CPU, then moved); the in-LLM rankings
   (`query_attention`, `last_token_attention`, `text_attention`, `stage_input_attention`) and
   `merge_into_nearest`; a `LayerPruner` stage through its layer (ranking, CPU selection, pruned
   hidden states, rotary, positions and mask); DyCoke's decoding stage for the first decoding step
   (`current_token_attention`, the CPU selection, `SelectingCache`, the cut mask); the Allocator's
   encoders, forward and shape-static action rules; ToMe's and DyCoke's whole `compress`; the
   device-side kernels of the other compressors.

   Not runnable there, because their control flow reads values (a fake tensor has none): the
   selection loops of VisionZip, DivPrune, VidCom2, Random Drop, FastVID, FlashVID, PruneVid and
   HoliTom; a second pruning stage, HoliTom's in-LLM merge at a stage (`len(dropped)`) and
   PruneVid's text ranking (`int(...max())`); DyCoke's later decoding steps (the cosine with the
   previous step's attention); the M-RoPE positions of `build_inputs` (`int(video_at[0])`,
   `get_rope_index`); the Allocator's logit-normal mean (its step follows max(sigma)), its Beta
   median and quantiles (scipy) and its seeded samples (`fork_rng` on a CUDA device);
   `AllocatorPolicy` and the clocks (CUDA events). These are covered by the static check and the
   CPU-transfer design above.
"""

from __future__ import annotations

import ast
import copy
import io
import re
import tokenize
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import (
    FakeTensor,
    FakeTensorDeviceMismatchError,
    FakeTensorMode,
    unset_fake_temporarily,
)
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.utils._python_dispatch import TorchDispatchMode

REPO = Path(__file__).resolve().parents[1]
MODEL_SIDE = ["resadapt_eval/baselines", "resadapt_eval/backbones", "resadapt_eval/allocator", "resadapt_eval/compute"]
MODEL_SIDE_FILES = ["resadapt_eval/pipeline.py"]
FACTORIES = frozenset("arange ones zeros full empty tensor as_tensor eye linspace rand randn randint randperm".split())
MARKER = re.compile(r"#\s*cpu:(?P<reason>.*)$")
WORD = re.compile(r"[A-Za-z_]{2,}")  # a reason has at least two words


def marker_lines(source: str) -> dict[int, str]:
    """{line: reason} of the `# cpu:` comments of `source` (real comments, not text in strings)."""
    found = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT and (match := MARKER.search(token.string)):
            found[token.start[0]] = match["reason"].strip()
    return found


def torch_factories(tree: ast.AST) -> dict[str, str]:
    """{name a file calls: factory} for `import torch [as t]` (t.zeros) and `from torch import zeros [as z]`."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update({f"{a.asname or a.name}.{f}": f for a in node.names if a.name == "torch" for f in FACTORIES})
        elif isinstance(node, ast.ImportFrom) and node.module == "torch":
            names.update({a.asname or a.name: a.name for a in node.names if a.name in FACTORIES})
    return names


def called_name(func: ast.expr) -> str | None:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
        return f"{func.value.id}.{func.attr}"
    return None


def factory_problems(source: str, path: str) -> list[str]:
    """`path:line: ...` for each tensor factory of `source` without `device=` and without a reasoned
    `# cpu:` marker on one of its lines, and for each marker on no factory's line."""
    tree = ast.parse(source)
    names, markers = torch_factories(tree), marker_lines(source)
    problems, used = [], set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or called_name(node.func) not in names:
            continue
        lines = range(node.lineno, node.end_lineno + 1)
        used.update(line for line in lines if line in markers)
        if any(k.arg == "device" for k in node.keywords):
            continue
        reasons = [markers[line] for line in lines if line in markers]
        factory = f"torch.{names[called_name(node.func)]}"
        if not reasons:
            problems.append(f"{path}:{node.lineno}: {factory} without device= (or a `# cpu: <why>` marker)")
        elif not any(len(WORD.findall(r)) >= 2 for r in reasons):
            problems.append(f"{path}:{node.lineno}: {factory}'s `# cpu:` marker gives no reason")
    problems += [f"{path}:{line}: `# cpu:` marker on no tensor factory" for line in sorted(set(markers) - used)]
    return sorted(problems, key=lambda p: int(p.split(":")[1]))


def model_side_files() -> list[Path]:
    files = [p for root in MODEL_SIDE for p in sorted((REPO / root).rglob("*.py"))]
    return files + [REPO / f for f in MODEL_SIDE_FILES]


# ---------------------------------------------------------------------------------------------- static check


def test_model_side_tensor_factories_name_their_device_or_say_why_they_stay_on_the_cpu():
    files = model_side_files()
    assert len(files) > 30 and all(f.is_file() for f in files)
    problems = [p for f in files for p in factory_problems(f.read_text(), str(f.relative_to(REPO)))]
    assert not problems, "tensor factories that may land on the wrong device:\n" + "\n".join(problems)


@pytest.mark.parametrize(
    "line, flagged",
    [
        ("x = torch.zeros(3)", True),
        ("x = torch.zeros(3, device=y.device)", False),
        ("x = torch.zeros_like(y)", False),
        ("x = y.new_zeros(3)", False),
        ("x = torch.as_tensor(a)", True),
        ("x = torch.as_tensor(a, device=y.device)", False),
        ("x = torch.randperm(4, generator=g)  # cpu: the seeded draw of the reference", False),
        ("x = torch.arange(4)  # cpu:", True),
        ("x = torch.arange(4)  # cpu: ok", True),
        ("x = torch.arange(4)  # cpu - index bookkeeping", True),
        ("s = '# cpu: index bookkeeping'; x = torch.arange(4)", True),
        ("y = x + 1  # cpu: index bookkeeping", True),
        ("x = torch.cat([a, torch.arange(4)])", True),
        ("x = torch.cat([a, torch.arange(4, device=a.device)])", False),
    ],
)
def test_the_static_check_flags_a_factory_without_device_or_reason(line, flagged):
    assert bool(factory_problems(f"import torch\n{line}\n", "f.py")) is flagged


def test_the_static_check_follows_aliases_and_multi_line_calls_and_names_file_and_line():
    source = "\n".join(
        [
            "import torch as th",
            "from torch import zeros as z, zeros_like",
            "a = th.ones(2)",
            "b = z(2)",
            "c = zeros_like(b)",
            "d = th.full(",
            "    (2,), -1  # cpu: index bookkeeping of the pick loop",
            ")",
            "e = th.tensor([1])",
        ]
    )
    problems = factory_problems(source, "pkg/m.py")
    assert [p.split(": ")[0] for p in problems] == ["pkg/m.py:3", "pkg/m.py:4", "pkg/m.py:9"]
    assert "torch.ones without device=" in problems[0] and "torch.zeros" in problems[1]


# ---------------------------------------------------------------------------------------------- fake CUDA

CUDA = torch.device("cuda", 0)
CPU = torch.device("cpu")
INDEX_OPS = {
    torch.ops.aten.index.Tensor,
    torch.ops.aten.index_put.default,
    torch.ops.aten.index_put_.default,
    torch.ops.aten._index_put_impl_.default,
}


class IndexDeviceError(RuntimeError):
    pass


class IndexDevices(TorchDispatchMode):
    """What a GPU refuses and FakeTensorMode lets through: indexing (reading or writing) a tensor with
    index tensors on a device other than its own or the CPU (ATen's check_indices_on_cpu_or_selfdevice),
    e.g. a CPU mask indexed by CUDA positions."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in INDEX_OPS:
            indexed, indices = args[0], args[1]
            wrong = [i.device for i in indices if i is not None and i.device not in (CPU, indexed.device)]
            if wrong:
                raise IndexDeviceError(f"{func}: a {indexed.device} tensor indexed by {wrong[0]} indices")
        return func(*args, **(kwargs or {}))


@contextmanager
def fake_cuda():
    """Fake CUDA tensors: `device="cuda"` works without a GPU, mixing devices raises, and sizes that
    follow from the data (nonzero, masks, unique) are symbols, so only control flow on values stops."""
    with FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv()), IndexDevices():
        yield


def fake_cuda_copy(module: torch.nn.Module) -> torch.nn.Module:
    """A copy of `module` on fake CUDA (inside `fake_cuda`)."""
    with unset_fake_temporarily():
        module = copy.deepcopy(module)
    return module.to("cuda")


def on_fake_cuda(*tensors: torch.Tensor) -> bool:
    return all(isinstance(t, FakeTensor) and t.device == CUDA for t in tensors)


def test_fake_cuda_catches_a_cpu_factory_and_a_cpu_tensor_indexed_by_cuda_positions():
    """The premise of the tests below."""
    with fake_cuda():
        x = torch.zeros(4, device="cuda")
        assert on_fake_cuda(x + torch.ones(4, device=x.device), x[torch.tensor([1, 2])])
        with pytest.raises(FakeTensorDeviceMismatchError):
            x + torch.ones(4)
        with pytest.raises(IndexDeviceError):
            torch.ones(4, dtype=torch.bool)[torch.tensor([1, 2], device="cuda")] = False


@pytest.fixture(scope="module")
def tiny_models(fixtures_dir):
    """Each family's tiny model (random weights, eager attention) and a capture of its last vision
    block's input on the CPU."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    from resadapt_eval.backbones.vision_attention import last_block_input

    models = {}
    for family in ("qwen25vl", "qwen3vl"):
        config = AutoConfig.from_pretrained(fixtures_dir / family)
        torch.manual_seed(0)
        model = AutoModelForImageTextToText.from_config(config, attn_implementation="eager").eval()
        vision = config.vision_config
        grid = torch.tensor([[2, 4, 4]])
        patch = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
        with torch.no_grad(), last_block_input(model) as captured:
            model.model.visual(torch.randn(int(grid.prod()), patch), grid_thw=grid)
        models[family] = model, captured
    return models


def test_merge_groups_and_the_compressed_prompt_follow_the_features_device():
    from resadapt_eval.backbones.layout import VIDEO_TOKEN_TYPE
    from resadapt_eval.backbones.qwen import compressed_sequence
    from resadapt_eval.baselines.common import DROPPED, Compression, merge_groups

    assignment = torch.tensor([0, 0, 2, DROPPED, 4, 4, 6, 6, 6, 9, 9, DROPPED])
    with fake_cuda():
        features = torch.randn(12, 8, device="cuda", dtype=torch.bfloat16)
        deepstack = torch.randn(12, 8, device="cuda", dtype=torch.bfloat16)
        compressions = [  # the compressors' CPU bookkeeping, with and without weights, and a device one
            Compression(assignment),
            Compression(assignment, torch.rand(12, dtype=torch.float64)),
            Compression(assignment.to("cuda"), torch.rand(12, device="cuda")),
        ]
        types = torch.zeros(1, 20, dtype=torch.long, device="cuda")
        types[:, 4:16] = VIDEO_TOKEN_TYPE
        full = dict(
            input_ids=torch.randint(0, 100, (1, 20), device="cuda"),
            attention_mask=torch.ones(1, 20, dtype=torch.long, device="cuda"),
            mm_token_type_ids=types,
        )
        positions = torch.arange(20, device="cuda").expand(3, 1, 20)
        for compression in compressions:
            kept, sizes, merged = merge_groups(compression, features, deepstack)
            assert on_fake_cuda(kept, sizes, *merged)
            assert [m.dtype for m in merged] == [torch.bfloat16] * 2
            inputs = compressed_sequence(full, positions, kept)
            assert on_fake_cuda(*inputs.values())
            assert inputs["position_ids"].shape[:2] == (3, 1)


def test_compressed_sequence_keeps_the_text_and_the_kept_video_tokens_at_their_positions():
    from resadapt_eval.backbones.layout import VIDEO_TOKEN_TYPE
    from resadapt_eval.backbones.qwen import compressed_sequence

    types = torch.tensor([[0, 0, VIDEO_TOKEN_TYPE, VIDEO_TOKEN_TYPE, VIDEO_TOKEN_TYPE, VIDEO_TOKEN_TYPE, 0]])
    full = dict(input_ids=torch.arange(7)[None] + 10, attention_mask=torch.ones(1, 7), mm_token_type_ids=types)
    inputs = compressed_sequence(full, torch.arange(7).expand(3, 1, 7) * 2, torch.tensor([1, 3]))
    assert inputs["input_ids"].tolist() == [[10, 11, 13, 15, 16]]
    assert inputs["position_ids"][0, 0].tolist() == [0, 2, 6, 10, 12]
    assert inputs["mm_token_type_ids"].tolist() == [[0, 0, VIDEO_TOKEN_TYPE, VIDEO_TOKEN_TYPE, 0]]


@pytest.mark.parametrize("family", ["qwen25vl", "qwen3vl"])
def test_received_attention_and_keys_stay_on_the_vision_tower_s_device(tiny_models, family):
    from resadapt_eval.backbones.qwen import ADAPTERS
    from resadapt_eval.backbones.vision_attention import received_attention_and_keys

    model, captured = tiny_models[family]
    unit = model.config.vision_config.spatial_merge_size**2
    with fake_cuda():
        block_input = dict(
            module=fake_cuda_copy(captured["module"]),
            hidden_states=captured["hidden_states"].to("cuda"),
            cu_seqlens=captured["cu_seqlens"].to("cuda"),  # two attention segments, as the tower gives them
            position_embeddings=tuple(t.to("cuda") for t in captured["position_embeddings"]),
        )
        received, keys = received_attention_and_keys(block_input, ADAPTERS[family].vision_rotary, unit)
    assert on_fake_cuda(received, keys)
    assert received.dtype == keys.dtype == torch.float32
    assert received.shape == (captured["hidden_states"].shape[0] // unit,) and keys.shape[0] == received.shape[0]


def test_the_tower_merges_units_on_the_vision_tower_s_device(tiny_models):
    """iLLaVA's merge between Qwen3-VL's vision blocks (`TowerReducer._merge`, on a block's captured
    input: two frame pairs of 4 units): the recomputed attention, the unit merge, the kept units'
    segments and rotary rows, and a DeepStack feature it follows."""
    from resadapt_eval.backbones.qwen import ADAPTERS
    from resadapt_eval.backbones.tower_reduction import TowerReducer
    from resadapt_eval.baselines import illava

    model, captured = tiny_models["qwen3vl"]
    with fake_cuda():
        visual = fake_cuda_copy(model.model.visual)
        reducer = TowerReducer(
            visual, {0: [2, 3]}, [4, 4], ADAPTERS["qwen3vl"].vision_rotary, illava.merge_units, lambda fn: fn
        )
        reducer._captured = dict(
            module=visual.blocks[-1].attn,
            hidden_states=captured["hidden_states"].to("cuda"),
            cu_seqlens=captured["cu_seqlens"].to("cuda"),
            position_embeddings=tuple(t.to("cuda") for t in captured["position_embeddings"]),
        )
        reducer.origin = torch.arange(8, device="cuda")
        reducer.sizes = torch.ones_like(reducer.origin)
        hidden = reducer._merge(0, captured["hidden_states"].to("cuda"))
        (tapped,) = reducer.follow([torch.randn(8, 5, device="cuda")], [-1])
        cu_seqlens, (cos, sin) = reducer._state
    assert on_fake_cuda(hidden, tapped, reducer.origin, reducer.sizes, cu_seqlens, cos, sin)


def text_inputs(model, length: int):
    """Fake CUDA hidden states (1, L, H), M-RoPE positions (3, 1, L) and rotary (cos, sin) of `model`'s LLM."""
    hidden = torch.randn(1, length, model.config.text_config.hidden_size, device="cuda")
    positions = torch.arange(length, device="cuda").expand(3, 1, length)
    rotary = fake_cuda_copy(model.model.language_model.rotary_emb)
    return hidden, positions, rotary(hidden, positions)


@pytest.mark.parametrize("family", ["qwen25vl", "qwen3vl"])
def test_the_in_llm_rankings_and_merge_run_on_the_llm_s_device(tiny_models, family, monkeypatch):
    from resadapt_eval.backbones.layer_pruning import (
        last_token_attention,
        merge_into_nearest,
        projected_qk,
        query_attention,
        stage_input_attention,
        text_attention,
    )
    from resadapt_eval.baselines import dart

    model, _ = tiny_models[family]
    with fake_cuda():
        layer = fake_cuda_copy(model.model.language_model.layers[3])
        hidden, _, (cos, sin) = text_inputs(model, 20)
        rows = query_attention(layer.self_attn, hidden, cos, sin, 16)
        assert on_fake_cuda(rows) and rows.shape == (model.config.text_config.num_attention_heads, 4, 20)
        for ranking in (
            last_token_attention(layer.self_attn, hidden, cos, sin),
            text_attention(layer.self_attn, hidden, cos, sin, 16),
            stage_input_attention(layer, hidden, cos, sin),
        ):
            assert on_fake_cuda(ranking) and ranking.shape == (20,)
        kept, dropped = torch.tensor([4, 9, 12], device="cuda"), torch.tensor([5, 6, 10, 13], device="cuda")
        merged = merge_into_nearest(hidden, kept, dropped)
        _, keys = projected_qk(layer.self_attn, hidden, 20, (cos, sin))
        norm = fake_cuda_copy(model.model.language_model.norm)
        visual, after = torch.arange(4, 16, device="cuda"), torch.arange(16, 20, device="cuda")
        # DART reads its pivots' indices to the host to visit them in its reference's order, which fake
        # tensors cannot give: visited here as found (that one sync: test_host_syncs.py, on real tensors)
        monkeypatch.setattr(dart, "visiting_order", lambda pivots: pivots)
        taken = dart.select(hidden, norm, dart.key_l1_norms(keys), visual, after, 9)
    assert on_fake_cuda(merged) and merged.shape == hidden.shape
    assert on_fake_cuda(taken) and taken.shape == (12,)


@pytest.mark.parametrize("family", ["qwen25vl", "qwen3vl"])
@pytest.mark.parametrize("rank_by", ["last_token", "stage_input", "duplication", "raters", "dual_filter"])
def test_a_pruning_stage_runs_through_its_layer_on_the_llm_s_device(tiny_models, family, rank_by, monkeypatch):
    """The prefill up to the layer after the stage: ranking in the layer before (or the stage's own
    input), the selection on the device, the pruned hidden states, rotary, positions and mask in the stage's
    layer (SparseVLM's: its raters at the first layer, 4 kept and 1 recycled of the 8 dropped; MustDrop's with
    two protected tokens). The next
    layer's hook asks whether the pruned length is above 1, a question about data."""
    from resadapt_eval.backbones.layer_pruning import LayerPruner
    from resadapt_eval.baselines import dart
    from resadapt_eval.baselines.inside_llm import Stage

    monkeypatch.setattr(dart, "visiting_order", lambda pivots: pivots)  # its one read of data (above)
    entering, syncs, pruner = fake_prefill_until(
        tiny_models[family][0],
        lambda llm: LayerPruner(
            llm,
            [Stage(4, 5, rank_by, recycle=int(rank_by == "raters"), thresholds=(0.001, 0.001))],
            torch.arange(4, 16),
            protected=torch.tensor([6, 9]) if rank_by == "dual_filter" else None,
        ),
        5,
    )
    assert on_fake_cuda(entering)
    assert syncs == 0  # the prefill, ranking and pick included, never reads the device on the host
    assert pruner.kept.device == CUDA and pruner.kept_by_layer[4] is pruner.kept


def fake_prefill_until(model, make_pruner, stop_layer: int):
    """A prefill of 20 tokens through a fake CUDA copy of `model`'s LLM with the pruner `make_pruner(llm)`
    attached (built on the host, before the engine call, from the prompt's positions), stopped at decoder
    layer `stop_layer`'s input: (the hidden states entering it, the host syncs counted, the pruner)."""
    from resadapt_eval.measure.syncs import SyncCounter

    class Stop(Exception):
        pass

    entering = {}

    def stop(module, args, kwargs):
        entering["hidden"] = args[0] if args else kwargs["hidden_states"]
        raise Stop

    with fake_cuda():
        language_model = fake_cuda_copy(model.model.language_model)
        hidden, positions, _ = text_inputs(model, 20)
        with unset_fake_temporarily():
            pruner = make_pruner(language_model)
        language_model.layers[stop_layer].register_forward_pre_hook(stop, with_kwargs=True, prepend=True)
        with torch.no_grad(), pruner.attached(), SyncCounter(device_only=True) as syncs, pytest.raises(Stop):
            language_model(inputs_embeds=hidden, position_ids=positions, use_cache=False)
    return entering["hidden"], syncs.count, pruner


@pytest.mark.parametrize("family", ["qwen25vl", "qwen3vl"])
def test_framefusion_merges_ranks_and_prunes_on_the_llm_s_device(tiny_models, family, monkeypatch):
    """FrameFusion's prefill through its merging layer (similarity, run averaging, the cut), the ranking
    layer after it and the pruning layer's input. Its merge count sets the sequence length, a read of
    data (one sync a merging layer): here the decision marks every third token of the later pairs."""
    from resadapt_eval.backbones.layer_pruning import FusionPruner
    from resadapt_eval.baselines import framefusion

    def decision(similarity, budget, layers, patches):  # 4 of the 12 visual tokens merge; merging ends
        merged = torch.zeros(len(similarity), dtype=torch.bool, device=similarity.device)
        merged[torch.tensor([4, 7, 10, 11], device=similarity.device)] = True
        return merged, 4, True, False

    monkeypatch.setattr(framefusion, "merge_decision", decision)
    model, _ = tiny_models[family]
    first = len(getattr(model.config.vision_config, "deepstack_visual_indexes", None) or ())
    patches = torch.arange(4).repeat(3)  # 3 pairs of 4 tokens
    entering, syncs, pruner = fake_prefill_until(
        model, lambda llm: FusionPruner(llm, torch.arange(4, 16), patches, 20 * 12, first), first + 2
    )
    assert on_fake_cuda(entering)
    assert syncs == 0
    assert pruner.layer_tokens == [12] * first + [8, pruner.layer_tokens[-1]] and pruner.phase == "done"
    assert pruner.kept.device == CUDA


@pytest.mark.parametrize("family", ["qwen25vl", "qwen3vl"])
def test_a_decoding_step_selects_the_visual_keys_on_the_llm_s_device(tiny_models, family):
    """DyCoke's decoding stage: the prefill, then the first decoding step (ranking in the layer before
    the stage, the CPU selection moved to the cache's device once, the selecting cache and the cut mask
    from the stage on). Later steps
    compare the attention with the previous step's, a question about data."""
    from resadapt_eval.backbones.decode_pruning import DecodePruner
    from resadapt_eval.baselines.inside_llm import DecodeStage

    model, _ = tiny_models[family]
    stage = DecodeStage(3, 4, 0.9)
    with fake_cuda():
        language_model = fake_cuda_copy(model.model.language_model)
        hidden, positions, _ = text_inputs(model, 20)
        pruner = DecodePruner(language_model, stage, torch.arange(4, 16, device="cuda"))
        with torch.no_grad(), pruner.attached():
            language_model(inputs_embeds=hidden, position_ids=positions, **pruner.generate_kwargs())
            step = language_model(
                inputs_embeds=hidden[:, -1:],
                position_ids=torch.full((3, 1, 1), 20, device="cuda"),
                **pruner.generate_kwargs(),
            )
    assert on_fake_cuda(step.last_hidden_state)
    assert pruner.cache.selection.device == CUDA and len(pruner.selections) == 1
    assert pruner.keys_dropped == (12 - stage.keep) * (len(language_model.layers) - stage.layer)


@pytest.mark.parametrize(
    "policy, modes", [("beta", ["mean"]), ("logit_normal", ["median", "quantile"])], ids=["beta", "logit_normal"]
)
@pytest.mark.parametrize("encoder", ["tiny", "tiny-colour"])
def test_the_allocator_scores_frames_on_its_device(policy, modes, encoder):
    from resadapt_eval.allocator import Allocator

    from .helpers import allocator_frames, tiny_allocator_config

    allocator = Allocator(tiny_allocator_config(policy=policy, encoder=encoder))
    video = allocator_frames(6)
    with fake_cuda():
        allocator = allocator.to("cuda")
        inputs = allocator.encode([video, video[:4]], ["where is the red ball?", "count"])
        p1, p2 = allocator(**inputs)
        scales = [allocator.to_scale(allocator.latent_actions(p1[0], p2[0], mode, 0.3)) for mode in modes]
    assert on_fake_cuda(*inputs.values(), p1, p2, *scales)
    assert p1.shape == (2, 6) and [s.shape for s in scales] == [(6,)] * len(modes)


@pytest.mark.parametrize("method, keep", [("tome", 20), ("dycoke", 20), ("mustdrop", 40)])
def test_the_shape_static_compressors_run_on_the_features_device(method, keep):
    """ToMe, DyCoke and MustDrop's window merge select without reading values back: their whole `compress`
    runs on fake CUDA features, its assignment stays on their device, and `merge_groups` merges there."""
    import importlib

    from resadapt_eval.baselines.common import VisualTokens, merge_groups

    compress = importlib.import_module(f"resadapt_eval.baselines.{method}").compress
    with fake_cuda():
        features, received = torch.randn(64, 8, device="cuda", dtype=torch.bfloat16), torch.rand(64, device="cuda")
        tokens = VisualTokens(features, [16] * 4, [(1, 4, 4)] * 4, received_attention=received)
        compression = compress(tokens, keep, 0)
        kept, sizes, (merged,) = merge_groups(compression, tokens.features)
    assert compression.assignment.device == CUDA and compression.assignment.shape == (64,)
    assert on_fake_cuda(kept, sizes, merged)


def compressor_kernels():
    """The device-side parts of the compressors whose selection reads values back: (name, call on
    unit features (N, D) and attention (N,), the device each output is on by design)."""
    from resadapt_eval.baselines import common, divprune, flashvid, holitom, prunevid, vidcom2
    from resadapt_eval.baselines.common import VisualTokens

    def holitom_steps(feats, attention):
        tokens = VisualTokens(feats, [16] * 4, [(1, 4, 4)] * 4)  # equal grids (else the matching reads values)
        steps = holitom.step_matches(tokens, feats)
        return (*steps[0], *holitom.follow(tokens, steps, 0, 2))

    def vidcom2_scores(feats, attention):
        channels = feats.double()[:, vidcom2.scoring_channels(feats, [0], [len(feats)])]
        to_video, to_frame = vidcom2.similarities(channels, [0, 16, 32, 48], [16] * 4)
        return to_video, to_frame, vidcom2.frame_weights(to_video, [0, 16, 32, 48], [16] * 4)

    def divprune_greedy(feats, attention):  # the whole greedy runs on fake tensors: it never reads a value back
        pair_of = torch.arange(4, device=feats.device).repeat_interleave(16)
        index = torch.tensor([3], device=feats.device)
        norms = divprune.row_norms(feats)
        nearest, row = (
            divprune.nearest_neighbour_distance(feats, norms),
            divprune.cosine_distance_to(feats, index, norms),
        )
        return divprune.max_min_greedy(feats, pair_of, 4, 10), divprune.distance_matrix(feats, norms), nearest, row

    return [
        ("divprune", divprune_greedy, CUDA),
        ("density_peaks", lambda f, a: common.density_peaks(f, 5, 4), CUDA),
        ("prunevid.dpc_knn", lambda f, a: (prunevid.dpc_knn(f, 5),), CUDA),
        ("flashvid.dpc_knn", lambda f, a: flashvid.dpc_knn(f, 5), CUDA),
        ("holitom.step_matches", holitom_steps, CUDA),
        ("vidcom2", vidcom2_scores, CUDA),
    ]


@pytest.mark.parametrize("name, kernel, device", compressor_kernels(), ids=[k[0] for k in compressor_kernels()])
def test_the_compressors_device_side_kernels_stay_on_the_features_device(name, kernel, device):
    with fake_cuda():
        feats = torch.nn.functional.normalize(torch.randn(64, 8, device="cuda"), dim=-1)
        outputs = kernel(feats, torch.rand(64, device="cuda"))
    assert len(outputs) > 0 and all(isinstance(t, FakeTensor) and t.device == device for t in outputs)


class KernelDevices(TorchDispatchMode):
    """The devices each aten op ran on, by op name."""

    def __init__(self):
        super().__init__()
        self.devices: dict[str, set] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if torch.is_tensor(out):
            self.devices.setdefault(func.__name__, set()).add(out.device)
        return out


@pytest.mark.parametrize("mode", ["exact", "fast"])
def test_the_frames_are_resized_on_the_model_s_device_in_chunks_and_come_back_to_the_cpu(mode, monkeypatch):
    """resize_frames(device="cuda"): the antialiased bicubic kernel runs on the CUDA device, a chunk of
    frames at a time (a chunk's float32 copy within RESIZE_CHUNK_BYTES), and the uint8 frames the
    processor reads come back on the CPU."""
    import numpy as np

    from resadapt_eval.backbones import layout

    frames = np.zeros((6, 72, 128, 3), dtype=np.uint8)
    monkeypatch.setattr(layout, "RESIZE_CHUNK_BYTES", 4 * 3 * 72 * 128 * 4)  # four frames a chunk
    with fake_cuda(), KernelDevices() as seen:
        out = layout.resize_frames(frames, 56, 84, mode, device="cuda")
    assert out.shape == (6, 3, 56, 84) and out.dtype == torch.uint8 and out.device == CPU
    bicubic = [name for name in seen.devices if "bicubic" in name]
    assert bicubic and all(seen.devices[name] == {CUDA} for name in bicubic)
    assert seen.devices["_to_copy.default"] >= {CUDA, CPU}  # there and back
