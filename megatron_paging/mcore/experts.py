"""TE-free paged grouped experts: a Megatron-Core experts module for any MoE layer spec.

:class:`PagedGroupedMLP` computes all local experts over the dispatcher's capacity buffer
(``[capacity_rows, hidden]``, rows grouped by expert, live rows first, counts on the device):

    fc1 = x @ W1[e]^T            (grouped GEMM over the expert row ranges)
    act = glu_or_act(fc1) * prob (Megatron-Core's weighted activation)
    out = act @ W2[e]^T

GEMM backends: ``grouped`` uses ``torch._grouped_mm`` (bf16 on sm90+; sync-free: the row ranges
stay on the device), ``loop`` runs one matmul per expert with host offsets (one host read; the
CPU default), ``auto`` picks ``grouped`` for bf16 CUDA tensors on sm90+ and ``loop`` elsewhere.

Paging: the module calls Megatron-Core's paged-stash hooks at the same points as its TE
op-fuser grouped MLP (``paged_stash_group_start`` -> ``get_paged_stash_context`` around the
computation -> ``paged_stash_group_commit``), looked up in
``megatron.core.transformer.moe.paged_stash`` at call time: after ``install()`` they are ours,
without it they are Megatron-Core's own manager. The two capacity-sized tensors backward needs,
the input ``x`` and ``fc1``, carry Megatron-Core's mark (``grouped_tensor_scale_inv = False``), so
either manager pages exactly those; the activation is recomputed from ``fc1`` in backward.
Rows past the live prefix are never read in a way that reaches a live result, so a reloaded
buffer whose tail is left untouched gives bit-identical results.

Offloading: fc1 and activation+fc2 are two autograd functions so that Megatron-Core's
fine-grained offloading groups ``expert_fc1`` (what fc1 saves: ``x``) and ``moe_act`` (what the
activation saves: ``fc1``) can be offloaded at the same points as in its TE experts
(``off_interface(...)`` around each, ``group_offload`` after it, looked up in
``fine_grained_activation_offload`` at call time: ours after ``install(offload_backend="paged")``,
else Megatron-Core's). Both tensors carry
:data:`~megatron_paging.mcore.offloading.backend.LIVE_ROWS_ATTR`, so the paged backend moves only
their live rows; Megatron-Core's moves them whole.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from megatron.core.pipeline_parallel import fine_grained_activation_offload as mcore_offload
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.random import (
    get_cuda_rng_tracker,
    get_expert_parallel_rng_tracker_name,
)
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe import paged_stash as mcore_paged_stash
from megatron.core.utils import get_pg_size

from megatron_paging.mcore.expert_activation import expert_activation
from megatron_paging.mcore.experts_checkpoint import experts_sharded_state_dict
from megatron_paging.mcore.offloading.backend import LIVE_ROWS_ATTR

GEMM_BACKENDS = ("auto", "grouped", "loop")


def resolve_gemm_backend(backend: str, x: torch.Tensor) -> str:
    if backend not in GEMM_BACKENDS:
        raise ValueError(f"gemm_backend must be one of {GEMM_BACKENDS}, got {backend!r}")
    if backend != "auto":
        return backend
    grouped_ok = (
        x.is_cuda
        and x.dtype == torch.bfloat16
        and hasattr(torch, "_grouped_mm")
        and torch.cuda.get_device_capability(x.device) >= (9, 0)
    )
    return "grouped" if grouped_ok else "loop"


def _gmm(a, b, offs, counts):
    """Grouped ``a @ b`` over row groups (``b`` 3-D: one matrix per group) or, with 2-D ``a``
    transposed and ``b`` 2-D, the per-group ``a_g @ b_g`` over the shared K groups."""
    if counts is None:
        return torch._grouped_mm(a, b, offs=offs)
    if b.dim() == 3:  # [C, K] x [E, K, N] -> [C, N]; rows past the groups are zero
        out = a.new_zeros(a.shape[0], b.shape[-1])
        start = 0
        for e, n in enumerate(counts):
            out[start : start + n] = a[start : start + n] @ b[e]
            start += n
        return out
    pieces, start = [], 0  # [M, C] x [C, N] -> [E, M, N] (weight gradients)
    for n in counts:
        pieces.append(a[:, start : start + n] @ b[start : start + n])
        start += n
    return torch.stack(pieces)


def _zero_empty_experts(dw, offs):
    """Experts without tokens get exact zeros (grouped_mm on sm100 does not write them).

    In place: a copy (``torch.where``) would hold a second weight gradient (384 MiB for fc1 at
    moe_compute) at the expert backward's peak, beside the first."""
    sizes = torch.diff(offs, prepend=offs.new_zeros(1)).view(-1, 1, 1)
    return dw.masked_fill_(sizes == 0, 0)


