"""Page-tile kernels vs Megatron-Core 0.19.2's Triton kernels vs ``torch.Tensor.copy_``.

One run, one device. For each regime of ``shared/HARDWARE.md``: stash and reload separately,
GB/s counting bytes read + written (2 x live bytes), the median of per-call CUDA-event timings
with L2 flushed before each call (``triton.testing.do_bench``'s method; the pool-state reset a
stash needs runs before the start event, outside the timed region). Then the effect of
``max_ctas`` on copy time and on a concurrent bf16 GEMM.

Writes a table to stdout, JSON to ``--out`` and a PNG bar chart beside it.
Run: ``megatron-paging bench kernels`` or ``python benchmarks/bench_kernels.py``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_paging import kernels
from megatron_paging.env import git_commit
from megatron_paging.pool import PagePool
from megatron_paging.record import PageRecord

PAGE_SIZE = 64
RESULTS = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True)
class Regime:
    name: str
    dtype: torch.dtype
    hidden: int
    capacity_rows: int
    live_rows: int
    host_spill: bool = False
    target: str = "copy97"  # copy97 | gbps1300 | copy100 | copy95


REGIMES = [
    Regime("bf16 h7168 24576/32768 live", torch.bfloat16, 7168, 32768, 24576),
    Regime("bf16 h2880 (not /1024)", torch.bfloat16, 2880, 32768, 24576),
    Regime("fp8 (uint8) h7168", torch.uint8, 7168, 32768, 24576),
    Regime("224-byte rows (MXFP8 scales)", torch.uint8, 224, 32768, 24576, target="gbps1300"),
    Regime("1000 live rows bf16 h7168", torch.bfloat16, 7168, 32768, 1000, target="copy100"),
    Regime("host spill bf16 h7168", torch.bfloat16, 7168, 8192, 6144, True, target="copy95"),
]


class Timer:
    """Median milliseconds of ``fn`` over ``reps`` calls, each after ``setup`` and an L2 flush."""

    def __init__(self, reps: int):
        self.reps = reps
        self.flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")

    def __call__(self, fn, setup=None) -> float:
        for _ in range(3):  # warm-up: JIT compiles, allocator
            if setup:
                setup()
            fn()
        times = []
        for _ in range(self.reps):
            if setup:
                setup()
            self.flush.zero_()  # also keeps the GPU busy while the host enqueues fn
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            times.append((start, end))
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in times)


def gbps(nbytes: int, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e9


class Case:
    """One regime's tensors: source, destination, our pool/record, MCore's buffer/tensor."""

    def __init__(self, regime: Regime, mcore):
        r = regime
        self.regime = r
        self.row_bytes = r.hidden * torch.empty(0, dtype=r.dtype).element_size()
        self.src = torch.randint(
            0, 256, (r.capacity_rows, self.row_bytes), dtype=torch.uint8, device="cuda"
        ).view(r.dtype)
        self.dst = torch.empty_like(self.src)
        self.live = torch.tensor([r.live_rows], dtype=torch.int64, device="cuda")
        # Host spill: a one-page device tier (too small for the record) and a host tier.
        cuda_rows, host_rows = (
            (PAGE_SIZE, r.capacity_rows) if r.host_spill else (r.capacity_rows, 0)
        )
        self.pool = PagePool.for_rows(self.row_bytes, PAGE_SIZE, cuda_rows, host_rows, "cuda")
        self.record = PageRecord.new(r.capacity_rows, self.row_bytes, PAGE_SIZE, self.live)
        self.mcore = mcore
        if mcore is not None:
            flags = [torch.zeros(1, dtype=torch.int64, device="cuda") for _ in range(2)]
            self.buffer = mcore.PagedStashBuffer(
                cuda_rows,
                r.hidden,
                PAGE_SIZE,
                torch.device("cuda"),
                *flags,
                r.dtype,
                num_tokens_host=host_rows,
            )
        self.moved = 2 * r.live_rows * self.row_bytes  # bytes read + written

    # Ours.
    def reset(self):
        self.pool.reset()
        self.pool.flags.reset()

    def stash(self, max_ctas=None):
        kernels.stash(self.src, self.record, self.pool, backend="cuda", max_ctas=max_ctas)

    def reload(self, max_ctas=None):
        kernels.reload(self.dst, self.record, self.pool, backend="cuda", max_ctas=max_ctas)

    def reset_and_stash(self):
        self.reset()
        self.stash()

    # Megatron-Core, driven as PagedTensor.offload_to_stash / reload_from_stash drive it.
    def mcore_reset(self):
        self.buffer.reset()
        self.buffer.overflow.zero_()
        self.paged = self.mcore.PagedTensor(
            self.src,
            num_tokens_tensor=self.live,
            max_num_tokens=self.regime.capacity_rows,
            hidden_size=self.regime.hidden,
            page_size=PAGE_SIZE,
        )

    def mcore_stash(self):
        self.paged.offload_to_stash(self.buffer)

    def mcore_reset_and_stash(self):
        self.mcore_reset()
        self.mcore_stash()
        self.paged._tensor = self.dst

    def mcore_reload(self):
        self.paged.reload_from_stash(self.buffer)

    # torch.Tensor.copy_ of the same live bytes (device->pinned / pinned->device for host spill).
    def copy_fns(self):
        n = self.regime.live_rows
        if not self.regime.host_spill:
            return (lambda: self.dst[:n].copy_(self.src[:n]),) * 2
        pinned = torch.empty_like(self.src, device="cpu", pin_memory=True)
        return (
            lambda: pinned[:n].copy_(self.src[:n], non_blocking=True),
            lambda: self.dst[:n].copy_(pinned[:n], non_blocking=True),
        )


def verify(case: Case) -> None:
    """The figures are meaningless if the copy is wrong: check one round trip first."""
    case.dst.view(torch.uint8).fill_(0)
    case.reset_and_stash()
    case.reload()
    n = case.regime.live_rows
    torch.cuda.synchronize()
    if not torch.equal(case.dst[:n].view(torch.uint8), case.src[:n].view(torch.uint8)):
        raise RuntimeError(f"{case.regime.name}: reload did not restore the stashed rows")
    if case.pool.flags.read()["overflow"]:
        raise RuntimeError(f"{case.regime.name}: the pool overflowed")


def target_met(regime: Regime, ours: float, copy: float) -> tuple[str, bool]:
    if regime.target == "gbps1300":
        return ">= 1300 GB/s", ours >= 1300
    if regime.target == "copy100":
        return ">= copy_", ours >= copy
    share = 0.97 if regime.target == "copy97" else 0.95
    return f">= {share:.0%} of copy_", ours >= share * copy


def bench_regime(regime: Regime, timer: Timer, mcore) -> dict:
    case = Case(regime, mcore)
    verify(case)
    copy_out, copy_in = case.copy_fns()
    ms = {
        "ours_stash": timer(case.stash, case.reset),
        "ours_reload": timer(case.reload, case.reset_and_stash),
        "copy_stash_direction": timer(copy_out),
        "copy_reload_direction": timer(copy_in),
    }
    if mcore is not None:
        ms["mcore_stash"] = timer(case.mcore_stash, case.mcore_reset)
        ms["mcore_reload"] = timer(case.mcore_reload, case.mcore_reset_and_stash)
    rates = {k: gbps(case.moved, v) for k, v in ms.items()}
    row = {
        "regime": regime.name,
        "dtype": str(regime.dtype).removeprefix("torch."),
        "hidden": regime.hidden,
        "row_bytes": case.row_bytes,
        "capacity_rows": regime.capacity_rows,
        "live_rows": regime.live_rows,
        "bytes_read_plus_written": case.moved,
        "ms": ms,
        "gbps": rates,
    }
    for op in ("stash", "reload"):
        label, ok = target_met(regime, rates[f"ours_{op}"], rates[f"copy_{op}_direction"])
        row[f"target_{op}"] = {"target": label, "met": ok}
    del case
    torch.cuda.empty_cache()
    return row


def bench_max_ctas(timer: Timer, sweep: list[int]) -> list[dict]:
    """Copy time vs max_ctas, and a bf16 8192^3 GEMM's time with paging on another stream."""
    case = Case(REGIMES[0], None)
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    gemm_alone = timer(lambda: a @ b)
    paging_stream = torch.cuda.Stream()
    rows = []
    for max_ctas in sweep:
        stash_ms = timer(lambda m=max_ctas: case.stash(m), case.reset)
        concurrent = []
        for _ in range(5):
            case.reset()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(paging_stream):
                for _ in range(8):  # stash + reload cycles keep the rings balanced
                    case.stash(max_ctas)
                    case.reload(max_ctas)
            start.record()
            a @ b
            end.record()
            torch.cuda.synchronize()
            concurrent.append(start.elapsed_time(end))
        gemm_with = statistics.median(concurrent)
        rows.append(
            {
                "max_ctas": max_ctas,
                "stash_ms": stash_ms,
                "stash_gbps": gbps(case.moved, stash_ms),
                "gemm_alone_ms": gemm_alone,
                "gemm_with_paging_ms": gemm_with,
                "gemm_slowdown": gemm_with / gemm_alone,
            }
        )
    return rows


