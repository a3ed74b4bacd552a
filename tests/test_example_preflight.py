"""The example's start-up checks (examples/preflight.py, run by examples/run_pretrain_1gpu.sh):
the benchmark controls (MEGATRON_PAGING_BENCH_* variables, defaults are what a user runs), the
launch line's flags, PAGED, the interpreter and the layout (NPROC, WORLD_SIZE, RANK, Megatron's
validate_args). Every refusal is one error line naming the flag or variable, exit status 2."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from preflight import BenchControls, bench_controls  # noqa: E402

IMPL, BACKEND = "MEGATRON_PAGING_BENCH_IMPLEMENTATION", "MEGATRON_PAGING_BENCH_KERNEL_BACKEND"
NO_OVERLAP, FRACTION = "MEGATRON_PAGING_BENCH_NO_OVERLAP", "MEGATRON_PAGING_BENCH_MEMORY_FRACTION"
ONE_STREAM = "MEGATRON_PAGING_BENCH_ONE_PAGING_STREAM"


def test_defaults_are_what_a_user_runs():
    assert bench_controls({}) == BenchControls()


def test_controls_are_read_from_the_environment():
    controls = bench_controls({"MEGATRON_PAGING_BENCH_KERNEL_BACKEND": "tile",
                               "MEGATRON_PAGING_BENCH_NO_OVERLAP": "1",
                               "MEGATRON_PAGING_BENCH_MEMORY_FRACTION": "0.5"})
    assert controls == BenchControls(False, "tile", False, 0.5)
    assert not bench_controls({ONE_STREAM: "1"}).offload_streams
    assert bench_controls({"MEGATRON_PAGING_BENCH_IMPLEMENTATION": "mcore"}).mcore_manager


@pytest.mark.parametrize(
    ("environ", "named"),
    [
        ({IMPL: "theirs"}, IMPL),
        ({BACKEND: "fast"}, BACKEND),
        ({NO_OVERLAP: "yes"}, NO_OVERLAP),
        ({FRACTION: "1.5"}, FRACTION),
        ({FRACTION: "half"}, FRACTION),
        ({IMPL: "mcore", BACKEND: "tile"}, BACKEND),
        ({ONE_STREAM: "true"}, ONE_STREAM),
        ({IMPL: "mcore", ONE_STREAM: "1"}, ONE_STREAM),
    ],
)
def test_a_bad_value_names_its_variable(environ, named):
    with pytest.raises(ValueError) as error:
        bench_controls(environ)
    assert named in str(error.value) and "\n" not in str(error.value)


# --- the launch line: one "error:" line naming the flag or variable, exit status 2 ------------

ROOT = Path(__file__).resolve().parent.parent
LAUNCH = ROOT / "examples" / "run_pretrain_1gpu.sh"
LAYOUT_VARIABLES = ("NPROC", "WORLD_SIZE", "RANK", "LOCAL_WORLD_SIZE", "PAGED", "PYTHON")


def _launch(*argv, python=sys.executable, script=LAUNCH, **env):
    import os
    import subprocess

    environ = {k: v for k, v in os.environ.items() if k not in LAYOUT_VARIABLES}
    if python is not None:
        environ["PYTHON"] = python
    environ.update(env)
    return subprocess.run(["bash", str(script), *argv], capture_output=True, text=True,
                          env=environ, timeout=120)


def _one_error_line(stderr: str, *named: str) -> str:
    errors = [line for line in stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1, stderr[-3000:]
    assert errors[0].startswith("error: ") and stderr.strip().splitlines()[-1] == errors[0]
    assert "Traceback" not in stderr and "usage:" not in stderr
    assert all(name in errors[0] for name in named), errors[0]
    return errors[0]


def _refused(megatron_argv, capsys, extra, *named, paged="1", env=None) -> str:
    """The example's launch line plus ``extra`` through the preflight: exit 2 and one error line
    naming each of ``named``."""
    import preflight

    line = _launch(DRY_RUN="1", PAGED=paged).stdout.split()
    megatron_argv(*line, *extra, **(env or {}))
    with pytest.raises(SystemExit) as done:
        preflight.check(environ=env or {})
    assert done.value.code == 2
    return _one_error_line(capsys.readouterr().err, *named)


def test_a_bad_choice_on_the_launch_line_is_one_line_without_usage():
    result = _launch("--paging-overflow-policy", "bogus")
    assert result.returncode == 2
    _one_error_line(result.stderr, "--paging-overflow-policy", "bogus")


@pytest.fixture
def megatron_argv(monkeypatch):
    """Megatron's parser reads sys.argv and WORLD_SIZE / RANK: set both for one parse."""
    pytest.importorskip("megatron.training")
    for name in LAYOUT_VARIABLES:
        monkeypatch.delenv(name, raising=False)

    def use(*argv, **env):
        monkeypatch.setattr(sys, "argv", ["preflight.py", *argv])
        for name, value in env.items():
            monkeypatch.setenv(name, value)

    return use


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--paging-prefetch-distance", "abc"], ("--paging-prefetch-distance", "abc")),
        # a prefix of --paging-prefetch-distance: unknown (Megatron's parser never abbreviates)
        (["--paging-prefetch", "2"], ("--paging-prefetch", "unknown")),
        (["--paging-overflow", "rerun"], ("--paging-overflow", "unknown")),
        (["--bogus-flag"], ("--bogus-flag", "unknown")),
    ],
)
def test_a_bad_flag_is_one_line_naming_it(argv, named, megatron_argv, capsys):
    import preflight

    megatron_argv(*argv)
    with pytest.raises(SystemExit) as done:
        preflight.parse_args()
    assert done.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""
    _one_error_line(err, *named)


