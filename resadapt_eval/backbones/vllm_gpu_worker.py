"""vLLM's GPU worker with its multimodal pruning path on for our token compressors (`vllm_compression`).

vLLM's GPU model runner switches that path (per-item video encoding, positions recomputed after the
encoder) on only for its own video pruning settings (`video_pruning_rate`); `CompressingGPUWorker` also
switches it on for an engine whose model class compresses on request. `VLLMBackbone` selects it through
vLLM's `worker_cls` engine argument when it compresses on a GPU (vLLM's default, v1, model runner).
"""

from __future__ import annotations

from vllm.v1.worker.gpu_worker import Worker

from .vllm_compression import PruningWorkerMixin


class CompressingGPUWorker(PruningWorkerMixin, Worker):
    pass
