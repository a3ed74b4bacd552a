"""Fused core attention for the TE-free local spec, on PyTorch's ``scaled_dot_product_attention``.

:class:`SDPAttention` is a ``core_attention`` for Megatron-Core's ``SelfAttentionSubmodules``
with the constructor and forward of ``megatron.core.transformer.dot_product_attention.
DotProductAttention``, but it never materializes the ``[b, heads, sq, sk]`` scores and
probabilities that dominate the unfused module's activation memory.

Semantics (those of DotProductAttention unless stated):

* query ``[sq, b, np, hn]``, key/value ``[sk, b, ng, hn]`` (sbhd); output ``[sq, b, np * hn]``.
* ``AttnMaskType.causal``: SDPA's ``is_causal`` (needs ``sq == sk``; a single query token attends
  to every key, as in DotProductAttention). The ``attention_mask`` tensor of a causal layer is
  ignored, as by TE's fused attention and Megatron's fused softmax kernel: GPT's dataloader mask is
  that same causal mask, but document masks (``--reset-attention-mask``) are *not* applied.
  ``no_mask``, and ``padding``/``arbitrary`` without a mask tensor, attend to every key.
* scale: ``softmax_scale`` or ``1/sqrt(hn)``. ``apply_query_key_layer_scaling`` leaves it as is:
  DotProductAttention divides Q.K^T by the layer number and multiplies it back inside an fp32
  softmax (an fp16-overflow guard that fp32-accumulating kernels do not need); the product is equal.
* the softmax always runs in fp32 inside the kernels; ``attention_softmax_in_fp32=False`` (a
  lower-precision softmax) is not reproduced, as with TE.
* GQA: ``enable_gqa=True`` on flash and math, so backward keeps the un-repeated K/V; the
  efficient and cuDNN backends get K/V repeated (PyTorch documents GQA for flash and math only).
* dropout (``attention_dropout``, else ``config.attention_dropout``; training mode only) runs
  inside the tensor-parallel RNG tracker's fork unless ``sequence_parallel``. SDPA's CUDA kernels
  take their philox seed/offset from the default CUDA generator, whose state is exactly what the
  fork swaps in, so the masks come from the model-parallel stream (not DotProductAttention's
  masks: same distribution, other bits).

Refused with a one-line ``ValueError`` naming the field: ``context_parallel_size > 1``,
``softmax_type`` other than vanilla, ``window_size``, ``qk_clip``, ``packed_seq_params``,
``attention_bias``, a mask tensor with a non-causal ``attn_mask_type``, the other mask types,
causal ``sq != sk``, and ``deterministic_mode`` without torch's strict deterministic algorithms
(the kernels read torch's flag, not the config).

Backends (``sdpa_backend``, one of :data:`SDPA_BACKENDS`). An explicit name pins that backend
alone, so SDPA raises rather than silently fall back. ``auto`` (the default) pins ``flash`` for
fp16/bf16 CUDA tensors, in deterministic mode and otherwise; ``efficient`` for other CUDA dtypes
(flash has no fp32 kernel); ``math`` elsewhere (CPU). Evidence, PyTorch's
aten/src/ATen/native/transformers/cuda/ (github.com/pytorch/pytorch):

* attention_backward.cu ``_flash_attention_backward``: with ``use_deterministic_algorithms(True)``
  (what ``--deterministic-mode`` sets) it calls FA2's ``mha_bwd`` with ``deterministic=true``
  (serialized dQ accumulation, the only order-dependent gradient: Dao-AILab/flash-attention#988);
  with ``warn_only=True`` it only warns "Flash Attention defaults to a non-deterministic algorithm".
  The flash forward is deterministic. ``_efficient_attention_backward`` forces
  ``num_splits_key = 1`` in deterministic mode, so efficient would be deterministic too, but flash
  is faster (``priority_order``'s note: "flash_attention V2 is universally faster than
  efficient_attention") and does GQA without repeating K/V.
* sdp_utils.cpp ``check_cudnn_deterministic``: cuDNN is never selected in deterministic mode
  (pinned alone: "No available kernel"), so ``cudnn`` is refused there. ``check_cudnn_layout``
  wants ``[b, s, h, d]`` memory, which Megatron's sbhd views lack (hence a copy when pinned).
* sdp_utils.cpp ``priority_order`` (recent main): unpinned SDPA tries cuDNN first on sm90/sm100
  with cuDNN > 9.15, so an unpinned run would use cuDNN outside deterministic mode and flash
  inside it. Pinning flash in both keeps deterministic and production runs on one forward kernel.
* math is deterministic but materializes the scores: the memory this module exists to avoid.

The pytorch/pytorch#182551 randomness.rst table summarizes the same per backend.
"""