def test_what_megatron_accepts_is_unchanged(megatron_argv, capsys):
    import preflight

    line = _launch(DRY_RUN="1").stdout.split()
    megatron_argv(*line)
    args = preflight.parse_args()
    assert args.paging_overflow_policy == "rerun" and args.moe_paged_stash_page_size == 64
    megatron_argv("--help")
    with pytest.raises(SystemExit) as done:
        preflight.parse_args()
    assert done.value.code == 0 and "--paging-prefetch-distance" in capsys.readouterr().out


def test_paged_accepts_only_0_or_1():
    for value in ("yes", "2", "true"):
        result = _launch(PAGED=value)
        assert result.returncode == 2, value
        _one_error_line(result.stderr, "PAGED")
    assert "--moe-paged-stash" not in _launch(PAGED="0", DRY_RUN="1").stdout.split()
    assert "--moe-paged-stash" in _launch(PAGED="1", DRY_RUN="1").stdout.split()


def test_launching_before_set_up_says_to_run_make_demo(tmp_path):
    """A clone without .venv whose python3 has no torch: one line, no ModuleNotFoundError."""
    import shutil

    clone = tmp_path / "clone"
    (clone / "examples").mkdir(parents=True)
    for name in ("run_pretrain_1gpu.sh", "preflight.py", "feature_checks.py"):
        shutil.copy(ROOT / "examples" / name, clone / "examples" / name)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    python3 = bin_dir / "python3"  # this interpreter without its site-packages: no torch
    python3.write_text(f'#!/bin/sh\nexec "{sys.executable}" -S "$@"\n')
    python3.chmod(0o755)
    import os

    result = _launch(python=None, script=clone / "examples" / "run_pretrain_1gpu.sh",
                     PATH=f"{bin_dir}:{os.environ['PATH']}")
    assert result.returncode == 2
    _one_error_line(result.stderr, "make demo")


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"WORLD_SIZE": "abc"}, "WORLD_SIZE"),
        ({"NPROC": "abc"}, "NPROC"),
        ({"NPROC": "0"}, "NPROC"),
        ({"RANK": "-1"}, "RANK"),
        ({"LOCAL_WORLD_SIZE": "x"}, "LOCAL_WORLD_SIZE"),
    ],
)
def test_a_bad_launch_variable_is_one_line_naming_it(env, named):
    from preflight import launch_layout

    with pytest.raises(ValueError) as error:
        launch_layout(env)
    assert named in str(error.value) and "\n" not in str(error.value)


def test_a_bad_launch_variable_on_the_launch_line():
    result = _launch(WORLD_SIZE="abc")
    assert result.returncode == 2
    _one_error_line(result.stderr, "WORLD_SIZE")


