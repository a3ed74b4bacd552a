"""Nsight Compute counters of the page kernels beside a plain streaming kernel, per regime of
``bench_kernels.py``: where a stash or reload spends the time ``copy_`` does not.

Per regime, one Nsight Compute process profiles three kernels, each once, caches flushed before
it (Nsight Compute's default): our stash and reload (the dispatch rule's path, as
``bench_kernels.py`` times them) and a streaming kernel over the same live bytes. The streaming
kernel is ``torch.bitwise_or(src, 0, out=dst)`` on int64 views, which reads and writes what
``copy_`` does; ``copy_`` itself is a device-to-device ``cudaMemcpyAsync``, which Nsight Compute
does not profile. Per kernel: duration, DRAM bytes read and written, DRAM throughput as a share of
peak, grid, and the warp stall reasons. Nsight Compute locks the clocks to base: durations are
longer than ``bench_kernels.py``'s; compare kernels within this file.

Run: ``python benchmarks/profile_kernels.py [--regimes 0,3,4]`` (needs ``ncu`` on PATH), or
``bash scripts/gpu_check.sh build profile-kernels``. Writes a table and JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import csv
import io
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from bench_kernels import REGIMES, Case
from common import default_out, header, print_table, require_gpu, write

# The sections whose raw metrics the file keeps (SpeedOfLight: duration, DRAM share of peak;
# MemoryWorkloadAnalysis: DRAM bytes; WarpStateStats: stall reasons; LaunchStats: the grid).
SECTIONS = ("SpeedOfLight", "MemoryWorkloadAnalysis", "WarpStateStats", "LaunchStats")
KEPT_PREFIXES = ("gpu__time_duration", "dram__", "launch__grid_size", "launch__block_size",
                 "smsp__average_warps_issue_stalled_", "sm__throughput", "lts__t_bytes.")
# Asked for by name too, in case a section of this Nsight Compute version leaves one out.
METRICS = ("gpu__time_duration.sum", "dram__bytes_read.sum", "dram__bytes_write.sum",
           "dram__throughput.avg.pct_of_peak_sustained_elapsed", "launch__grid_size")
OPS = ("stash", "reload", "streaming")


def workload(regime_index: int) -> None:
    """Inside Nsight Compute: warm every op up, then profile each once (profiler windows)."""
    case = Case(REGIMES[regime_index], None)
    case.verify("cuda")
    n = case.regime.live_rows
    src = case.src[:n].view(torch.int64)
    dst = case.dst[:n].view(torch.int64)
    ops = {
        "stash": (case.stash, case.reset),
        "reload": (case.reload, case.reset_and_stash),
        "streaming": (lambda: torch.bitwise_or(src, 0, out=dst), lambda: None),
    }
    for op, before in ops.values():  # module loads and first-launch work stay unprofiled
        before()
        op()
    cudart = torch.cuda.cudart()
    for name in OPS:
        op, before = ops[name]
        before()
        torch.cuda.synchronize()
        cudart.cudaProfilerStart()
        op()
        torch.cuda.synchronize()
        cudart.cudaProfilerStop()


def kernel_op(kernel_name: str) -> str:
    """Which op a profiled kernel is: our kernels are templated on reload (``<0, ...>`` stash,
    ``<1, ...>`` reload); the streaming kernel is PyTorch's bitwise-or; anything else a window
    launched is recorded as ``other``."""
    if "bulk_kernel<" in kernel_name or "tile_kernel<" in kernel_name:
        return "reload" if "_kernel<1" in kernel_name.replace(" ", "") else "stash"
    return "streaming" if "bitwiseor" in kernel_name.lower().replace("_", "") else "other"


def number(text: str) -> float | str:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return text


def parse_raw_csv(text: str) -> list[dict]:
    """``ncu --import R --page raw --csv``: a header row, a units row, then one row per kernel.
    Keeps the kernel name, the grid and the metrics named by KEPT_PREFIXES (with their units)."""
    lines = text[text.index('"ID"'):] if '"ID"' in text else ""
    rows = list(csv.reader(io.StringIO(lines)))
    if len(rows) < 3:
        raise RuntimeError("Nsight Compute reported no kernels (was the workload profiled?)")
    names, units = rows[0], rows[1]
    kernels = []
    for values in rows[2:]:
        row = dict(zip(names, values, strict=False))
        metrics = {
            name: {"value": number(row[name]), "unit": unit}
            for name, unit in zip(names, units, strict=False)
            if name.startswith(KEPT_PREFIXES) and row.get(name, "") != ""
        }
        kernels.append({"kernel": row.get("Kernel Name", ""), "op": kernel_op(row.get(
            "Kernel Name", "")), "metrics": metrics})
    return kernels


def profile_regime(ncu: str, regime_index: int, tmp: Path) -> list[dict]:
    report = tmp / f"regime{regime_index}"
    sections = [arg for s in SECTIONS for arg in ("--section", s)]
    command = [ncu, "--profile-from-start", "off", *sections, "--metrics", ",".join(METRICS),
               "-f", "-o", str(report),
               sys.executable, __file__, "--workload", str(regime_index)]
    subprocess.run(command, check=True)
    raw = subprocess.run([ncu, "--import", f"{report}.ncu-rep", "--page", "raw", "--csv",
                          "--print-kernel-base", "demangled"],  # template arguments name the op
                         check=True, capture_output=True, text=True).stdout
    kernels = parse_raw_csv(raw)
    found = [k["op"] for k in kernels]
    if any(found.count(op) != 1 for op in OPS):
        raise RuntimeError(f"regime {regime_index}: expected one kernel per op {OPS}, Nsight "
                           f"Compute profiled {[k['kernel'] for k in kernels]}")
    return kernels


# Nsight Compute picks each value's unit itself (a 0.6 MB write prints as 639 Kbyte).
UNIT_SCALE = {"": 1.0, "%": 1.0, "byte": 1.0, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9,
              "ns": 1e-3, "us": 1.0, "ms": 1e3, "usecond": 1.0, "nsecond": 1e-3,
              "msecond": 1e3}


def metric(kernel: dict, name: str, per: float = 1.0) -> float | None:
    """The metric in the table's unit: microseconds for times, `per` bytes for bytes."""
    entry = kernel["metrics"].get(name, {})
    value, unit = entry.get("value"), entry.get("unit", "")
    if not isinstance(value, float):
        return None
    if unit not in UNIT_SCALE:
        raise RuntimeError(f"{name}: unknown Nsight Compute unit {unit!r}")
    return value * UNIT_SCALE[unit] / per