from __future__ import annotations

import math
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from torch.nn import attention as torch_attention
from torch.nn.attention import SDPBackend

SDPA_BACKENDS = ("auto", "flash", "efficient", "cudnn", "math")
# What a layer spec may use as core attention: this module, or Megatron's unfused local one.
CORE_ATTENTIONS = ("sdpa", "local")
_PINNED = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "math": SDPBackend.MATH,
}
_NATIVE_GQA = (SDPBackend.FLASH_ATTENTION, SDPBackend.MATH)
_UNMASKED = (AttnMaskType.no_mask, AttnMaskType.padding, AttnMaskType.arbitrary)


def validate_sdpa_backend(name: str) -> str:
    if name not in SDPA_BACKENDS:
        raise ValueError(f"sdpa_backend must be one of {SDPA_BACKENDS}, got {name!r}")
    return name


def select_sdpa_backend(
    name: str, device_type: str, dtype: torch.dtype, deterministic: bool,
    same_head_dim: bool = True,
) -> SDPBackend:
    """The one SDPA backend to pin for tensors of ``device_type``/``dtype`` (see module doc).
    ``same_head_dim=False`` (multi-latent attention: value heads narrower than query/key heads)
    rules flash out: it needs one head size for all three."""
    validate_sdpa_backend(name)
    on_cuda = device_type == "cuda"
    if name == "auto":
        if not on_cuda:
            return SDPBackend.MATH
        low_precision = dtype in (torch.float16, torch.bfloat16)
        flash = low_precision and same_head_dim
        return SDPBackend.FLASH_ATTENTION if flash else SDPBackend.EFFICIENT_ATTENTION
    if name in ("efficient", "cudnn") and not on_cuda:
        raise ValueError(f"sdpa_backend={name!r} needs CUDA tensors, got {device_type} tensors")
    if name == "cudnn" and deterministic:
        raise ValueError(
            "sdpa_backend='cudnn' is not deterministic (PyTorch excludes it under "
            "torch.use_deterministic_algorithms(True)); use 'flash' or 'auto'"
        )
    return _PINNED[name]


def strict_deterministic() -> bool:
    """Deterministic algorithms on and not warn-only: only then are flash/efficient backward
    passes deterministic (warn-only mode keeps their atomics and just warns)."""
    return (
        torch.are_deterministic_algorithms_enabled()
        and not torch.is_deterministic_algorithms_warn_only_enabled()
    )


def _refuse_unsupported(config) -> None:
    if config.context_parallel_size > 1:
        raise ValueError(
            f"SDPAttention does not support context parallelism "
            f"(context_parallel_size={config.context_parallel_size})"
        )
    if config.softmax_type != "vanilla":
        raise ValueError(
            f"SDPAttention supports softmax_type='vanilla' only, got {config.softmax_type!r}"
        )
    if config.window_size is not None:
        raise ValueError(
            f"SDPAttention does not support sliding windows (window_size={config.window_size})"
        )
    if config.qk_clip:
        raise ValueError("SDPAttention does not report attention logits, needed by qk_clip=True")


def _sbhd_to_bhsd(t: torch.Tensor) -> torch.Tensor:
    return t.permute(1, 2, 0, 3)


def _sbhd_to_bhsd_bshd_memory(t: torch.Tensor) -> torch.Tensor:
    # cuDNN's layout check accepts only [b, s, h, d]-contiguous memory seen as [b, h, s, d].
    return t.transpose(0, 1).contiguous().transpose(1, 2)


