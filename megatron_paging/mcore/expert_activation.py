"""The experts' prob-weighted activation, ``act(fc1) * probs``, as two interchangeable objects.

:class:`FusedSwiglu` (``config.bias_activation_fusion``: Megatron's ``bias_swiglu_fusion``,
on unless ``--no-bias-swiglu-fusion``) runs :mod:`megatron_paging.kernels.weighted_swiglu`,
one kernel per direction in fp32 math with nothing kept but inputs and outputs.
:class:`TorchActivation` (``--no-bias-swiglu-fusion``) is Megatron-Core's unfused expression —
any ``activation_func``, gated or not, with its clamp and linear offset.

Both give ``forward(fc1, probs) -> inter`` and ``backward(fc1, probs, dinter, own_fc1) ->
(inter, dfc1, dprobs)``: backward recomputes the activation from ``fc1`` and hands back
``inter`` too, for fc2's weight gradient. It consumes ``dinter`` (the fused kernel writes
``inter`` over it) and, with ``own_fc1`` (the fc1 recompute owns its fc1), ``fc1`` (``dfc1``
over it); the torch expression allocates new tensors instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_paging.kernels import weighted_swiglu


class TorchActivation:
    """Megatron-Core's unfused weighted activation."""

    def __init__(self, config):
        self.config = config

    def expression(self, fc1, probs):
        config = self.config
        if config.gated_linear_unit:
            x_glu, x_linear = torch.chunk(fc1, 2, dim=-1)
            if (clamp := config.activation_func_clamp_value) is not None:
                x_glu = x_glu.clamp(min=None, max=clamp)
                x_linear = x_linear.clamp(min=-clamp, max=clamp)
            act = config.activation_func(x_glu) * (x_linear + config.glu_linear_offset)
        else:
            act = config.activation_func(fc1)
        return (act * probs.unsqueeze(-1)).to(act.dtype)

    def forward(self, fc1, probs):
        with torch.no_grad():
            return self.expression(fc1, probs)

    def backward(self, fc1, probs, dinter, own_fc1: bool = False):
        """``(inter, dfc1, dprobs)`` by autograd over the expression (new tensors)."""
        del own_fc1  # autograd makes new tensors anyway
        with torch.enable_grad():
            fc1_, probs_ = fc1.detach().requires_grad_(), probs.detach().requires_grad_()
            inter = self.expression(fc1_, probs_)
        dfc1, dprobs = torch.autograd.grad(inter, (fc1_, probs_), dinter)
        return inter.detach(), dfc1.contiguous(), dprobs


class FusedSwiglu:
    """The fused prob-weighted SwiGLU (:mod:`megatron_paging.kernels.weighted_swiglu`)."""

    @staticmethod
    def forward(fc1, probs):
        return weighted_swiglu.forward(fc1, probs)

    @staticmethod
    def backward(fc1, probs, dinter, own_fc1: bool = False):
        # over only what is contiguous (the loop GEMM backend's outputs may not be)
        return weighted_swiglu.backward(
            fc1, probs, dinter, dfc1_over_fc1=own_fc1 and fc1.is_contiguous(),
            inter_over_dinter=dinter.is_contiguous())


def expert_activation(config):
    """The activation ``config`` asks for; raises one line for what the fused kernel lacks."""
    if not getattr(config, "bias_activation_fusion", False):
        return TorchActivation(config)
    if not (config.gated_linear_unit and config.activation_func is F.silu):
        raise ValueError(
            "PagedGroupedMLP fuses only SwiGLU (gated silu) under bias_activation_fusion; for "
            "another activation pass --no-bias-swiglu-fusion / --no-bias-gelu-fusion"
        )
    for name in ("activation_func_clamp_value", "glu_linear_offset"):
        if getattr(config, name, None):
            raise ValueError(
                f"the fused weighted SwiGLU has no {name} ({getattr(config, name)!r}); pass "
                "--no-bias-swiglu-fusion for the unfused expression"
            )
    return FusedSwiglu()


__all__ = ["FusedSwiglu", "TorchActivation", "expert_activation"]
