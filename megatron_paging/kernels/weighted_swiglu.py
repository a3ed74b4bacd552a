"""The experts' prob-weighted SwiGLU as one kernel per direction (``csrc/weighted_swiglu.cu``).

``fc1`` is ``[rows, 2 * cols]`` (gate half, then linear half), ``probs`` ``[rows]``:

    inter  = silu(gate) * linear * probs
    dfc1   = [dinter * probs * linear * silu'(gate), dinter * probs * silu(gate)]
    dprobs = sum over columns of dinter * silu(gate) * linear

computed in fp32 from the stored inputs with one rounding per output — the semantics of
Megatron-Core's fused ``weighted_bias_swiglu`` (``bias_swiglu_fusion``, on unless
``--no-bias-swiglu-fusion``), without its bias.
Unfused, torch runs this as about a dozen elementwise kernels whose fp32 temporaries (the
prob-weighted product is fp32) are each the size of the capacity buffer; they set the peak of
an expert backward. The kernels keep nothing but their inputs and outputs, and the backward can
write ``dfc1`` over ``fc1`` when the caller owns ``fc1`` (the fc1 recompute) and ``inter`` over
``dinter`` (both expert paths: ``dinter`` is made in their backward and dead after it).

On CPU tensors :func:`forward` / :func:`backward` run :func:`reference_forward` /
:func:`reference_backward`, the same formulas in torch (fp32 math, one rounding); on CUDA the
kernel, which matches them to the last bit except where the compiler fuses a multiply-add
differently or (``dprobs``) sums in another order (tests/test_weighted_swiglu.py measures it).
"""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_inputs(fc1: torch.Tensor, probs: torch.Tensor, dinter: torch.Tensor | None = None):
    """Raise a one-line error unless the arguments fit; returns ``(rows, cols)``."""
    if not isinstance(fc1, torch.Tensor) or fc1.dim() != 2 or fc1.shape[1] % 2:
        shape = tuple(fc1.shape) if isinstance(fc1, torch.Tensor) else type(fc1).__name__
        raise ValueError(f"fc1 must be a 2-D tensor [rows, 2 * cols], got {shape}")
    if fc1.dtype not in FLOAT_DTYPES:
        raise TypeError(f"fc1 must be float32, bfloat16 or float16, got {fc1.dtype}")
    rows, cols = fc1.shape[0], fc1.shape[1] // 2
    if not isinstance(probs, torch.Tensor) or probs.numel() != rows or probs.dim() > 2:
        shape = tuple(probs.shape) if isinstance(probs, torch.Tensor) else type(probs).__name__
        raise ValueError(f"probs must hold one value per fc1 row ({rows}), got {shape}")
    if probs.dtype not in FLOAT_DTYPES:
        raise TypeError(f"probs must be float32, bfloat16 or float16, got {probs.dtype}")
    for name, t in (("probs", probs), ("dinter", dinter)):
        if t is not None and t.device != fc1.device:
            raise ValueError(f"{name} is on {t.device} but fc1 is on {fc1.device}")
    if dinter is not None:
        if tuple(dinter.shape) != (rows, cols):
            raise ValueError(f"dinter must be [{rows}, {cols}], got {tuple(dinter.shape)}")
        if dinter.dtype != fc1.dtype:
            raise TypeError(f"dinter must be {fc1.dtype} like fc1, got {dinter.dtype}")
    return rows, cols


def _reference_terms(fc1, probs):
    """fp32 ``gate``, ``linear``, ``exp(-gate)``, ``silu(gate) * linear`` and the probs column:
    what both reference directions start from, computed the way the kernels do."""
    gate, linear = fc1.float().chunk(2, dim=-1)
    e = torch.exp(-gate)
    return gate, linear, e, gate / (1.0 + e) * linear, probs.reshape(-1, 1).float()


def reference_forward(fc1: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    check_inputs(fc1, probs)
    *_, act, p = _reference_terms(fc1, probs)
    return (act * p).to(fc1.dtype)


def reference_backward(fc1, probs, dinter):
    """``(inter, dfc1, dprobs)`` by the kernel's formulas in torch (any device)."""
    check_inputs(fc1, probs, dinter)
    gate, linear, e, act, p = _reference_terms(fc1, probs)
    d = dinter.float()
    sig, silu = 1.0 / (1.0 + e), gate / (1.0 + e)
    dpa = d * p
    dgate = dpa * linear * (sig * (1.0 + gate * (1.0 - sig)))
    dfc1 = torch.cat((dgate, dpa * silu), dim=-1).to(fc1.dtype)
    dprobs = (d * act).sum(dim=-1).to(probs.dtype).reshape(probs.shape)
    return (act * p).to(fc1.dtype), dfc1, dprobs


def _library():
    from megatron_paging.kernels import build, cuda_ops

    try:
        return cuda_ops.library()
    except build.BuildError as exc:
        raise build.BuildError(
            f"the fused weighted SwiGLU (Megatron's default bias_swiglu_fusion) needs the "
            f"CUDA extension: {exc}; or pass --no-bias-swiglu-fusion for the unfused torch ops"
        ) from exc


def forward(fc1: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """``inter`` ([rows, cols], fc1's dtype): the kernel on CUDA, the reference elsewhere."""
    if not fc1.is_cuda:
        return reference_forward(fc1, probs)
    rows, cols = check_inputs(fc1, probs)
    fc1, probs = fc1.contiguous(), probs.contiguous()
    inter = fc1.new_empty((rows, cols))
    problem = _library().weighted_swiglu_forward(fc1, probs.reshape(-1), inter)
    if problem:
        raise RuntimeError(problem)
    return inter


def backward(fc1, probs, dinter, *, dfc1_over_fc1: bool = False,
             inter_over_dinter: bool = False):
    """``(inter, dfc1, dprobs)`` for ``dinter``; ``inter`` is what the forward returned, for
    fc2's weight gradient. On CUDA the kernel can write ``dfc1`` over ``fc1`` and ``inter``
    over ``dinter`` (the caller must own them and not read them afterwards): then the backward
    allocates nothing fc1- or inter-sized. Elsewhere both are ignored."""
    if not fc1.is_cuda:
        return reference_backward(fc1, probs, dinter)
    rows, cols = check_inputs(fc1, probs, dinter)
    for name, t, over in (("dfc1_over_fc1", fc1, dfc1_over_fc1),
                          ("inter_over_dinter", dinter, inter_over_dinter)):
        if over and not t.is_contiguous():
            raise ValueError(f"{name} needs a contiguous tensor to write over")
    fc1, probs, dinter = fc1.contiguous(), probs.contiguous(), dinter.contiguous()
    dfc1 = fc1 if dfc1_over_fc1 else torch.empty_like(fc1)
    inter = dinter if inter_over_dinter else fc1.new_empty((rows, cols))
    # A row without columns has a zero sum; the kernel does not visit it.
    dprobs = probs.new_zeros(probs.shape) if cols == 0 else torch.empty_like(probs)
    problem = _library().weighted_swiglu_backward(
        fc1, probs.reshape(-1), dinter, dfc1, inter, dprobs.reshape(-1)
    )
    if problem:
        raise RuntimeError(problem)
    return inter, dfc1, dprobs


__all__ = ["check_inputs", "backward", "forward", "reference_backward", "reference_forward"]
