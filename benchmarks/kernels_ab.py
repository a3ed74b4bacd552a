"""A/B of the page kernels of two source trees on one GPU, in one call: did a change move them?

Each round runs the probe once in this tree and once in the baseline tree (alternating, so a
drift of the GPU's clocks hits both arms alike), each in its own process with its own extension
build. The probe times stash and reload through each path (``cuda``: the dispatch rule, ``tile``,
``bulk``) and ``copy_`` with bench_kernels' cases, two ways: the benchmark's timer (L2 flush,
then the start event) and with the host held ahead of the GPU (a sleep kernel before the start
event), so a slower host-side call cannot pass for a slower kernel. It also records the host
time of each call.

    git archive <commit> megatron_paging benchmarks/bench_kernels.py benchmarks/common.py \\
        benchmarks/portable.py | (mkdir -p /tmp/base && tar -x -C /tmp/base)
    python benchmarks/kernels_ab.py --baseline /tmp/base --baseline-commit <commit>

The baseline tree needs bench_kernels' ``Case`` and ``REGIMES`` (any commit since they exist).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def probe(regimes: list[int]) -> list[dict]:
    """Run in the tree under test (cwd): one row per regime, path and timer."""
    sys.path.insert(0, "benchmarks")
    import torch
    from bench_kernels import REGIMES, Case

    flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")

    def timed(fn, setup, host_ahead: bool, reps: int = 40) -> tuple[float, float]:
        for _ in range(3):
            setup()
            fn()
        events, host_us = [], []
        for _ in range(reps):
            setup()
            flush.zero_()
            if host_ahead:
                torch.cuda._sleep(2_000_000)  # about 1 ms: fn is enqueued long before it runs
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            t0 = time.perf_counter()
            fn()
            host_us.append((time.perf_counter() - t0) * 1e6)
            end.record()
            events.append((start, end))
        torch.cuda.synchronize()
        return (statistics.median(s.elapsed_time(e) for s, e in events),
                statistics.median(host_us))

    rows = []
    for index in regimes:
        regime = REGIMES[index]
        case = Case(regime, None)
        for arm, (fn, setup) in arms_of(case).items():
            for host_ahead in (False, True):
                ms, host = timed(fn, setup, host_ahead)
                rows.append({"regime": regime.name, "arm": arm, "host_ahead": host_ahead,
                             "gbps": round(case.moved / ms / 1e6, 1), "host_us": round(host, 1)})
        del case
        torch.cuda.empty_cache()
    return rows


def arms_of(case) -> dict:
    """Arm name -> (timed call, untimed set-up before it); each path checked byte for byte."""
    n = case.regime.live_rows
    arms = {"copy_": (lambda: case.dst[:n].copy_(case.src[:n]), lambda: None)}
    for path in ("cuda", "tile", "bulk"):
        case.verify(path)
        arms[f"{path}_stash"] = (lambda p=path: case.stash(p), case.reset)
        arms[f"{path}_reload"] = (lambda p=path: case.reload(p),
                                  lambda p=path: case.reset_and_stash(p))
    return arms


def run_tree(tree: Path, tag: str, regimes: str) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve()
         != HERE.parent] + [str(tree)]),
        "XDG_CACHE_HOME": str(Path(os.environ.get("TMPDIR", "/tmp")) / f"kernels_ab_{tag}")}
    out = subprocess.run([sys.executable, str(HERE / "kernels_ab.py"), "--probe", regimes],
                         cwd=tree, env=env, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"{tag} tree ({tree}) failed:\n{out.stderr[-2000:]}")
    return [{"tree": tag, **row} for row in json.loads(out.stdout.strip().splitlines()[-1])]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", type=Path, help="the other source tree")
    parser.add_argument("--baseline-commit", default="unknown", help="its commit, recorded")
    parser.add_argument("--regimes", default="0,3,4", help="bench_kernels REGIMES indices")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--probe", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.probe is not None:
        print(json.dumps(probe([int(i) for i in args.probe.split(",")])), flush=True)
        return 0
    if args.baseline is None:
        parser.error("--baseline DIR is required")
    sys.path.insert(0, str(HERE))
    from common import default_out, header, require_gpu, write

    require_gpu("kernels A/B")
    rows = []
    for round_index in range(args.rounds):
        for tree, tag in ((HERE.parent, "this"), (args.baseline, "baseline")):
            for row in run_tree(tree.resolve(), tag, args.regimes):
                rows.append({"round": round_index, **row})
                print(json.dumps(rows[-1]), flush=True)
    write({**header("kernels_ab"), "baseline_commit": args.baseline_commit,
           "method": "bench_kernels' cases; median of 40 CUDA-event timings per arm, L2 flushed "
           "before each; host_ahead: a ~1 ms sleep kernel before the start event; rounds "
           "alternate the trees; GB/s = bytes read + written / time", "rows": rows},
          args.out or default_out("kernels_ab"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