def print_table(rows: list[dict], sweep: list[dict]) -> None:
    cols = ("ours_stash", "ours_reload", "mcore_stash", "mcore_reload", "copy_stash_direction")
    print(
        f"{'regime':<30} "
        + " ".join(f"{c.replace('_direction', ''):>13}" for c in cols)
        + "  targets (stash/reload)"
    )
    for row in rows:
        figs = " ".join(
            f"{row['gbps'][c]:>13.0f}" if c in row["gbps"] else f"{'n/a':>13}" for c in cols
        )
        marks = "/".join(
            "PASS" if row[f"target_{op}"]["met"] else "MISS" for op in ("stash", "reload")
        )
        print(f"{row['regime']:<30} {figs}  {row['target_stash']['target']}: {marks}")
    print("GB/s, bytes read + written.\n")
    print(
        f"{'max_ctas':>8} {'stash GB/s':>11} {'GEMM ms':>9} {'GEMM+paging ms':>15} {'slowdown':>9}"
    )
    for s in sweep:
        print(
            f"{s['max_ctas']:>8} {s['stash_gbps']:>11.0f} {s['gemm_alone_ms']:>9.3f} "
            f"{s['gemm_with_paging_ms']:>15.3f} {s['gemm_slowdown']:>9.3f}"
        )


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = [
        ("ours_stash", "page-tile stash"),
        ("ours_reload", "page-tile reload"),
        ("mcore_stash", "MCore stash"),
        ("mcore_reload", "MCore reload"),
        ("copy_stash_direction", "copy_"),
    ]
    fig, ax = plt.subplots(figsize=(13, 5))
    width = 0.8 / len(series)
    for i, (key, label) in enumerate(series):
        values = [row["gbps"].get(key, 0.0) for row in rows]
        ax.bar([x + i * width for x in range(len(rows))], values, width, label=label)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(rows))])
    ax.set_xticklabels([row["regime"] for row in rows], rotation=15, ha="right", fontsize=8)
    ax.set_yscale("log")  # host spill runs ~40x below the device-memory regimes
    ax.set_ylabel("GB/s (read + written), log scale")
    ax.set_title(f"Paged stash kernels on {torch.cuda.get_device_name()}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def load_mcore():
    try:
        from megatron.core.transformer.moe import paged_stash
    except Exception as exc:  # noqa: BLE001 - the comparison is optional, the reason is printed
        print(f"Megatron-Core kernels unavailable ({exc}); their columns read n/a")
        return None
    return paged_stash


def main(argv: list[str] | None = None) -> int:
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    default_out = RESULTS / f"kernels_{(gpu or 'none').replace(' ', '_')}.json"
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=default_out, help="JSON path (PNG beside it)")
    parser.add_argument("--reps", type=int, default=30, help="timed calls per figure")
    parser.add_argument("--max-ctas", default="64,256,2048", help="the max_ctas sweep")
    args = parser.parse_args(argv)
    if gpu is None:
        print("error: the kernel benchmark needs a CUDA device")
        return 2
    import triton

    mcore = load_mcore()
    timer = Timer(args.reps)
    rows = [bench_regime(r, timer, mcore) for r in REGIMES]
    sweep = bench_max_ctas(timer, [int(v) for v in args.max_ctas.split(",")])
    print_table(rows, sweep)
    result = {
        "gpu": gpu,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "megatron_core": _mcore_version() if mcore is not None else None,
        "page_size": PAGE_SIZE,
        "default_max_ctas": kernels.MAX_CTAS,
        "method": "median of per-call CUDA events, L2 flushed before each call, "
        f"{args.reps} calls; GB/s = (bytes read + bytes written) / time",
        "regimes": rows,
        "max_ctas_sweep": sweep,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    png = args.out.with_suffix(".png")
    plot(rows, png)
    print(f"wrote {args.out} and {png}")
    return 0


def _mcore_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("megatron-core")
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    raise SystemExit(main())
