"""The scale benchmark's summary (``bench_scale.py``; no GPU): per arm its peaks and step against
unpaged, parity, what overflows cost; per layout, rank and capacity factor the fastest arm that
fits with paging against the fastest without.

    python benchmarks/bench_scale.py --report-only --out benchmarks/results/scale_h200.json
"""

from __future__ import annotations

import json
import statistics

from common import print_table
from hot_step import rerun_extra
from scale_layouts import ARMS, PARITY_PAIR, RERUN_ARMS, RERUN_PAIRS


def rerun_cost(record: dict) -> dict:
    """What overflows cost a paged arm: the planned overflow rate its pool factor was sized
    for, the steps that overflowed, and where a step reran, its time beyond the median steady
    step and the expected cost per step at the planned rate (rate x that extra / median)."""
    rate = record.get("pool_factor_rate")
    if rate is None:
        return {}
    reports = json.loads(record["report"].get("overflow") or "[]")
    steps = sorted({int(report["step"]) for report in reports})
    times = {int(i): float(ms) for i, ms in (record.get("iteration_ms") or {}).items()}
    median = record.get("median_steady_iteration_ms")
    extra = [times[s] - median for s in steps if s in times and median]
    cost = {"overflow_rate_planned": rate, "overflow_steps": steps}
    if extra:
        cost["rerun_extra_ms"] = statistics.mean(extra)
        cost["expected_rerun_cost"] = rate * statistics.mean(extra) / median
    return cost


def summarize(records: list[dict]) -> list[dict]:
    """Per layout, rank and capacity factor: each arm against unpaged (peaks, step ratio) and,
    for the deterministic paged arm, parity with the deterministic unpaged one (bitwise)."""
    rows = []
    base = {(r["layout"], r["rank"], r["capacity_factor"]): r for r in records
            if r["arm"] == "unpaged" and r["status"] == "ok"}
    parity_base = {(r["layout"], r["rank"], r["capacity_factor"]): r for r in records
                   if r["arm"] == PARITY_PAIR[0] and r["status"] == "ok"}
    twin_of = dict(RERUN_PAIRS)  # overflowing arm -> the twin whose pool holds its hot step
    fits = {(r["layout"], r["rank"], r["capacity_factor"], r["arm"]): r for r in records
            if r["arm"] in twin_of.values() and r["status"] == "ok"}
    for r in records:
        row = {k: r[k] for k in ("layout", "rank", "stage", "arm", "capacity_factor", "status")}
        if r["status"] == "ok":
            rep = r["report"]
            row.update(
                peak_mib=float(rep.get("steady_peak_allocated_mib", "nan")),
                fb_peak_mib=float(rep.get("steady_fb_peak_allocated_mib", "nan")),
                pool_cuda_mib=float(rep.get("pool_cuda_mib", 0)),
                iteration_ms=r["median_steady_iteration_ms"],
            )
            control = base.get((r["layout"], r["rank"], r["capacity_factor"]))
            if control is not None and r is not control:
                row["peak_vs_unpaged"] = row["peak_mib"] / float(
                    control["report"]["steady_peak_allocated_mib"])
                if r["median_steady_iteration_ms"] and control["median_steady_iteration_ms"]:
                    row["step_vs_unpaged"] = (r["median_steady_iteration_ms"]
                                              / control["median_steady_iteration_ms"])
            row["overflow_actions"] = rep.get("overflow_actions")
            if r["arm"] in twin_of:
                twin = fits.get((r["layout"], r["rank"], r["capacity_factor"], twin_of[r["arm"]]))
                if twin is not None:
                    row.update(rerun_extra(r, twin, r.get("pool_factor_rate")))
            elif r["arm"] not in RERUN_ARMS:
                row.update(rerun_cost(r))
            twin = parity_base.get((r["layout"], r["rank"], r["capacity_factor"]))
            if r["arm"] == PARITY_PAIR[1] and twin is not None:
                row["bitwise"] = (r["losses"] == twin["losses"]
                                  and r["grad_checksums"] == twin["grad_checksums"])
        rows.append(row)
    return rows


def pages(arm: str) -> bool:
    """Whether an arm pages expert activations (ours or Megatron-Core's manager)."""
    return "--moe-paged-stash" in ARMS[arm].flags


def fastest_fits(records: list[dict]) -> list[dict]:
    """Per layout, rank and capacity factor: the fastest arm that ran (fits) with paging and the
    fastest without, and how much faster the first is (the second's step / the first's). The
    parity pair and the rerun pairs are controls, not configurations, and are left out."""
    groups: dict[tuple, dict[bool, dict]] = {}
    for r in records:
        if (r["status"] != "ok" or r["arm"] in PARITY_PAIR + RERUN_ARMS or r["arm"] not in ARMS
                or not r.get("median_steady_iteration_ms")):
            continue
        best = groups.setdefault((r["layout"], r["rank"], r["capacity_factor"]), {})
        side = pages(r["arm"])
        if side not in best or (r["median_steady_iteration_ms"]
                                < best[side]["median_steady_iteration_ms"]):
            best[side] = r
    rows = []
    for (layout, rank, factor), best in groups.items():
        row = {"layout": layout, "rank": rank, "capacity_factor": factor}
        for side, name in ((True, "with_paging"), (False, "without_paging")):
            if side in best:
                row[name] = {"arm": best[side]["arm"],
                             "step_ms": best[side]["median_steady_iteration_ms"]}
        if len(best) == 2:
            row["speedup"] = (best[False]["median_steady_iteration_ms"]
                              / best[True]["median_steady_iteration_ms"])
        rows.append(row)
    return rows


def summarize_result(result: dict) -> dict:
    """``result`` (a scale file) with its ``summary`` and ``fastest`` recomputed from its runs."""
    runs = result["runs"]
    return {**result, "summary": summarize(runs), "fastest": fastest_fits(runs)}


def print_summary(result: dict) -> None:
    rows = result.get("summary", [])
    print_table(
        ["layout", "rank", "arm", "cf", "status", "peak MiB", "fb MiB", "x unpaged", "step x",
         "overflow", "rerun cost", "bitwise"],
        [[r["layout"], r["rank"], r["arm"], r["capacity_factor"], r["status"],
          r.get("peak_mib", "-"), r.get("fb_peak_mib", "-"), r.get("peak_vs_unpaged", "-"),
          r.get("step_vs_unpaged", "-"), r.get("overflow_actions", "-"),
          r.get("expected_rerun_cost", "-"), r.get("bitwise", "-")]
         for r in rows],
        floats=".3g",
    )
    for f in result.get("fastest", []):
        paged, other = f.get("with_paging"), f.get("without_paging")
        text = " against ".join(f"{side['arm']} {side['step_ms']:,.0f} ms" for side in
                                (paged, other) if side)
        speed = f": {f['speedup']:.3f}x" if "speedup" in f else ""
        print(f"fastest fit with / without paging, {f['layout']} rank {f['rank']} cf "
              f"{f['capacity_factor']:g}: {text}{speed}", flush=True)
    print("step times are compute only (collectives emulated)", flush=True)