FAKE_LINE = ("--fake-process-group", "--pipeline-model-parallel-size", "2",
             "--expert-model-parallel-size", "4", "--global-batch-size", "16")


@pytest.mark.parametrize(
    ("env", "extra", "named"),
    [
        # the fake group's emulated job: PP 2 does not divide 15 ranks
        ({"WORLD_SIZE": "15", "RANK": "1"}, FAKE_LINE, ("WORLD_SIZE=15", "pipeline")),
        ({"WORLD_SIZE": "16", "RANK": "99"}, FAKE_LINE, ("RANK=99",)),
        # EP 4 x PP 2 does not divide 12 ranks (Megatron's validate_args lets it through)
        ({"WORLD_SIZE": "12", "RANK": "1"}, FAKE_LINE, ("WORLD_SIZE=12", "expert")),
        # torchrun would replace WORLD_SIZE by NPROC: the variable would be ignored
        ({"WORLD_SIZE": "15"}, (), ("WORLD_SIZE=15", "NPROC")),
        ({"NPROC": "2", "RANK": "2"}, (), ("RANK=2",)),
        ({"NPROC": "2"}, ("--expert-model-parallel-size", "4"), ("NPROC=2", "expert")),
        # global batch 8 over 3 data-parallel ranks: Megatron's own validate_args refuses it
        ({"NPROC": "3"}, (), ("validate_args",)),
    ],
)
def test_the_layout_is_validated_before_megatron_starts(env, extra, named, megatron_argv,
                                                        capsys):
    _refused(megatron_argv, capsys, extra, *named, env=env)


@pytest.mark.parametrize("env", [{"WORLD_SIZE": "16", "RANK": "8"}, {"WORLD_SIZE": "8"}])
def test_a_valid_layout_passes(env, megatron_argv, capsys):
    import preflight

    line = _launch(DRY_RUN="1").stdout.split()
    megatron_argv(*line, *FAKE_LINE, **env)
    try:
        preflight.check(environ=env)
    except SystemExit:
        # without a GPU the last check refuses; nothing before it did
        assert "no CUDA GPU" in _one_error_line(capsys.readouterr().err)


@pytest.mark.parametrize("extra", [
    ("--fp8-format", "hybrid"), ("--fp4-format", "e2m1"), ("--moe-apply-probs-on-input",),
    ("--moe-latent-size", "256"),
])
def test_what_the_example_experts_cannot_compute_is_refused_before_megatron_starts(
        extra, megatron_argv, capsys):
    """Else PagedGroupedMLP refuses it while the model is built, in a traceback."""
    _refused(megatron_argv, capsys, extra, extra[0], "PagedGroupedMLP")


def test_the_fused_router_without_transformer_engine_is_refused(megatron_argv, capsys):
    """Megatron-Core's fused router kernels are Transformer Engine's: without it the first
    forward fails in a traceback."""
    _refused(megatron_argv, capsys, ("--moe-router-fusion",), "--moe-router-fusion",
             "Transformer Engine")


@pytest.mark.parametrize(("extra", "named"), [
    (("--moe-pad-expert-input-to-capacity",), "moe_expert_capacity_factor must be set"),
    (("--moe-router-padding-for-quantization",), "fp8/fp4 must be specified"),
    (("--moe-expert-capacity-factor", "1.0", "--moe-router-load-balancing-type", "sinkhorn"),
     "moe_expert_capacity_factor only works with aux_loss"),
])
def test_what_megatrons_transformer_config_refuses_is_one_line_before_megatron_starts(
        extra, named, megatron_argv, capsys):
    """The model's TransformerConfig is built at start-up (on a copy, with the run's shims):
    its refusals would otherwise be a traceback per rank when the model is built."""
    _refused(megatron_argv, capsys, extra, "Megatron's TransformerConfig", named)


def test_the_config_check_leaves_megatrons_transformer_config_as_it_was():
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_paging.mcore.validation import config_shims

    original = TransformerConfig.__dict__["__post_init__"]
    with config_shims("paged"):
        assert TransformerConfig.__dict__["__post_init__"] is not original
    assert TransformerConfig.__dict__["__post_init__"] is original