class SDPAttention(MegatronModule):
    """Core attention on ``scaled_dot_product_attention`` with one pinned backend (module doc).

    Takes DotProductAttention's arguments plus ``sdpa_backend`` (default ``"auto"``).
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: ProcessGroupCollection | None = None,
        sdpa_backend: str = "auto",
        k_channels: int | None = None,
        v_channels: int | None = None,
    ):
        super().__init__(config=config)
        self.sdpa_backend = validate_sdpa_backend(sdpa_backend)
        _refuse_unsupported(config)
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        # Head counts come from the tensors; the group is kept for sharded_state_dict.
        self.pg_collection = pg_collection
        self.tp_group = pg_collection.tp
        # DotProductAttention's effective scale: layer scaling divides and re-multiplies it.
        # (multi-latent attention passes its query/key and value head sizes, and its scale)
        head_dim = config.kv_channels if k_channels is None else k_channels
        self.softmax_scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"SDPAttention needs 0 <= attention_dropout < 1, got {dropout}")
        self.attention_dropout = float(dropout)

    def _is_causal(self, mask_type, attention_mask, sq: int, sk: int) -> bool:
        if mask_type == AttnMaskType.causal:
            if sq == 1:  # one query token (a decode step) sees every key, as DotProductAttention
                return False
            if sq != sk:
                raise ValueError(f"SDPAttention: causal attention needs sq == sk, got {sq}, {sk}")
            return True
        if mask_type == AttnMaskType.no_mask or (mask_type in _UNMASKED and attention_mask is None):
            return False
        masked = "" if attention_mask is None else " with an attention_mask tensor"
        raise ValueError(
            f"SDPAttention supports attn_mask_type causal or no_mask (padding/arbitrary without "
            f"a mask tensor), got attn_mask_type={mask_type.name}{masked}"
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        if packed_seq_params is not None:
            raise ValueError("SDPAttention does not support packed sequences (packed_seq_params)")
        if attention_bias is not None:
            raise ValueError("SDPAttention does not support attention_bias")
        deterministic = strict_deterministic()
        if self.config.deterministic_mode and not deterministic:
            raise ValueError(
                "SDPAttention: deterministic_mode=True needs torch.use_deterministic_algorithms("
                "True) (not warn_only): SDPA's backward kernels read torch's flag"
            )
        sq, batch, heads, _ = query.shape
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        is_causal = self._is_causal(mask_type, attention_mask, sq, key.size(0))
        backend = select_sdpa_backend(
            self.sdpa_backend, query.device.type, query.dtype, deterministic,
            same_head_dim=value.size(-1) == query.size(-1),
        )
        grouped = key.size(2) != heads
        native_gqa = backend in _NATIVE_GQA
        if grouped and not native_gqa:
            key = key.repeat_interleave(heads // key.size(2), dim=2)
            value = value.repeat_interleave(heads // value.size(2), dim=2)
        to_bhsd = (
            _sbhd_to_bhsd_bshd_memory if backend == SDPBackend.CUDNN_ATTENTION else _sbhd_to_bhsd
        )
        dropout_p = self.attention_dropout if self.training else 0.0
        # Megatron draws attention dropout from the tensor-parallel stream unless
        # sequence-parallel; without dropout no random numbers are drawn, so no fork is needed.
        if dropout_p > 0.0 and not self.config.sequence_parallel:
            rng_context = tensor_parallel.get_cuda_rng_tracker().fork()
        else:
            rng_context = nullcontext()
        # Looked up at call time so tests can record the pinned backend.
        with torch_attention.sdpa_kernel([backend]), rng_context:
            context = F.scaled_dot_product_attention(
                to_bhsd(query),
                to_bhsd(key),
                to_bhsd(value),
                dropout_p=dropout_p,
                is_causal=is_causal,
                scale=self.softmax_scale,
                enable_gqa=grouped and native_gqa,
            )
        # [b, np, sq, hn] -> [sq, b, np * hn]
        return context.permute(2, 0, 1, 3).contiguous().view(sq, batch, -1)


__all__ = [
    "CORE_ATTENTIONS",
    "SDPA_BACKENDS",
    "SDPAttention",
    "select_sdpa_backend",
    "strict_deterministic",
    "validate_sdpa_backend",
]
