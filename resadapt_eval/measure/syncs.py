"""Host-device synchronisations a piece of code asks for, counted while it runs, on any device.

On a GPU each of these makes the host wait until the device has finished everything queued
before it; on a CPU nothing waits, so they are counted by what the code calls, not by waiting:
- at torch's dispatch level (a `TorchDispatchMode`): a tensor read as a Python number (`.item()`,
  `int()`, `float()`, `bool()`, `__index__`: `aten._local_scalar_dense`), and the ops whose output
  size depends on the data (`nonzero`, `torch.where(cond)`, `unique`, `masked_select`, `bincount`,
  indexing or index assignment with a boolean mask, `repeat_interleave` with tensor repeats and no
  `output_size`);
- in Python (a patch of `torch.Tensor` for the duration): `.tolist()`, `.cpu()` and `.numpy()`,
  which read a tensor's memory directly on a CPU and dispatch nothing there.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

DATA_DEPENDENT = {
    aten._local_scalar_dense.default,
    aten.nonzero.default,
    aten.masked_select.default,
    aten.bincount.default,
    aten._unique2.default,
    aten.unique_dim.default,
    aten.unique_consecutive.default,
    aten._unique.default,
}
BOOLEAN_INDEXED = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default}
COPIES_TO_HOST = ("tolist", "cpu", "numpy")


def is_sync(func, args, kwargs) -> bool:
    """Whether the aten call `func(*args, **kwargs)` needs the host to read device data."""
    if func in DATA_DEPENDENT:
        return True
    if func in BOOLEAN_INDEXED:
        return any(torch.is_tensor(i) and i.dtype == torch.bool for i in args[1] if i is not None)
    if func == aten.repeat_interleave.Tensor:
        return kwargs.get("output_size") is None
    return False


class SyncCounter(TorchDispatchMode):
    """`count`: the synchronising aten calls seen so far (see the module docstring); with
    `device_only`, only those reading a tensor off the CPU (where CPU-side bookkeeping is meant to
    stay on the CPU and the rest runs on a fake or real accelerator)."""

    def __init__(self, device_only: bool = False):
        super().__init__()
        self.count, self.device_only = 0, device_only

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if is_sync(func, args, kwargs) and (not self.device_only or _off_cpu(args)):
            self.count += 1
        return func(*args, **kwargs)


def _off_cpu(args) -> bool:
    tensors = [a for a in args if torch.is_tensor(a)] + [
        t for a in args if isinstance(a, (list, tuple)) for t in a if torch.is_tensor(t)
    ]
    return any(t.device.type != "cpu" for t in tensors)


@contextmanager
def counting_syncs():
    """Count the host-device synchronisations asked for in the block: `counts["n"]` after it."""
    counts = {"n": 0}
    saved = {name: getattr(torch.Tensor, name) for name in COPIES_TO_HOST}

    def counted(original):
        def call(*args, **kwargs):
            counts["n"] += 1
            return original(*args, **kwargs)

        return call

    for name, original in saved.items():
        setattr(torch.Tensor, name, counted(original))
    counter = SyncCounter()
    try:
        with counter:
            yield counts
    finally:
        for name, original in saved.items():
            setattr(torch.Tensor, name, original)
        counts["n"] += counter.count
