"""One emulated rank of an EP job on the CPU: Megatron's fake process group, a real MoELayer from
our spec (static dispatcher, paged experts), emulated peers. Run as a script (the process group
is process-global); each run of the list gets a fresh layer (same seed) and fresh peers; prints
one JSON line with every run's step results (hex floats: compared bitwise).

    python tests/fake_pg_worker.py '{"world": 8, "ep": 8, "rank": 3, "runs": [{"paged": true,
        "load": "lognormal:0.3"}, ...]}'
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main(spec: dict) -> list[dict]:
    warnings.simplefilter("ignore")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=spec["rank"],
                            world_size=spec["world"])
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(
        1, 1, None, expert_model_parallel_size=spec["ep"], create_gloo_process_groups=False)
    return [run({**spec, **one}) for one in spec["runs"]]


def run(spec: dict) -> dict:
    from mcore_fixtures import cpu_moe_layer, moe_config

    from megatron_paging.config import PagingConfig
    from megatron_paging.mcore.installer import PagingInstaller
    from megatron_paging.mcore.peers import EmulatedPeers
    from megatron_paging.tools.peer_load import parse_load

    peers = EmulatedPeers(parse_load(spec["load"], seed=spec.get("seed", 0)), spec.get("seed", 0))
    installer = PagingInstaller()
    api = installer.install(PagingConfig(page_size=16, pool_residency="step"), peers=peers)
    paged = spec["paged"]
    config = moe_config(num_moe_experts=spec["experts"], moe_router_topk=2,
                        expert_model_parallel_size=spec["ep"], moe_paged_stash=paged,
                        moe_expert_rank_capacity_factor=spec.get("capacity_factor", 2.0),
                        moe_paged_stash_buffer_size_factor_cuda=spec.get("pool_factor", 3.0))
    torch.manual_seed(0)
    layer = cpu_moe_layer(config)
    layer.set_layer_number(spec.get("layer", 7))
    if spec.get("budgetless"):  # as the rerun of an over-budget step: no static budget
        layer.token_dispatcher._comm_manager.moe_expert_rank_capacity_factor = None
    steps = []
    for step in range(spec.get("steps", 3)):
        peers.begin_step()
        layer.zero_grad()
        if paged:
            api.paged_stash_reset(enabled=True, config=config)
        outputs = []
        for micro in range(spec.get("microbatches", 2)):
            if paged:
                api.paged_stash_init_chunk_handler(None, None)
            gen = torch.Generator().manual_seed(100 * step + micro)
            hidden = torch.randn(16, 2, config.hidden_size, generator=gen).requires_grad_()
            out, _ = layer(hidden)
            outputs.append((hidden, out))
        losses = []
        for _hidden, out in reversed(outputs):  # backward in reverse: pages in flight
            loss = out.float().square().mean()
            loss.backward()
            losses.append(loss.item().hex())
        overflow = False
        if paged:
            flags = api.engine.flags
            overflow = bool(flags.read()["overflow"]) if flags is not None else False
            api.paged_stash_finish()
        grads = [float(p.grad.double().sum()).hex() for p in layer.parameters()
                 if p.grad is not None]
        inputs = [float(h.grad.double().sum()).hex() for h, _ in outputs]
        live = layer.token_dispatcher._comm_manager.tokens_per_expert.tolist()
        steps.append({"losses": losses, "grads": grads, "inputs": inputs, "live": live,
                      "overflow": overflow})
    pools = api.engine.pools
    result = {
        "steps": steps,
        "mode": api.engine.mode,
        "free": [list(p.free_pages()) == [p.num_cuda_pages, p.num_host_pages]
                 for p in (pools or [])],
        "received_rows": peers.stats.received_rows,
        "dropped_rows": peers.stats.dropped_rows,
        "capacity_rows": layer.token_dispatcher._comm_manager.num_permuted_tokens,
    }
    installer.uninstall()
    return result


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
