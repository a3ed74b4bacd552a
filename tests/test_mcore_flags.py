"""Flags through Megatron's real argument parser, the PagingConfig they build, and every
start-up error of paging_config / validate_paging_args."""

from __future__ import annotations

import argparse
import re

import pytest

pytest.importorskip("megatron.training")

from megatron_paging.config import PagingConfig  # noqa: E402
from megatron_paging.mcore import flag_checks, flags  # noqa: E402

BASE = [
    "--moe-paged-stash",
    "--moe-expert-rank-capacity-factor",
    "1.25",
    "--moe-token-dispatcher-type",
    "flex",
    "--moe-flex-dispatcher-backend",
    "static",
]


@pytest.fixture(scope="module")
def parser():
    from megatron.training.arguments import add_megatron_arguments

    megatron = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    before = {a.dest: a for a in megatron._actions}
    parser = flags.add_paging_args(megatron)
    # Megatron-Core's own paged-stash flags are kept, not redefined.
    for flag in flags.MCORE_FLAGS:
        assert parser._option_string_actions[flag] is before[flag.lstrip("-").replace("-", "_")]
    return parser


def _validate(parser, argv, environ=None, cuda=False):
    args = parser.parse_args(argv)
    flags.validate_paging_args(args, environ=environ or {}, cuda_available=cuda)
    return args


def test_every_flag_has_its_default_and_keywords():
    assert flags.OUR_FLAGS.keys() == flags.PAGING_DEFAULTS.keys()


def test_defaults_and_megatron_names(parser):
    args = _validate(parser, BASE)
    assert args.moe_paged_stash is True
    assert args.moe_paged_stash_page_size == 64
    assert args.moe_paged_stash_buffer_size_factor_cuda == pytest.approx(1.10)
    assert args.moe_paged_stash_buffer_size_factor_cpu == 0.0
    assert args.moe_flex_dispatcher_backend == "static"
    # Eager Megatron runs free the pages between steps (--paging-pool-residency auto).
    eager = PagingConfig(pool_residency="step")
    assert flags.paging_config(args, environ={}, cuda_available=False) == eager
    assert (args.paging_overflow_policy, args.paging_gemm_backend) == ("rerun", "auto")
    assert (args.paging_core_attention, args.paging_sdpa_backend) == ("sdpa", "auto")
    options = flags.install_options(args, eager)
    assert options == dict(replace_paged_stash=True, config=eager, ddp_on_training_stream=True)
    # Megatron's side stream for DDP, on request (acts without --moe-paged-stash too)
    kept = _validate(parser, BASE + ["--paging-keep-ddp-side-stream"])
    assert flags.install_options(kept, eager)["ddp_on_training_stream"] is False
    unpaged = [a for a in BASE if a != "--moe-paged-stash"] + ["--paging-keep-ddp-side-stream"]
    assert flags.install_options(_validate(parser, unpaged))["ddp_on_training_stream"] is False


def test_our_flags_parse(parser):
    argv = BASE + [
        "--paging-max-ctas", "512",
        "--paging-prefetch-distance", "2",
        "--paging-overflow-policy", "grow",
        "--paging-growth-factor", "2.5",
        "--paging-kernel-backend", "reference",
        "--paging-gemm-backend", "loop",
        "--paging-no-overlap",
        "--moe-paged-stash-page-size", "32",
        "--moe-paged-stash-buffer-size-factor-cuda", "-1.25",
        "--moe-paged-stash-buffer-size-factor-cpu", "0.5",
    ]  # fmt: skip
    args = parser.parse_args(argv)
    config = flags.paging_config(args, environ={"MEGATRON_PAGING_MAX_CTAS": "512"},
                                 cuda_available=False)
    # Megatron-Core's sign convention: a negative factor sizes from the measured peak.
    assert config == PagingConfig(
        page_size=32, cuda_factor=-1.25, host_factor=0.5, kernel_backend="reference",
        max_ctas=512, prefetch_distance=2, overlap=False, overflow_policy="grow",
        growth_factor=2.5, pool_residency="step",
    )
    assert flags.install_options(args, config) == dict(
        replace_paged_stash=True, config=config, ddp_on_training_stream=True
    )


