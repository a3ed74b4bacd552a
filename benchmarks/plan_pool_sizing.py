"""Does the plan's recommended pool factor hold its design overflow rate? A check on the CPU.

For each frontier layout (``scale_layouts.py``: its largest-memory rank, paged, capacity factor
2) and the one-GPU example, ``megatron-paging plan`` recommends
``--moe-paged-stash-buffer-size-factor-cuda`` for a design overflow rate (default 1e-3 per step;
``plan/pools.py``: a 4,000-step Monte-Carlo with the line's seed). Here 20,000 further steps are
drawn with ANOTHER seed from the same router-load model (``tools/peer_load.py``'s
``LognormalLoad``) by the plan's own ``plan/pools.simulate``: per step, every MoE layer of the
rank times every microbatch gets its own live rows; the pool holds each record's rows
page-rounded from its forward to its backward, in the order of the rank's pipeline schedule
(Megatron-Core's generators); a step overflows when, at any moment of it, the records alive need
more rows than the device tier has. Target: observed rate <= 2x the design rate. (The tests
check ``simulate``'s per-step need against a brute-force walk of the schedule.)

``--trace T.json`` (a peer-load trace recorded on a GPU, ``tools/peer_load.py``'s format) also
checks the trace target on every config the trace fits: the plan sized from the trace, replayed
in order, must not overflow and must use at most 10 % more pool than the trace's peak live rows
need. Without a trace that target is reported as not run.

    python benchmarks/plan_pool_sizing.py   # -> benchmarks/results/plan_pool_sizing_cpu.json
"""

from __future__ import annotations

import argparse
import datetime
import math
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from portable import dumps  # noqa: E402
from scale_layouts import LAYOUTS  # noqa: E402

if TYPE_CHECKING:
    from megatron_paging.plan.liveness import RecordSchedule

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"
DESIGN_RATE = 1e-3
STEPS = 20_000
SEED = 20_261_204  # the validation draws' seed; the plan's is the line's --seed (1234)
TRACE_MARGIN = 1.10  # the trace target: at most 10 % more pool than the peak live rows need


def pool_rows(peak_records: int, hint: int, factor: float, page: int) -> int:
    """The device tier's rows for ``factor`` (``plan/pools.our_pool_bytes`` at one byte a row)."""
    from megatron_paging.plan.pools import PoolKey, our_pool_bytes

    return our_pool_bytes([PoolKey(1, peak_records)], hint, factor, page)


