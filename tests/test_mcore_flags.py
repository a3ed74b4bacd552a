"""Flags through Megatron's real argument parser (generated from PagingArgs), the PagingConfig
they build, and every start-up error of paging_config."""

from __future__ import annotations

import argparse
import re

import pytest

pytest.importorskip("megatron.training")

import dataclasses  # noqa: E402

from megatron_paging.config import PagingArgs, PagingConfig  # noqa: E402
from megatron_paging.mcore import flag_checks, flags  # noqa: E402
from megatron_paging.overflow.policy import GrowPolicy  # noqa: E402

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


def _validate(parser, argv, environ=None, cuda=False, **kwargs):
    args = parser.parse_args(argv)
    flags.paging_config(args, environ=environ or {}, cuda_available=cuda, **kwargs)
    return args


def test_the_flags_are_the_fields_of_paging_args(parser):
    ours = {a.dest for a in parser._actions if a.dest.startswith("paging_")}
    assert ours == {f.name for f in dataclasses.fields(PagingArgs)}
    for f in dataclasses.fields(PagingArgs):
        action = parser._option_string_actions[flags.flag_name(f.name)]
        assert action.default == f.default and action.help, f.name


def test_help_renders_every_flag(parser):
    text = parser.format_help()  # raises on an unescaped "%" in any help string
    for f in dataclasses.fields(PagingArgs):
        assert flags.flag_name(f.name) in text
    for flag in flags.MCORE_FLAGS:
        assert flag in text
    assert "static" in text


def test_mend_help_escapes_only_lone_percent_signs():
    parser = argparse.ArgumentParser()
    parser.add_argument("--a", default=3, help="10% more, %(default)s and 50%% kept")
    flags.mend_help(parser)
    assert "10% more, 3 and 50% kept" in parser.format_help()


def test_defaults_and_megatron_names(parser):
    args = _validate(parser, BASE)
    assert args.moe_paged_stash is True
    assert args.moe_paged_stash_page_size == 64
    assert args.moe_paged_stash_buffer_size_factor_cuda == pytest.approx(1.10)
    assert args.moe_paged_stash_buffer_size_factor_cpu == 0.0
    assert args.moe_flex_dispatcher_backend == "static"
    # Eager Megatron runs free the pages between steps; graphs keep them (below).
    eager = PagingConfig(pool_residency="step")
    assert flags.paging_config(args, environ={}, cuda_available=False) == eager
    assert flags.paging_args(args) == PagingArgs()
    assert flags.install_options(args, eager) == dict(replace_paged_stash=True, config=eager)


def test_our_flags_parse(parser):
    argv = BASE + [
        "--paging-prefetch-distance", "2",
        "--paging-overflow-policy", "grow",
        "--paging-hold-last-slot",
        "--moe-paged-stash-page-size", "32",
        "--moe-paged-stash-buffer-size-factor-cuda", "-1.25",
        "--moe-paged-stash-buffer-size-factor-cpu", "0.5",
    ]  # fmt: skip
    args = parser.parse_args(argv)
    config = flags.paging_config(args, environ={"MEGATRON_PAGING_MAX_CTAS": "512"},
                                 cuda_available=False)
    # Megatron-Core's sign convention: a negative factor sizes from the measured peak.
    assert config == PagingConfig(
        page_size=32, cuda_factor=-1.25, host_factor=0.5, max_ctas=512, prefetch_distance=2,
        overflow_policy=GrowPolicy(), hold_last_slot=True, pool_residency="step",
    )
    assert flags.install_options(args, config) == dict(replace_paged_stash=True, config=config)


def test_max_ctas_comes_from_the_environment(parser):
    args = parser.parse_args(BASE)
    config = flags.paging_config(args, environ={"MEGATRON_PAGING_MAX_CTAS": " 96 "},
                                 cuda_available=False)
    assert config.max_ctas == 96 and config.grid_bound == 96
    # An unpaged run reads nothing: a bad value there is not its concern.
    unpaged = parser.parse_args(["--moe-token-dispatcher-type", "flex"])
    flags.paging_config(unpaged, environ={"MEGATRON_PAGING_MAX_CTAS": "bad"}, cuda_available=False)


OFFLOAD = ["--fine-grained-activation-offloading", "--paging-offload-backend", "paged"]