def test_max_ctas_comes_from_the_environment_when_no_flag_sets_it(parser):
    args = parser.parse_args(BASE)
    config = flags.paging_config(args, environ={"MEGATRON_PAGING_MAX_CTAS": " 96 "},
                                 cuda_available=False)
    assert config.max_ctas == 96 and config.grid_bound == 96
    # An unpaged run reads nothing: a bad value there is not its concern.
    unpaged = parser.parse_args(["--moe-token-dispatcher-type", "flex"])
    flags.paging_config(unpaged, environ={"MEGATRON_PAGING_MAX_CTAS": "bad"}, cuda_available=False)


@pytest.mark.parametrize(
    "argv, environ, cuda, message",
    [
        (["--paging-overflow-policy", "skip"], {}, False,
         "--paging-overflow-policy only apply with --moe-paged-stash"),
        (["--paging-max-ctas", "8", "--paging-kernel-backend", "reference"], {}, False,
         "--paging-max-ctas, --paging-kernel-backend only apply with --moe-paged-stash"),
        (["--moe-flex-dispatcher-backend", "static"], {}, False,
         "--moe-flex-dispatcher-backend static needs --moe-token-dispatcher-type flex"),
        (BASE + ["--moe-paged-stash-page-size", "0"], {}, False,
         "--moe-paged-stash-page-size must be a positive integer"),
        (BASE + ["--moe-paged-stash-buffer-size-factor-cuda", "0"], {}, False,
         "--moe-paged-stash-buffer-size-factor-cuda must be non-zero"),
        (BASE + ["--moe-paged-stash-buffer-size-factor-cpu", "nan"], {}, False,
         "--moe-paged-stash-buffer-size-factor-cpu must be a finite number"),
        (["--moe-paged-stash"], {}, False,
         "--moe-paged-stash needs --moe-expert-rank-capacity-factor"),
        (BASE[:1] + ["--moe-expert-rank-capacity-factor", "-1"], {}, False,
         "--moe-expert-rank-capacity-factor must be > 0"),
        (BASE + ["--paging-max-ctas", "0"], {}, False,
         "--paging-max-ctas must be a positive integer"),
        (BASE + ["--paging-max-ctas", "256"], {"MEGATRON_PAGING_MAX_CTAS": "1024"}, False,
         "--paging-max-ctas 256 conflicts with MEGATRON_PAGING_MAX_CTAS=1024"),
        (BASE + ["--paging-prefetch-distance", "-1"], {}, False,
         "--paging-prefetch-distance must be a non-negative integer, got -1"),
        (BASE + ["--paging-growth-factor", "1.0"], {}, False,
         "--paging-growth-factor must be > 1, got 1.0"),
        (BASE + ["--paging-max-inflight-stashes", "-1"], {}, False,
         "--paging-max-inflight-stashes must be a non-negative integer, got -1"),
        (BASE, {"MEGATRON_PAGING_MAX_CTAS": "lots"}, False,
         "MEGATRON_PAGING_MAX_CTAS must be a positive integer (it bounds the copy kernels' "
         "grid), got 'lots'"),
        (BASE + ["--cuda-graph-impl", "local"], {}, False,
         "--cuda-graph-impl local cannot be combined with --moe-paged-stash"),
        (BASE + ["--paging-kernel-backend", "bulk"], {}, False,
         "--paging-kernel-backend bulk needs a CUDA device"),
        (["--paging-core-attention", "local", "--paging-sdpa-backend", "flash"], {}, False,
         "--paging-sdpa-backend flash needs --paging-core-attention sdpa"),
        (["--paging-sdpa-backend", "cudnn", "--deterministic-mode"], {}, False,
         "--paging-sdpa-backend cudnn is not deterministic"),
        (BASE + ["--paging-no-overlap", "--paging-implementation", "mcore"], {}, False,
         "--paging-no-overlap have no effect with --paging-implementation mcore"),
        (BASE + ["--paging-kernel-backend", "cuda"], {}, False,
         "--paging-kernel-backend cuda needs a CUDA device"),
        (BASE + ["--paging-implementation", "mcore", "--paging-max-ctas", "8",
                 "--paging-prefetch-distance", "2", "--paging-kernel-backend", "reference",
                 "--paging-overflow-policy", "skip", "--paging-gemm-backend", "loop"],
         {"MEGATRON_PAGING_MAX_CTAS": "8"}, False,
         "--paging-max-ctas, --paging-prefetch-distance, --paging-overflow-policy, "
         "--paging-kernel-backend have no effect with --paging-implementation mcore"),
        (BASE + ["--paging-implementation", "mcore", "--paging-overflow-policy", "grow"], {},
         False, "--paging-overflow-policy have no effect with --paging-implementation mcore"),
        (["--paging-gemm-backend", "loop", "--paging-prefetch-distance", "2"], {}, False,
         "--paging-prefetch-distance only apply with --moe-paged-stash"),
    ],
)  # fmt: skip
def test_startup_errors(parser, argv, environ, cuda, message):
    with pytest.raises(ValueError) as error:
        _validate(parser, argv, environ=environ, cuda=cuda)
    assert message in str(error.value)
    assert "\n" not in str(error.value)


