"""What tests/test_paging.py and tests/test_paging_reloads.py share: small pools over the
reference kernels and the CPU stream backend, a context paging through them, and a squaring op
that saves its input."""

from __future__ import annotations

import torch

from megatron_paging.config import PagingConfig
from megatron_paging.pages.pool import PagePools
from megatron_paging.runtime.context import PagingContext
from megatron_paging.runtime.engine import PagingEngine
from megatron_paging.runtime.streams import CpuStreamBackend

ROWS, WIDTH, PAGE = 16, 8, 4
ROW_BYTES, PAGES = WIDTH * 4, 16 * ROWS // PAGE
CONFIG = PagingConfig(page_size=PAGE, kernel_backend="reference")


def make_pools() -> PagePools:
    pools = PagePools(PAGE)
    pools.add(ROW_BYTES, cuda_rows=PAGES * PAGE)
    return pools


def paged(backend=None):
    """A context over an engine that pages through roomy pools from its first step."""
    backend = backend or CpuStreamBackend()
    pools = make_pools()
    return PagingContext(PagingEngine(CONFIG, stream_backend=backend, pools=pools)), backend, pools


def stashed(backend):
    return [e.info["record"] for e in backend.entries("launch", "stash")]


class Square(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return 2 * x * grad