@pytest.mark.parametrize(
    "argv, environ, message",
    [
        (["--paging-overflow-policy", "skip"], {},
         "--paging-overflow-policy only applies with --moe-paged-stash or "
         "--paging-offload-backend paged"),
        (["--paging-prefetch-distance", "2", "--paging-hold-last-slot"], {},
         "--paging-prefetch-distance, --paging-hold-last-slot only apply with"),
        (BASE + ["--paging-offload-host-factor", "2"], {},
         "--paging-offload-host-factor only applies with --paging-offload-backend paged"),
        (["--moe-flex-dispatcher-backend", "static"], {},
         "--moe-flex-dispatcher-backend static needs --moe-token-dispatcher-type flex"),
        (BASE + ["--moe-permute-fusion"], {},
         "--moe-permute-fusion has no effect with --moe-flex-dispatcher-backend static"),
        (BASE + ["--moe-permute-fusion-into-hybridep"], {},
         "--moe-permute-fusion-into-hybridep has no effect with --moe-flex-dispatcher-backend"),
        (BASE + ["--moe-enable-deepep"], {},
         "--moe-enable-deepep replaces --moe-flex-dispatcher-backend static by deepep"),
        (BASE + ["--moe-paged-stash-page-size", "0"], {},
         "--moe-paged-stash-page-size must be a positive integer"),
        (BASE + ["--moe-paged-stash-buffer-size-factor-cuda", "0"], {},
         "--moe-paged-stash-buffer-size-factor-cuda must be non-zero"),
        (BASE + ["--moe-paged-stash-buffer-size-factor-cpu", "nan"], {},
         "--moe-paged-stash-buffer-size-factor-cpu must be a finite number"),
        (["--moe-paged-stash"], {},
         "--moe-paged-stash needs --moe-expert-rank-capacity-factor"),
        (BASE[:1] + ["--moe-expert-rank-capacity-factor", "-1"], {},
         "--moe-expert-rank-capacity-factor must be > 0"),
        (BASE + ["--paging-prefetch-distance", "-1"], {},
         "--paging-prefetch-distance must be a non-negative integer, got -1"),
        (BASE + OFFLOAD[:1] + ["--offload-modules", "core_attn", "--paging-offload-backend",
                               "paged", "--paging-offload-host-factor", "0.5"], {},
         "--paging-offload-host-factor must be >= 1, got 0.5"),
        (BASE, {"MEGATRON_PAGING_MAX_CTAS": "lots"},
         "MEGATRON_PAGING_MAX_CTAS must be a positive integer"),
        (BASE + ["--cuda-graph-impl", "local"], {},
         "--cuda-graph-impl local cannot be combined with --moe-paged-stash"),
        (["--paging-offload-backend", "paged"], {},
         "--paging-offload-backend paged needs --fine-grained-activation-offloading"),
        (OFFLOAD, {}, "--fine-grained-activation-offloading needs --offload-modules"),
        (OFFLOAD + ["--offload-modules", "bogus_module"], {},
         "--offload-modules bogus_module: not offloadable with --paging-offload-backend paged; "
         "choose from attn_norm, qkv_linear, core_attn, attn_proj, mlp_norm, expert_fc1, "
         "moe_act"),
        (OFFLOAD[:1] + ["--offload-modules", "core_attn", "nope"], {},
         "--offload-modules nope: not offloadable with --paging-offload-backend mcore"),
        (OFFLOAD + ["--offload-modules", "fused_group_mlp"], {},
         "--offload-modules fused_group_mlp: not offloadable"),
        (OFFLOAD[:1] + ["--offload-modules", "fused_group_mlp"], {},
         "--offload-modules fused_group_mlp needs Transformer Engine's op fuser"),
        (OFFLOAD + ["--offload-modules", "attn_proj"], {},
         "--offload-modules attn_proj needs core_attn too"),
        (BASE + OFFLOAD[:1] + ["--offload-modules", "expert_fc1"], {},
         "--offload-modules expert_fc1 with --moe-paged-stash needs --paging-offload-backend "
         "paged"),
        (OFFLOAD + ["--offload-modules", "expert_fc1"], {},
         "--offload-modules expert_fc1 with --paging-offload-backend paged needs "
         "--moe-expert-rank-capacity-factor"),
        (OFFLOAD + ["--offload-modules", "core_attn", "--cuda-graph-impl", "local"], {},
         "--cuda-graph-impl local cannot be combined with --paging-offload-backend paged"),
        (OFFLOAD + ["--offload-modules", "core_attn", "--delay-offload-until-cuda-graph"], {},
         "--delay-offload-until-cuda-graph has no effect with --paging-offload-backend paged"),
        (OFFLOAD + ["--offload-modules", "core_attn",
                    "--fine-grained-offloading-max-inflight-offloads", "3"], {},
         "--fine-grained-offloading-max-inflight-offloads applies to --paging-offload-backend "
         "paged only with --cuda-graph-impl full_iteration"),
        (["--fake-process-group", "--num-experts", "8", "--moe-token-dispatcher-type",
          "alltoall"], {},
         "--fake-process-group needs --moe-token-dispatcher-type flex "
         "--moe-flex-dispatcher-backend static"),
        (BASE + ["--num-experts", "8", "--fake-process-group", "--cuda-graph-impl",
                 "full_iteration"], {},
         "--cuda-graph-impl full_iteration cannot be combined with --fake-process-group"),
        (BASE + ["--paging-overflow-policy", "skip", "--optimizer-cuda-graph"], {},
         "--optimizer-cuda-graph with --paging-overflow-policy skip"),
        (BASE + ["--paging-overflow-policy", "grow", "--fp16"], {},
         "--fp16 with --paging-overflow-policy grow"),
        (BASE + ["--cuda-graph-impl", "full_iteration", "--step-batch-size-schedule",
                 "0:8 1K:16"], {},
         "--step-batch-size-schedule with --cuda-graph-impl full_iteration"),
        (BASE + ["--rampup-batch-size", "16", "16", "1000"], {},
         "--rampup-batch-size: Megatron-Core 0.19.2 parses it but never ramps"),
        (BASE + ["--num-experts", "8", "--fake-process-group", "--save", "/tmp/c",
                 "--save-interval", "2"], {},
         "--save cannot be combined with --fake-process-group"),
        (BASE + ["--num-experts", "8", "--fake-process-group", "--load", "/tmp/c"], {},
         "--load cannot be combined with --fake-process-group"),
        (BASE + ["--num-experts", "8", "--fake-process-group", "--delay-wgrad-compute"], {},
         "--delay-wgrad-compute needs Transformer Engine"),
        (BASE + ["--num-experts", "8", "--delay-wgrad-compute"], {},
         "--delay-wgrad-compute needs Transformer Engine"),
        (BASE + ["--num-experts", "8", "--fake-process-group", "--paging-emulated-load",
                 "zipf:1"], {},
         "--paging-emulated-load 'zipf:1': expected lognormal:<skew> or a path to a .json"),
        (BASE + ["--paging-emulated-load", "lognormal:1"], {},
         "--paging-emulated-load only applies with --fake-process-group"),
        (["--paging-recompute-expert-fc1"] + OFFLOAD[:1] + ["--offload-modules", "moe_act"], {},
         "--offload-modules moe_act offloads the experts' fc1, which "
         "--paging-recompute-expert-fc1 does not keep"),
    ],
)  # fmt: skip
def test_startup_errors(parser, argv, environ, message):
    with pytest.raises(ValueError) as error:
        _validate(parser, argv, environ=environ, te_available=False)
    assert message in str(error.value)
    assert "\n" not in str(error.value)


