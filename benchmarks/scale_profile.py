"""One profiled iteration per scale arm (``bench_scale.py --profile-iteration N``): where the
step's device time goes, for a step-time result that needs explaining (a missed target is
reported with the profile that says why).

The example profiles iteration N with torch.profiler when ``MEGATRON_PAGING_BENCH_PROFILE_ITER``
is set and writes its kernel timeline to ``MEGATRON_PAGING_BENCH_PROFILE_JSON.rank<RANK>``
(examples/step_probe.py). This module names those variables for a run, keeps the timeline
gzipped beside the result file, and puts its summary in the arm's record: device busy time, the
paging kernels and copy-engine transfers and how much of them ran beside other work, the paging
time with nothing beside it and the compute ops around it, and the idle gaps the device spent
waiting (``megatron_paging.tools.kernel_timeline``). The profiler slows iteration N and the
next one (which prints it): they leave the arm's median.
"""

from __future__ import annotations

import gzip
import shutil
from pathlib import Path

from megatron_paging.tools.kernel_timeline import exposed_paging, idle_gaps, load, summarize

PROFILE_ITER_ENV = "MEGATRON_PAGING_BENCH_PROFILE_ITER"
PROFILE_JSON_ENV = "MEGATRON_PAGING_BENCH_PROFILE_JSON"


def profile_env(iteration: int | None, prefix: Path) -> dict[str, str]:
    """The example's environment for profiling ``iteration`` into ``prefix.rank<RANK>``."""
    if iteration is None:
        return {}
    return {PROFILE_ITER_ENV: str(iteration), PROFILE_JSON_ENV: str(prefix)}


def perturbed_iterations(iteration: int | None) -> set[int]:
    """The iterations the profiler slows: the profiled one and the next."""
    return set() if iteration is None else {iteration, iteration + 1}


def read_profile(prefix: Path, rank: int, keep: Path) -> dict:
    """The summary of the timeline the example wrote for ``rank``; the timeline itself moves,
    gzipped, to ``keep`` (a directory). Empty when the run wrote none."""
    written = prefix.with_name(f"{prefix.name}.rank{rank}")
    if not written.exists():
        return {}
    record = load(written)
    keep.mkdir(parents=True, exist_ok=True)
    kept = keep / f"{prefix.name}.json.gz"
    with open(written, "rb") as source, gzip.open(kept, "wb") as target:
        shutil.copyfileobj(source, target)
    written.unlink()
    return {
        "iteration": record["iteration"],
        "timeline": kept.name,
        **summarize(record),
        "exposed_paging": exposed_paging(record),
        "idle": idle_gaps(record),
    }


def profile_line(profile: dict) -> str:
    """One line per profiled arm for the benchmark's output."""
    exposed = profile["exposed_paging"]
    return (f"profile it {profile['iteration']}: busy {profile['busy_ms']:.0f} of "
            f"{profile['span_ms']:.0f} ms; paging kernels {profile['paging_sum_ms']:.0f} ms "
            f"({profile['paging_hidden_ms']:.0f} beside compute, {exposed['exposed_ms']:.0f} "
            f"alone, {exposed['queued_ms']:.0f} of it holding compute back); copies "
            f"{profile['copies_sum_ms']:.0f} ms ({profile['copies_beside_kernels_ms']:.0f} "
            f"beside kernels); idle {profile['idle']['queued_ms']:.0f} ms queued, "
            f"{profile['idle']['host_ms']:.0f} ms host")

