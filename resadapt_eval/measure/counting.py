"""FLOPs of work whose size depends on the data (a compressor's similarities, an encoder's
forward): counted while it runs by torch's FlopCounterMode, in the convention of `flops.py`
(2 FLOPs per multiply-add of every matmul, convolution and attention product). Three kernels
FlopCounterMode leaves out are counted too: matrix-vector products (`aten.mv`), CPU's fused
attention (`_scaled_dot_product_flash_attention_for_cpu`) and the inference fast path of
`nn.MultiheadAttention` (`_native_multi_head_attention`: its projections and attention products)."""

from __future__ import annotations

import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

from .clock import Spans

aten = torch.ops.aten


def mv_flop(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """(m, k) @ (k,): 2 * m * k."""
    m, k = a_shape
    return 2 * m * k


def cpu_attention_flop(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    """(B, h, T, d) queries against (B, h, S, d) keys: 4 * B * h * T * S * d."""
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def native_multi_head_attention_flop(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    """(B, T, D) queries, (B, S, D) keys and values: the q projection 2 B T D^2, the k and v
    projections 2 B S D 2D, the attention products 4 B T S D and the output projection 2 B T D^2."""
    B, T, D = query_shape
    S = key_shape[1]
    return 2 * B * T * D * D + 2 * B * S * D * 2 * D + 4 * B * T * S * D + 2 * B * T * D * D


UNCOUNTED_KERNELS = {
    aten.mv: mv_flop,
    aten._scaled_dot_product_flash_attention_for_cpu: cpu_attention_flop,
    aten._native_multi_head_attention: native_multi_head_attention_flop,
}


def flop_counter(depth: int | None = None) -> FlopCounterMode:
    """A silent FlopCounterMode that also counts `UNCOUNTED_KERNELS`."""
    return FlopCounterMode(display=False, depth=depth, custom_mapping=UNCOUNTED_KERNELS)


def counted_flops(fn, *args, **kwargs):
    """(fn(*args, **kwargs), the FLOPs it ran)."""
    with flop_counter() as counter:
        result = fn(*args, **kwargs)
    return result, counter.get_total_flops()


class CountedCall:
    """`fn` with every call counted and timed: `flops` is the total so far, `seconds()` the time its
    calls took on `stopwatch` (`measure.clock.Stopwatch`: CUDA events on a GPU, read once at the end),
    `last` the last call's result."""

    def __init__(self, fn, stopwatch):
        self.fn, self.flops, self.work, self.last = fn, 0, Spans(stopwatch), None

    def __call__(self, *args, **kwargs):
        with self.work.timed():
            result, flops = counted_flops(self.fn, *args, **kwargs)
        self.flops += flops
        self.last = result  # what a later stage reads of it (a compressor's protected tokens)
        return result

    def seconds(self) -> float:
        """Seconds spent in the calls so far."""
        return self.work.seconds()
