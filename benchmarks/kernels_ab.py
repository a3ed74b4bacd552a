"""A/B of the page kernels of several source trees on one GPU, in one call: did a change move them?

Each round runs the probe once in this tree and once in every baseline tree (alternating, so a
drift of the GPU's clocks hits all arms alike), each in its own process with its own extension
build (all trees build side by side before the first round). The probe times stash and reload
through each path (``cuda``: the dispatch rule, ``tile``, ``bulk``) and ``copy_`` with
bench_kernels' cases, two ways: the benchmark's timer (L2 flush, then the start event) and with
the host held ahead of the GPU (a sleep kernel before the start event), so a slower host-side
call cannot pass for a slower kernel. It also records the host time of each call.

Both timers put the flush and an event before each launch, so neither shows what a launch costs
right behind another kernel (what programmatic dependent launch changes): ``--chain K`` adds
arms that time K stash + reload pairs (K pairs of ``copy_``) back to back behind a sleep kernel,
with nothing between the launches, in µs per launch (L2 warm). ``--max-ctas`` adds the
dispatch rule's arms at those grid bounds; regimes ``small-h7168`` and ``small-224`` are records
with fewer bulk tiles than an H100 or H200 has SMs.

    git archive <commit> megatron_paging benchmarks/bench_kernels.py benchmarks/common.py \\
        benchmarks/portable.py | (mkdir -p /tmp/base && tar -x -C /tmp/base)
    python benchmarks/kernels_ab.py --baseline /tmp/base --baseline-commit <commit>

The baseline trees need bench_kernels' ``Case``, ``Regime`` and ``REGIMES`` (any commit since
they exist). With one baseline its rows are tagged ``baseline``, with several by folder name.
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
# Records with fewer bulk tiles than 132 SMs: (name, dtype, hidden, capacity rows, live rows).
SMALL_RECORDS = {
    "small-h7168": ("bf16 h7168 200/256 live (4 x 28 bulk tiles)", "bfloat16", 7168, 256, 200),
    "small-224": ("224-byte rows 6144/8192 live (128 bulk tiles)", "uint8", 224, 8192, 6144),
}


def regime_of(key: str):
    """bench_kernels' regime at index ``key``, or the small record of that name."""
    import torch
    from bench_kernels import REGIMES, Regime

    if key in SMALL_RECORDS:
        name, dtype, hidden, capacity, live = SMALL_RECORDS[key]
        return Regime(name, getattr(torch, dtype), hidden, capacity, live)
    return REGIMES[int(key)]


def probe(regimes: list[str], max_ctas: list[int], chain: int) -> list[dict]:
    """Run in the tree under test (cwd): one row per regime, arm and timer."""
    sys.path.insert(0, "benchmarks")
    import torch
    from bench_kernels import Case

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

    def chained(pair, setup, reps: int = 20) -> float:
        """Median µs per launch of ``chain`` calls of ``pair`` (two launches) back to back."""
        setup()
        samples = []
        for _ in range(reps + 2):  # the first two warm up
            torch.cuda._sleep(10_000_000)  # ~6 ms: every launch is queued before the first runs
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(chain):
                pair()
            end.record()
            samples.append((start, end))
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in samples[2:]) * 1e3 / (2 * chain)

    rows = []
    for key in regimes:
        regime = regime_of(key)
        case = Case(regime, None)
        for arm, (fn, setup) in arms_of(case, max_ctas).items():
            for host_ahead in (False, True):
                ms, host = timed(fn, setup, host_ahead)
                rows.append({"regime": regime.name, "arm": arm, "host_ahead": host_ahead,
                             "gbps": round(case.moved / ms / 1e6, 1), "host_us": round(host, 1)})
        for arm, (pair, setup) in (chain_arms_of(case) if chain else {}).items():
            us = chained(pair, setup)
            rows.append({"regime": regime.name, "arm": arm, "host_ahead": True,
                         "us_per_launch": round(us, 2), "gbps": round(case.moved / us / 1e3, 1)})
        del case
        torch.cuda.empty_cache()
    return rows


def arms_of(case, max_ctas: list[int]) -> dict:
    """Arm name -> (timed call, untimed set-up before it); each path checked byte for byte."""
    n = case.regime.live_rows
    arms = {"copy_": (lambda: case.dst[:n].copy_(case.src[:n]), lambda: None)}
    for path in ("cuda", "tile", "bulk"):
        case.verify(path)
        arms[f"{path}_stash"] = (lambda p=path: case.stash(p), case.reset)
        arms[f"{path}_reload"] = (lambda p=path: case.reload(p),
                                  lambda p=path: case.reset_and_stash(p))
    for m in max_ctas:
        arms[f"cuda_stash@{m}"] = (lambda m=m: case.stash("cuda", m), case.reset)
        arms[f"cuda_reload@{m}"] = (lambda m=m: case.reload("cuda", m),
                                    lambda m=m: case.reset_and_stash("cuda", m))
    return arms


def chain_arms_of(case) -> dict:
    """Arm name -> (two launches: a stash and its reload, or two copy_, set-up before the chain).
    A stash + reload pair leaves every page of the pool free again, so pairs chain without a
    reset."""
    n = case.regime.live_rows
    arms = {"copy__chain": (lambda: (case.dst[:n].copy_(case.src[:n]),
                                     case.dst[:n].copy_(case.src[:n])), lambda: None)}
    for path in ("cuda", "tile", "bulk"):
        arms[f"{path}_chain"] = (lambda p=path: (case.stash(p), case.reload(p)), case.reset)
    return arms