def lognormal_needs(load, route, block: int, page: int, schedule: RecordSchedule, steps: int,
                    seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(per step the rows needed at its fullest moment, per step the rows of the moment with
    the most records alone) under the load model, ``steps`` drawn with ``seed``: the plan's own
    Monte-Carlo (``plan/pools.simulate``), run once over every moment and once (the same
    draws) over the peak moment."""
    from megatron_paging.plan.pools import LoadModel, simulate

    model = LoadModel(route, block, page, schedule.layers, schedule.alive)
    needs = simulate(load, model, steps, seed)
    at_peak = simulate(load, replace(model, alive=schedule.peak_moment[None]), steps, seed)
    return needs, at_peak


def trace_needs(trace: dict, block: int, page: int, schedule: RecordSchedule) -> np.ndarray:
    """The trace replayed in order (``TraceLoad.rows``'s indexing: step s, microbatch m reads
    entry ``(s x microbatches_per_step + m) mod len``), one value per recorded step."""
    from megatron_paging.plan.pools import page_rows, step_needs

    per_step = trace["microbatches_per_step"]
    totals = {}
    for layer in {layer for _, _, layer in schedule.records}:
        entries = trace["layers"].get(str(layer))
        if entries is None:
            raise ValueError(f"the trace has no layer {layer}")
        rows = np.asarray(entries, dtype=np.int64)  # [entry, peer, local expert]
        totals[layer] = np.minimum(rows.sum(axis=-1), block).sum(axis=-1)
    length = min(len(t) for t in totals.values())
    steps = max(1, length // per_step)
    live = np.empty((steps, len(schedule.records)), np.int64)
    for j, (_, m, layer) in enumerate(schedule.records):
        index = (np.arange(steps) * per_step + m) % len(totals[layer])
        live[:, j] = totals[layer][index]
    return step_needs(page_rows(live, page), schedule.alive)


def configs() -> list[dict]:
    """The one-GPU example (its paging line) and each layout's largest-memory rank, paged at
    capacity factor 2."""
    from plan_measured import EXAMPLE_LINE, PAGING_LINE

    out = [{"name": "one_gpu_example", "argv": [*EXAMPLE_LINE, *PAGING_LINE], "world_size": 1,
            "rank": 0}]
    for layout in LAYOUTS.values():
        rank = layout.ranks[0]
        out.append({"name": layout.name, "world_size": layout.world_size, "rank": rank,
                    "argv": [*layout.flags(rank), "--moe-expert-rank-capacity-factor", "2.0",
                             "--moe-paged-stash"]})
    return out


def check(config: dict, design_rate: float, steps: int, seed: int, trace_path: str | None,
          plan_steps: int = 4000) -> dict:
    """One config: the plan's factor for ``design_rate``, its overflows over ``steps`` fresh
    steps, and (given a trace that fits) the trace target."""
    from megatron_paging.mcore.plan_inputs import parse_megatron, plan_inputs, quiet
    from megatron_paging.plan import shapes as S
    from megatron_paging.plan.arms import hint_rows, pool_keys
    from megatron_paging.plan.liveness import record_schedule
    from megatron_paging.plan.model import build_plan
    from megatron_paging.plan.pools import our_pool_bytes, page_rows
    from megatron_paging.tools.peer_load import LognormalLoad, RouteShape, TraceLoad, parse_load

    with quiet():
        inputs = plan_inputs(parse_megatron(config["argv"], config["world_size"],
                                            config["rank"]), config["rank"])
    started = time.perf_counter()
    plan = build_plan(inputs, rates=(design_rate,), steps=plan_steps)
    plan_seconds = time.perf_counter() - started
    stage = next(s for s in inputs.stages if s.pipeline_rank == plan.pipeline_rank)
    if inputs.paging.hold_last_slot:
        raise ValueError(f"{config['name']}: --paging-hold-last-slot is not simulated here")
    model, par, page = inputs.model, inputs.parallel, inputs.paging.page_size
    d = S.dims(model, par)
    schedule = record_schedule(stage.chunks, stage.ops)
    hint = page_rows(hint_rows(model, d), page)
    advice = next(r for r in plan.pools.rows if r.rate == design_rate)
    factor = advice.cuda_factor  # the flag value the plan prints (3 decimals)
    rows = pool_rows(schedule.peak_records, hint, factor, page)
    keys = pool_keys(model, d, schedule.peak_records, False)
    route = RouteShape(tokens=d.stream_tokens, topk=model.topk, num_experts=model.num_experts,
                       ep=par.ep, rank=stage.ep_rank)
    load = parse_load(inputs.load, seed)
    if not isinstance(load, LognormalLoad):
        raise ValueError(f"{config['name']}: the line's load {inputs.load} is not a load model")
    started = time.perf_counter()
    needs, at_peak = lognormal_needs(load, route, d.block, page, schedule, steps, seed)
    sim_seconds = time.perf_counter() - started
    overflows = int(np.count_nonzero(needs > rows))
    rate = overflows / steps
    result = {
        "name": config["name"], "world_size": config["world_size"], "rank": config["rank"],
        "pipeline_stage": plan.pipeline_rank, "flags": config["argv"],
        "load": load.name(), "ep": par.ep, "ep_rank": stage.ep_rank, "page_rows": page,
        "tokens_per_peer": d.stream_tokens, "topk": model.topk, "block_rows": d.block,
        "records_per_step": len(schedule.records), "records_at_peak": schedule.peak_records,
        "schedule_moments": int(schedule.alive.shape[0]),
        "design": {"rate": design_rate, "cuda_factor": factor, "estimate": advice.method,
                   "plan_steps": plan.pools.steps, "plan_seed": plan.pools.seed},
        "pool_rows": rows, "pool_bytes": our_pool_bytes(keys, hint, factor, page),
        "pool_mib": round(our_pool_bytes(keys, hint, factor, page) / 2**20, 1),
        "hint_rows_at_peak": schedule.peak_records * hint,
        "steps": steps, "seed": seed,
        "needed_rows": {"mean": float(needs.mean()), "max": int(needs.max()),
                        "p999": float(np.quantile(needs, 0.999))},
        "overflow_steps": overflows, "observed_rate": rate,
        "overflow_steps_at_peak_moment_only": int(np.count_nonzero(at_peak > rows)),
        "target": f"observed rate <= {2 * design_rate:g} (2x design)",
        "verdict": "PASS" if rate <= 2 * design_rate else "MISS",
        "seconds": {"plan": round(plan_seconds, 2), "simulation": round(sim_seconds, 2)},
    }
    if par.ep == 1:
        result["note"] = ("EP 1: every route stays on this rank, so the live rows are the same "
                          "each step and the pool never overflows at factor >= 1")
    result["trace"] = {"status": "not run: needs a GPU-recorded peer-load trace (--trace)"}
    if trace_path is not None:
        trace = TraceLoad(trace_path)
        try:
            trace.check(route)
        except ValueError as error:
            result["trace"] = {"status": f"not run: {error}", "path": trace_path}
            return result
        traced = build_plan(inputs, rates=(design_rate,), steps=plan_steps, load=trace_path)
        t_factor = next(r for r in traced.pools.rows if r.rate == design_rate).cuda_factor
        t_rows = pool_rows(schedule.peak_records, hint, t_factor, page)
        t_needs = trace_needs(trace.trace, d.block, page, schedule)
        peak = int(t_needs.max())
        over = int(np.count_nonzero(t_needs > t_rows))
        ratio = t_rows / peak if peak else math.inf
        result["trace"] = {
            "status": "run", "path": trace_path, "source": trace.trace.get("source", ""),
            "cuda_factor": t_factor, "pool_rows": t_rows, "replayed_steps": int(len(t_needs)),
            "peak_needed_rows": peak, "pool_over_peak": ratio, "overflow_steps": over,
            "target": "no overflow with pool <= 1.10x the peak live rows' need",
            "verdict": "PASS" if over == 0 and ratio <= TRACE_MARGIN else "MISS",
        }
    return result


def git_commit() -> str:
    """HEAD, with ``+dirty`` when tracked files differ from it (the run used uncommitted code)."""
    out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True, cwd=ROOT).stdout.strip()
    return (out.stdout.strip() or "unknown") + ("+dirty" if dirty else "")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", nargs="+", default=None,
                        help="which configs (default: one_gpu_example and every layout)")
    parser.add_argument("--design-rate", type=float, default=DESIGN_RATE)
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--seed", type=int, default=SEED,
                        help="the validation draws' seed (must differ from the plan's)")
    parser.add_argument("--trace", default=None, help="a GPU-recorded peer-load trace (.json)")
    parser.add_argument("--out", type=Path, default=RESULTS / "plan_pool_sizing_cpu.json")
    args = parser.parse_args(argv)
    from megatron_paging.plan.pools import STEP_CHUNK

    started = time.perf_counter()
    chosen = [c for c in configs() if args.configs is None or c["name"] in args.configs]
    results = []
    for config in chosen:
        r = check(config, args.design_rate, args.steps, args.seed, args.trace)
        if r["seed"] == r["design"]["plan_seed"]:
            raise SystemExit("the validation seed equals the plan's: pass another --seed")
        results.append(r)
        trace = r["trace"]
        print(f"{r['name']:<16} factor {r['design']['cuda_factor']:.3f} "
              f"({r['design']['estimate']}), pool {r['pool_mib']:.1f} MiB "
              f"({r['pool_rows']} rows, {r['records_at_peak']} records at the peak); "
              f"{r['overflow_steps']}/{r['steps']} steps overflow = {r['observed_rate']:.2e} "
              f"vs design {args.design_rate:g}: {r['verdict']}"
              + (f"; trace: {trace['verdict']}" if trace["status"] == "run" else "")
              + f" [{time.perf_counter() - started:.0f} s]", flush=True)
    result = {
        "benchmark": "plan_pool_sizing",
        "device": "cpu",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "what": __doc__.split("\n\n")[1].replace("\n", " "),
        "params": {"design_rate": args.design_rate, "steps": args.steps,
                   "validation_seed": args.seed, "chunk": STEP_CHUNK, "trace": args.trace},
        "configs": results,
        "seconds": round(time.perf_counter() - started, 1),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(dumps(result))
    print(f"wrote {args.out} ({result['seconds']} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
