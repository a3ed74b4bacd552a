"""Layer-spec helpers: a GPT-MoE built from Megatron-Core's local (TE-free) spec whose experts
are :class:`~megatron_paging.mcore.experts.PagedGroupedMLP`.

:func:`get_gpt_moe_paged_block_spec` is the whole decoder of a layout as Megatron-Core's own
``get_gpt_decoder_block_spec`` builds it (``--moe-layer-freq`` dense/MoE pattern,
``--multi-latent-attention``, shared experts, ``--qk-layernorm``, this pipeline stage's layers),
with those experts and that attention in every layer; :func:`get_gpt_moe_paged_layer_spec` is
one MoE layer of it.

The experts change, and by default the core attention:
:class:`~megatron_paging.mcore.attention.SDPAttention` (fused SDPA, no ``[b, heads, s, s]``
activations, as TE's fused attention) instead of Megatron's unfused ``DotProductAttention``
(``core_attention="local"``). Norms, projections, router and shared experts are exactly what
``get_gpt_layer_local_submodules`` gives, so the model trains without Transformer Engine or
apex, and paging (``--moe-paged-stash``) covers its expert activations.
"""

from __future__ import annotations

import dataclasses
from functools import partial

from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_layer_local_submodules,
)
from megatron.core.transformer.multi_latent_attention import MLASelfAttention
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayer

from megatron_paging.mcore.attention import CORE_ATTENTIONS, SDPAttention, validate_sdpa_backend
from megatron_paging.mcore.experts import PagedGroupedMLP


def paged_moe_mlp_builder(
    num_experts: int,
    gemm_backend: str = "auto",
    recompute_fc1: bool = False,
    **local_kwargs,
):
    """The ``mlp`` builder of an MoE layer: Megatron's local MoE with paged grouped experts."""
    if not isinstance(num_experts, int) or num_experts <= 0:
        raise ValueError(f"num_experts must be a positive integer, got {num_experts!r}")
    local = get_gpt_layer_local_submodules(num_experts=num_experts, **local_kwargs)
    return with_paged_experts(local.mlp, recompute_fc1, gemm_backend)


def with_core_attention(
    self_attention: ModuleSpec, core_attention: str = "sdpa", sdpa_backend: str = "auto"
) -> ModuleSpec:
    """``self_attention`` (a local SelfAttention spec) with the chosen core attention."""
    if core_attention not in CORE_ATTENTIONS:
        raise ValueError(f"core_attention must be one of {CORE_ATTENTIONS}, got {core_attention!r}")
    validate_sdpa_backend(sdpa_backend)
    if core_attention == "local":
        if sdpa_backend != "auto":
            raise ValueError(f"sdpa_backend={sdpa_backend!r} needs core_attention='sdpa'")
        return self_attention  # Megatron's unfused DotProductAttention, as the local spec has it
    submodules = dataclasses.replace(
        self_attention.submodules, core_attention=_sdpa_builder(self_attention, sdpa_backend)
    )
    return dataclasses.replace(self_attention, submodules=submodules)


def _sdpa_builder(self_attention: ModuleSpec, sdpa_backend: str):
    """SDPAttention as the attention module builds its core attention: ``SelfAttention`` calls
    the builder (a class or a ``partial``), ``MLASelfAttention`` passes it to ``build_module``
    (a class or a ``ModuleSpec``, which does not take a ``partial``)."""
    if sdpa_backend == "auto":
        return SDPAttention
    if isinstance(self_attention.module, type) and issubclass(self_attention.module,
                                                              MLASelfAttention):
        return ModuleSpec(module=SDPAttention, params={"sdpa_backend": sdpa_backend})
    return partial(SDPAttention, sdpa_backend=sdpa_backend)


def get_gpt_moe_paged_layer_spec(
    num_experts: int,
    normalization: str | None = None,
    qk_layernorm: bool = False,
    gemm_backend: str = "auto",
    core_attention: str = "sdpa",
    sdpa_backend: str = "auto",
    recompute_expert_fc1: bool = False,
) -> ModuleSpec:
    """A transformer-layer spec for GPT-MoE: local (TE-free) modules + paged grouped experts.

    Args:
        num_experts: routed experts per MoE layer (``--num-experts``).
        normalization: ``"RMSNorm"`` or None/``"LayerNorm"`` (``--normalization``).
        qk_layernorm: layernorm on queries and keys (``--qk-layernorm``).
        gemm_backend: PagedGroupedMLP GEMMs (``auto``, ``grouped``, ``loop``).
        core_attention: ``sdpa`` (SDPAttention) or ``local`` (Megatron's unfused attention).
        sdpa_backend: SDPAttention's pinned SDPA backend (``SDPA_BACKENDS``; ``auto``).
        recompute_expert_fc1: experts save only their input and recompute fc1 in backward
            (``--paging-recompute-expert-fc1``).
    """
    local_kwargs = dict(normalization=normalization, qk_layernorm=qk_layernorm)
    submodules = get_gpt_layer_local_submodules(num_experts=num_experts, **local_kwargs)
    mlp = paged_moe_mlp_builder(num_experts, gemm_backend, recompute_expert_fc1, **local_kwargs)
    attention = with_core_attention(submodules.self_attention, core_attention, sdpa_backend)
    submodules = dataclasses.replace(submodules, self_attention=attention, mlp=mlp)
    return ModuleSpec(module=TransformerLayer, submodules=submodules)


def with_paged_experts(mlp, recompute_fc1: bool = False, gemm_backend: str = "auto"):
    """An MoE layer's ``mlp`` builder (``partial(MoELayer, submodules=...)``) with
    :class:`PagedGroupedMLP` experts; a dense MLP's is returned as it is."""
    submodules = getattr(mlp, "keywords", {}).get("submodules")
    if submodules is None or not hasattr(submodules, "experts"):
        return mlp
    experts = partial(PagedGroupedMLP, gemm_backend=gemm_backend, recompute_fc1=recompute_fc1)
    return partial(mlp.func, submodules=dataclasses.replace(submodules, experts=experts))


def get_gpt_moe_paged_block_spec(
    config,
    normalization: str | None = None,
    vp_stage: int | None = None,
    pp_rank: int | None = None,
    recompute_expert_fc1: bool = False,
):
    """This pipeline stage's decoder (Megatron-Core's local block spec for ``config``) with
    PagedGroupedMLP experts and SDPAttention in every layer."""
    block = get_gpt_decoder_block_spec(
        config, use_transformer_engine=False, normalization=normalization, vp_stage=vp_stage,
        pp_rank=pp_rank,
    )
    layers = []
    for layer in block.layer_specs:
        submodules = dataclasses.replace(
            layer.submodules,
            self_attention=with_core_attention(layer.submodules.self_attention),
            mlp=with_paged_experts(layer.submodules.mlp, recompute_expert_fc1),
        )
        layers.append(dataclasses.replace(layer, submodules=submodules))
    return dataclasses.replace(block, layer_specs=layers)


__all__ = ["get_gpt_moe_paged_block_spec", "get_gpt_moe_paged_layer_spec",
           "paged_moe_mlp_builder", "with_core_attention", "with_paged_experts"]
