"""What every benchmark shares: CUDA-event timing, spreads, the result header, a printed table,
JSON + PNG output.

Every result file starts with :func:`header`: the benchmark, the GPU name, the UTC date, the
commit (``$GIT_COMMIT``, else ``git rev-parse HEAD``) and the torch version, so a number quoted
anywhere can be traced to its run.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from portable import dumps

from megatron_paging.config import kernel_grid_bound
from megatron_paging.env import git_commit
from megatron_paging.tools.kernel_timeline import idle_gaps, summarize, timeline_record

RESULTS = Path(__file__).resolve().parent / "results"


def gbps(nbytes: int, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e9


def grid_bound_arg(text: str) -> int:
    """An argparse ``type`` for a kernel grid bound given on a benchmark's command line, for the
    benchmarks that launch the kernels' raw ``copy`` (the check is the config's)."""
    try:
        return kernel_grid_bound(int(text))
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


class CudaTimer:
    """Median milliseconds of ``fn`` over ``reps`` calls, each after ``setup`` and an L2 flush
    (``triton.testing.do_bench``'s method; ``setup`` runs before the start event, untimed)."""

    def __init__(self, reps: int = 30, warmup: int = 3):
        self.reps, self.warmup = reps, warmup
        self.flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")

    def samples(self, fn: Callable[[], object], setup: Callable[[], object] | None = None):
        for _ in range(self.warmup):  # JIT compiles, allocator, handles
            if setup:
                setup()
            fn()
        events = []
        for _ in range(self.reps):
            if setup:
                setup()
            self.flush.zero_()  # also keeps the GPU busy while the host enqueues fn
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            events.append((start, end))
        torch.cuda.synchronize()
        return [s.elapsed_time(e) for s, e in events]

    def __call__(self, fn, setup=None) -> float:
        return statistics.median(self.samples(fn, setup))


def spread(values: list[float]) -> dict:
    """Median, min, max and the relative half-range of repeated measurements."""
    median = statistics.median(values)
    return {
        "median": median,
        "min": min(values),
        "max": max(values),
        "relative_spread": (max(values) - min(values)) / (2 * median) if median else None,
    }


def header(benchmark: str, **extra) -> dict:
    """The fields every result file starts with."""
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return {
        "benchmark": benchmark,
        "gpu": gpu,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "torch": torch.__version__,
        **extra,
    }


def require_gpu(benchmark: str) -> None:
    """Exit 2 with one line where no CUDA device is visible, before anything runs or is
    written: every number a benchmark records is a GPU's, and a file written without one (named
    for no GPU, its arms all failed) would read as a result."""
    if not torch.cuda.is_available():
        print(f"error: the {benchmark} benchmark needs a CUDA GPU and none is visible (nothing "
              "run, nothing written)", file=sys.stderr, flush=True)
        raise SystemExit(2)


def default_out(benchmark: str) -> Path:
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
    return RESULTS / f"{benchmark}_{gpu.replace(' ', '_').lower()}.json"


def write(result: dict, out: Path, plot: Callable[[object], None] | None = None) -> None:
    """``result`` as JSON at ``out``; ``plot(axes_factory)`` draws the PNG beside it."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(dumps(result, indent=2))
    written = [str(out)]
    if plot is not None:
        png = out.with_suffix(".png")
        plot(png)
        written.append(str(png))
    print("wrote " + " and ".join(written), flush=True)


def print_table(headers: list[str], rows: list[list[object]], floats: str = ".1f") -> None:
    """``rows`` under ``headers``, columns right-aligned; floats formatted with ``floats``."""
    cells = [[format(c, floats) if isinstance(c, float) else str(c) for c in row] for row in rows]
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)]
    print("  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True)), flush=True)
    for row in cells:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)), flush=True)


def figure(width: float = 9, height: float = 4.5):
    """A matplotlib figure on the Agg canvas (no pyplot, no global backend switch)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=120)
    FigureCanvasAgg(fig)
    return fig


def gpu_busy(step: Callable[[], object]) -> dict:
    """GPU-busy time (union of device-op intervals), the paging kernels' own time, and the idle
    gaps of one profiled step (``kernel_timeline.idle_gaps``: ended by a late host launch or by
    an op already queued behind a dependency). Host activity is profiled too, for the launch
    times; its overhead lengthens host-late gaps, so compare them between arms, not with the
    unprofiled step time."""
    try:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step()
        record = timeline_record(prof.events(), iteration=0, wall_ms=0.0)
    except Exception as error:  # noqa: BLE001 - profiling is a diagnostic, never fatal
        return {"gpu_busy_error": repr(error)}
    if not record["rows"]:
        return {"gpu_busy_error": "the profiler saw no CUDA kernels"}
    summary, gaps = summarize(record), idle_gaps(record)
    return {"gpu_busy_ms": summary["busy_ms"], "paging_kernel_ms": summary["paging_sum_ms"],
            "paging_hidden_ms": summary["paging_hidden_ms"],
            "kernels_per_step": summary["kernels"], "idle_gaps": gaps}


class GcTime:
    """Milliseconds the Python garbage collector ran (``gc.callbacks``) while installed (a
    ``with`` block): ``snapshot()`` then ``since(snapshot)`` gives one step's GC time and
    collection count. cProfile charges a collection to whatever function allocated when it
    began, so a GC-heavy step looks slower everywhere; this measures it directly."""

    def __init__(self):
        self.ms, self.collections, self._start = 0.0, 0, None

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self.ms += 1e3 * (time.perf_counter() - self._start)
            self.collections += 1
            self._start = None

    def __enter__(self):
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._callback)

    def snapshot(self) -> tuple[float, int]:
        return self.ms, self.collections

    def since(self, snapshot: tuple[float, int]) -> tuple[float, int]:
        return self.ms - snapshot[0], self.collections - snapshot[1]


def host_profile(step: Callable[[], object], top: int = 25) -> list[str]:
    """cProfile of one step's host work (by tottime)."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    step()
    profiler.disable()
    text = io.StringIO()
    # file names without their folders: a result file holds no machine's paths
    pstats.Stats(profiler, stream=text).strip_dirs().sort_stats("tottime").print_stats(top)
    return [line for line in text.getvalue().splitlines() if line.strip()]


__all__ = ["CudaTimer", "GcTime", "RESULTS", "default_out", "figure", "gbps", "gpu_busy", "header",
           "host_profile", "print_table", "require_gpu", "spread", "write"]