@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is not None,
                    reason="Transformer Engine is installed: the layer-level offloading runs")
def test_layer_level_cpu_offloading_without_transformer_engine_is_refused(megatron_argv,
                                                                          capsys):
    """Megatron-Core asserts it when the model is built (and refuses it beside the paged stash
    in its TransformerConfig): one line first, naming the flag and the alternative."""
    _refused(megatron_argv, capsys, ("--cpu-offloading-num-layers", "1"),
             "--cpu-offloading-num-layers", "--fine-grained-activation-offloading", paged="0")


def test_a_host_read_loss_check_with_full_iteration_graphs_is_refused(megatron_argv, capsys):
    """The example validates each loss as Megatron's GPT script does: a spike check reads it on
    the host, which a captured iteration cannot."""
    _refused(megatron_argv, capsys,
             ("--check-for-spiky-loss", "--cuda-graph-impl", "full_iteration",
              "--no-check-for-nan-in-loss-and-grad"), "--check-for-spiky-loss", "full-iteration")


def test_a_rerun_mode_megatron_cannot_start_with_is_refused(megatron_argv, capsys):
    """Megatron-Core 0.19.2's parser offers ``--rerun-mode report_stats`` but its rerun state
    machine has no such mode: one line here, not a traceback from initialize_megatron."""
    import preflight

    _refused(megatron_argv, capsys, ("--rerun-mode", "report_stats"), "--rerun-mode report_stats",
             "validate_results")
    line = _launch(DRY_RUN="1").stdout.split()
    megatron_argv(*line, "--rerun-mode", "validate_results")
    try:
        preflight.check(environ={})
    except SystemExit:
        # without a GPU the last check refuses; nothing before it did
        assert "no CUDA GPU" in _one_error_line(capsys.readouterr().err)


def test_a_save_the_checkpoint_writer_cannot_make_is_refused(megatron_argv, capsys, monkeypatch):
    """Megatron-Core's torch_dist writer imports psutil only when it first saves: without it a
    run would fail after its first save interval, so the start refuses."""
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "psutil" else real_find_spec(name, *a))
    _refused(megatron_argv, capsys, ("--save", "/tmp/checkpoints"), "--save", "psutil")


@pytest.mark.skipif(any(importlib.util.find_spec(m) for m in ("transformer_engine", "apex")),
                    reason="Megatron-Core loads the distributed optimizer with TE or Apex")
def test_resuming_the_distributed_optimizer_without_te_or_apex_is_refused(
        megatron_argv, capsys, tmp_path):
    """Without TE or Apex, Megatron-Core 0.19.2's DistributedOptimizer.state_dict reads torch
    Adam's 'step' before any step made one: every rank fails loading its checkpoint. A first
    launch whose --load names an empty directory loads nothing and starts; --no-load-optim
    resumes without the optimizer's state."""
    import preflight

    dist_opt = ("--use-distributed-optimizer", "--load", str(tmp_path))
    line = _launch(DRY_RUN="1").stdout.split()
    for extra in (dist_opt, (*dist_opt, "--no-load-optim")):
        (tmp_path / "latest_checkpointed_iteration.txt").unlink(missing_ok=True)
        if "--no-load-optim" in extra:
            (tmp_path / "latest_checkpointed_iteration.txt").write_text("2")
        megatron_argv(*line, *extra)
        with pytest.raises(SystemExit):  # without a GPU the last check refuses, nothing before
            preflight.check(environ={})
        assert "no CUDA GPU" in _one_error_line(capsys.readouterr().err)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("2")
    _refused(megatron_argv, capsys, dist_opt, "--use-distributed-optimizer", "--no-load-optim")


def test_a_bare_megatron_assertion_names_its_source_line(megatron_argv, capsys):
    """Most of validate_args' checks are bare asserts: the refusal quotes the assertion and
    where it is, not ``AssertionError()`` (here: --save without --save-interval)."""
    _refused(megatron_argv, capsys, ("--save", "/tmp/checkpoints"),
             "assert args.save_interval is not None", "megatron/training/arguments.py:")