def test_cuda_backend_accepted_with_cuda(parser):
    args = _validate(parser, BASE + ["--paging-kernel-backend", "cuda"], cuda=True)
    assert args.paging_kernel_backend == "cuda"


def test_bad_choices_are_rejected_by_the_parser(parser, capsys):
    for argv in (["--paging-overflow-policy", "retry"], ["--moe-flex-dispatcher-backend", "x"]):
        with pytest.raises(SystemExit):
            parser.parse_args(argv)
    assert "invalid choice" in capsys.readouterr().err


def test_bare_parser_gets_megatron_flags_too():
    parser = flags.add_paging_args(argparse.ArgumentParser())
    args = _validate(parser, BASE[:3] + ["--paging-prefetch-distance", "0"])
    assert args.paging_prefetch_distance == 0
    assert args.moe_paged_stash and args.moe_expert_rank_capacity_factor == 1.25


def test_mcore_implementation_takes_the_gemm_backend_only(parser):
    argv = BASE + ["--paging-implementation", "mcore", "--paging-gemm-backend", "loop"]
    args = _validate(parser, argv)
    assert args.paging_gemm_backend == "loop"
    assert flags.install_options(args) == dict(
        replace_paged_stash=False, ddp_on_training_stream=True
    )


def test_full_iteration_graphs_are_accepted_with_paging(parser):
    argv = BASE + ["--cuda-graph-impl", "full_iteration"]
    config = flags.paging_config(parser.parse_args(argv), environ={}, cuda_available=False)
    assert config == PagingConfig()  # auto keeps the pages a captured graph points at


@pytest.mark.parametrize(
    "extra, residency",
    [([], "step"), (["--paging-pool-residency", "persistent"], "persistent"),
     (["--paging-pool-residency", "step"], "step"),
     (["--cuda-graph-impl", "full_iteration", "--paging-pool-residency", "persistent"],
      "persistent")],
)
def test_pool_residency_flag(parser, extra, residency):
    config = flags.paging_config(parser.parse_args(BASE + extra), environ={}, cuda_available=False)
    assert config.pool_residency == residency


def test_hold_last_slot_flag(parser):
    args = parser.parse_args(BASE + ["--paging-hold-last-slot"])
    assert flags.paging_config(args, environ={}, cuda_available=False).hold_last_slot
    assert not flags.paging_config(parser.parse_args(BASE), environ={},
                                   cuda_available=False).hold_last_slot
    for argv, words in ((["--paging-hold-last-slot"], "only apply with --moe-paged-stash"),
                        (BASE + ["--paging-implementation", "mcore", "--paging-hold-last-slot"],
                         "have no effect with --paging-implementation mcore")):
        with pytest.raises(ValueError, match=words):
            flags.validate_paging_args(parser.parse_args(argv), environ={}, cuda_available=False)


@pytest.mark.parametrize(
    "argv, message",
    [(BASE + ["--cuda-graph-impl", "full_iteration", "--paging-pool-residency", "step"],
      "--paging-pool-residency step cannot be combined with --cuda-graph-impl full_iteration"),
     (BASE + ["--paging-implementation", "mcore", "--paging-pool-residency", "persistent"],
      "--paging-pool-residency have no effect with --paging-implementation mcore"),
     (["--paging-pool-residency", "step"],
      "--paging-pool-residency only apply with --moe-paged-stash")],
)
def test_pool_residency_refusals(parser, argv, message):
    with pytest.raises(ValueError) as error:
        flags.validate_paging_args(parser.parse_args(argv), environ={}, cuda_available=False)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_gemm_backend_also_selects_the_unpaged_controls_gemms(parser):
    args = _validate(parser, ["--paging-gemm-backend", "grouped"])
    assert not args.moe_paged_stash and args.paging_gemm_backend == "grouped"


