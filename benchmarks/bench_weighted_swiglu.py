"""The experts' prob-weighted SwiGLU: fused kernel vs Megatron-Core's unfused torch expression.

Per shape (rows = capacity rows of one layer and microbatch, cols = moe-ffn), bf16 ``fc1`` and
fp32 probs, forward and backward (backward = what the experts run: the activation recomputed
from ``fc1``, its gradients, and ``inter`` for fc2's weight gradient):

* milliseconds (CUDA events, median over ``--reps``, L2 flushed), the bytes the fused kernel
  must move at least (inputs read once, outputs written once) and the GB/s that gives;
* the peak memory each allocates beyond its inputs and outputs (the unfused expression's fp32
  temporaries; the fused kernel's is zero by construction, measured all the same).

Both arms are checked against each other (within the roundings of the unfused expression)
before they are timed. Prints a table, writes JSON (``--out``) and a PNG beside it.
Run: ``python benchmarks/bench_weighted_swiglu.py``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from common import (
    CudaTimer,
    default_out,
    figure,
    gbps,
    header,
    print_table,
    require_gpu,
    write,
)

from megatron_paging.kernels import weighted_swiglu
from megatron_paging.mcore.expert_activation import TorchActivation

MIB = 2**20
# moe_compute (benchmarks/frontier/arms.py): 98304 capacity rows, moe-ffn 3072; expert_heavy:
# 24576 x 2048; the example: 6144 x 1024.
SHAPES = ((98304, 3072), (24576, 2048), (6144, 1024))


# The experts' own unfused activation (what --no-bias-swiglu-fusion runs), SwiGLU.
UNFUSED = TorchActivation(SimpleNamespace(gated_linear_unit=True, activation_func=F.silu,
                                          activation_func_clamp_value=None,
                                          glu_linear_offset=0.0))


ARMS = {
    "unfused": (UNFUSED.forward, UNFUSED.backward),
    "fused": (weighted_swiglu.forward, weighted_swiglu.backward),
}


def transient_mib(fn, keep_bytes: int) -> float:
    """Peak bytes ``fn`` allocates beyond what it returns (``keep_bytes``), in MiB."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return (peak - keep_bytes) / MIB


def measure(rows: int, cols: int, timer: CudaTimer) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    fc1 = torch.randn(rows, 2 * cols, device="cuda", generator=gen).mul_(3).bfloat16()
    probs = torch.rand(rows, device="cuda", generator=gen)
    dinter = torch.randn(rows, cols, device="cuda", generator=gen).bfloat16()
    half, row_f32 = rows * cols * 2, rows * 4
    bytes_fwd = 2 * half + row_f32 + half  # fc1 + probs in, inter out
    # fc1 + dinter + probs in; dfc1 + inter + dprobs out
    bytes_bwd = 3 * half + row_f32 + 3 * half + row_f32
    checked = [ARMS[a][1](fc1, probs, dinter) for a in ARMS]
    for name, u, f in zip(("inter", "dfc1", "dprobs"), *checked, strict=True):
        if not torch.allclose(u.float(), f.float(), rtol=2**-5, atol=5e-2 * f.abs().max().item()):
            raise SystemExit(f"{rows}x{cols}: fused {name} disagrees with the unfused expression")
    del checked
    result = {"rows": rows, "cols": cols, "bytes_forward": bytes_fwd, "bytes_backward": bytes_bwd}
    for arm, (fwd, bwd) in ARMS.items():
        fwd_ms = timer(lambda fwd=fwd: fwd(fc1, probs))
        bwd_ms = timer(lambda bwd=bwd: bwd(fc1, probs, dinter))
        result[arm] = {
            "forward_ms": fwd_ms, "backward_ms": bwd_ms,
            "forward_gbps": gbps(bytes_fwd, fwd_ms), "backward_gbps": gbps(bytes_bwd, bwd_ms),
            "forward_transient_mib": transient_mib(lambda fwd=fwd: fwd(fc1, probs), half),
            "backward_transient_mib": transient_mib(
                lambda bwd=bwd: bwd(fc1, probs, dinter), 3 * half + row_f32),
        }
    return result


def plot(results):
    def draw(png):
        fig = figure(9, 4)
        ax = fig.add_subplot(1, 1, 1)
        labels = [f"{r['rows']}x{r['cols']}" for r in results]
        width = 0.2
        for i, (arm, key) in enumerate((("unfused", "forward_ms"), ("fused", "forward_ms"),
                                        ("unfused", "backward_ms"), ("fused", "backward_ms"))):
            ax.bar([x + (i - 1.5) * width for x in range(len(results))],
                   [r[arm][key] for r in results], width, label=f"{arm} {key[:-3]}")
        ax.set_xticks(range(len(results)), labels)
        ax.set_ylabel("ms (median)")
        ax.set_title("prob-weighted SwiGLU, bf16: fused kernel vs unfused torch")
        ax.legend()
        fig.savefig(png)

    return draw


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=str, default=None,
                        help="JSON path, PNG beside it (default: "
                        "benchmarks/results/weighted_swiglu_<gpu>.json)")
    parser.add_argument("--reps", type=int, default=20, help="timed calls per arm and direction")
    args = parser.parse_args(argv)
    require_gpu("weighted-swiglu")
    timer = CudaTimer(reps=args.reps)
    results = [measure(rows, cols, timer) for rows, cols in SHAPES]
    print_table(["shape", "arm", "fwd ms", "fwd GB/s", "bwd ms", "bwd GB/s", "fwd tmp MiB",
                 "bwd tmp MiB"],
                [[f"{r['rows']}x{r['cols']}", arm, f"{r[arm]['forward_ms']:.3f}",
                  f"{r[arm]['forward_gbps']:.0f}", f"{r[arm]['backward_ms']:.3f}",
                  f"{r[arm]['backward_gbps']:.0f}", r[arm]["forward_transient_mib"],
                  r[arm]["backward_transient_mib"]] for r in results for arm in ARMS])
    result = header("weighted_swiglu", reps=args.reps, results=results)
    out = args.out or default_out("weighted_swiglu")
    write(result, Path(out), plot(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
