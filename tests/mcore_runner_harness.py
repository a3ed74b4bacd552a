"""The Megatron runner's CPU harness: the smallest stand-ins for what the runner touches.

Megatron-Core's model and schedule are replaced by stand-ins that expose only what
``PagedStashRunner`` touches (``decoder.layers[i].mlp.token_dispatcher``, ``zero_grad_buffer``, the
forward-backward keyword interface, ``paged_stash_reset`` from the schedule); the pages go
through real pools with the stash/reload kernels. Used by ``test_mcore_runner*.py``.
"""

from __future__ import annotations

import os
import random
import tempfile
from types import SimpleNamespace

import numpy
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

pytest.importorskip("megatron.core")

from megatron_paging.config import PagingArgs, PagingConfig  # noqa: E402
from megatron_paging.kernels import reload, stash  # noqa: E402
from megatron_paging.mcore.runner import PagedStashRunner  # noqa: E402
from megatron_paging.pages.pool import PagePools  # noqa: E402
from megatron_paging.pages.record import PageRecord  # noqa: E402

HIDDEN, CAPACITY, PAGE, MICROBATCHES = 8, 16, 4, 4
ROW_BYTES = HIDDEN * 4


@pytest.fixture(scope="module", autouse=True)
def world():
    """A one-rank gloo world, so the runner's all_reduce is a real collective."""
    if dist.is_initialized():
        yield
        return
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{os.path.join(tmp, 'init')}"
        dist.init_process_group("gloo", init_method=init, rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


class Dispatcher:
    def __init__(self, config):
        self.config = config
        self._comm_manager = SimpleNamespace(
            moe_expert_rank_capacity_factor=config.moe_expert_rank_capacity_factor,
            over_budget=torch.zeros(1, dtype=torch.bool),
        )

    def check_over_budget(self):
        return self._comm_manager.over_budget

    def reset_over_budget(self):
        self._comm_manager.over_budget.fill_(0)


class Router(torch.nn.Module):
    """Megatron-Core's router as the runner sees it: an aux-loss-free expert bias, which
    finalize_model_grads updates at the end of every forward-backward."""

    def __init__(self):
        super().__init__()
        self.register_buffer("expert_bias", torch.zeros(3))


class Chunk(torch.nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        torch.manual_seed(0)
        self.weight = torch.nn.Parameter(torch.randn(HIDDEN, 3) * 0.3)
        self.router = Router()
        mlp = SimpleNamespace(token_dispatcher=Dispatcher(config))
        self.decoder = SimpleNamespace(layers=[SimpleNamespace(mlp=mlp)])
        self.mtp_process = False

    def zero_grad_buffer(self):
        self.weight.grad = None


class Engine:
    """The part of PagingEngine the runner uses: config (the policy), pools, flags, grow."""

    def __init__(self, cuda_rows, policy):
        self.config = PagingConfig.from_args(PagingArgs(paging_overflow_policy=policy),
                                             page_size=PAGE)
        self.cuda_rows = cuda_rows
        self.pools = self._new_pools()
        self.releases = 0
        self.paged = False

    def _new_pools(self):
        pools = PagePools(PAGE)
        pools.add(ROW_BYTES, self.cuda_rows)
        return pools

    def release_pools(self):
        """Stands in for PagingEngine.release_pools, whose next step calibrates new pools."""
        self.pools = self._new_pools()
        self.releases += 1

    @property
    def flags(self):
        return self.pools.flags if self.paged else None

    def grow(self, factor):
        """Blind growth (nothing counted); True: the pools changed, as PagingEngine.grow says."""
        self.pools = self.pools.grown(factor)
        return True


class Paging:
    """The part of MCorePagingAPI the runner uses, over real pools."""

    def __init__(self, cuda_rows, policy):
        self.engine = Engine(cuda_rows, policy)
        self.enabled = False

    def paged_stash_reset(self, enabled=True, config=None):
        self.enabled = self.engine.paged = bool(enabled)
        self.engine.pools.reset()

    def check_paged_stash_overflow(self):
        return self.engine.pools.flags.overflow.ne(0)

    def check_paged_stash_host_spill(self):
        return self.engine.pools.flags.host_spill.ne(0)


def make_forward_backward(paging, calls, budgets):
    """Megatron's schedule in miniature: reset paging, all forwards, then all backwards.
    ``calls`` logs whether each call paged, ``budgets`` the dispatcher's capacity factor."""

    def forward_backward(*, model, data_iterator, num_microbatches, forward_only, **_):
        calls.append(model[0].config.moe_paged_stash)
        config = model[0].config
        manager = model[0].decoder.layers[0].mlp.token_dispatcher._comm_manager
        budgets.append(manager.moe_expert_rank_capacity_factor)
        if config.moe_paged_stash:
            paging.paged_stash_reset(enabled=not forward_only, config=config)
        pools = paging.engine.pools if config.moe_paged_stash and paging.enabled else None
        dispatcher = model[0].decoder.layers[0].mlp.token_dispatcher
        losses = []
        for _ in range(num_microbatches):
            tokens, live, over_budget = next(data_iterator[0])
            if over_budget and dispatcher._comm_manager.moe_expert_rank_capacity_factor:
                dispatcher._comm_manager.over_budget.fill_(1)  # a static budget dropped tokens
            record = PageRecord.new(CAPACITY, ROW_BYTES, PAGE, torch.tensor(live))

            def pack(t, tokens=tokens, record=record, pools=pools):
                if t is not tokens or pools is None:
                    return t
                stash(t, record, pools[ROW_BYTES])
                return record

            def unpack(saved, pools=pools):
                if isinstance(saved, torch.Tensor):
                    return saved
                dst = torch.zeros(CAPACITY, HIDDEN)
                reload(dst, saved, pools[ROW_BYTES])
                return dst

            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                # Dropout draws from the RNG: a rerun must replay the attempt's draws.
                # Python's and NumPy's generators too (Megatron's error injection draws there)
                noise = 1.0 if forward_only else (
                    1.0 + 1e-3 * (random.random() + float(numpy.random.rand())))
                out = F.dropout(tokens @ model[0].weight * noise + model[0].router.expert_bias,
                                p=0.25, training=not forward_only)
            losses.append((out[:live].tanh() ** 2).sum())
        if not forward_only:
            for loss in losses:
                loss.backward()
            model[0].router.expert_bias.add_(0.125)  # finalize_model_grads' bias update
        return [float(loss.detach()) for loss in losses]

    return forward_backward


def batches(step, over_budget_step=None, count=MICROBATCHES):
    gen = torch.Generator().manual_seed(step)
    out = []
    for _ in range(count):
        live = int(torch.randint(CAPACITY // 2, CAPACITY + 1, (1,), generator=gen))
        tokens = torch.randn(CAPACITY, HIDDEN, generator=gen)
        tokens[live:] = 9.0
        out.append((tokens, live, step == over_budget_step))
    return out


class Run:
    def __init__(self, policy, cuda_rows, paged=True, optimizer="adamw"):
        self.config = SimpleNamespace(moe_paged_stash=paged, moe_expert_rank_capacity_factor=1.0)
        self.chunk = Chunk(self.config)
        params = [self.chunk.weight]
        self.optimizer = {
            "adamw": lambda: torch.optim.AdamW(params, lr=0.05),
            "adamw-fused": lambda: torch.optim.AdamW(params, lr=0.05, fused=True),
            "sgd": lambda: torch.optim.SGD(params, lr=0.1, momentum=0.9),
        }[optimizer]()
        self.paging = Paging(cuda_rows, policy)
        self.calls, self.budgets = [], []
        self.runner = PagedStashRunner(
            self.config,
            False,
            [self.chunk],
            self.optimizer,
            make_forward_backward(self.paging, self.calls, self.budgets),
            paging=self.paging,
        )

    def train_step(self, step, over_budget_step=None):
        """What megatron.training.train_step does around the runner."""
        torch.manual_seed(1000 + step)  # every run starts each step from the same RNG state
        random.seed(1000 + step)
        numpy.random.seed(1000 + step)
        self.chunk.zero_grad_buffer()
        losses = self.runner(
            model=[self.chunk],
            data_iterator=[iter(batches(step, over_budget_step))],
            num_microbatches=MICROBATCHES,
            seq_length=CAPACITY,
            forward_only=False,
        )
        self.optimizer.step()
        return losses

    def state(self):
        st = self.optimizer.state[self.chunk.weight]
        return [self.chunk.weight.detach().clone()] + [
            v.clone() for _, v in sorted(st.items()) if isinstance(v, torch.Tensor)
        ]


ROOMY = CAPACITY * MICROBATCHES
TINY = CAPACITY * 2  # overflows in the middle of the microbatches


def assert_equal_states(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)


def roomy_pools(rows=ROOMY):
    pools = PagePools(PAGE)
    pools.add(ROW_BYTES, rows)
    return pools
