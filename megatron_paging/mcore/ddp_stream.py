"""DDP's gradient accumulators on the stream the training steps run on.

Megatron 0.19.2's ``get_model`` builds the DDP wrappers inside ``torch.cuda.stream(<a new side
stream>)`` (kept for Transformer Engine's FP8 parameters; full-iteration CUDA graphs use the
capture stream instead). DDP keeps each parameter's ``AccumulateGrad`` node alive, and such a
node runs on the stream that was current when it was created: the side stream. Since PyTorch 2.9
autograd then records that stream on every weight gradient it hands over from the backward's
stream (``record_stream``, and the warning "The AccumulateGrad node's stream does not match the
stream of the node that produced the incoming gradient"). A gradient dropped by DDP's hook is
then reusable only once the GPU has passed that point, so the memory of every weight gradient
the host has run ahead of stays allocated, expert weight gradients included, at the
forward-backward peak.

:func:`on_training_stream` wraps Megatron's ``wrap_model_chunks_with_ddp`` so the wrappers (and
their accumulators) are made on the default stream, where the eager training steps run, except
where Megatron's side stream has a reason: FP8 (Transformer Engine's parameters) and CUDA-graph
implementations that train on another stream (``full_iteration``: the capture stream, which
Megatron already picks; ``transformer_engine``: a stream set at initialization).
"""

from __future__ import annotations

import functools
import logging

import torch

logger = logging.getLogger(__name__)

TRAINING_MODULE = "megatron.training.training"
WRAP_NAME = "wrap_model_chunks_with_ddp"
# cuda_graph_impl values whose eager steps run on the default stream.
DEFAULT_STREAM_GRAPH_IMPLS = ("none", "local")


def keeps_side_stream(config) -> str | None:
    """Why Megatron's own DDP stream stays for ``config`` (None: the default stream is used)."""
    if getattr(config, "fp8", None):
        return "fp8 (Transformer Engine's FP8 parameters set up their gradients there)"
    impl = getattr(config, "cuda_graph_impl", "none") or "none"
    if impl not in DEFAULT_STREAM_GRAPH_IMPLS:
        return f"--cuda-graph-impl {impl} (its steps do not run on the default stream)"
    return None


def on_training_stream(wrap):
    """``wrap_model_chunks_with_ddp`` made under the default stream (see the module docstring)."""

    @functools.wraps(wrap)
    def wrapped(model, config, *args, **kwargs):
        reason = keeps_side_stream(config)
        if reason is not None or not torch.cuda.is_available():
            if reason is not None:
                logger.info("megatron-paging: DDP initialized on Megatron's stream: %s", reason)
            return wrap(model, config, *args, **kwargs)
        default = torch.cuda.default_stream()
        default.wait_stream(torch.cuda.current_stream())  # Megatron's stream: ordered after
        with torch.cuda.stream(default):
            return wrap(model, config, *args, **kwargs)

    wrapped.megatron_paging_ddp_stream = True
    return wrapped


__all__ = ["TRAINING_MODULE", "WRAP_NAME", "keeps_side_stream", "on_training_stream"]
