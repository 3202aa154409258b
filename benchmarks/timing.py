"""Shared timing helper for the benchmark scripts."""

import statistics
import time


def median_seconds(fn, repeats: int) -> float:
    """Median wall time of `fn()` over `repeats` runs, after one warm-up run."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