def tree_env(tree: Path, tag: str) -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(
        [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve()
         != HERE.parent] + [str(tree)]),
        "XDG_CACHE_HOME": str(Path(os.environ.get("TMPDIR", "/tmp")) / f"kernels_ab_{tag}")}


def build_all(trees: dict[str, Path]) -> None:
    """Every tree's extension, built side by side (each into its own cache) before round 0."""
    build = "from megatron_paging.kernels import cuda_ops; cuda_ops.library()"
    procs = {tag: subprocess.Popen([sys.executable, "-c", build], cwd=tree,
                                   env=tree_env(tree, tag), stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True)
             for tag, tree in trees.items()}
    for tag, proc in procs.items():
        out, _ = proc.communicate(timeout=900)
        if proc.returncode != 0:
            raise RuntimeError(f"{tag} tree ({trees[tag]}) did not build:\n{out[-2000:]}")


def run_tree(tree: Path, tag: str, probe_args: list[str]) -> list[dict]:
    out = subprocess.run([sys.executable, str(HERE / "kernels_ab.py"), *probe_args],
                         cwd=tree, env=tree_env(tree, tag), capture_output=True, text=True,
                         timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"{tag} tree ({tree}) failed:\n{out.stderr[-2000:]}")
    return [{"tree": tag, **row} for row in json.loads(out.stdout.strip().splitlines()[-1])]


def summary(rows: list[dict], tags: list[str]) -> list[str]:
    """One line per regime, arm and timer: the median over rounds of each tree's figure (GB/s;
    µs per launch for the chain arms), trees in ``tags`` order."""
    cells: dict[tuple, dict[str, list[float]]] = {}
    for row in rows:
        key = (row["regime"], row["arm"], row["host_ahead"])
        value = row.get("us_per_launch", row["gbps"])
        cells.setdefault(key, {}).setdefault(row["tree"], []).append(value)
    lines = [f"{'regime':<46} {'arm':<16} {'ahead':<5} " + " ".join(f"{t:>12}" for t in tags)]
    for (regime, arm, ahead), by_tree in cells.items():
        figures = " ".join(f"{statistics.median(by_tree[t]):>12.2f}" if t in by_tree
                           else f"{'-':>12}" for t in tags)
        lines.append(f"{regime[:46]:<46} {arm:<16} {str(ahead):<5} {figures}")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", type=Path, action="append",
                        help="another source tree (repeat for several)")
    parser.add_argument("--baseline-commit", action="append",
                        help="its commit, recorded (repeat in --baseline's order)")
    parser.add_argument("--regimes", default="0,3,4",
                        help="bench_kernels REGIMES indices and small-record names "
                        f"({', '.join(SMALL_RECORDS)}), comma-separated")
    parser.add_argument("--max-ctas", type=int, nargs="*", default=[],
                        help="also time the dispatch rule's path at these grid bounds")
    parser.add_argument("--chain", type=int, default=0,
                        help="also time this many stash + reload pairs back to back (0: not)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds over all trees")
    parser.add_argument("--out", type=Path, default=None, help="result JSON")
    parser.add_argument("--probe", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.probe is not None:
        rows = probe(args.probe.split(","), args.max_ctas, args.chain)
        print(json.dumps(rows), flush=True)
        return 0
    if not args.baseline:
        parser.error("--baseline DIR is required")
    commits = args.baseline_commit or []
    if len(commits) > len(args.baseline):
        parser.error("more --baseline-commit than --baseline")
    commits += ["unknown"] * (len(args.baseline) - len(commits))
    baselines = ({"baseline": args.baseline[0]} if len(args.baseline) == 1
                 else {tree.resolve().name: tree for tree in args.baseline})
    if len(baselines) != len(args.baseline) or "this" in baselines:
        parser.error("baseline folders need distinct names other than 'this'")
    sys.path.insert(0, str(HERE))
    from common import default_out, header, require_gpu, write

    require_gpu("kernels A/B")
    trees = {"this": HERE.parent, **{tag: tree.resolve() for tag, tree in baselines.items()}}
    build_all(trees)
    probe_args = ["--probe", args.regimes, "--chain", str(args.chain)]
    probe_args += ["--max-ctas", *map(str, args.max_ctas)] if args.max_ctas else []
    rows = []
    for round_index in range(args.rounds):
        for tag, tree in trees.items():
            for row in run_tree(tree, tag, probe_args):
                rows.append({"round": round_index, **row})
                print(json.dumps(rows[-1]), flush=True)
    print("\n".join(summary(rows, list(trees))), flush=True)
    write({**header("kernels_ab"), "baseline_commits": dict(zip(baselines, commits, strict=True)),
           "method": "bench_kernels' cases; median of 40 CUDA-event timings per arm, L2 flushed "
           "before each; host_ahead: a ~1 ms sleep kernel before the start event; *_chain arms: "
           "median over 20 reps of chain stash + reload pairs (copy_ pairs) queued behind a sleep "
           "kernel, nothing between the launches, L2 warm, us_per_launch; rounds alternate the "
           "trees; GB/s = bytes read + written / time", "rows": rows},
          args.out or default_out("kernels_ab"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