def test_bad_choices_are_rejected_by_the_parser(parser, capsys):
    for argv in (["--paging-overflow-policy", "retry"], ["--moe-flex-dispatcher-backend", "x"],
                 ["--paging-offload-backend", "te"]):
        with pytest.raises(SystemExit):
            parser.parse_args(argv)
    assert "invalid choice" in capsys.readouterr().err


def test_bare_parser_gets_megatron_flags_too():
    parser = flags.add_paging_args(argparse.ArgumentParser())
    args = _validate(parser, BASE[:3] + ["--paging-prefetch-distance", "0"])
    assert args.paging_prefetch_distance == 0
    assert args.moe_paged_stash and args.moe_expert_rank_capacity_factor == 1.25
    parser.format_help()


def test_megatron_cores_manager_gets_no_config_of_ours(parser):
    args = _validate(parser, BASE, mcore_manager=True)
    assert flags.paging_config(args, environ={}, cuda_available=False,
                               mcore_manager=True) == PagingConfig()
    assert flags.install_options(args, mcore_manager=True) == dict(replace_paged_stash=False)
    with pytest.raises(ValueError, match="not on Megatron-Core's own paged-stash manager"):
        _validate(parser, BASE + OFFLOAD + ["--offload-modules", "core_attn"],
                  mcore_manager=True)


@pytest.mark.parametrize("extra, residency", [
    ([], "step"), (["--cuda-graph-impl", "full_iteration"], "persistent")])