def streaming_share(kernels: list[dict], op: str) -> float | None:
    """The streaming kernel's time over the op's: 1.0 means the op moves its bytes as fast."""
    times = {k["op"]: metric(k, "gpu__time_duration.sum") for k in kernels}
    if not times.get(op) or times.get("streaming") is None:
        return None
    return times["streaming"] / times[op]


def summary_rows(results: list[dict]) -> list[list[object]]:
    rows = []
    for result in results:
        for kernel in result["kernels"]:
            rows.append([result["regime"], kernel["op"],
                         metric(kernel, "gpu__time_duration.sum"),
                         metric(kernel, "dram__bytes_read.sum", per=1e6),
                         metric(kernel, "dram__bytes_write.sum", per=1e6),
                         metric(kernel, "dram__throughput.avg.pct_of_peak_sustained_elapsed"),
                         metric(kernel, "launch__grid_size"),
                         streaming_share(result["kernels"], kernel["op"])])
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--regimes", default="0,3,4",
                        help=f"indices of bench_kernels' regimes (0..{len(REGIMES) - 1})")
    parser.add_argument("--out", type=Path, default=None, help="JSON path")
    parser.add_argument("--workload", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.workload is not None:
        workload(args.workload)
        return 0
    try:
        indices = [int(i) for i in args.regimes.split(",")]
        regimes = [REGIMES[i] for i in indices]
    except (ValueError, IndexError):
        parser.error(f"--regimes: indices 0..{len(REGIMES) - 1}, got {args.regimes!r}")
    if any(r.host_spill for r in regimes):
        parser.error("--regimes: the host-spill regime moves over PCIe; profile device regimes")
    ncu = shutil.which("ncu")
    if ncu is None:
        parser.error("Nsight Compute's `ncu` is not on PATH")
    require_gpu("kernels_profile")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for index, regime in zip(indices, regimes, strict=True):
            results.append({"regime": regime.name, "regime_index": index,
                            "bytes_read_plus_written": 2 * regime.live_rows * regime.hidden
                            * torch.empty(0, dtype=regime.dtype).element_size(),
                            "kernels": profile_regime(ncu, index, Path(tmp))})
            print(f"profiled {regime.name}", flush=True)
    print_table(["regime", "op", "us", "DRAM read MB", "DRAM write MB", "DRAM % peak", "grid",
                 "streaming/op"],
                summary_rows(results))
    result = header(
        "kernels_profile",
        command=f"ncu --profile-from-start off {' '.join('--section ' + s for s in SECTIONS)} "
                f"--metrics {','.join(METRICS)} "
                "(one process per regime; clocks locked to base, caches flushed per kernel)",
        streaming_kernel="torch.bitwise_or(src, 0, out=dst) on int64 views of the live rows: "
                         "copy_'s bytes through an SM kernel (copy_ is a cudaMemcpyAsync)",
        regimes=results,
    )
    write(result, args.out or default_out("kernels_profile"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
