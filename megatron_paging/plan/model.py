"""The plan of one rank: every arm's memory (:mod:`.arms`) and the pool advice (:mod:`.pools`).

:class:`PlanInputs` is everything the model reads, in plain Python:
:mod:`megatron_paging.mcore.plan_inputs` fills it from a launch line, tests build it by hand.
:func:`build_plan` picks
the rank (the pipeline stage whose as-launched arm peaks highest, unless one was asked for),
evaluates every arm there and sizes the pools by Monte-Carlo.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np

from megatron_paging.plan import shapes as S
from megatron_paging.plan.arms import (
    ARMS,
    CONSTANTS,
    ArmMemory,
    Constants,
    PagingSettings,
    evaluate,
    hint_rows,
    pool_keys,
)
from megatron_paging.plan.liveness import max_in_flight, record_schedule
from megatron_paging.plan.pools import (
    FactorAdvice,
    LoadModel,
    PoolAdvice,
    factor_for_rate,
    overflow_rate,
    page_rows,
    simulate,
)
from megatron_paging.runtime.pipeline_ops import Op
from megatron_paging.tools.peer_load import RouteShape, parse_load

DEFAULT_RATES = (1e-2, 1e-3, 1e-4)


@dataclass(frozen=True)
class StageInputs:
    """One pipeline rank: what it builds, its schedule, and the global rank that stands for it
    (with its expert-parallel rank, which a recorded load trace must match)."""

    pipeline_rank: int
    chunks: tuple[S.Chunk, ...]
    ops: tuple[Op, ...]
    global_rank: int = 0
    ep_rank: int = 0


@dataclass(frozen=True)
class PlanInputs:
    model: S.ModelShape
    parallel: S.Parallel
    microbatches: int
    stages: tuple[StageInputs, ...]
    paging: PagingSettings = PagingSettings()
    as_launched: str = "unpaged"
    load: str = "lognormal:0.3"
    seed: int = 0
    schedule: str = "1F1B"
    notes: tuple[str, ...] = ()
    requested_stage: int | None = None  # the stage of --rank (None: the largest)


@dataclass
class Plan:
    """One rank's predicted memory per arm (bytes), how it was chosen, and the pool advice."""

    global_rank: int
    pipeline_rank: int
    world: int
    parallel: dict
    microbatches: int
    schedule: str
    chunks: list[dict]
    max_in_flight: int
    as_launched: str
    arms: dict[str, ArmMemory]
    stage_peaks: dict[int, int]  # pipeline rank -> the as-launched arm's peak
    pools: PoolAdvice | None
    constants: dict
    notes: list[str] = field(default_factory=list)
    model_seconds: float = 0.0


def _chunk_summary(chunk: S.Chunk) -> dict:
    return {"vp_stage": chunk.vp_stage, "embedding": chunk.embedding, "loss": chunk.loss,
            "layers": [layer.number for layer in chunk.layers],
            "moe_layers": [layer.number for layer in chunk.layers if layer.moe]}


def _stage_peak(inputs: PlanInputs, stage: StageInputs, constants: Constants) -> int:
    spec = next(a for a in ARMS if a.name == inputs.as_launched)
    return evaluate(inputs.model, inputs.parallel, stage.chunks, stage.ops, stage.pipeline_rank,
                    spec, inputs.paging, constants).peak


