"""CPU: the TE-free block spec builds every attention Megatron-Core offers with our core
attention (SelfAttention calls its builder, MLASelfAttention passes it to ``build_module``), and a
DeepSeek-V3-shaped block (MLA with q/kv LoRA, dense layers first, a shared expert) trains one
step."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from mcore_fixtures import installed, model_parallel, moe_config  # noqa: F401

from megatron_paging.mcore.attention import SDPAttention

MLA = dict(
    multi_latent_attention=True, q_lora_rank=24, kv_lora_rank=16, qk_head_dim=16,
    qk_pos_emb_head_dim=8, v_head_dim=8, kv_channels=16, qk_layernorm=True, rope_type="rope",
)  # fmt: skip


def _mla_config(**overrides):
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    base = moe_config(num_layers=3, moe_layer_freq=[0, 1, 1],
                      moe_shared_expert_intermediate_size=32,
                      attention_dropout=0.0, hidden_dropout=0.0,
                      normalization="RMSNorm", **overrides)
    fields = {f: getattr(base, f) for f in base.__dataclass_fields__ if f in vars(base)}
    fields.update(MLA, **overrides)
    return MLATransformerConfig(**{k: v for k, v in fields.items()
                                   if k in MLATransformerConfig.__dataclass_fields__
                                   and MLATransformerConfig.__dataclass_fields__[k].init})


@pytest.mark.parametrize("backend", ["auto", "math"])
def test_mla_block_builds_with_sdpa_and_trains(model_parallel, installed, backend,  # noqa: F811
                                               monkeypatch):
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention
    from megatron.core.transformer.transformer_block import TransformerBlock

    from megatron_paging.mcore.specs import get_gpt_moe_paged_block_spec, with_core_attention

    config = _mla_config()
    spec = get_gpt_moe_paged_block_spec(config, normalization="RMSNorm")
    if backend != "auto":
        layers = [replace(layer, submodules=replace(
            layer.submodules, self_attention=with_core_attention(
                layer.submodules.self_attention, sdpa_backend=backend)))
            for layer in spec.layer_specs]
        spec = replace(spec, layer_specs=layers)
    if not torch.cuda.is_available():  # MLA's rotary embedding asks CUDA for its device
        monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    torch.manual_seed(0)
    block = TransformerBlock(config, spec)
    attentions = [layer.self_attention for layer in block.layers]
    assert all(isinstance(a, MLASelfAttention) for a in attentions)
    assert all(isinstance(a.core_attention, SDPAttention) for a in attentions)
    assert {a.core_attention.sdpa_backend for a in attentions} == {backend}
    kinds = [type(layer.mlp).__name__ for layer in block.layers]
    assert kinds[0] == "MLP" and kinds[1:] == ["MoELayer", "MoELayer"]
    assert block.layers[1].mlp.shared_experts is not None

    hidden = torch.randn(8, 2, config.hidden_size, requires_grad=True)
    out = block(hidden, attention_mask=None)
    out = out[0] if isinstance(out, tuple) else out
    assert out.shape == hidden.shape and torch.isfinite(out).all()
    out.float().square().mean().backward()
    grads = [p.grad for p in block.parameters() if p.requires_grad]
    assert hidden.grad is not None and torch.isfinite(hidden.grad).all()
    assert sum(g is not None and bool(g.abs().sum() > 0) for g in grads) > len(grads) // 2


def test_self_attention_takes_a_pinned_backend(model_parallel, installed):  # noqa: F811
    from megatron.core.transformer.transformer_block import TransformerBlock

    from megatron_paging.mcore.specs import get_gpt_moe_paged_layer_spec

    config = moe_config(num_layers=1)
    spec = get_gpt_moe_paged_layer_spec(config.num_moe_experts, sdpa_backend="math")
    block = TransformerBlock(config, spec)
    assert block.layers[0].self_attention.core_attention.sdpa_backend == "math"
