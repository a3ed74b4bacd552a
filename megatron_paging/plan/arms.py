"""One pipeline rank's memory under each arm: parameters, gradients, optimizer state, the
activations alive at the forward-backward's peak by part, the pools, and the optimizer step.

Peak means ``torch.cuda.max_memory_allocated`` over a steady step: the larger of

* the forward-backward peak: static state + the saved activations of every chunk-microbatch
  alive at a schedule moment (:mod:`.liveness`) + the working set of the op running there (the
  loss, or one layer's backward) + what the arm keeps resident (pools, one layer's capacity
  buffers) + :data:`CONSTANTS` ``.workspace_mib``;
* the optimizer step: static state + Adam's one fp32 temporary the size of its largest
  parameter group's shard (torch's foreach AdamW: ``sqrt(exp_avg_sq)``) + what the last
  microbatch leaves referenced + persistent pools + the same workspace.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_paging.plan import shapes as S
from megatron_paging.plan.liveness import moments
from megatron_paging.plan.pools import PoolKey, mcore_pool_bytes, our_pool_bytes

MIB = 2**20


@dataclass(frozen=True)
class Constants:
    """The model's only fitted number (docs/plan.md "Constants"; refit by
    benchmarks/plan_validation.py: fit_workspace).

    workspace_mib: memory every moment of the step holds beyond tensors the model names
    (cuBLAS/cuBLASLt workspaces, RNG states, the step's small tensors). Fitted on the one-GPU
    example's unpaged arm (benchmarks/results/mcore_graphs_h200.json, mode unpaged): the mean of
    its forward-backward and optimizer-step residuals.
    """

    workspace_mib: float = 68.2


CONSTANTS = Constants()


@dataclass(frozen=True)
class ArmSpec:
    name: str
    flags: str  # what the launch line carries for this arm
    description: str
    manager: str | None = None  # "ours" or "mcore": the experts' saved rows go to page pools
    recompute_moe: bool = False
    offload_experts: bool = False
    offload_dense: bool = False
    recompute_fc1: bool = False
    # the experts' x and fc1 leave as their live rows (our paged offloading backend) into a
    # host-only pool, not whole capacity buffers (Megatron-Core's backend)
    offload_live_rows: bool = False


DENSE_OFFLOAD = "attn_norm qkv_linear core_attn attn_proj mlp_norm"
EXPERT_OFFLOAD = "expert_fc1 moe_act"
ARMS: tuple[ArmSpec, ...] = (
    ArmSpec("unpaged", "(no paging)", "capacity-sized expert activations kept for backward"),
    ArmSpec("paged", "--moe-paged-stash", "expert rows paged into megatron-paging's pools",
            manager="ours"),
    ArmSpec("mcore", "--moe-paged-stash, MEGATRON_PAGING_BENCH_IMPLEMENTATION=mcore",
            "Megatron-Core's manager: pools per (dtype, columns), kept across steps",
            manager="mcore"),
    ArmSpec("recompute", "--recompute-granularity selective --recompute-modules moe",
            "the MoE layer keeps only its input and runs again in backward", recompute_moe=True),
    ArmSpec("offload", f"--fine-grained-activation-offloading --offload-modules "
            f"{EXPERT_OFFLOAD}", "Megatron-Core's offloading moves the experts' x and fc1 to the "
            "host", offload_experts=True),
    ArmSpec("paged_offload", f"--moe-paged-stash --fine-grained-activation-offloading "
            f"--offload-modules {DENSE_OFFLOAD} --paging-offload-backend paged",
            "paged experts, dense modules' saved tensors offloaded to the host",
            manager="ours", offload_dense=True),
    ArmSpec("paged_offload_experts", f"--moe-paged-stash --fine-grained-activation-offloading "
            f"--offload-modules {EXPERT_OFFLOAD} --paging-offload-backend paged",
            "paged stash on; the experts' x and fc1 go to the host as their live rows (the "
            "offload hooks are innermost: the stash pools stay empty)",
            manager="ours", offload_experts=True, offload_live_rows=True),
    ArmSpec("paged_recompute_fc1", "--moe-paged-stash --paging-recompute-expert-fc1",
            "paged experts that keep only x and recompute fc1 in backward",
            manager="ours", recompute_fc1=True),
)
ARM_NAMES = tuple(a.name for a in ARMS)


@dataclass(frozen=True)
class PagingSettings:
    """The launch line's pool flags (the paged arms use them)."""

    page_size: int = 64
    cuda_factor: float = 1.10
    host_factor: float = 0.0
    hold_last_slot: bool = False
    persistent_pool: bool = False  # --cuda-graph-impl full_iteration (or residency persistent)
    offload_host_factor: float = 1.25  # --paging-offload-host-factor (live-row offload tiers)


@dataclass(frozen=True)
class ArmMemory:
    """One arm on one rank, in bytes. Activation parts are what is alive at the
    forward-backward peak; ``experts_live`` is what the same records' expected live rows take."""

    arm: str
    params: int
    grads: int
    optimizer: int
    embedding_loss: int
    attention: int
    residual: int
    dense_mlp: int
    router: int
    dispatch: int
    experts: int
    experts_live: int
    workspace: int  # the working set of the op at the peak (beyond saved tensors)
    pool_device: int
    pool_host: int
    host_offload: int  # activation bytes on the host at the peak (not device memory)
    constant: int
    fb_peak: int
    optimizer_extra: int  # the optimizer step's temporary and leftovers
    step_peak: int
    peak: int
    peak_phase: str  # "forward-backward" or "optimizer step"
    peak_moment: str
    in_flight: int  # chunk-microbatches alive at the forward-backward peak

    @property
    def static(self) -> int:
        return self.params + self.grads + self.optimizer


@dataclass(frozen=True)
class _Terms:
    """One layer (or chunk part) under an arm: device parts, expected live expert bytes, host
    bytes and the backward working set."""

    parts: S.Parts
    live: int = 0
    host: int = 0
    work: int = 0

    def __add__(self, other: _Terms) -> _Terms:
        return _Terms(self.parts + other.parts, self.live + other.live, self.host + other.host,
                      max(self.work, other.work))


def _dense_offloaded(model: S.ModelShape, d: S.Dims) -> tuple[int, int]:
    """(attention, residual) bytes the dense-module offload moves per layer: everything the
    attention keeps but rope's cos/sin, and the first norm's input and output and the second
    norm's input (attn_norm, qkv_linear, core_attn, attn_proj, mlp_norm)."""
    offloaded = S.attention_saved(model, d) - S.rope_saved(model, d)
    return offloaded, 3 * S.BF16 * d.stream_tokens * model.hidden


def layer_terms(model: S.ModelShape, d: S.Dims, layer: S.Layer, arm: ArmSpec,
                page: int = 1) -> _Terms:
    """One layer's saved bytes under ``arm``; ``page``: the pools' page (live-row offloads
    occupy whole host pages)."""
    attn, res = S.attention_saved(model, d), S.residual_saved(model, d)
    host = 0
    if arm.offload_dense:
        off_attn, off_res = _dense_offloaded(model, d)
        attn, res, host = attn - off_attn, res - off_res, off_attn + off_res
    work_attn = S.attention_working_set(model, d)
    if not layer.moe:
        parts = S.Parts(attention=attn, residual=res, dense_mlp=S.mlp_saved(model, d, d.ffn))
        return _Terms(parts, 0, host, max(work_attn, S.mlp_working_set(model, d, d.ffn)))
    rc = arm.recompute_fc1
    shared = S.mlp_saved(model, d, d.shared_ffn) if d.shared_ffn else 0
    router, dispatch = S.router_saved(model, d), S.dispatch_saved(model, d)
    capacity = S.expert_bytes(model, d, d.capacity, rc)
    live = S.expert_bytes(model, d, d.expected_live, rc)
    pooled = arm.manager is not None or arm.offload_experts
    # The dispatcher's backward runs after the experts' backward freed their x and fc1; by then
    # the stash and Megatron-Core's offload hold the layer below's reloaded x and fc1 instead
    # (prefetched at the experts' input, counted in `resident`), our live-row offload not yet.
    regroup = S.dispatch_working_set(model, d)
    dispatch_work = regroup - capacity if not pooled or arm.offload_live_rows else regroup
    # MoELayer's forward runs the shared experts first, so the engine (latest node first) runs
    # their backward last: the MoE output's gradient (the hidden dropout's, a new tensor) waits
    # for them through the routed backward; a recomputed layer's checkpoint holds it throughout.
    output_grad = (S.BF16 * d.stream_tokens * model.hidden
                   if model.hidden_dropout and (d.shared_ffn or arm.recompute_moe) else 0)
    work_moe = max(S.expert_working_set(model, d, rc), dispatch_work) + output_grad
    if d.shared_ffn:
        work_moe = max(work_moe, S.mlp_working_set(model, d, d.shared_ffn))
    if arm.recompute_moe:  # only the input (the norm output in `residual`) is kept
        # Backward first runs the layer's forward again: at its combine, beside the x and fc1
        # the experts saved, the regroup gather holds the experts' output, its rows and their
        # masked copy (then the block exchange's input and output): three [C, h] again.
        recomputed = router + dispatch + capacity + shared
        work_moe = max(work_moe, regroup + output_grad)
        return _Terms(S.Parts(attention=attn, residual=res), live, host,
                      max(work_attn, recomputed + work_moe))
    if arm.offload_live_rows:  # each record's expected live rows, in whole pages
        host += S.expert_bytes(model, d, -(-d.expected_live // page) * page, rc)
    elif arm.offload_experts:
        host += capacity
    parts = S.Parts(attention=attn, residual=res, dense_mlp=shared, router=router,
                    dispatch=dispatch, experts=0 if pooled else capacity)
    return _Terms(parts, live, host, max(work_attn, work_moe))


@dataclass(frozen=True)
class _ChunkTerms:
    full: _Terms  # everything the chunk-microbatch keeps after its forward
    forward_work: int  # the loss's working set at the end of the forward
    backward: tuple[_Terms, ...]  # candidate backward moments: kept-so-far + working set


def chunk_terms(model: S.ModelShape, d: S.Dims, chunk: S.Chunk, arm: ArmSpec,
                pipelined: bool = False, page: int = 1) -> _ChunkTerms:
    """A chunk-microbatch's saved activations and its backward's candidate moments. Pipelined,
    a chunk keeps the input it received (its first norm's input), Megatron's
    ``deallocate_output_tensor`` frees the data of the output it sent, and the gradient it
    receives for that output stays referenced until its backward ends."""
    stream = S.BF16 * d.stream_tokens * model.hidden
    received = stream if pipelined and not chunk.embedding else 0
    base = _Terms(S.Parts(
        embedding_loss=S.embedding_saved(model, d) if chunk.embedding else 0, residual=received))
    prefixes, running = [], base
    for layer in chunk.layers:
        terms = layer_terms(model, d, layer, arm, page)
        running = _Terms(running.parts + terms.parts, running.live + terms.live,
                         running.host + terms.host, terms.work)
        prefixes.append(running)
    if pipelined and chunk.layers and not chunk.loss:
        sent = S.Parts(residual=-stream)
        running = _Terms(running.parts + sent, running.live, running.host, running.work)
        prefixes[-1] = running
        # backward_step keeps the output gradient it received through the whole backward
        prefixes = [_Terms(p.parts, p.live, p.host, p.work + stream) for p in prefixes]
    top = _Terms(running.parts, running.live, running.host, 0)
    loss_work = 0
    if chunk.loss:
        loss_work = S.loss_working_set(model, d)
        top = _Terms(top.parts + S.Parts(embedding_loss=S.loss_saved(model, d)), top.live,
                     top.host, loss_work)
        prefixes.append(top)
    return _ChunkTerms(_Terms(top.parts, top.live, top.host), loss_work,
                       tuple(prefixes) or (base,))


def pool_keys(model: S.ModelShape, d: S.Dims, records: int, recompute_fc1: bool):
    """The pools one record set needs: x's rows and (unless recomputed) fc1's; equal row
    sizes share a pool."""
    sizes = [S.BF16 * model.hidden] + ([] if recompute_fc1 else [S.BF16 * d.fc1_cols])
    if len(sizes) == 2 and sizes[0] == sizes[1]:
        return [PoolKey(sizes[0], 2 * records)]
    return [PoolKey(size, records) for size in sizes]


def hint_rows(model: S.ModelShape, d: S.Dims) -> int:
    """A record's average-token hint: PagedGroupedMLP passes ``capacity // factor`` rows."""
    if not model.capacity_factor:
        return d.expected_live
    return int(d.capacity // model.capacity_factor)


def peak_records(chunks, ops) -> int:
    """MoE records (one per MoE layer and chunk-microbatch) in flight at their peak."""
    per_chunk = [c.moe_layers for c in chunks]
    return max((sum(n * k for n, k in zip(m.alive, per_chunk, strict=True))
                for m in moments(ops, len(chunks))), default=0)


def pools(model, d, arm: ArmSpec, records: int, paging: PagingSettings) -> tuple[int, int]:
    """(device, host) pool bytes of a paged arm for ``records`` in flight at the peak."""
    if arm.manager is None or records == 0:
        return 0, 0
    page, hint = paging.page_size, hint_rows(model, d)
    if arm.offload_live_rows:
        # No record reaches the stash (its pools are empty); the offload backend's host-only
        # pools hold offload_host_factor x the page-rounded live rows in flight, the expected
        # live rows standing in for the calibration step's.
        keys = pool_keys(model, d, records, arm.recompute_fc1)
        return 0, our_pool_bytes(keys, d.expected_live, paging.offload_host_factor, page)
    if arm.manager == "mcore":  # every record counted, the last one before backward included
        keys = pool_keys(model, d, records, arm.recompute_fc1)
        return (mcore_pool_bytes(keys, hint, paging.cuda_factor, page),
                mcore_pool_bytes(keys, hint, paging.host_factor, page))
    held = 1 if paging.hold_last_slot else 0
    keys = pool_keys(model, d, max(records - held, 0), arm.recompute_fc1)
    # A negative factor sizes from measured rows: the expected live rows stand in for them.
    base = hint if paging.cuda_factor > 0 else d.expected_live
    host_base = hint if paging.host_factor > 0 else d.expected_live
    return (our_pool_bytes(keys, base, paging.cuda_factor, page),
            our_pool_bytes(keys, host_base, paging.host_factor, page))


def evaluate(model: S.ModelShape, par: S.Parallel, chunks, ops, pipeline_rank: int,
             arm: ArmSpec, paging: PagingSettings, constants: Constants = CONSTANTS
             ) -> ArmMemory:
    """``arm``'s memory on pipeline rank ``pipeline_rank`` (its ``chunks`` and schedule
    ``ops``)."""
    d = S.dims(model, par)
    counts = S.ParamCounts()
    for chunk in chunks:
        counts += S.chunk_params(model, par, chunk, pipeline_rank == par.pp - 1)
    params = model.param_bytes * counts.total
    grads = (S.FP32 if par.grads_fp32 else model.param_bytes) * counts.total
    master = S.FP32 if model.param_bytes < S.FP32 else 0
    dp, edp = (par.dp, par.edp) if par.distributed_optimizer else (1, 1)
    shards = ((counts.dense + counts.dense_1d) / dp, counts.expert / edp)
    optimizer = int((master + 2 * S.FP32) * sum(shards))
    static = params + grads + optimizer

    terms = [chunk_terms(model, d, chunk, arm, par.pp > 1, paging.page_size)
             for chunk in chunks]
    moe_layers = sum(c.moe_layers for c in chunks)
    resident = _Terms(S.Parts())
    if moe_layers and (arm.manager or arm.offload_experts):  # one layer's capacity buffers
        resident = _Terms(S.Parts(experts=S.expert_bytes(model, d, d.capacity,
                                                         arm.recompute_fc1)))
    if arm.offload_dense and any(c.layers for c in chunks):
        attn, res = _dense_offloaded(model, d)
        resident = resident + _Terms(S.Parts(attention=attn, residual=res))
    records = peak_records(chunks, ops)
    pool_device, pool_host = pools(model, d, arm, records, paging)
    constant = int(constants.workspace_mib * MIB)
    # Megatron-Core's manager drops a stash's sources once it sees the copy end, or at the
    # backward of the same chunk-microbatch; a host ahead of the GPU has not seen the last
    # stash of the forward just before another chunk-microbatch's backward (1F1B) end, so that
    # layer's sources are still allocated through the backward's first layer. Ours drops every
    # stash source when any backward begins (runtime/sources.py).
    stale = (S.expert_bytes(model, d, d.capacity, arm.recompute_fc1)
             if moe_layers and arm.manager == "mcore" else 0)

    full_totals = [t.full.parts.total for t in terms]
    best, best_total = None, -1
    for m in moments(ops, len(chunks)):
        own_full = full_totals[m.chunk] if m.kind == "backward" else 0
        kept = sum(n * total for n, total in zip(m.alive, full_totals, strict=True)) - own_full
        held = 0
        if m.kind == "forward":
            candidates = [_Terms(S.Parts(), work=terms[m.chunk].forward_work)]
        else:
            candidates = terms[m.chunk].backward
            held = stale if _follows_another_forward(ops, m, chunks) else 0
        for own in candidates:
            total = kept + own.parts.total + own.work + held
            if total > best_total:
                best_total, best = total, (m, own, held)
    moment, alive, held = best if best is not None else (None, _Terms(S.Parts()), 0)
    resident = resident + _Terms(S.Parts(experts=held))
    if moment is not None:  # the breakdown of the winning moment
        for c, n in enumerate(moment.alive):
            full = terms[c].full
            count = n - (1 if (moment.kind == "backward" and c == moment.chunk) else 0)
            alive = _Terms(alive.parts + full.parts.scaled(count), alive.live + full.live * count,
                           alive.host + full.host * count, alive.work)
    parts = alive.parts + resident.parts
    fb_peak = static + parts.total + alive.work + pool_device + constant

    # The optimizer step: Adam's temporary over the largest group, plus what the last
    # microbatch leaves referenced (its routing tensors; a recomputed MoE layer's input and
    # recomputed norm output), plus pools kept across steps.
    groups = (counts.dense / dp, counts.dense_1d / dp, counts.expert / edp)
    leftover = moe_layers * S.router_saved(model, d)
    if arm.recompute_moe:
        leftover += moe_layers * 2 * S.BF16 * d.stream_tokens * model.hidden
    optimizer_extra = int(S.FP32 * max(groups)) + leftover
    kept_pool = pool_device if (arm.manager == "mcore" or paging.persistent_pool) else 0
    step_peak = static + optimizer_extra + kept_pool + constant
    phase = "forward-backward" if fb_peak >= step_peak else "optimizer step"
    return ArmMemory(
        arm=arm.name, params=params, grads=grads, optimizer=optimizer,
        embedding_loss=parts.embedding_loss, attention=parts.attention,
        residual=parts.residual, dense_mlp=parts.dense_mlp, router=parts.router,
        dispatch=parts.dispatch, experts=parts.experts, experts_live=alive.live,
        workspace=alive.work, pool_device=pool_device, pool_host=pool_host,
        host_offload=alive.host, constant=constant, fb_peak=fb_peak,
        optimizer_extra=optimizer_extra, step_peak=step_peak, peak=max(fb_peak, step_peak),
        peak_phase=phase, peak_moment=_describe(moment, chunks),
        in_flight=moment.in_flight if moment else 0,
    )


def _follows_another_forward(ops, moment, chunks) -> bool:
    """Whether the op before this backward is the forward of another chunk-microbatch that
    stashes (its chunk has MoE layers)."""
    if moment.index == 0:
        return False
    prev = ops[moment.index - 1]
    return (prev.kind == "F" and chunks[prev.chunk].moe_layers > 0
            and (prev.chunk, prev.microbatch) != (moment.chunk, moment.microbatch))


def _describe(moment, chunks) -> str:
    if moment is None:
        return "no schedule"
    where = "end of forward" if moment.kind == "forward" else "backward"
    alive = moment.in_flight
    return (f"{where} of chunk {moment.chunk} microbatch {moment.microbatch} "
            f"({alive} chunk-microbatch{'' if alive == 1 else 'es'} alive)")


def arm(name: str) -> ArmSpec:
    for spec in ARMS:
        if spec.name == name:
            return spec
    raise ValueError(f"unknown arm {name!r}; arms: {', '.join(ARM_NAMES)}")


__all__ = ["ARMS", "ARM_NAMES", "ArmMemory", "ArmSpec", "CONSTANTS", "Constants", "EXPERT_OFFLOAD",
           "PagingSettings", "arm", "evaluate", "hint_rows", "peak_records", "pool_keys",
           "pools"]
