"""The ``megatron-paging`` command: one subcommand per entry of :data:`COMMANDS`.

Each entry names the subcommand, its one-line help, its plain-text description and a
``configure(parser)`` that adds the subcommand's arguments and returns the function that runs it
(``func(args) -> exit code``). A new subcommand is one more ``configure`` function and one more
entry; the help text shown by ``--help`` is plain text (no RST markup).
"""

from __future__ import annotations

import argparse
import runpy
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from megatron_paging.version import __version__

DESCRIPTION = (
    "Paged MoE activation stashing for Megatron-Core: page-tile CUDA kernels and a FIFO "
    "paging-stream scheduler."
)
EPILOG = "Run 'megatron-paging COMMAND --help' for the options of a command."

Handler = Callable[[argparse.Namespace], int]


class _Parser(argparse.ArgumentParser):
    """A bad argument is one line on stderr and exit status 2: the usage above it would bury it
    (the demo's is 17 lines)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} ('{self.prog} --help' lists the options)\n")


@dataclass(frozen=True)
class Command:
    name: str
    help: str  # one line, in the top-level command list
    description: str  # plain text, at the top of 'megatron-paging NAME --help'
    configure: Callable[[argparse.ArgumentParser], Handler]
    parser_options: dict = field(default_factory=dict)  # extra add_parser() keywords


# --- demo ------------------------------------------------------------------------------------


def _configure_demo(parser: argparse.ArgumentParser) -> Handler:
    from megatron_paging.demo import cli as demo_cli

    demo_cli.add_arguments(parser)  # sets its own description and formatter
    return demo_cli.run


# --- info ------------------------------------------------------------------------------------


def _cmd_info(_args: argparse.Namespace) -> int:
    from megatron_paging.env import info

    rows = info()
    width = max(len(k) for k in rows)
    for key, value in rows.items():
        print(f"{key:<{width}}  {value}")
    return 0


def _configure_info(_parser: argparse.ArgumentParser) -> Handler:
    return _cmd_info


# --- bench -----------------------------------------------------------------------------------


BENCHMARKS_DIR = Path(__file__).resolve().parent.parent / "benchmarks"


def benchmarks() -> dict[str, Path]:
    """The source checkout's ``benchmarks/bench_*.py`` by name (``bench_step_ratio.py``:
    ``step-ratio``); empty where megatron-paging is installed without its source tree."""
    scripts = sorted(BENCHMARKS_DIR.glob("bench_*.py"))
    return {script.stem.removeprefix("bench_").replace("_", "-"): script for script in scripts}


def _cmd_bench(args: argparse.Namespace) -> int:
    script = benchmarks().get(args.which)
    if script is None:
        print(f"error: no benchmark {args.which!r} in {BENCHMARKS_DIR}; run benchmarks from a "
              "source checkout", file=sys.stderr)
        return 2
    sys.argv = [str(script), *args.rest]
    sys.path.insert(0, str(script.parent))  # the benchmarks' shared helper (common.py)
    runpy.run_path(str(script), run_name="__main__")
    return 0


def _configure_bench(parser: argparse.ArgumentParser) -> Handler:
    found = benchmarks()
    listed = ", ".join(f"{name} ({script.name})" for name, script in found.items())
    parser.add_argument(
        "which",
        choices=list(found) or None,  # none found: any name, refused by _cmd_bench
        metavar="BENCHMARK",
        help=f"the benchmark to run: {listed}" if found
        else f"the benchmark to run (none found in {BENCHMARKS_DIR})",
    )
    parser.add_argument(
        "rest",
        nargs=argparse.REMAINDER,
        metavar="ARGS",
        help="arguments passed on to the benchmark script unchanged "
        "(e.g. 'megatron-paging bench kernels --help' shows the script's own options)",
    )
    return _cmd_bench


# --- plan ------------------------------------------------------------------------------------


def _cmd_plan(args: argparse.Namespace) -> int:
    from megatron_paging.env import quiet_megatron_import

    with quiet_megatron_import():  # megatron_paging.mcore imports Megatron-Core
        from megatron_paging.mcore.plan_cli import main as plan_main

    return plan_main(args.rest)


def _configure_plan(parser: argparse.ArgumentParser) -> Handler:
    parser.add_argument("rest", nargs=argparse.REMAINDER, metavar="ARGS",
                        help="the plan's options and the launch line's Megatron flags "
                        "('megatron-paging plan --help' lists the plan's options)")
    return _cmd_plan


COMMANDS: tuple[Command, ...] = (
    Command(
        "demo",
        "train a tiny MoE model unpaged and paged; check parity",
        "",  # megatron_paging.demo.cli sets it
        _configure_demo,
    ),
    Command(
        "info",
        "versions, CUDA, optional extras, extension cache",
        "Print the versions of megatron-paging, Python, torch, megatron-core and Triton, whether "
        "CUDA is available, whether Transformer Engine and apex import, the CUDA extension's "
        "cache folder and MEGATRON_PAGING_MAX_CTAS.",
        _configure_info,
    ),
    Command(
        "bench",
        "run a benchmark script from benchmarks/ (source checkout only)",
        "Run one of the benchmark scripts (bench_*.py) of the source checkout's benchmarks/ "
        "folder, with the remaining arguments passed on to it.",
        _configure_bench,
    ),
    Command(
        "plan",
        "predict each arm's per-rank memory for a launch line; size the page pools",
        "",  # megatron_paging.mcore.plan_cli prints its own help
        _configure_plan,
        # Every argument, '--help' and Megatron's flags included, goes to the plan's own
        # parser: no prefix character argparse would treat as an option here.
        parser_options={"prefix_chars": "\0", "add_help": False},
    ),
)


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The command line; ``only``: configure that subcommand's arguments alone (the others
    are listed but not configured: the demo's flags import Megatron, which 'info' must not
    need)."""
    parser = _Parser(prog="megatron-paging", description=DESCRIPTION, epilog=EPILOG)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}",
                        help="print the version of megatron-paging and exit")
    sub = parser.add_subparsers(dest="command", required=True, title="commands",
                                metavar="COMMAND", help="one of:")
    for command in COMMANDS:
        sub_parser = sub.add_parser(command.name, help=command.help,
                                    description=command.description or None,
                                    **command.parser_options)
        if only is None or command.name == only:
            sub_parser.set_defaults(func=command.configure(sub_parser))
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    chosen = next((a for a in argv if not a.startswith("-")), "")
    parser = build_parser(only=chosen)
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # said by the subcommand's parser, which owns the options
        commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        commands.choices[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