def test_pool_residency_follows_the_graph_mode(parser, extra, residency):
    config = flags.paging_config(parser.parse_args(BASE + extra), environ={}, cuda_available=False)
    assert config.pool_residency == residency


@pytest.mark.parametrize("connections, prefix", [(None, 1.0), ("32", 1.0), ("1", 0.0)])
def test_offload_dma_prefix_follows_the_hardware_queues(parser, connections, prefix):
    args = parser.parse_args(BASE + OFFLOAD + ["--offload-modules", "core_attn"])
    environ = {} if connections is None else {"CUDA_DEVICE_MAX_CONNECTIONS": connections}
    config = flags.paging_config(args, environ=environ, cuda_available=False)
    assert config.offload_dma_prefix == prefix
    stash_only = flags.paging_config(parser.parse_args(BASE), environ=environ,
                                     cuda_available=False)
    assert stash_only.offload_dma_prefix == 0.0


def test_offload_options_reach_install(parser):
    args = _validate(parser, BASE + OFFLOAD + ["--offload-modules", "core_attn", "expert_fc1"])
    assert flags.install_options(args)["offload_backend"] == "paged"
    mcore = _validate(parser, OFFLOAD[:1] + ["--offload-modules", "core_attn"])
    assert flags.install_options(mcore)["offload_backend"] == "mcore"


def test_fake_process_group_gets_emulated_peers(parser):
    from megatron_paging.mcore.peers import EmulatedPeers

    argv = BASE + ["--num-experts", "8", "--fake-process-group", "--seed", "7",
                   "--paging-emulated-load", "lognormal:0.5"]
    args = _validate(parser, argv)
    peers = flags.install_options(args)["peers"]
    assert isinstance(peers, EmulatedPeers) and peers.load.skew == 0.5 and peers.seed == 7
    unpaged = _validate(parser, [a for a in argv if a != "--moe-paged-stash"])
    assert isinstance(flags.install_options(unpaged)["peers"], EmulatedPeers)
    assert "peers" not in flags.install_options(_validate(parser, BASE))


@pytest.mark.parametrize("emulated", [[], ["--fake-process-group"]])
def test_combined_1f1b_is_accepted_with_the_static_backend(parser, emulated):
    """Combined 1F1B pages like the other schedules (the installed schedule-node policy keeps
    what the static dispatcher's neighbours save): accepted, paged and emulated alike."""
    args = _validate(parser, BASE + ["--num-experts", "8", "--overlap-moe-expert-parallel-comm",
                                     *emulated], te_available=False)
    assert args.overlap_moe_expert_parallel_comm


def test_recompute_expert_fc1_needs_no_paging(parser):
    args = _validate(parser, ["--paging-recompute-expert-fc1"])
    assert flags.paging_args(args).paging_recompute_expert_fc1


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
        (["--num-layers", "8", "--pipeline-model-parallel-size", "2", "--recompute-granularity",
          "full", "--recompute-method", "block", "--recompute-num-layers", "4"],
         "--moe-paged-stash with --recompute-method block --recompute-num-layers 4 pages nothing "
         "(each pipeline chunk holds 4 layers"),
    ],
    ids=["selective-moe", "full-uniform", "full-block-every-layer"],
)
def test_recompute_of_every_moe_layer_is_refused_with_paged_stash(parser, recompute, message):
    args = parser.parse_args(BASE + recompute)
    with pytest.raises(ValueError, match=re.escape(message)) as error:
        flags.paging_config(args, environ={}, cuda_available=False, te_available=False)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("layout", [[], ["--num-layers", "8", "--pipeline-model-parallel-size",
                                          "2"]])
def test_block_recompute_of_some_layers_pages_the_others(parser, layout):
    args = parser.parse_args(BASE + layout + ["--recompute-granularity", "full",
                                              "--recompute-method", "block",
                                              "--recompute-num-layers", "3"])
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
    """Megatron-Core's own manager keeps its behaviour."""
    args = parser.parse_args(BASE + ["--recompute-granularity", "selective",
                                     "--recompute-modules", "moe"])
    flags.paging_config(args, environ={}, cuda_available=False, te_available=False,
                        mcore_manager=True)


def test_every_flag_is_documented():
    """docs/mcore.md's flag table lists every flag we add."""
    from pathlib import Path

    docs = (Path(__file__).resolve().parent.parent / "docs" / "mcore.md").read_text()
    for f in dataclasses.fields(PagingArgs):
        flag = "`" + flags.flag_name(f.name)
        assert f"| {flag}" in docs, f"{flag} missing from docs/mcore.md's flag table"
