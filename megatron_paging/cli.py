"""The ``megatron-paging`` command: ``demo``, ``info``, ``bench``."""

from __future__ import annotations

import argparse
import runpy
import sys
from pathlib import Path

BENCHMARKS = {
    "kernels": "bench_kernels.py",
    "host-cost": "bench_host_cost.py",
    "scheduler": "bench_scheduler.py",
    "frontier": "bench_frontier.py",
}


def _cmd_info(_args: argparse.Namespace) -> int:
    from megatron_paging.env import info

    rows = info()
    width = max(len(k) for k in rows)
    for key, value in rows.items():
        print(f"{key:<{width}}  {value}")
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    script = Path(__file__).resolve().parent.parent / "benchmarks" / BENCHMARKS[args.which]
    if not script.exists():
        print(f"error: {script} not found; run benchmarks from a source checkout", file=sys.stderr)
        return 2
    sys.argv = [str(script), *args.rest]
    sys.path.insert(0, str(script.parent))  # the benchmarks' shared helper (common.py)
    runpy.run_path(str(script), run_name="__main__")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from megatron_paging.demo import cli as demo_cli

    parser = argparse.ArgumentParser(prog="megatron-paging", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train a tiny MoE model unpaged and paged; check parity")
    demo_cli.add_arguments(demo)
    demo.set_defaults(func=demo_cli.run)
    sub.add_parser("info", help="versions, CUDA, optional extras, extension cache").set_defaults(
        func=_cmd_info
    )
    bench = sub.add_parser("bench", help="run a benchmark script from benchmarks/")
    bench.add_argument("which", choices=sorted(BENCHMARKS))
    bench.add_argument("rest", nargs=argparse.REMAINDER, help="arguments for the script")
    bench.set_defaults(func=_cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