def _fc1_grads(dfc1, x, w1, offs, counts):
    """fc1's dgrad and wgrad (``dx``, ``dw1``) for ``dfc1``."""
    dfc1 = dfc1.contiguous()
    dw1 = _gmm(dfc1.t(), x, offs, counts)
    dx = _gmm(dfc1, w1, offs, counts)
    return dx, (_zero_empty_experts(dw1, offs) if counts is None else dw1)


def _fc2_wgrad(dout, inter, offs, counts):
    dw2 = _gmm(dout.t(), inter, offs, counts)
    return _zero_empty_experts(dw2, offs) if counts is None else dw2


class _Fc1(torch.autograd.Function):
    """``fc1 = x @ W1[e]^T`` over the expert row ranges; saves ``x`` (Megatron's expert_fc1)."""

    @staticmethod
    def forward(ctx, x, w1, offs, counts):
        ctx.save_for_backward(x, w1, offs)
        ctx.counts = counts
        return _gmm(x, w1.transpose(1, 2), offs, counts)

    @staticmethod
    def backward(ctx, dfc1):
        x, w1, offs = ctx.saved_tensors
        dx, dw1 = _fc1_grads(dfc1, x, w1, offs, ctx.counts)
        return dx, dw1, None, None


class _ActFc2(torch.autograd.Function):
    """Weighted activation -> fc2; saves ``fc1`` (Megatron's moe_act) and recomputes the
    activation from it in backward."""

    @staticmethod
    def forward(ctx, fc1, probs, w2, offs, counts, act):
        inter = act.forward(fc1, probs)
        out = _gmm(inter, w2.transpose(1, 2), offs, counts)
        ctx.save_for_backward(fc1, probs)
        # The weight (a parameter: nothing offloads it) and the expert offsets (a few int32s)
        # stay out of the saved tensors, so backward runs the dgrad GEMM before it unpacks fc1:
        # with fc1 offloaded, the unpack makes the compute stream wait for fc1's reload, and
        # the GEMM then runs beside the copy instead of after it.
        ctx.w2, ctx.offs, ctx.counts, ctx.act = w2, offs, counts, act
        return out

    @staticmethod
    def backward(ctx, dout):
        w2, offs, counts, act = ctx.w2, ctx.offs, ctx.counts, ctx.act
        dout = dout.contiguous()
        dinter = _gmm(dout, w2, offs, counts)
        fc1, probs = ctx.saved_tensors
        # fc1 may be a reloaded or offloaded buffer someone else owns: dfc1 gets its own
        # (dinter is this backward's: the fused activation writes inter over it).
        inter, dfc1, dprobs = act.backward(fc1, probs, dinter)
        return dfc1, dprobs, _fc2_wgrad(dout, inter, offs, counts), None, None, None


class _ExpertsRecomputeFc1(torch.autograd.Function):
    """fc1 -> weighted activation -> fc2 in one function that saves only ``x`` (and the probs)
    and recomputes fc1 from it in backward (``--paging-recompute-expert-fc1``).

    fc1 is the widest expert activation (``fc1_out`` columns against ``hidden`` for ``x``: 6x
    at moe-ffn 3072, hidden 1024, gated), so keeping only ``x`` cuts what paging or offloading
    moves per layer by that much for one extra grouped GEMM in backward. Backward runs the same
    GEMMs as :class:`_Fc1` + :class:`_ActFc2` on the same inputs (the recomputed fc1 is the
    forward's fc1 bit for bit) and the same activation, so gradients are bitwise equal. The
    recomputed fc1 is this function's own, so the fused activation writes ``dfc1`` over it
    (and ``inter`` over ``dinter``): the backward's transient is then ``dout``, fc1 and
    ``dinter``, nothing more of their size.
    """

    @staticmethod
    def forward(ctx, x, probs, w1, w2, offs, counts, act):
        fc1 = _gmm(x, w1.transpose(1, 2), offs, counts)
        inter = act.forward(fc1, probs)
        del fc1
        out = _gmm(inter, w2.transpose(1, 2), offs, counts)
        ctx.save_for_backward(x, probs)
        # Weights and offsets stay off the saved tensors (see _ActFc2): the fc2 dgrad runs
        # before x is unpacked, beside its reload.
        ctx.w1, ctx.w2, ctx.offs, ctx.counts, ctx.act = w1, w2, offs, counts, act
        return out

    @staticmethod
    def backward(ctx, dout):
        w1, w2, offs, counts, act = ctx.w1, ctx.w2, ctx.offs, ctx.counts, ctx.act
        dout = dout.contiguous()
        dinter = _gmm(dout, w2, offs, counts)
        x, probs = ctx.saved_tensors
        fc1 = _gmm(x, w1.transpose(1, 2), offs, counts)
        inter, dfc1, dprobs = act.backward(fc1, probs, dinter, own_fc1=True)
        del fc1, dinter
        dw2 = _fc2_wgrad(dout, inter, offs, counts)
        del inter
        dx, dw1 = _fc1_grads(dfc1, x, w1, offs, counts)
        return dx, dprobs, dw1, dw2, None, None, None


