"""Timing (DESIGN.md section 6).

- CPU: wall clock, warm-up, median of several runs.
- GPU: CUDA events around each call after a warm-up (eager time: includes the
  host's launch overhead), and CUDA-graph replay (GPU time: the launches are
  recorded once and replayed). Report both; the median of many runs.
"""

from __future__ import annotations

import os
import statistics
import time

import torch

# Repeats of one timing whose slowest is more than this many times the fastest disagree: the machine was
# busy (other processes, a compile beside it), and the median is not the kernel's time.
UNSTEADY_SPREAD = 2.0


def _summary(times: list, prefix: str = "") -> dict:
    """Median, fastest and slowest of the repeats, and where they disagree (UNSTEADY_SPREAD) a note saying
    so with the machine's load, so that no one takes a busy machine's time for the kernel's."""
    lo, hi = min(times), max(times)
    out = {f"{prefix}ms": statistics.median(times), f"{prefix}min_ms": lo, f"{prefix}max_ms": hi,
           f"{prefix}reps": len(times)}
    if len(times) >= 3 and lo > 0 and hi / lo > UNSTEADY_SPREAD:
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
        out[f"{prefix}unsteady"] = (f"its {len(times)} repeats range from {lo:.3g} to {hi:.3g} ms ({hi / lo:.1f}x; "
                                    f"load average {load:.1f} on {os.cpu_count()} cores): the machine was busy, "
                                    f"so the median is not the kernel's time")
    return out


def time_cpu(fn, *, warmup: int = 1, reps: int = 5, max_seconds: float = 20.0) -> dict:
    """Median wall time of ``fn()`` in ms (stops early after ``max_seconds``)."""
    for _ in range(warmup):
        fn()
    times = []
    t_end = time.perf_counter() + max_seconds
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
        if time.perf_counter() > t_end:
            break
    return _summary(times)


def time_cuda(fn, *, warmup: int = 5, reps: int = 50) -> dict:
    """Median eager time of ``fn()`` in ms, timed with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return _summary(times)


def time_cuda_graph(fn, *, warmup: int = 3, reps: int = 50, calls_per_graph: int = 1) -> dict:
    """Median GPU time of ``fn()`` in ms from CUDA-graph replay.

    ``fn`` is captured ``calls_per_graph`` times into one graph (its outputs
    come from the graph's private pool); each replay is timed with events.
    """
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls_per_graph):
            fn()
    for _ in range(warmup):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / calls_per_graph)
    del graph
    return _summary(times, "graph_")


def time_call(fn, device, *, reps: int | None = None, graph: bool = True, max_seconds: float = 20.0,
              warmup: int | None = None) -> dict:
    """Time ``fn`` where it runs: CPU wall clock, or GPU events + graph replay."""
    dev = torch.device(device)
    if dev.type == "cuda":
        out = time_cuda(fn, reps=reps or 50, warmup=5 if warmup is None else warmup)
        if graph:
            try:
                out.update(time_cuda_graph(fn, reps=reps or 50))
            except RuntimeError as e:  # a call that cannot be captured: say so, keep eager
                out["graph_error"] = str(e).splitlines()[0][:200]
        return out
    return time_cpu(fn, reps=reps or 5, max_seconds=max_seconds, warmup=1 if warmup is None else warmup)