def advise_pools(inputs: PlanInputs, stage: StageInputs, rates, steps: int, load_spec: str,
                 seed: int) -> PoolAdvice | None:
    """Buffer factors for each target rate from a Monte-Carlo of the in-flight live rows."""
    model, par, paging = inputs.model, inputs.parallel, inputs.paging
    schedule = record_schedule(stage.chunks, stage.ops)
    at_peak = schedule.peak_records
    if not at_peak or not model.num_experts:
        return None
    d = S.dims(model, par)
    page = paging.page_size
    route = RouteShape(tokens=d.stream_tokens, topk=model.topk, num_experts=model.num_experts,
                       ep=par.ep, rank=stage.ep_rank)
    load = parse_load(load_spec, seed)
    # every record of the step drawn; per step the fullest schedule moment's page-rounded rows
    samples = simulate(load, LoadModel(route, d.block, page, schedule.layers, schedule.alive),
                       steps, seed)
    records = at_peak - (1 if paging.hold_last_slot else 0)
    scale = records / at_peak  # a held slot is never paged: a layer fewer in the pool
    hint = at_peak * page_rows(hint_rows(model, d), page)
    capacity = at_peak * page_rows(d.capacity, page)
    typical = float(np.median(samples))
    keys = pool_keys(model, d, records, inputs.as_launched == "paged_recompute_fc1")

    def device_bytes(rows_total: float, factor: float) -> int:
        if factor == 0:
            return 0
        rows = max(page, math.ceil(rows_total * scale * abs(factor)))
        per_key = page_rows(rows, page)
        return sum(per_key * (key.records // max(records, 1)) * key.row_bytes for key in keys)

    line = paging.cuda_factor
    out = []
    for rate in sorted(rates, reverse=True):
        plus, method = factor_for_rate(samples, hint, rate, False, capacity / hint)
        minus, _ = factor_for_rate(samples, hint, rate, True, capacity / typical)
        need = plus if line > 0 else minus
        cpu = max(0.0, need - abs(line))
        cpu_bytes = device_bytes(hint if line > 0 else typical, cpu)
        out.append(FactorAdvice(rate, round(plus, 3), device_bytes(hint, plus),
                                -round(minus, 3), device_bytes(typical, minus),
                                round(cpu if line > 0 else -cpu, 3), cpu_bytes, method))
    ratios = samples / hint
    return PoolAdvice(
        load=load.name(), steps=steps, seed=seed, records_at_peak=at_peak,
        hint_rows=int(hint), capacity_rows=int(capacity), mean_ratio=float(ratios.mean()),
        max_ratio=float(ratios.max()), line_factor=line,
        line_rate=overflow_rate(samples, hint, line), rows=tuple(out),
        method=(f"{steps} simulated steps (seed {seed}) of {load.name()}; live rows of each of "
                f"the step's {len(schedule.records)} records, page-rounded, summed over those "
                f"in flight at each of {schedule.alive.shape[0]} schedule moments, the most "
                f"per step; rate = share of steps above the pool, read from the sample where "
                f"it holds >= 10 overflows, else from a log-normal fit of the step needs"),
    )


def build_plan(inputs: PlanInputs, rates=DEFAULT_RATES, steps: int = 4000,
               load: str | None = None, seed: int | None = None,
               constants: Constants = CONSTANTS) -> Plan:
    """Every arm on the chosen rank (``inputs.requested_stage``, else the pipeline stage whose
    as-launched arm peaks highest) and the pool advice."""
    start = time.perf_counter()
    peaks = {s.pipeline_rank: _stage_peak(inputs, s, constants) for s in inputs.stages}
    chosen = inputs.requested_stage
    if chosen is None:
        chosen = max(peaks, key=lambda r: (peaks[r], -r))
    stage = next(s for s in inputs.stages if s.pipeline_rank == chosen)
    arms = {spec.name: evaluate(inputs.model, inputs.parallel, stage.chunks, stage.ops,
                                stage.pipeline_rank, spec, inputs.paging, constants)
            for spec in ARMS}
    advice = advise_pools(inputs, stage, rates, steps, load or inputs.load,
                          inputs.seed if seed is None else seed)
    par = inputs.parallel
    return Plan(
        global_rank=stage.global_rank, pipeline_rank=stage.pipeline_rank, world=par.world,
        parallel={"tp": par.tp, "pp": par.pp, "vpp": par.vpp, "ep": par.ep, "etp": par.etp,
                  "cp": par.cp, "dp": par.dp, "edp": par.edp,
                  "distributed_optimizer": par.distributed_optimizer},
        microbatches=inputs.microbatches, schedule=inputs.schedule,
        chunks=[_chunk_summary(c) for c in stage.chunks],
        max_in_flight=max_in_flight(stage.ops, len(stage.chunks)),
        as_launched=inputs.as_launched, arms=arms, stage_peaks=peaks, pools=advice,
        constants={"workspace_mib": constants.workspace_mib}, notes=list(inputs.notes),
        model_seconds=time.perf_counter() - start,
    )


__all__ = ["DEFAULT_RATES", "Plan", "PlanInputs", "StageInputs", "advise_pools", "build_plan"]
