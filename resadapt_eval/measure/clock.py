"""Clocks for a request's stages: CUDA events on a CUDA device (recorded in stream order and read
once the work has finished, so nothing waits in between), wall clocks otherwise."""

from __future__ import annotations

import resource
import time
from contextlib import contextmanager

import torch
from transformers import LogitsProcessor


class Stopwatch:
    """Marks on `device`'s timeline; `seconds(start, end)` between two marks."""

    def __init__(self, device: torch.device | str):
        self.cuda = torch.device(device).type == "cuda"

    def mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def seconds(self, start, end) -> float:
        if self.cuda:
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        return end - start


class Spans:
    """Seconds spent inside `timed()` blocks on `stopwatch`'s clock, summed by `seconds()` (CUDA
    events read once, at the end)."""

    def __init__(self, stopwatch: Stopwatch):
        self.stopwatch, self.spans = stopwatch, []

    @contextmanager
    def timed(self):
        start = self.stopwatch.mark()
        try:
            yield
        finally:
            self.spans.append((start, self.stopwatch.mark()))

    def seconds(self) -> float:
        return sum(self.stopwatch.seconds(a, b) for a, b in self.spans)


class ModuleTimer:
    """Seconds spent in a module's forward passes while `recording()`, from a pre-hook and a hook
    (public `nn.Module` seams); `take()` returns them and starts again from zero."""

    def __init__(self, module: torch.nn.Module, stopwatch: Stopwatch):
        self.stopwatch, self.spans, self.open, self.active = stopwatch, [], None, False
        module.register_forward_pre_hook(self._start)
        module.register_forward_hook(self._stop)

    def _start(self, module, args):
        if self.active:
            self.open = self.stopwatch.mark()

    def _stop(self, module, args, output):
        if self.active:
            self.spans.append((self.open, self.stopwatch.mark()))

    @contextmanager
    def recording(self):
        self.active = True
        try:
            yield self
        finally:
            self.active = False

    def take(self) -> float:
        spans, self.spans = self.spans, []
        return sum(self.stopwatch.seconds(a, b) for a, b in spans)


class FirstLogits(LogitsProcessor):
    """Marks the first time `generate` asks for the next token's logits: the end of prefill
    (the vision tower and the prompt), so `seconds(start, first)` is the time to first token."""

    def __init__(self, stopwatch: Stopwatch):
        self.stopwatch, self.first = stopwatch, None

    def __call__(self, input_ids, scores):
        if self.first is None:
            self.first = self.stopwatch.mark()
        return scores


def reset_peak_memory(device: torch.device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory in MiB: allocated on a CUDA device since `reset_peak_memory`; on CPU the
    process's peak resident set (it never goes down, so it is the peak of the run so far)."""
    if torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB
