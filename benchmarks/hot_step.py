"""One hot step, to time what an overflow rerun costs (bench_scale.py's ``paged.hot_step`` pair).

A paged arm of the scale table gets the plan's pool factor for 1e-2 overflowing steps, so in a
five-step run no step overflows and the cost of a rerun goes unmeasured. This module writes a
peer-load trace (``--paging-emulated-load``, megatron_paging.tools.peer_load) that is the run's
own lognormal load draw for draw, except that in iteration :data:`HOT_ITERATION` every EMULATED
peer sends :data:`HOT_ROWS` times the rows (capped at the static block, as always). Each rerun
pair (``scale_layouts.RERUN_PAIRS``) replays it at the parity rank:

* ``paged.hot_step``: the planned pool; the hot step overflows and, under ``rerun``, runs again
  in pools grown to what it needed;
* ``paged.hot_step_fits``: a pool :data:`FITS_POOL_SCALE` times larger; the hot step fits.

Both compute the same rows, so their hot-step times differ by the rerun alone, and the cost per
step at the recommended pool factor is ``rate x that difference / the step time``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

HOT_ITERATION = 4  # Megatron's logged iteration (curr_iteration 3): a steady step
HOT_ROWS = 1.4  # how many times its rows every peer sends in the hot step
FITS_POOL_SCALE = HOT_ROWS * 1.15  # the twin's pool: the hot step's rows and their spread
TRACE_TOKEN = "<hot-step trace>"  # in a recorded launch line, where the trace's path goes


def write_trace(argv: list[str], world_size: int, rank: int, iterations: int, path: Path,
                hot_iteration: int = HOT_ITERATION, hot_rows: float = HOT_ROWS) -> dict:
    """Write the trace for this launch line (its layout, rank, microbatches and load) covering
    ``iterations`` steps; returns its shape fields (not the rows)."""
    from megatron_paging.mcore.grid import route_shape
    from megatron_paging.mcore.plan_inputs import parse_megatron, plan_inputs, quiet
    from megatron_paging.tools.peer_load import TRACE_FORMAT, parse_load

    if not 1 <= hot_iteration <= iterations:
        raise ValueError(f"hot iteration {hot_iteration} is not one of the run's {iterations}")
    with quiet():
        args = parse_megatron(argv, world_size, rank)
        inputs = plan_inputs(args, rank)
    stage = inputs.stages[inputs.requested_stage]
    shape = route_shape(args, rank)  # what the run's start-up checks the trace against
    load = parse_load(args.paging_emulated_load, args.seed)
    moe_layers = [layer.number for chunk in stage.chunks for layer in chunk.layers if layer.moe]
    hot_step = hot_iteration - 1  # the peers key a step by Megatron's curr_iteration

    def rows(step: int, layer: int, microbatch: int, peer: int) -> list[int]:
        drawn = load.rows(shape, step, layer, microbatch, peer)
        scale = hot_rows if step == hot_step else 1.0
        return np.floor(drawn * scale + 0.5).astype(np.int64).tolist()

    # one entry per (step, microbatch), steps 0..iterations-1 in order: the trace never wraps
    layers = {str(layer): [[rows(step, layer, mb, peer) for peer in range(shape.ep)]
                           for step in range(iterations) for mb in range(inputs.microbatches)]
              for layer in moe_layers}
    fields = {"format": TRACE_FORMAT, "num_experts": shape.num_experts, "ep": shape.ep,
              "rank": shape.rank, "tokens_per_peer": shape.tokens, "topk": shape.topk,
              "microbatches_per_step": inputs.microbatches,
              "source": f"{load.name()} (seed {args.seed}), iteration {hot_iteration} "
                        f"x{hot_rows:g}"}
    Path(path).write_text(json.dumps({**fields, "layers": layers}))
    return fields


def rerun_extra(hot: dict, fits: dict, rate: float | None) -> dict:
    """From the two arms' records: the rerun's time (hot-step time of ``hot`` minus that of
    ``fits``) and the expected cost per step at ``rate`` overflowing steps. Measured only when
    ``hot`` overflowed in one step (the monitor's step count, which the record keeps) and
    ``fits`` in none."""
    reports = {key: json.loads(r["report"].get("overflow") or "[]") for key, r in
               (("hot", hot), ("fits", fits))}
    hot_steps = {int(report["step"]) for report in reports["hot"]}
    times = {key: {int(i): float(ms) for i, ms in (r.get("iteration_ms") or {}).items()}
             for key, r in (("hot", hot), ("fits", fits))}
    if (len(hot_steps) != 1 or reports["fits"] or rate is None
            or HOT_ITERATION not in times["hot"] or HOT_ITERATION not in times["fits"]):
        return {"rerun_measured": False, "hot_overflow_steps": sorted(hot_steps),
                "fits_overflow_steps": sorted(int(r["step"]) for r in reports["fits"])}
    steady = [ms for i, ms in times["fits"].items() if i >= 3 and i != HOT_ITERATION]
    step_ms = float(np.median(steady)) if steady else times["fits"][HOT_ITERATION]
    extra = times["hot"][HOT_ITERATION] - times["fits"][HOT_ITERATION]
    return {"rerun_measured": True, "hot_overflow_steps": sorted(hot_steps),
            "rerun_extra_ms": extra, "step_ms": step_ms,
            "overflow_rate_planned": rate, "expected_rerun_cost": rate * extra / step_ms}