@pytest.mark.parametrize("modules", [["layernorm"], ["core_attn", "layernorm"], ["moe_act"],
                                     ["gdn_norm_out", "core_attn"]])
@pytest.mark.parametrize("paged", [True, False])
def test_recompute_through_checkpoint_without_output_needs_te(parser, modules, paged):
    argv = (BASE if paged else []) + [
        "--recompute-granularity", "selective", "--recompute-modules", *modules]
    args = parser.parse_args(argv)
    with pytest.raises(ValueError) as error:
        flags.paging_config(args, environ={}, cuda_available=False, te_available=False)
    needs_te = " ".join(m for m in modules if m in flag_checks.TE_RECOMPUTE_MODULES)
    message = str(error.value)
    assert message.startswith(f"--recompute-modules {needs_te} needs Transformer Engine")
    assert "CheckpointWithoutOutput" in message and "\n" not in message
    with pytest.raises(ValueError, match="needs Transformer Engine"):
        flags.validate_paging_args(args, environ={}, cuda_available=False, te_available=False)
    # With Transformer Engine installed, Megatron-Core's own path works.
    flags.paging_config(args, environ={}, cuda_available=False, te_available=True)


@pytest.mark.parametrize("modules", [["core_attn"], ["moe"], ["mlp"], ["core_attn", "moe"],
                                     ["mla_up_proj"]])
def test_recompute_without_checkpoint_without_output_runs_without_te(parser, modules):
    # paged, except for moe: its recompute leaves the stash nothing (refused, test below)
    base = [] if "moe" in modules else BASE
    argv = base + ["--recompute-granularity", "selective", "--recompute-modules", *modules]
    config = flags.paging_config(parser.parse_args(argv), environ={}, cuda_available=False,
                                 te_available=False)
    assert config == (PagingConfig() if "moe" in modules else PagingConfig(pool_residency="step"))


@pytest.mark.parametrize(
    "recompute, message",
    [
        (["--recompute-granularity", "selective", "--recompute-modules", "core_attn", "moe"],
         "--moe-paged-stash with --recompute-granularity selective --recompute-modules moe "
         "pages nothing (every MoE layer is recomputed in the backward); drop one of them"),
        (["--recompute-granularity", "full", "--recompute-method", "uniform",
          "--recompute-num-layers", "1"],
         "--moe-paged-stash with --recompute-granularity full --recompute-method uniform pages "
         "nothing"),
    ],
    ids=["selective-moe", "full-uniform"],
)
def test_recompute_of_every_moe_layer_is_refused_with_paged_stash(parser, recompute, message):
    args = parser.parse_args(BASE + recompute)
    with pytest.raises(ValueError, match=re.escape(message)) as error:
        flags.paging_config(args, environ={}, cuda_available=False, te_available=False)
    assert "\n" not in str(error.value)


def test_block_recompute_of_some_layers_pages_the_others(parser):
    args = parser.parse_args(BASE + ["--recompute-granularity", "full", "--recompute-method",
                                     "block", "--recompute-num-layers", "2"])
    assert flags.paging_config(args, environ={}, cuda_available=False, te_available=False) == (
        PagingConfig(pool_residency="step"))


def test_recompute_check_only_for_selective_granularity(parser):
    # Full recompute checkpoints whole layers (tensor_parallel.checkpoint), not these modules.
    args = parser.parse_args(["--recompute-granularity", "full", "--recompute-method", "uniform",
                              "--recompute-modules", "layernorm"])
    flags.paging_config(args, environ={}, cuda_available=False, te_available=False)
    # args without the attributes (a bare namespace) pass too.
    flags.paging_config(argparse.Namespace(), environ={}, cuda_available=False,
                        te_available=False)


def test_transformer_engine_is_detected_when_not_injected(parser, monkeypatch):
    args = parser.parse_args(["--recompute-granularity", "selective", "--recompute-modules",
                              "layernorm"])
    real = flags.importlib.util.find_spec
    seen = []

    def find_spec(name, *rest):
        seen.append(name)
        return object() if name == "transformer_engine" else real(name, *rest)

    monkeypatch.setattr(flags.importlib.util, "find_spec", find_spec)
    flags.paging_config(args, environ={}, cuda_available=False)
    assert "transformer_engine" in seen
    monkeypatch.setattr(flags.importlib.util, "find_spec",
                        lambda name, *rest: None if name == "transformer_engine" else real(
                            name, *rest))
    with pytest.raises(ValueError, match="--recompute-modules layernorm needs Transformer"):
        flags.paging_config(args, environ={}, cuda_available=False)