def _mark_capacity_buffer(tensor: torch.Tensor, live_rows: torch.Tensor | None) -> None:
    """Megatron-Core's paged-stash mark, and the live count the paged offloading reads."""
    tensor.grouped_tensor_scale_inv = False
    if live_rows is not None:
        setattr(tensor, LIVE_ROWS_ATTR, live_rows)


class PagedGroupedMLP(MegatronModule):
    """Grouped experts without Transformer Engine whose saved activations are paged.

    Builder signature of Megatron-Core's experts (``ExpertsBuilder``):
    ``PagedGroupedMLP(num_local_experts, config, pg_collection=..., name=...)``; extra keywords
    ``gemm_backend`` ('auto', 'grouped', 'loop') and ``recompute_fc1`` (save only ``x`` and
    recompute fc1 in backward: :class:`_ExpertsRecomputeFc1`).
    """

    def __init__(
        self,
        num_local_experts,
        config,
        pg_collection=None,
        name=None,
        gemm_backend: str = "auto",
        recompute_fc1: bool = False,
    ):
        super().__init__(config=config)
        if gemm_backend not in GEMM_BACKENDS:
            raise ValueError(f"gemm_backend must be one of {GEMM_BACKENDS}, got {gemm_backend!r}")
        for flag in ("add_bias_linear", "fp8", "fp4", "moe_apply_probs_on_input"):
            if getattr(config, flag, None):
                raise ValueError(
                    f"PagedGroupedMLP does not support {flag}={getattr(config, flag)!r}"
                )
        if config.moe_latent_size:
            raise ValueError("PagedGroupedMLP does not support moe_latent_size")
        if getattr(config, "delay_wgrad_compute", False):
            # backward computes the weight gradients; a backward_dw that did nothing would
            # silently break Megatron's delayed-wgrad schedule.
            raise ValueError(
                "PagedGroupedMLP does not support delay_wgrad_compute=True (weight gradients "
                "are computed in backward)"
            )
        if get_pg_size(getattr(pg_collection, "expt_tp", None)) > 1:
            # the weights hold whole experts: a split over expert TP would be silently wrong
            raise ValueError("PagedGroupedMLP does not support expert tensor parallelism "
                             "(--expert-tensor-parallel-size must be 1)")
        self.num_local_experts = num_local_experts
        self.pg_collection = pg_collection
        self.gemm_backend = gemm_backend
        self.name = name
        offloading = getattr(config, "fine_grained_activation_offloading", False)
        modules = getattr(config, "offload_modules", None) or []
        self.offload_expert_fc1 = bool(offloading and "expert_fc1" in modules)
        self.offload_moe_act = bool(offloading and "moe_act" in modules)
        if recompute_fc1 and self.offload_moe_act:
            raise ValueError(
                "recompute_fc1=True keeps no fc1 for the moe_act offload group to offload; drop "
                "moe_act from offload_modules (expert_fc1 offloads the saved input)"
            )
        self.recompute_fc1 = bool(recompute_fc1)
        self.activation = expert_activation(config)
        ffn = config.moe_ffn_hidden_size
        fc1_out = 2 * ffn if config.gated_linear_unit else ffn
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        shape1, shape2 = (
            (num_local_experts, fc1_out, config.hidden_size),
            (num_local_experts, config.hidden_size, ffn),
        )
        self.weight1 = torch.nn.Parameter(
            torch.empty(shape1, dtype=config.params_dtype, device=device)
        )
        self.weight2 = torch.nn.Parameter(
            torch.empty(shape2, dtype=config.params_dtype, device=device)
        )
        for weight, init, dim in (
            (self.weight1, config.init_method, 1),
            (self.weight2, config.output_layer_init_method, 2),
        ):
            if config.perform_initialization:
                self._init(weight, init)
            # Expert weights reduce over the expert-data-parallel group (Megatron's mark).
            weight.allreduce = False
            set_tensor_model_parallel_attributes(weight, is_parallel=True, dim=dim, stride=1)

    @staticmethod
    def _init(weight, init_method):
        if weight.is_cuda:
            with get_cuda_rng_tracker().fork(get_expert_parallel_rng_tracker_name()):
                for e in range(weight.shape[0]):
                    init_method(weight.data[e])
        else:
            for e in range(weight.shape[0]):
                init_method(weight.data[e])

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs, **_):
        x = permuted_local_hidden_states
        backend = resolve_gemm_backend(self.gemm_backend, x)
        tokens_per_expert = tokens_per_expert.to(x.device)
        if backend == "grouped":
            offs, counts = torch.cumsum(tokens_per_expert, 0).to(torch.int32), None
        else:
            offs, counts = None, [int(n) for n in tokens_per_expert.tolist()]
        paging = self.config.moe_paged_stash
        if paging:
            x = mcore_paged_stash.paged_stash_group_start(x)
            factor = self.config.moe_expert_rank_capacity_factor
            stash_context = mcore_paged_stash.get_paged_stash_context(
                name="grouped_mlp",
                max_num_tokens=x.shape[0],
                num_tokens_tensor=tokens_per_expert.sum(),
                avg_num_tokens=int(x.shape[0] // factor) if factor else None,
            )
        else:
            stash_context = nullcontext()
        probs = permuted_probs.reshape(-1)
        live = None
        if self.offload_expert_fc1 or self.offload_moe_act:
            # One private count per call: the paged offloading backend moves only live rows.
            live = tokens_per_expert.sum().reshape(1).to(torch.int64)
        with stash_context:
            if self.recompute_fc1:
                output = self._recompute_fc1_forward(x, probs, offs, counts, live)
            else:
                output = self._forward(x, probs, offs, counts, live)
        if paging:
            output = mcore_paged_stash.paged_stash_group_commit(output, name="grouped_mlp")
        return output, None

    def _recompute_fc1_forward(self, x, probs, offs, counts, live):
        """One offload group (``expert_fc1``): the function saves only ``x``."""
        off_interface = mcore_offload.FineGrainedActivationOffloadingInterface
        manager = off_interface(self.offload_expert_fc1, x, "expert_fc1")
        with manager as x:
            _mark_capacity_buffer(x, live)
            output = _ExpertsRecomputeFc1.apply(
                x, probs, self.weight1, self.weight2, offs, counts, self.activation
            )
        return manager.group_offload(output, forced_released_tensors=[x])

    def _forward(self, x, probs, offs, counts, live):
        """Two offload groups: ``expert_fc1`` (fc1 saves ``x``), ``moe_act`` (saves fc1)."""
        off_interface = mcore_offload.FineGrainedActivationOffloadingInterface
        fc1_manager = off_interface(self.offload_expert_fc1, x, "expert_fc1")
        with fc1_manager as x:  # marks go on the tensors the functions save (group
            _mark_capacity_buffer(x, live)  # boundaries may hand back new tensor objects)
            fc1 = _Fc1.apply(x, self.weight1, offs, counts)
        fc1 = fc1_manager.group_offload(fc1, forced_released_tensors=[x])
        act_manager = off_interface(self.offload_moe_act, fc1, "moe_act")
        with act_manager as fc1:
            _mark_capacity_buffer(fc1, live)
            output = _ActFc2.apply(fc1, probs, self.weight2, offs, counts, self.activation)
        output = act_manager.group_offload(output, forced_released_tensors=[fc1])
        return output

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """Megatron-Core's expert checkpoint layout (``mcore/experts_checkpoint.py``): each
        expert a slice of the global expert axis, interchangeable with Megatron-Core's experts."""
        return experts_sharded_state_dict(self, prefix, sharded_offsets)

    def get_extra_state(self):
        """Nothing: the key exists so that Megatron-Core's per-expert extra states have a place
        in this module's checkpoint (``mcore/experts_checkpoint.py``)."""
        return None

    def set_extra_state(self, state):
        """Megatron-Core's per-expert extra states, loaded from its checkpoint: these experts
        keep no fp8 metadata, so they are dropped."""

    def backward_dw(self):
        """Weight gradients are computed in backward (delay_wgrad_compute is rejected)."""


__all__ = ["GEMM_BACKENDS", "PagedGroupedMLP", "resolve_gemm_backend"]
