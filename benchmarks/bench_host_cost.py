"""Host microseconds per stash/reload call and per paged layer (issue: cut the host cost).

Tiny records, so every kernel is shorter than the host work that issues it and the host time is
what the timer sees (no synchronize inside the timed loops; the GPU never falls behind far
enough to block the host). Runs against whichever ``megatron_paging`` is importable, so the same
script measures an older tree too (``PYTHONPATH=<old tree> python benchmarks/bench_host_cost.py
--label before``): it only uses calls both APIs have.

* ``kernel_call_us``: one ``kernels.stash`` + one ``kernels.reload`` of a one-page record, per
  call (the Python wrapper, the argument checks, the operator call, the launch).
* ``layer_us``: one paged layer through the scheduler: open_slot, 2 saves, commit (2 stashes),
  backward_slot_start (2 reloads), 2 unpacks, on a CUDA stream backend.
* ``context_layer_us``: one synthetic MoE layer (:class:`SyntheticMoELayer`, 3 marked capacity
  buffers of 8 segments) forward + backward through :class:`PagingContext`, ``unpaged`` (no
  engine) and ``paged`` — their difference is the runtime's whole host cost per layer
  (hooks, slots, saves, stash, reload, unpack), the quantity the scheduler benchmark's gaps
  come from.
* ``primitives_us``: the CUDA-side host primitives that path is built of (event create +
  record, a stream wait, a stream switch, ``record_stream``, a small allocation, a small copy).
* ``offload_group_us`` (trees with the offloading backend): one offload group through the
  scheduler: 2 whole tensors (arena DMA) + 1 live-row record (host-only pool), commit,
  backward_slot_start, 3 unpacks — the host work per group that the eager example pays.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

ROWS, ROW_BYTES, PAGE = 64, 256, 64


def _scheduler(backend, pools):
    from megatron_paging.scheduler import PagingScheduler

    try:
        from megatron_paging.config import PagingConfig
    except ImportError:  # the tree before the typed config
        return PagingScheduler(backend, pools, kernel_backend="cuda", page_size=PAGE)
    return PagingScheduler(backend, pools, config=PagingConfig(page_size=PAGE,
                                                               kernel_backend="cuda"))


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _median_us(fn, calls: int, repeats: int) -> float:
    per_call = []
    for _ in range(repeats):
        _sync()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        per_call.append((time.perf_counter() - start) / calls * 1e6)
        _sync()
    return statistics.median(per_call)


def measure(calls: int = 2000, repeats: int = 7) -> dict:
    from megatron_paging import kernels
    from megatron_paging.pool import PagePool, PagePools
    from megatron_paging.record import PageRecord
    from megatron_paging.streams import CudaStreamBackend

    device = torch.device("cuda")
    pool = PagePool.for_rows(ROW_BYTES, PAGE, 4 * ROWS, 0, device)
    src = torch.randint(0, 256, (ROWS, ROW_BYTES), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    live = torch.tensor([ROWS - 7], device=device)
    record = PageRecord.new(ROWS, ROW_BYTES, PAGE, live)

    def kernel_pair():
        kernels.stash(src, record, pool, "cuda")
        kernels.reload(dst, record, pool, "cuda")

    kernel_pair()
    torch.cuda.synchronize()
    if not torch.equal(dst[: ROWS - 7], src[: ROWS - 7]):
        raise RuntimeError("the round trip did not restore the rows")
    kernel_us = _median_us(kernel_pair, calls, repeats) / 2

    pools = PagePools(PAGE, device)
    pools.add(ROW_BYTES, 8 * ROWS)
    backend = CudaStreamBackend(device)
    tensors = [torch.randn(ROWS, ROW_BYTES // 4, device=device) for _ in range(2)]
    state = {"mb": 0, "scheduler": _scheduler(backend, pools)}

    def layer():
        scheduler, mb = state["scheduler"], state["mb"]
        state["mb"] += 1
        scheduler.open_slot(0, 0, mb)
        handles = [scheduler.save(t, live) for t in tensors]
        scheduler.commit()
        scheduler.backward_slot_start(0, 0, mb)
        for h in handles:
            scheduler.unpack(h)

    layer()
    layer_us = _median_us(layer, calls // 4, repeats)
    state["scheduler"].finish()
    offload_us = _offload_group_us(backend, pools, tensors, live, calls // 4, repeats)
    return {"kernel_call_us": kernel_us, "layer_us": layer_us, "records_per_layer": 2,
            "context_layer_us": _context_layer_us(backend, calls // 20, repeats),
            "primitives_us": _primitives_us(backend, calls, repeats),
            "offload_group_us": offload_us, "offload_group": "2 whole tensors + 1 live-row record",
            "record": f"{ROWS} rows x {ROW_BYTES} B, one page", "calls": calls,
            "repeats": repeats, "method": "median over repeats of host perf_counter per call"}


def _offload_group_us(backend, pools, tensors, live, calls, repeats) -> float | None:
    try:
        from megatron_paging.config import PagingConfig
        from megatron_paging.offload import HostArena, OffloadPools
        from megatron_paging.pool import PagePools
        from megatron_paging.scheduler import PagingScheduler
    except ImportError:  # a tree before the offloading backend
        return None
    device = pools.device
    host = PagePools(PAGE, device)
    host.add(ROW_BYTES, 0, 8 * ROWS)
    whole = tensors[0].numel() * tensors[0].element_size()
    offload = OffloadPools(host, HostArena(4 * whole, device))
    from megatron_paging import kernels

    kernels.prepare(host, "cuda")
    config = PagingConfig(page_size=PAGE, kernel_backend="cuda")
    state = {"mb": 0, "scheduler": PagingScheduler(backend, pools, config=config, offload=offload)}
    key = ("offload", 0, "core_attn")

    def group():
        scheduler, mb = state["scheduler"], state["mb"]
        state["mb"] += 1
        scheduler.open_slot(0, key, mb)
        handles = [scheduler.save(t, None, offload=True) for t in tensors]
        handles.append(scheduler.save(tensors[0], live, offload=True))
        scheduler.commit()
        scheduler.backward_slot_start(0, key, mb)
        for h in handles:
            scheduler.unpack(h)

    group()
    us = _median_us(group, calls, repeats)
    state["scheduler"].finish()
    return us


def _context_layer_us(backend, calls: int, repeats: int, kernel_backend: str = "cuda",
                      device=None) -> dict | None:
    """Host us per synthetic layer forward + backward, unpaged and paged (16 per step)."""
    try:
        from megatron_paging.config import PagingConfig
        from megatron_paging.engine import PagingEngine
        from megatron_paging.paging import PagingContext
        from megatron_paging.pool import PagePools
        from megatron_paging.tools.pipeline_sim import SyntheticMoELayer
    except ImportError:
        return None
    device = backend.device if device is None else device
    tokens, hidden, ffn, segments, microbatches = 256, 64, 128, 8, 16
    layer = SyntheticMoELayer(tokens, hidden, ffn, segments).to(device)
    x0 = torch.randn(tokens, hidden, device=device)
    grad = torch.randn_like(x0)
    pools = PagePools(PAGE, device)
    pools.add(hidden * 4, tokens * microbatches)
    pools.add(ffn * 4, 2 * tokens * microbatches)
    engine = PagingEngine(PagingConfig(page_size=PAGE, kernel_backend=kernel_backend),
                          stream_backend=backend, pools=pools)
    steps = {}
    for name, context in (("unpaged", PagingContext(None)), ("paged", PagingContext(engine))):
        def step(context=context):
            context.begin_step()
            outputs = []
            for mb in range(microbatches):
                x = x0.detach().requires_grad_(True)
                with context.forward(0, mb):
                    outputs.append(context.group_commit(layer(context.group_start(x, 0),
                                                              context)))
            for mb in reversed(range(microbatches)):
                with context.backward(0, mb):
                    torch.autograd.backward(outputs[mb], grad)
            if context.finish():
                raise RuntimeError("records left unreloaded")

        step()
        steps[name] = step
    counts = _counts_per_layer(steps, microbatches)
    # The arms alternate within each repeat, so a slow spell of the machine hits both.
    samples = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            samples[name].append(_median_us(step, max(calls, 3), 1) / microbatches)
    out = {name: statistics.median(v) for name, v in samples.items()}
    out |= {f"{name}_min": min(v) for name, v in samples.items()}
    out["paged_minus_unpaged"] = out["paged"] - out["unpaged"]
    out["paged_minus_unpaged_min"] = out["paged_min"] - out["unpaged_min"]
    out["counts_per_layer"] = counts
    out["profile_per_layer_us"] = _profile_per_layer(steps, microbatches)
    out["layer"] = f"{tokens} tokens, hidden {hidden}, ffn {ffn}, {segments} segments, 3 records"
    return out


def _counts_per_layer(steps: dict, microbatches: int) -> dict:
    """Deterministic companions of the timings, per layer forward + backward: aten ops
    dispatched (each an allocation, a view or a kernel launch on the GPU's host path) and
    Python-level calls (functions and builtins), per arm and paged minus unpaged."""
    import collections
    import sys

    from torch.utils._python_dispatch import TorchDispatchMode

    class AtenOps(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[str(func)] += 1
            return func(*args, **(kwargs or {}))

    out = {}
    for name, step in steps.items():
        with AtenOps() as aten:
            step()
        calls = [0]

        def count(frame, event, arg, calls=calls):
            if event in ("call", "c_call"):
                calls[0] += 1

        sys.setprofile(count)
        try:
            step()
        finally:
            sys.setprofile(None)
        out[name] = {"aten_ops": sum(aten.ops.values()) / microbatches,
                     "python_calls": calls[0] / microbatches, "by_op": aten.ops}
    paged, unpaged = out["paged"], out["unpaged"]
    out["paged_minus_unpaged"] = {
        "aten_ops": paged["aten_ops"] - unpaged["aten_ops"],
        "python_calls": paged["python_calls"] - unpaged["python_calls"],
        "by_op": {op: n / microbatches for op, n in (paged["by_op"] - unpaged["by_op"]).items()},
    }
    for name in steps:
        out[name]["by_op"] = {op: n / microbatches for op, n in out[name]["by_op"].items()}
    return out


def _profile_per_layer(steps: dict, microbatches: int, repeats: int = 5, top: int = 25) -> dict:
    """Where the paged layer's extra host time goes: cProfile's own time per function (C
    functions and methods included, e.g. an event record or the autograd engine's backward),
    in us per layer, paged minus unpaged, the largest differences first. Profiler overhead
    inflates every entry alike, so read them against each other, not as absolute costs."""
    import cProfile
    import pstats

    own = {}
    for name, step in steps.items():
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(repeats):
            step()
        profile.disable()
        stats = pstats.Stats(profile).stats  # {(file, line, func): (cc, nc, tottime, cum, ...)}
        scale = 1e6 / (repeats * microbatches)
        own[name] = {}
        for (path, line, func), entry in stats.items():
            key = f"{Path(path).name}:{line}:{func}" if line else func
            own[name][key] = own[name].get(key, 0.0) + entry[2] * scale
    paged, unpaged = own["paged"], own["unpaged"]
    diff = {key: paged.get(key, 0.0) - unpaged.get(key, 0.0) for key in paged.keys() | unpaged}
    rows = sorted(diff.items(), key=lambda item: -abs(item[1]))[:top]
    return {"total_paged": sum(paged.values()), "total_unpaged": sum(unpaged.values()),
            "top_differences": [[key, round(d, 2), round(paged.get(key, 0.0), 2),
                                 round(unpaged.get(key, 0.0), 2)] for key, d in rows],
            "columns": ["function", "paged minus unpaged", "paged", "unpaged"],
            "repeats": repeats}


def _primitives_us(backend, calls: int, repeats: int) -> dict:
    """Host us of each CUDA-side primitive the paging path issues (one call each)."""
    device, paging = backend.device, backend.paging_stream
    small = torch.zeros(8, dtype=torch.int64, device=device)
    scratch = torch.empty(8, dtype=torch.int64, device=device)
    event = torch.cuda.Event()
    event.record()
    block = torch.empty(1 << 16, dtype=torch.uint8, device=device)

    def stream_switch():
        with torch.cuda.stream(paging):
            pass

    cases = {
        "event_create_record": lambda: torch.cuda.Event().record(),
        "stream_wait_event": lambda: paging.wait_event(event),
        "stream_context_switch": stream_switch,
        "current_stream": lambda: torch.cuda.current_stream(device.index),
        "record_stream": lambda: block.record_stream(paging),
        "empty_64KiB": lambda: torch.empty(1 << 16, dtype=torch.uint8, device=device),
        "copy_8_int64": lambda: scratch.copy_(small),
        "clone_8_int64": small.clone,
        "slice_view": lambda: small[2:5],
    }
    return {name: _median_us(fn, calls, repeats) for name, fn in cases.items()}


def measure_cpu(calls: int = 20, repeats: int = 15) -> dict:
    """The runtime's Python cost alone: ``context_layer_us`` on the CPU with kernels that move
    nothing and a CPU stream backend that keeps no log (both defined here, for this
    measurement only), so what is left is the hooks, slots, records and scheduler."""
    from megatron_paging import kernels
    from megatron_paging.streams import CpuStreamBackend

    class QuietCpuBackend(CpuStreamBackend):
        """The CPU backend without its test log: every verb costs what the runtime pays."""

        def record(self, stream, what=""):
            return None

        def wait(self, stream, event, reason=""):
            pass

        def launch(self, stream, kind, fn, **info):
            fn()

        def keep_alive(self, tensor, stream):
            pass

        def note(self, kind, **info):
            pass

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: thread hand-offs would be noise
    kernels.REGISTRY["null"] = kernels.KernelBackend("null", lambda *args: None, ("cpu",))
    try:
        layer = _context_layer_us(QuietCpuBackend(), calls, repeats, "null", torch.device("cpu"))
    finally:
        del kernels.REGISTRY["null"]
        torch.set_num_threads(threads)
    return {"context_layer_us": layer, "calls": calls, "repeats": repeats,
            "method": "median over repeats of host perf_counter per step / microbatches; "
                      "kernels move nothing (host Python cost only)"}


def _print_profile(label: str, profile: dict, rows: int = 12) -> None:
    print(f"{label}: profiled us per layer (own time, profiler overhead included): paged "
          f"{profile['total_paged']:.1f}, unpaged {profile['total_unpaged']:.1f}; largest "
          "differences:", flush=True)
    for key, diff, paged, unpaged in profile["top_differences"][:rows]:
        print(f"  {diff:+9.1f}  ({paged:8.1f} vs {unpaged:8.1f})  {key}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", default="after")
    parser.add_argument("--out", type=Path, required=True, help="JSON to write (one label)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: only the runtime's Python cost per layer (measure_cpu)")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_host_cost needs a CUDA device (or --device cpu)")
    import megatron_paging

    result = {"label": args.label, "package": str(Path(megatron_paging.__file__).parent)}
    if args.device == "cpu":
        result |= measure_cpu()
        layer = result["context_layer_us"]
        print(f"{args.label} (cpu, Python only): synthetic layer fwd+bwd, median / min of "
              f"repeats: unpaged {layer['unpaged']:.1f} / {layer['unpaged_min']:.1f} us, paged "
              f"{layer['paged']:.1f} / {layer['paged_min']:.1f} us (+"
              f"{layer['paged_minus_unpaged']:.1f} / +{layer['paged_minus_unpaged_min']:.1f} us)",
              flush=True)
        extra = layer["counts_per_layer"]["paged_minus_unpaged"]
        print(f"{args.label} (cpu): paging adds {extra['aten_ops']:.2f} aten ops and "
              f"{extra['python_calls']:.1f} Python calls per layer: {extra['by_op']}", flush=True)
        _print_profile(args.label, layer["profile_per_layer_us"])
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        return
    result |= measure()
    offload = result["offload_group_us"]
    print(f"{args.label}: {result['kernel_call_us']:.1f} us per kernel call, "
          f"{result['layer_us']:.1f} us per layer of 2 records"
          + (f", {offload:.1f} us per offload group of 3 records" if offload else ""), flush=True)
    if layer := result.get("context_layer_us"):
        print(f"{args.label}: synthetic layer fwd+bwd {layer['unpaged']:.1f} us unpaged, "
              f"{layer['paged']:.1f} us paged (+{layer['paged_minus_unpaged']:.1f} us)", flush=True)
        _print_profile(args.label, layer["profile_per_layer_us"])
    print(f"{args.label}: primitives (us) " + ", ".join(
        f"{k} {v:.1f}" for k, v in result["primitives_us"].items()), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