@pytest.mark.parametrize(("extra", "named"), [
    (("--expert-tensor-parallel-size", "2"), ("--expert-tensor-parallel-size 2",)),
    (("--window-size", "128,0"), ("--window-size", "SDPAttention")),
    (("--softmax-type", "off-by-one"), ("--softmax-type", "SDPAttention")),
    (("--moe-use-upcycling",), ("--moe-use-upcycling", "PagedGroupedMLP")),
    (("--inprocess-restart",), ("--inprocess-restart",)),
    (("--use-checkpoint-args",), ("--use-checkpoint-args",)),
    (("--use-torch-fsdp2", "--ckpt-format", "torch_dist", "--save", "c", "--save-interval", "2"),
     ("--save with --use-torch-fsdp2", "PagedGroupedMLP")),
    (("--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor", "--load", "c"),
     ("--load with --use-megatron-fsdp",)),
] + ([] if importlib.util.find_spec("transformer_engine") else [
    (("--use-precision-aware-optimizer",), ("--use-precision-aware-optimizer",
                                            "Transformer Engine")),
    (("--optimizer-cpu-offload",), ("--optimizer-cpu-offload", "Transformer Engine")),
    (("--moe-flex-dispatcher-backend", "ncclep"), ("ncclep", "Transformer Engine")),
]), ids=lambda value: value[0] if isinstance(value, tuple) else None)
def test_what_would_fail_after_the_start_or_do_nothing_is_refused_at_start_up(
        extra, named, megatron_argv, capsys):
    """Each of these passes Megatron's checks, then fails after the run began (a traceback per
    rank) or is silently skipped by the example."""
    _refused(megatron_argv, capsys, extra, *named)


@pytest.mark.parametrize(("extra", "named"), [
    (("--enable-cuda-graph",), ("cannot be combined", "Megatron sets --cuda-graph-impl local")),
    (("--recompute-activations", "--recompute-modules", "moe"),
     ("pages nothing", "Megatron sets --recompute-granularity selective")),
    (("--moe-layer-recompute",), ("pages nothing", "--recompute-modules core_attn moe")),
], ids=["enable-cuda-graph", "recompute-activations", "moe-layer-recompute"])
def test_flags_megatron_rewrites_are_checked_as_it_runs_them(extra, named, megatron_argv,
                                                             capsys):
    """validate_args and the TransformerConfig turn these into flags paging refuses, after the
    paging checks read the line: the checks run again on the line as Megatron runs it."""
    _refused(megatron_argv, capsys, extra, *named)


@pytest.mark.parametrize("recorded_for", ["this rank", "another EP rank"])
def test_a_peer_load_trace_is_checked_against_the_layout_at_start_up(recorded_for, tmp_path,
                                                                     megatron_argv, capsys):
    """A trace recorded for another layout is refused before Megatron builds anything, naming
    what differs (the peers would otherwise find out at their first exchange)."""
    import preflight

    from megatron_paging.mcore.grid import route_shape
    from megatron_paging.mcore.plan_inputs import parse_megatron, quiet
    from megatron_paging.tools.peer_load import TRACE_FORMAT

    env = {"WORLD_SIZE": "16", "RANK": "9"}
    line = _launch(DRY_RUN="1").stdout.split()
    with quiet():
        shape = route_shape(parse_megatron([*line, *FAKE_LINE], 16, 9), 9)
    assert (shape.ep, shape.rank) == (4, 1)  # ranks 8-11 are stage 1's first EP group
    trace = tmp_path / "trace.json"
    rank = shape.rank if recorded_for == "this rank" else shape.rank + 1
    trace.write_text(json.dumps({
        "format": TRACE_FORMAT, "num_experts": shape.num_experts, "ep": shape.ep, "rank": rank,
        "tokens_per_peer": shape.tokens, "topk": shape.topk, "microbatches_per_step": 1,
        "layers": {}}))
    megatron_argv(*line, *FAKE_LINE, "--paging-emulated-load", str(trace), **env)
    with pytest.raises(SystemExit):
        preflight.check(environ=env)
    error = _one_error_line(capsys.readouterr().err)
    if recorded_for == "this rank":
        assert "no CUDA GPU" in error  # without a GPU the last check refuses; nothing before it
    else:
        assert "--paging-emulated-load" in error and f"rank={rank}" in error, error
