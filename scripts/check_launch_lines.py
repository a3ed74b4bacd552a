"""Before a GPU call, on the CPU: every launch line the GPU tests, the golden layouts and the
scale arms start the example with still passes its start-up checks (examples/preflight.py), and
none trips the runner's check of the model's config. A new refusal that would fail a GPU run is
found here, in about two minutes, instead of on the device.

    .venv/bin/python scripts/check_launch_lines.py        # exit 1 if any line is refused

Only the last start-up check, a visible GPU, may refuse: no GPU is expected here.
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import os
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for folder in ("examples", "tests", "benchmarks", "."):
    sys.path.insert(0, str(ROOT / folder))
LAYOUT_VARIABLES = ("WORLD_SIZE", "RANK", "NPROC")
ACCEPTED = "no CUDA GPU"


@functools.cache
def example_line(paged: bool, *extra: str) -> tuple[str, ...]:
    """The example script's flags followed by ``extra`` (its DRY_RUN output: a default such as
    its global batch gives way to a flag in ``extra``)."""
    env = {k: v for k, v in os.environ.items() if k not in LAYOUT_VARIABLES}
    env.update(DRY_RUN="1", PAGED="1" if paged else "0", PYTHON=sys.executable)
    return tuple(subprocess.run(["bash", str(ROOT / "examples" / "run_pretrain_1gpu.sh"), *extra],
                                env=env, capture_output=True, text=True,
                                check=True).stdout.splitlines())


def launch_lines(traces: Path):
    """``(name, argv, environment)`` of every line the GPU runs start the example with; the
    rerun pair's peer-load traces are written to ``traces`` (a directory), as bench_scale.py
    writes them."""
    import bench_scale
    import golden_values
    import test_example_emulated as emulated
    import test_example_features as features
    import test_example_pretrain as pretrain

    small = tuple(pretrain.SMALL)
    for paged in (True, False):
        arm = "paged" if paged else "unpaged"
        runs = [("small", small, {}), ("graphs", small + pretrain.GRAPHS, {}),
                ("eager long", small + pretrain.EAGER_LONG, {})]
        runs += [(f"feature {k}", small + v, features.ENV.get(k, {}))
                 for k, v in features.FEATURES.items()]
        runs += [(f"rerun {k}", small + v, {}) for k, (v, _) in features.RERUNS.items()]
        for name, flags in features.OPTIMIZER_FORMATS.items():
            save = ("--save", "checkpoint", "--save-interval", "2", "--exit-interval", "2")
            runs += [(f"save {name}", small + features.RESUME + flags + save, {}),
                     (f"load {name}", small + features.RESUME + flags + ("--load", "c"), {})]
        for env, stage in ((emulated.STAGE_0, "stage 0"), (emulated.STAGE_1, "last stage")):
            layout = small + emulated.LAYOUT
            runs += [(f"emulated {stage}", layout, env),
                     (f"emulated {stage} interleaved", layout + emulated.INTERLEAVED, env),
                     (f"emulated {stage} MLA",
                      layout + emulated.INTERLEAVED + emulated.MLA, env),
                     (f"emulated {stage} batch schedule",
                      emulated.SCHEDULE_BASE + emulated.SCHEDULE_LAYOUT, env)]
        runs += [(f"golden {name}", tuple(layout.flags), layout.env())
                 for name, layout in golden_values.LAYOUTS.items()]
        for modules in (pretrain.EXPERT_MODULES, pretrain.DENSE_MODULES):
            runs.append((f"offload paged {len(modules)} modules",
                         small + pretrain._offloading("paged", modules), {}))
        for name, extra, env in runs:
            yield f"{arm} {name}", list(example_line(paged, *extra)), env
    for name, flags in features.FEATURES.items():
        for paged in (True, False):
            yield (f"feature {name} {'paged' if paged else 'unpaged'}",
                   [*example_line(paged), *small, *flags], features.ENV.get(name, {}))
    for name, flags in features.THROUGH_RERUN.items():
        extra = small + flags + pretrain.SMALL_POOL + ("--paging-overflow-policy", "rerun")
        yield f"through rerun {name}", [*example_line(True), *extra], {}
    for layout, rank, arm, factor in bench_scale.plan_runs(
            list(bench_scale.LAYOUTS), list(bench_scale.ARMS), [2.0, 1.5, 3.0], True):
        argv, _ = bench_scale.arm_argv(layout, rank, arm, factor)
        argv = bench_scale.with_trace(argv, layout, rank, bench_scale.TRAIN_ITERS,
                                      traces / f"{layout.name}_{rank}_{arm}_{factor:g}.json")
        yield (f"scale {layout.name} rank {rank} {arm} cf {factor:g}",
               [*example_line(False), *argv], {**layout.env(rank), **bench_scale.ARMS[arm].env})


def main() -> int:
    warnings.simplefilter("ignore")
    logging.disable(logging.WARNING)  # Megatron's notices say nothing about the lines
    import preflight

    from megatron_paging.mcore.flag_checks import check_megatron_combinations

    runner_refusals = []
    start_up_check = preflight.check_as_megatron_runs_it

    def with_runner_check(raw, validated, config, environ, mcore_manager):
        start_up_check(raw, validated, config, environ, mcore_manager)
        if getattr(config, "moe_paged_stash", False) and not mcore_manager:
            try:  # what mcore/runner.py checks before the first step
                check_megatron_combinations(config)
            except ValueError as error:
                runner_refusals.append(f"the runner: {error}")

    preflight.check_as_megatron_runs_it = with_runner_check
    refused = total = 0
    traces = tempfile.TemporaryDirectory()
    for name, argv, env in launch_lines(Path(traces.name)):
        total += 1
        sys.argv = ["preflight.py", *argv]
        environ = {**{k: v for k, v in os.environ.items() if k not in LAYOUT_VARIABLES}, **env}
        stderr = io.StringIO()
        try:
            with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
                preflight.check(environ=environ)
            verdicts = []
        except SystemExit:
            last = (stderr.getvalue().strip().splitlines() or ["exit without a line"])[-1]
            verdicts = [] if ACCEPTED in last else [last]
        verdicts += runner_refusals
        runner_refusals.clear()
        for verdict in verdicts:
            print(f"refused: {name}: {verdict}", flush=True)
        refused += bool(verdicts)
    print(f"{total} launch lines, {refused} refused", flush=True)
    return 1 if refused else 0


if __name__ == "__main__":
    raise SystemExit(main())
