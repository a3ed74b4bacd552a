"""The plan's pure model on a tiny hand-computed configuration: shapes, parameter counts, saved
activations, working sets, one arm's peak, the pools (docs/plan.md)."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_paging.plan import shapes as S
from megatron_paging.plan.arms import ARMS, Constants, PagingSettings, arm, evaluate
from megatron_paging.plan.liveness import one_f_one_b_ops
from megatron_paging.plan.model import PlanInputs, StageInputs, build_plan
from megatron_paging.plan.pools import PoolKey, mcore_pool_bytes, our_pool_bytes
from megatron_paging.plan.report import format_table, to_dict, to_json

# hidden 8, 2 heads of 4, 4 tokens, 4 experts top-2, moe-ffn 6 (fc1 12 columns), capacity 1.5
TINY = S.ModelShape(hidden=8, heads=2, query_groups=2, kv_channels=4, ffn=16, vocab=32, seq=4,
                    micro_batch=1, rotary_dim=4, num_experts=4, topk=2, moe_ffn=6,
                    capacity_factor=1.5)
ONE = S.Parallel()
NO_CONSTANT = Constants(workspace_mib=0.0)
MOE = S.Layer(1, True)
CHUNK = (S.Chunk(0, (MOE,), embedding=True, loss=True),)


def test_dims_capacity_and_live_rows():
    d = S.dims(TINY, ONE)
    assert (d.tokens, d.capacity, d.block, d.expected_live, d.fc1_cols) == (4, 12, 12, 8, 12)
    # EP 4: the budget ceil(4 x 2 x 1.5) = 12 splits in blocks of 3
    d4 = S.dims(TINY, S.Parallel(world=4, ep=4))
    assert (d4.local_experts, d4.block, d4.capacity) == (1, 3, 12)


def test_saved_activations_by_hand():
    d = S.dims(TINY, ONE)
    # qkv 2*4*(2+4)*4 + roped q,k 2*4*(2+2)*4 + cos/sin 2*2*4*4 + out 2*4*2*4 + lse 4*4*2
    assert S.attention_saved(TINY, d) == 192 + 128 + 64 + 64 + 32
    # 4 bf16 [4, 8] + 2 bool masks + 2 fp32 rstd [4]
    assert S.residual_saved(TINY, d) == 256 + 64 + 32
    assert S.router_saved(TINY, d) == 7 * 4 * 4 * 4
    assert S.dispatch_saved(TINY, d) == 27 * 12 + 17 * 4 * 2 + 4 * 12
    assert S.expert_bytes(TINY, d, d.capacity, False) == 2 * 12 * (8 + 12)
    assert S.expert_bytes(TINY, d, d.expected_live, True) == 2 * 8 * 8
    assert S.embedding_saved(TINY, d) == 64 + 32
    assert S.loss_saved(TINY, d) == 64 + 4 * 4 * 32
    assert S.loss_working_set(TINY, d) == 2 * 4 * 32
    assert S.mlp_saved(TINY, d, 16) == 2 * 4 * 16 * 3


def test_qk_norms_keep_a_query_copy_only_when_its_reshape_cannot_view_qkv():
    qk = dataclasses.replace(TINY, qk_layernorm=True)
    d = S.dims(qk, ONE)
    # 2 heads in 2 groups: query is a view into qkv; the norms add only fp32 rstd per head row
    assert S.qk_norms_saved(qk, d) == 4 * 4 * (2 + 2)
    assert S.attention_saved(qk, d) == S.attention_saved(TINY, d) + 64
    one_group = dataclasses.replace(qk, query_groups=1)  # one group: still a view
    assert S.qk_norms_saved(one_group, S.dims(one_group, ONE)) == 4 * 4 * (2 + 1)
    gqa = dataclasses.replace(qk, heads=4, query_groups=2)  # 2 groups of 2: a bf16 copy
    assert S.qk_norms_saved(gqa, S.dims(gqa, ONE)) == 2 * 4 * 4 * 4 + 4 * 4 * (4 + 2)
    # without rope the norms' outputs are the new q and k that SDPA keeps
    no_rope = dataclasses.replace(qk, rotary_dim=0)
    bare = dataclasses.replace(TINY, rotary_dim=0)
    d0 = S.dims(bare, ONE)
    assert S.attention_saved(no_rope, d0) == S.attention_saved(bare, d0) + 128 + 64


def test_working_sets_by_hand():
    d = S.dims(TINY, ONE)
    assert S.attention_working_set(TINY, d) == 2 * 4 * (2 * 4 + 2 * (2 + 4) * 4)
    # fc1 moment: dfc1 2*12*12 + dx 2*12*8 + dw1 2*4*8*12 (fc2's: 192 + 144 + 288 + 384)
    assert S.expert_working_set(TINY, d, False) == 288 + 192 + 768
    assert S.expert_working_set(TINY, d, True) == 288 + 192 + 768 + 192 + 384
    unfused = dataclasses.replace(TINY, fused_activation=False)
    assert S.expert_working_set(unfused, d, False) == 192 + 22 * 12 * 6


def test_parameters_by_hand():
    counts = S.chunk_params(TINY, ONE, CHUNK[0], last_stage=True)
    # embedding 256, qkv 192 + proj 64, router 32, output 256 | norms 8+8+8 | experts 4*8*18
    assert (counts.dense, counts.dense_1d, counts.expert) == (800, 24, 576)
    mla = dataclasses.replace(TINY, mla=S.MLAShape(q_lora_rank=4, kv_lora_rank=2, qk_head_dim=3,
                                                   qk_pos_dim=1, v_head_dim=2))
    attn = S.attention_params(mla, ONE)
    # q 8*4 + 4*2*4, kv 8*(2+1) + 2*2*(3+2), proj 2*2*8 | norms 8 + 4 + 2
    assert (attn.dense, attn.dense_1d) == (32 + 32 + 24 + 20 + 32, 14)


def test_mla_up_proj_recompute_keeps_no_query_key_value_and_makes_them_in_backward():
    shape = S.MLAShape(q_lora_rank=4, kv_lora_rank=2, qk_head_dim=3, qk_pos_dim=1, v_head_dim=2)
    kept = dataclasses.replace(TINY, mla=shape)
    recomputed = dataclasses.replace(TINY, mla=dataclasses.replace(shape, recompute_up_proj=True))
    d = S.dims(kept, ONE)
    # 4 tokens x 2 heads: query and key (3 + 1 rope) and value (2), bf16
    assert S.mla_up_proj_saved(shape, d) == 2 * 4 * 2 * (2 * 4 + 2) == 160
    # q down output 2*4*4, kv down (2+1) (bf16), out 2*4*2*2, lse 4*4*2; without
    # --qk-layernorm the local spec builds q/kv_layernorm as identities: no norm outputs
    assert S.attention_saved(recomputed, d) == 32 + 24 + 32 + 32
    # with it, their outputs: q 2*4*4 and kv 2*4*2
    normed = dataclasses.replace(recomputed, qk_layernorm=True)
    assert S.attention_saved(normed, d) == S.attention_saved(recomputed, d) + 32 + 16
    # ... and, kept, those 160 bytes plus rope's cos/sin for query and key (2 x 2 x bf16 x 4
    # tokens x 1: each apply_rotary_pos_emb call makes its own)
    assert S.attention_saved(kept, d) == S.attention_saved(recomputed, d) + 160 + 32
    assert (S.attention_working_set(recomputed, d)
            == S.attention_working_set(kept, d) + 160)  # made again for the layer's backward


def test_unpaged_arm_by_hand():
    ops = one_f_one_b_ops(1, 0, 2)
    m = evaluate(TINY, ONE, CHUNK, ops, 0, arm("unpaged"), PagingSettings(page_size=4),
                 NO_CONSTANT)
    assert (m.params, m.grads, m.optimizer) == (2 * 1400, 4 * 1400, 12 * 1400)
    layer = 480 + 352 + 448 + 508 + 480
    # the peak: the layer's backward (its fc1-gradient moment), everything of the chunk alive
    # but the loss's softmax
    assert m.fb_peak == 25200 + 96 + layer + 1248
    assert (m.experts, m.workspace, m.in_flight) == (480, 1248, 1)
    # Adam's temporary over the largest group (800 dense) + the router's last-microbatch tensors
    assert m.step_peak == 25200 + 4 * 800 + 448
    assert m.peak == m.step_peak and m.peak_phase == "optimizer step"


def test_paged_arm_by_hand():
    ops = one_f_one_b_ops(1, 0, 2)
    paging = PagingSettings(page_size=4, cuda_factor=1.1)
    m = evaluate(TINY, ONE, CHUNK, ops, 0, arm("paged"), paging, NO_CONSTANT)
    # pools: hint int(12 // 1.5) = 8 rows, x 1.1 -> 9 -> 12 rows (3 pages), of 16 B and 24 B
    assert m.pool_device == 12 * 16 + 12 * 24
    assert m.experts == 480  # one layer's capacity buffers stay resident
    assert m.fb_peak == 25200 + 96 + (480 + 352 + 448 + 508) + 480 + 1248 + m.pool_device
    assert m.step_peak == 25200 + 3200 + 448  # the pool is freed for the optimizer step
    persistent = evaluate(TINY, ONE, CHUNK, ops, 0, arm("paged"),
                          dataclasses.replace(paging, persistent_pool=True), NO_CONSTANT)
    assert persistent.step_peak == m.step_peak + m.pool_device
    mcore = evaluate(TINY, ONE, CHUNK, ops, 0, arm("mcore"), paging, NO_CONSTANT)
    # int(8 x 1.1) = 8 tokens, 2 pages per key; kept across steps
    assert mcore.pool_device == 8 * 16 + 8 * 24
    assert mcore.step_peak == m.step_peak + mcore.pool_device


def test_recompute_and_offload_arms():
    ops = one_f_one_b_ops(1, 0, 1)
    paging = PagingSettings(page_size=4)
    recompute = evaluate(TINY, ONE, CHUNK, ops, 0, arm("recompute"), paging, NO_CONSTANT)
    assert (recompute.router, recompute.dispatch, recompute.experts) == (0, 0, 0)
    # its backward recomputes router, dispatch and experts (448 + 508 + 480) under 1248, while
    # the checkpoint holds the MoE output's gradient (the hidden dropout's, bf16 [4, 8])
    assert recompute.workspace == 448 + 508 + 480 + 1248 + 64
    offload = evaluate(TINY, ONE, CHUNK, ops, 0, arm("offload"), paging, NO_CONSTANT)
    assert (offload.experts, offload.host_offload, offload.pool_device) == (480, 480, 0)


def test_paged_offload_experts_arm_by_hand():
    # three microbatches in flight (records of the one MoE layer), pages of 4 rows
    ops = one_f_one_b_ops(3, 0, 3)
    paging = PagingSettings(page_size=4, offload_host_factor=1.25)
    offload = evaluate(TINY, ONE, CHUNK, ops, 0, arm("offload"), paging, NO_CONSTANT)
    live = evaluate(TINY, ONE, CHUNK, ops, 0, arm("paged_offload_experts"), paging, NO_CONSTANT)
    # no record reaches the stash: no device pool; one layer's capacity x and fc1 resident
    assert (live.pool_device, live.experts) == (0, 2 * 12 * (8 + 12))
    # on the host: per record its 8 expected live rows (2 pages) of x (8) and fc1 (12 columns)
    assert live.in_flight == 3 and live.host_offload == 3 * 2 * 8 * (8 + 12)
    assert offload.host_offload == 3 * 2 * 12 * (8 + 12)  # Megatron-Core's: whole capacity
    # host-only pools per row size: 3 records x 8 rows x 1.25 = 30 -> 32 rows (8 pages)
    assert live.pool_host == 32 * 2 * 8 + 32 * 2 * 12
    # the device side is the expert offload's
    assert (live.fb_peak, live.step_peak, live.peak) == (offload.fb_peak, offload.step_peak,
                                                         offload.peak)


def test_pool_bytes_by_hand():
    keys = [PoolKey(16, 3)]
    # ours: 3 records x 12 page-rounded rows = 36, x 1.1 -> 40 rows (10 pages)
    assert our_pool_bytes(keys, 10, 1.1, 4) == 40 * 16
    # Megatron-Core: int(3 x 10 x 1.1) = 33 tokens -> 9 pages
    assert mcore_pool_bytes(keys, 10, 1.1, 4) == 36 * 16
    assert our_pool_bytes(keys, 10, 0.0, 4) == 0


def _inputs(pp: int = 2, microbatches: int = 4) -> PlanInputs:
    par = S.Parallel(world=pp, pp=pp)
    stages = tuple(
        StageInputs(s, (S.Chunk(0, (S.Layer(s + 1, True),), embedding=s == 0,
                                loss=s == pp - 1),),
                    tuple(one_f_one_b_ops(pp, s, microbatches)), global_rank=s)
        for s in range(pp))
    return PlanInputs(TINY, par, microbatches, stages, PagingSettings(page_size=4),
                      as_launched="paged", seed=3)


def test_build_plan_picks_the_largest_stage_and_reports():
    plan = build_plan(_inputs(), steps=200)
    assert plan.pipeline_rank == max(plan.stage_peaks, key=plan.stage_peaks.get)
    assert set(plan.arms) == {a.name for a in ARMS}
    assert plan.max_in_flight == (2 if plan.pipeline_rank == 0 else 1)
    table = format_table(plan)
    assert "PEAK" in table and "paged_recompute_fc1" in table
    data = to_dict(plan)
    assert data["arms"]["paged"]["peak_mib"] == pytest.approx(plan.arms["paged"].peak / 2**20,
                                                              abs=0.05)
    assert '"stage_peaks_mib"' in to_json(plan)
    asked = build_plan(dataclasses.replace(_inputs(), requested_stage=1), steps=200)
    assert asked.pipeline_rank == 1


def test_pipeline_stage_keeps_its_input_and_frees_its_output():
    from megatron_paging.plan.arms import chunk_terms

    d = S.dims(TINY, ONE)
    stream = 2 * 4 * 8  # one bf16 [tokens, hidden]
    first = S.Chunk(0, (MOE,), embedding=True)
    last = S.Chunk(0, (MOE,), loss=True)
    unpaged = arm("unpaged")
    # the first stage sends its output (Megatron frees its data), the last keeps what it received
    assert chunk_terms(TINY, d, first, unpaged, True).full.parts.residual == 352 - stream
    assert chunk_terms(TINY, d, last, unpaged, True).full.parts.residual == 352 + stream
    assert chunk_terms(TINY, d, CHUNK[0], unpaged, False).full.parts.residual == 352


def test_recomputed_forward_peaks_at_the_combine_when_its_gather_outweighs_the_experts():
    # moe-ffn 1: the experts' backward (at most 368 B) is below the combine's three [12, 8]
    narrow = dataclasses.replace(TINY, moe_ffn=1)
    d = S.dims(narrow, ONE)
    assert S.expert_working_set(narrow, d, False) == 368
    m = evaluate(narrow, ONE, CHUNK, one_f_one_b_ops(1, 0, 1), 0, arm("recompute"),
                 PagingSettings(page_size=4), NO_CONSTANT)
    capacity = S.expert_bytes(narrow, d, d.capacity, False)  # x and fc1, saved again
    # router + dispatch + x and fc1 + the experts' output, the gathered rows and their masked
    # copy + the MoE output's gradient the checkpoint holds
    assert m.workspace == 448 + 508 + capacity + 3 * 2 * 12 * 8 + 64


def test_a_pipelined_chunk_holds_its_received_output_gradient_through_its_backward():
    from megatron_paging.plan.arms import chunk_terms
    d = S.dims(TINY, ONE)
    middle = S.Chunk(0, (MOE,))
    alone = chunk_terms(TINY, d, middle, arm("paged"))
    piped = chunk_terms(TINY, d, middle, arm("paged"), pipelined=True)
    # bf16 [4, 8]: referenced by backward_step until the chunk's backward ends
    assert [t.work for t in piped.backward] == [t.work + 64 for t in alone.backward]
    last = S.Chunk(0, (MOE,), loss=True)  # the loss chunk receives no gradient
    assert ([t.work for t in chunk_terms(TINY, d, last, arm("paged"), pipelined=True).backward]
            == [t.work for t in chunk_terms(TINY, d, last, arm("paged")).backward])


def test_shared_experts_hold_the_moe_output_gradient_through_the_routed_backward():
    from megatron_paging.plan.arms import layer_terms
    shared = dataclasses.replace(TINY, shared_ffn=2)
    d = S.dims(shared, ONE)
    routed = S.expert_working_set(shared, d, False)
    assert routed > max(S.mlp_working_set(shared, d, 2), S.attention_working_set(shared, d))
    # their backward runs last: the dropout's gradient (bf16 [4, 8]) waits for it
    assert layer_terms(shared, d, MOE, arm("paged")).work == routed + 64
    no_dropout = dataclasses.replace(shared, hidden_dropout=False)  # it is the layer's own
    assert layer_terms(no_dropout, d, MOE, arm("paged")).work == routed


def test_the_sigmoid_router_keeps_two_fp32_score_tensors_and_its_group_mask():
    d = S.dims(TINY, ONE)
    sigmoid = dataclasses.replace(TINY, router_sigmoid=True)
    # the sigmoid's output for routing and for the aux loss, fp32 [4 tokens, 4 experts]
    assert S.router_saved(sigmoid, d) == 2 * 4 * 4 * 4
    grouped = dataclasses.replace(sigmoid, router_groups=2)  # + the bool expert mask
    assert S.router_saved(grouped, d) == 2 * 4 * 4 * 4 + 4 * 4
    assert S.router_saved(TINY, d) == 7 * 4 * 4 * 4  # softmax: the traced count


def test_the_dispatcher_backward_sits_beside_the_prefetched_reload_of_pooled_arms():
    from megatron_paging.plan.arms import layer_terms
    # hidden 32, moe-ffn 1: the regroup's three [12, 32] outweigh every other backward moment
    wide = dataclasses.replace(TINY, hidden=32, moe_ffn=1)
    d = S.dims(wide, ONE)
    three = S.dispatch_working_set(wide, d)
    capacity = S.expert_bytes(wide, d, d.capacity, False)
    others = max(S.expert_working_set(wide, d, False), S.attention_working_set(wide, d))
    assert three == 3 * 2 * 12 * 32 and three - capacity > others
    # paged, Megatron-Core's offload: the layer below's reloaded x and fc1 (the resident term)
    assert layer_terms(wide, d, MOE, arm("paged")).work == three
    assert layer_terms(wide, d, MOE, arm("offload")).work == three
    # unpaged and our live-row offload: the layer's own x and fc1 are freed, nothing reloaded
    assert layer_terms(wide, d, MOE, arm("unpaged")).work == three - capacity
    assert layer_terms(wide, d, MOE, arm("paged_offload_experts")).work == three - capacity


def test_megatron_cores_manager_holds_a_forwards_last_stash_sources_into_the_next_backward():
    from megatron_paging.plan.liveness import Moment
    from megatron_paging.runtime.pipeline_ops import Op
    paging = PagingSettings(page_size=4)
    d = S.dims(TINY, ONE)
    capacity = S.expert_bytes(TINY, d, d.capacity, False)
    # PP = 1: each backward follows its own forward, whose sources it releases
    alone = evaluate(TINY, ONE, CHUNK, one_f_one_b_ops(1, 0, 2), 0, arm("paged"), paging,
                     NO_CONSTANT)
    # 1F1B on stage 0 of 2: F0 F1 B0 F2 B1 ... — B0 follows F1, another microbatch's forward
    ops = one_f_one_b_ops(2, 0, 2)
    assert [(o.kind, o.microbatch) for o in ops[:3]] == [("F", 0), ("F", 1), ("B", 0)]
    first = (S.Chunk(0, (MOE,), embedding=True),)
    piped = dataclasses.replace(ONE, world=2, pp=2)
    held = evaluate(TINY, piped, first, ops, 0, arm("mcore"), paging, NO_CONSTANT)
    ours = evaluate(TINY, piped, first, ops, 0, arm("paged"), paging, NO_CONSTANT)
    unpaged = evaluate(TINY, piped, first, ops, 0, arm("unpaged"), paging, NO_CONSTANT)
    assert alone.experts == capacity  # the resident reload only
    assert held.experts == 2 * capacity  # Megatron-Core's manager: + the stale sources
    assert ours.experts == capacity  # ours releases them when the backward begins
    assert unpaged.experts == 2 * capacity  # two microbatches' saved x and fc1, nothing stale
    from megatron_paging.plan.arms import _follows_another_forward
    moment = Moment(2, "backward", 0, 0, (2,))
    assert _follows_another_forward(ops, moment, first)
    assert not _follows_another_forward([Op("F", 0, 0), Op("B", 0, 0)],
                                        Moment(1, "backward", 0, 0, (1,)), first)
