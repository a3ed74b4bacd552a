"""Offload transfers on one device: pinned ``copy_`` (the copy engine) vs the offload paths of
megatron-paging, alone and beside a GEMM.

* whole tensors (the dense modules): one DMA ``copy_`` into / out of a pinned arena range — the
  path :mod:`megatron_paging.pages.offload` uses;
* live rows (the experts) by the page-tile kernels into / out of a host-only pool's pinned tier,
  GB/s against the kernels' grid (``--ctas``; the runtime uses 4 CTAs for D2H and 8 for H2D);
* live rows with the copy engine's prefix (what the runtime does when
  ``CUDA_DEVICE_MAX_CONNECTIONS`` > 1): the first rows by one DMA copy into a prefix arena, the
  live rows past them by the kernels — with every live row in the prefix (one expert-parallel
  rank: every step routes the same rows) and with half of them;
* beside a bf16 8192^3 GEMM loop on the compute stream, D2H and H2D: the GEMM's slowdown and
  the transfer's rate when the copy engine moves the bytes vs when the SM kernel does.

GB/s count the bytes that cross PCIe once (D2H or H2D), the unit ``copy_`` is measured in.
Every arm is checked byte for byte before it is timed. Prints a table and the targets (>= 95%
of pinned ``copy_``), writes JSON (``--out``) and a PNG beside it.
Run: ``python benchmarks/bench_offload.py``.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch
from common import (
    CudaTimer,
    default_out,
    figure,
    gbps,
    grid_bound_arg,
    header,
    print_table,
    require_gpu,
    write,
)

from megatron_paging import kernels
from megatron_paging.config import DEFAULT_MAX_CTAS, PagingConfig
from megatron_paging.pages.offload import HostArena, OffloadPools
from megatron_paging.pages.pool import PagePool, PagePools
from megatron_paging.pages.record import PageRecord
from megatron_paging.runtime.transfers import PagedHandle
from megatron_paging.runtime.transfers import Transfers as RuntimeTransfers

PAGE_SIZE = 64
HIDDEN = 7168
CAPACITY, LIVE = 16384, 12288  # bf16 rows: 176 MiB live of a 235 MiB capacity buffer
DENSE_SHAPE = (8192, 8192)  # bf16: 128 MiB, a [s*b, h] attention input


class Transfers:
    """The tensors of one run: a capacity buffer with live rows, a dense tensor, their homes."""

    def __init__(self):
        dev = torch.device("cuda")
        self.rows_src = torch.randn(CAPACITY, HIDDEN, dtype=torch.bfloat16, device=dev)
        self.rows_dst = torch.zeros_like(self.rows_src)
        row_bytes = HIDDEN * 2
        self.pool = PagePool.for_rows(row_bytes, PAGE_SIZE, 0, LIVE, dev)
        live = torch.tensor([LIVE], dtype=torch.int64, device=dev)
        self.record = PageRecord.new(CAPACITY, row_bytes, PAGE_SIZE, live)
        self.kernel = kernels.resolve_backend("cuda", dev)
        kernels.prepare([self.pool], "cuda")
        self.live_bytes = LIVE * row_bytes
        self.dense = torch.randn(*DENSE_SHAPE, dtype=torch.bfloat16, device=dev)
        self.dense_back = torch.empty_like(self.dense)
        self.dense_bytes = self.dense.numel() * 2
        self.arena = HostArena(self.dense_bytes, dev)
        self.start = self.arena.alloc(self.dense_bytes)
        self.pinned = torch.empty(self.dense_bytes, dtype=torch.uint8, pin_memory=True)

    # rows: the page-tile kernels into the host tier
    def reset(self):
        self.pool.reset()
        self.pool.flags.reset()

    def rows_out(self, max_ctas):
        self.kernel.copy(False, self.rows_src, self.record, self.pool, max_ctas)

    def rows_in(self, max_ctas):
        self.kernel.copy(True, self.rows_dst, self.record, self.pool, max_ctas)

    def reset_and_rows_out(self, max_ctas=DEFAULT_MAX_CTAS):
        self.reset()
        self.rows_out(max_ctas)

    # whole: one DMA copy into the arena range
    def dense_out(self):
        self.arena.view(self.start, self.dense_bytes).copy_(
            self.dense.view(-1).view(torch.uint8), non_blocking=True
        )

    def dense_in(self):
        self.dense_back.view(-1).view(torch.uint8).copy_(
            self.arena.view(self.start, self.dense_bytes), non_blocking=True
        )

    def check(self):
        self.reset_and_rows_out()
        self.rows_in(DEFAULT_MAX_CTAS)
        self.dense_out()
        self.dense_in()
        torch.cuda.synchronize()
        live = slice(0, LIVE)
        assert torch.equal(self.rows_dst[live], self.rows_src[live]), "rows round trip differs"
        assert torch.equal(self.dense_back, self.dense), "dense round trip differs"
        assert not self.pool.flags.read()["overflow"]


class PrefixPath:
    """Live rows through the runtime's prefix split: ``prefix_rows`` first rows by the copy
    engine, the rest by the kernels (one stream, in that order, as the paging stream runs them).
    ``backend``: the kernel backend (``"cuda"`` here; the CPU test uses ``"reference"``)."""

    def __init__(self, src: torch.Tensor, dst: torch.Tensor, live_rows: int, prefix_rows: int,
                 backend: str = "cuda"):
        dev, (capacity, row_bytes) = src.device, (src.shape[0], src[0].numel() * src.itemsize)
        self.src, self.dst, self.live_rows, self.prefix_rows = src, dst, live_rows, prefix_rows
        pools = PagePools(PAGE_SIZE, dev)
        self.pool = pools.add(row_bytes, 0, max(live_rows - prefix_rows, PAGE_SIZE))
        self.kernel = kernels.resolve_backend(backend, dev)
        kernels.prepare([self.pool], backend)
        offload = OffloadPools(pools, None, prefix_rows={(capacity, row_bytes): prefix_rows},
                               prefix_arena=HostArena(prefix_rows * row_bytes, dev))
        defaults = PagingConfig()
        self.grids = (defaults.offload_d2h_max_ctas, defaults.offload_h2d_max_ctas)
        self.runtime = RuntimeTransfers(None, self.kernel, None, None, offload, None,
                                        defaults.grid_bound, self.grids)
        live = torch.tensor([live_rows], dtype=torch.int64, device=dev)
        prefix, rest_rows, rest_live = self.runtime.split_prefix(capacity, row_bytes, live)
        assert prefix == prefix_rows, (prefix, prefix_rows)
        record = PageRecord.new(rest_rows, row_bytes, PAGE_SIZE, rest_live)
        self.handle = PagedHandle(id=0, record=record, shape=src.shape, dtype=src.dtype,
                                  device=dev, wgrad_only=False, source=None, offload="rows",
                                  prefix_rows=prefix_rows)
        self.nbytes = prefix_rows * row_bytes
        self.live_bytes = live_rows * row_bytes

    def reset(self):
        self.runtime.offload.reset()
        self.pool.flags.reset()
        self.handle.prefix_range = (self.runtime.offload.prefix_arena.alloc(self.nbytes),
                                    self.nbytes)

    def _move(self, reload: bool):
        self.runtime._copy_prefixed(self.kernel.copy, reload, self.handle,
                                    self.dst if reload else self.src, self.pool,
                                    self.grids[1 if reload else 0])

    def rows_out(self):
        self._move(False)

    def rows_in(self):
        self._move(True)

    def reset_and_rows_out(self):
        self.reset()
        self.rows_out()

    def check(self):
        self.dst.zero_()
        self.reset_and_rows_out()
        self.rows_in()
        if self.src.is_cuda:
            torch.cuda.synchronize()
        live = slice(0, self.live_rows)
        assert torch.equal(self.dst[live], self.src[live]), (
            f"prefix {self.prefix_rows}: rows round trip differs")
        assert not self.pool.flags.read()["overflow"]


def bench_prefix(t: Transfers, timer: CudaTimer) -> list[dict]:
    rows = []
    for prefix_rows in (LIVE, LIVE // 2):
        path = PrefixPath(t.rows_src, t.rows_dst, LIVE, prefix_rows)
        path.check()
        out_ms = timer(path.rows_out, path.reset)
        in_ms = timer(path.rows_in, path.reset_and_rows_out)
        rows.append({"prefix_rows": prefix_rows, "live_rows": LIVE,
                     "kernel_max_ctas": {"d2h": path.grids[0], "h2d": path.grids[1]},
                     "d2h_gbps": gbps(t.live_bytes, out_ms),
                     "h2d_gbps": gbps(t.live_bytes, in_ms)})
    return rows


def bench_alone(t: Transfers, timer: CudaTimer, sweep: list[int]) -> dict:
    pinned, src = t.pinned, t.dense.view(-1).view(torch.uint8)
    copy_out = timer(lambda: pinned.copy_(src, non_blocking=True))
    copy_in = timer(lambda: src.copy_(pinned, non_blocking=True))
    result = {
        "copy_d2h_gbps": gbps(t.dense_bytes, copy_out),
        "copy_h2d_gbps": gbps(t.dense_bytes, copy_in),
        "whole_d2h_gbps": gbps(t.dense_bytes, timer(t.dense_out)),
        "whole_h2d_gbps": gbps(t.dense_bytes, timer(t.dense_in)),
        "rows": [],
    }
    for max_ctas in sweep:
        out_ms = timer(lambda m=max_ctas: t.rows_out(m), t.reset)
        in_ms = timer(lambda m=max_ctas: t.rows_in(m), t.reset_and_rows_out)
        result["rows"].append({
            "max_ctas": max_ctas,
            "d2h_gbps": gbps(t.live_bytes, out_ms),
            "h2d_gbps": gbps(t.live_bytes, in_ms),
        })
    return result


def _beside_gemm(launch, reset, gemm, side, reps: int = 5) -> tuple[float, float]:
    """(GEMM ms, transfer ms) when ``launch`` runs on ``side`` while the GEMM loop runs."""
    gemm_ms, move_ms = [], []
    for _ in range(reps):
        reset()
        torch.cuda.synchronize()
        events = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        with torch.cuda.stream(side):
            events[2].record()
            launch()
            events[3].record()
        events[0].record()
        gemm()
        events[1].record()
        torch.cuda.synchronize()
        gemm_ms.append(events[0].elapsed_time(events[1]))
        move_ms.append(events[2].elapsed_time(events[3]))
    return statistics.median(gemm_ms), statistics.median(move_ms)


def bench_beside_gemm(t: Transfers, timer: CudaTimer, grids: list[int]) -> dict:
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")

    def gemm():
        for _ in range(6):  # ~ the time one transfer takes
            a @ b

    alone = timer(gemm)
    side = torch.cuda.Stream()
    arms = {}
    # Both directions: the runtime's reload grid differs from its offload grid (PagingConfig's
    # offload_d2h_max_ctas / offload_h2d_max_ctas), so each needs its own GEMM interference.
    for direction, dense, rows, reset in (("d2h", t.dense_out, t.rows_out, t.reset),
                                          ("h2d", t.dense_in, t.rows_in, t.reset_and_rows_out)):
        g, m = _beside_gemm(dense, lambda: None, gemm, side)
        arms[f"copy_engine_{direction}"] = {"gemm_ms": g, "gemm_slowdown": g / alone,
                                            "transfer_gbps": gbps(t.dense_bytes, m)}
        for max_ctas in grids:
            g, m = _beside_gemm(lambda c=max_ctas, f=rows: f(c), reset, gemm, side)
            arms[f"sm_kernel_{direction}_ctas{max_ctas}"] = {
                "gemm_ms": g, "gemm_slowdown": g / alone,
                "transfer_gbps": gbps(t.live_bytes, m),
            }
    return {"gemm_alone_ms": alone, "arms": arms}


def plot(result):
    def draw(png: Path):
        fig = figure(11, 4.5)
        ax1, ax2 = fig.subplots(1, 2)
        rows = result["alone"]["rows"]
        ctas = [r["max_ctas"] for r in rows]
        ax1.plot(ctas, [r["d2h_gbps"] for r in rows], "o-", label="live rows D2H (SM kernel)")
        ax1.plot(ctas, [r["h2d_gbps"] for r in rows], "s-", label="live rows H2D (SM kernel)")
        ax1.axhline(result["alone"]["copy_d2h_gbps"], ls="--", c="k", label="pinned copy_ D2H")
        ax1.axhline(result["alone"]["copy_h2d_gbps"], ls=":", c="k", label="pinned copy_ H2D")
        ax1.set_xscale("log", base=2)
        ax1.set_xlabel("max_ctas")
        ax1.set_ylabel("GB/s (bytes over PCIe)")
        ax1.legend(fontsize=7)
        arms = result["beside_gemm"]["arms"]
        ax2.bar(range(len(arms)), [a["gemm_slowdown"] for a in arms.values()])
        ax2.set_xticks(range(len(arms)), list(arms), rotation=30, fontsize=7, ha="right")
        ax2.axhline(1.0, c="k", lw=0.5)
        ax2.set_ylabel("GEMM time / alone")
        fig.suptitle(f"offload transfers, {result['gpu']} ({result['commit']})")
        fig.tight_layout()
        fig.savefig(png)

    return draw


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON path, PNG beside it (default: "
                        "benchmarks/results/offload_<gpu>.json)")
    parser.add_argument("--ctas", type=grid_bound_arg, nargs="+",
                        default=[1, 2, 4, 8, 16, 32, 132, 2048],
                        help="grids of the live-row kernels measured alone (must include the "
                        "runtime's 4 and 8)")
    parser.add_argument("--gemm-ctas", type=grid_bound_arg, nargs="+", default=[2, 4, 8, 16, 132],
                        help="grids of the SM kernel beside the GEMM, both directions")
    args = parser.parse_args(argv)
    require_gpu("offload")
    t = Transfers()
    t.check()
    timer = CudaTimer(reps=10)
    result = header("offload", hidden=HIDDEN, capacity_rows=CAPACITY, live_rows=LIVE,
                    dense_shape=list(DENSE_SHAPE), page_size=PAGE_SIZE)
    result["alone"] = bench_alone(t, timer, args.ctas)
    result["prefix"] = bench_prefix(t, timer)
    result["beside_gemm"] = bench_beside_gemm(t, timer, args.gemm_ctas)
    alone = result["alone"]
    # The rows target is judged at the default grids (PagingConfig: D2H 4, H2D 8 CTAs).
    defaults = PagingConfig()
    d2h_ctas, h2d_ctas = defaults.offload_d2h_max_ctas, defaults.offload_h2d_max_ctas
    by_ctas = {r["max_ctas"]: r for r in alone["rows"]}
    if d2h_ctas not in by_ctas or h2d_ctas not in by_ctas:
        raise SystemExit(f"--ctas must include the default grids {d2h_ctas} and {h2d_ctas}")
    result["targets"] = {
        "whole_vs_copy": {
            "target": ">= 95% of pinned copy_ (D2H and H2D)",
            "d2h": alone["whole_d2h_gbps"] / alone["copy_d2h_gbps"],
            "h2d": alone["whole_h2d_gbps"] / alone["copy_h2d_gbps"],
        },
        "rows_vs_copy": {
            "target": ">= 95% of pinned copy_ (D2H and H2D)",
            "max_ctas": {"d2h": d2h_ctas, "h2d": h2d_ctas},
            "d2h": by_ctas[d2h_ctas]["d2h_gbps"] / alone["copy_d2h_gbps"],
            "h2d": by_ctas[h2d_ctas]["h2d_gbps"] / alone["copy_h2d_gbps"],
        },
    }
    whole_prefix = next(r for r in result["prefix"] if r["prefix_rows"] == LIVE)
    result["targets"]["rows_by_prefix_vs_copy"] = {
        "target": ">= 95% of pinned copy_ (D2H and H2D); every live row in the prefix",
        "prefix_rows": LIVE,
        "d2h": whole_prefix["d2h_gbps"] / alone["copy_d2h_gbps"],
        "h2d": whole_prefix["h2d_gbps"] / alone["copy_h2d_gbps"],
    }
    for name in ("whole_vs_copy", "rows_vs_copy", "rows_by_prefix_vs_copy"):
        target = result["targets"][name]
        target["met"] = min(target["d2h"], target["h2d"]) >= 0.95
    print(f"pinned copy_: D2H {alone['copy_d2h_gbps']:.1f} GB/s, H2D {alone['copy_h2d_gbps']:.1f}")
    print(f"whole (arena DMA): D2H {alone['whole_d2h_gbps']:.1f}, "
          f"H2D {alone['whole_h2d_gbps']:.1f}")
    print_table(["max_ctas", "rows D2H GB/s", "rows H2D GB/s"],
                [[r["max_ctas"], r["d2h_gbps"], r["h2d_gbps"]] for r in alone["rows"]])
    for r in result["prefix"]:
        print(f"prefix {r['prefix_rows']:>5} of {LIVE} live rows: D2H {r['d2h_gbps']:.1f}, "
              f"H2D {r['h2d_gbps']:.1f} GB/s")
    beside = result["beside_gemm"]
    print(f"GEMM loop alone {beside['gemm_alone_ms']:.2f} ms; beside a transfer:")
    for name, arm in beside["arms"].items():
        print(f"  {name:<24} GEMM x{arm['gemm_slowdown']:.3f}, "
              f"transfer {arm['transfer_gbps']:.1f} GB/s")
    for name, target in result["targets"].items():
        print(f"target {name}: {target['target']}: {'PASS' if target['met'] else 'MISS'} "
              f"(D2H {target['d2h']:.3f}, H2D {target['h2d']:.3f})")
    write(result, args.out or default_out("offload"), plot(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