def test_recompute_refusal_is_ours_only(parser):
    """Megatron-Core's own manager (--paging-implementation mcore) keeps its behaviour."""
    args = parser.parse_args(BASE + ["--paging-implementation", "mcore",
                                     "--recompute-granularity", "selective",
                                     "--recompute-modules", "moe"])
    flags.paging_config(args, environ={}, cuda_available=False, te_available=False)


def test_max_inflight_stashes_flag(parser):
    config = flags.paging_config(parser.parse_args(BASE), environ={}, cuda_available=False)
    assert config.stash_in_flight == 1  # the default bounds the host's lead to one layer
    args = parser.parse_args(BASE + ["--paging-max-inflight-stashes", "0"])
    assert flags.paging_config(args, environ={}, cuda_available=False).stash_in_flight == 0
    for argv, words in ((["--paging-max-inflight-stashes", "3"],
                         "only apply with --moe-paged-stash"),
                        (BASE + ["--paging-implementation", "mcore",
                                 "--paging-max-inflight-stashes", "3"],
                         "have no effect with --paging-implementation mcore")):
        with pytest.raises(ValueError, match=words):
            flags.validate_paging_args(parser.parse_args(argv), environ={}, cuda_available=False)


def test_prefetch_point_flag(parser):
    config = flags.paging_config(parser.parse_args(BASE), environ={}, cuda_available=False)
    assert config.prefetch_point == "experts"
    args = parser.parse_args(BASE + ["--paging-prefetch-point", "dispatcher"])
    assert flags.paging_config(args, environ={}, cuda_available=False).prefetch_point == (
        "dispatcher"
    )
    alltoall = ["--moe-paged-stash", "--moe-expert-rank-capacity-factor", "1.25",
                "--moe-token-dispatcher-type", "alltoall"]
    for argv, words in (
        (alltoall + ["--paging-prefetch-point", "dispatcher"],
         "--paging-prefetch-point dispatcher needs --moe-token-dispatcher-type flex "
         "--moe-flex-dispatcher-backend static (got 'alltoall' / "),
        (["--paging-prefetch-point", "dispatcher"], "only apply with --moe-paged-stash"),
        (BASE + ["--paging-implementation", "mcore", "--paging-prefetch-point", "dispatcher"],
         "--paging-prefetch-point have no effect with --paging-implementation mcore"),
    ):
        with pytest.raises(ValueError) as error:
            flags.validate_paging_args(parser.parse_args(argv), environ={}, cuda_available=False)
        assert words in str(error.value) and "\n" not in str(error.value)
    with pytest.raises(SystemExit):  # not a choice: argparse names the flag
        parser.parse_args(BASE + ["--paging-prefetch-point", "router"])


def test_stash_point_flag(parser):
    config = flags.paging_config(parser.parse_args(BASE), environ={}, cuda_available=False)
    assert config.stash_point == "commit"
    args = parser.parse_args(BASE + ["--paging-stash-point", "next-layer"])
    assert flags.paging_config(args, environ={}, cuda_available=False).stash_point == "next-layer"
    for argv, words in (
        (["--paging-stash-point", "next-layer"], "only apply with --moe-paged-stash"),
        (BASE + ["--paging-implementation", "mcore", "--paging-stash-point", "next-layer"],
         "--paging-stash-point have no effect with --paging-implementation mcore"),
    ):
        with pytest.raises(ValueError) as error:
            flags.validate_paging_args(parser.parse_args(argv), environ={}, cuda_available=False)
        assert words in str(error.value) and "\n" not in str(error.value)


def test_every_flag_of_ours_is_documented():
    """docs/mcore.md's flag table and the README's list every flag we add."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    docs = (root / "docs" / "mcore.md").read_text()
    readme = (root / "README.md").read_text()
    for dest in flags.OUR_FLAGS:
        flag = "`--" + dest.replace("_", "-")
        assert f"| {flag}" in docs, f"{flag} missing from docs/mcore.md's flag table"
        assert flag in readme, f"{flag} missing from README.md"
