"""The paged offloading backend's start-up: every refusal of --paging-offload-backend and the
flags it builds a config from, on Megatron's own argument parser; the offload plan from a group
log (Megatron-Core's knobs: margin, fraction, delta); and the lifts of Megatron-Core's checks
(validate_args' TE assertion, affinity pinning without NVML, the fake TE cpu_offload)."""

from __future__ import annotations

import argparse

import pytest

pytest.importorskip("megatron.core")
pytest.importorskip("megatron.training")

from megatron_paging.mcore import flags  # noqa: E402
from megatron_paging.mcore.offloading.groups import GroupLog, plan_from_log  # noqa: E402

# ---------------------------------------------------------------------------- start-up flags
BASE = ["--moe-expert-rank-capacity-factor", "1.25", "--moe-token-dispatcher-type", "flex",
        "--moe-flex-dispatcher-backend", "static"]
OFFLOAD = ["--fine-grained-activation-offloading", "--offload-modules", "core_attn",
           "--paging-offload-backend", "paged"]


@pytest.fixture(scope="module")
def parser():
    from megatron.training.arguments import add_megatron_arguments

    return flags.add_paging_args(add_megatron_arguments(argparse.ArgumentParser()))


def _config(parser, argv):
    return flags.paging_config(parser.parse_args(argv), environ={}, cuda_available=False)


def test_paged_offload_alone_builds_a_config_with_its_flags(parser):
    config = _config(parser, BASE + OFFLOAD + ["--paging-offload-host-factor", "2"])
    assert config.offload_host_factor == 2.0
    assert (config.offload_d2h_max_ctas, config.offload_h2d_max_ctas) == (4, 8)  # defaults
    args = parser.parse_args(BASE + OFFLOAD)
    assert flags.install_options(args, config)["offload_backend"] == "paged"


@pytest.mark.parametrize(("extra", "in_flight"), [([], 2), (["3"], 3), (["0"], 0)])
def test_megatron_in_flight_cap_sets_ours_under_graphs(parser, extra, in_flight):
    argv = BASE + OFFLOAD + ["--cuda-graph-impl", "full_iteration"]
    if extra:
        argv += ["--fine-grained-offloading-max-inflight-offloads", *extra]
    assert _config(parser, argv).offload_in_flight == in_flight


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (BASE + ["--paging-offload-backend", "paged"],
         ("--paging-offload-backend", "--fine-grained-activation-offloading")),
        (BASE + ["--paging-offload-host-factor", "2"],
         ("--paging-offload-host-factor", "--paging-offload-backend")),
        (BASE + OFFLOAD[:2] + ["fused_group_mlp"] + OFFLOAD[3:],
         ("--offload-modules", "fused_group_mlp")),
        (BASE + OFFLOAD + ["--cuda-graph-impl", "local"],
         ("--cuda-graph-impl local", "--paging-offload-backend")),
        (BASE + OFFLOAD + ["--delay-offload-until-cuda-graph"],
         ("--delay-offload-until-cuda-graph",)),
        (BASE + OFFLOAD + ["--fine-grained-offloading-max-inflight-offloads", "2"],
         ("--fine-grained-offloading-max-inflight-offloads", "--cuda-graph-impl full_iteration")),
        (BASE + OFFLOAD + ["--cuda-graph-impl", "full_iteration",
                           "--fine-grained-offloading-max-inflight-offloads", "-1"],
         ("--fine-grained-offloading-max-inflight-offloads", "-1")),
        (BASE + OFFLOAD + ["--paging-offload-host-factor", "0.5"],
         ("--paging-offload-host-factor", "0.5")),
        (BASE[2:] + OFFLOAD[:2] + ["moe_act"] + OFFLOAD[3:],
         ("--moe-expert-rank-capacity-factor", "moe_act")),
        (BASE + OFFLOAD[:2] + ["expert_fc1", "moe_act"] + OFFLOAD[3:]
         + ["--paging-recompute-expert-fc1"],
         ("--offload-modules moe_act", "--paging-recompute-expert-fc1")),
    ],
)
def test_offload_startup_refusals_name_their_flags_in_one_line(parser, argv, named):
    with pytest.raises(ValueError) as excinfo:
        _config(parser, argv)
    message = str(excinfo.value)
    assert all(name in message for name in named) and "\n" not in message


# ---------------------------------------------------------------------------- the offload plan
def _log(microbatches=2, names=("a", "b", "a", "b"), immediate=True, nbytes=100):
    log = GroupLog()
    for mb in range(1, microbatches + 1):
        for i, name in enumerate(names):
            log.forward_group((0, mb), i, name)
            log.add_bytes((0, mb), i, nbytes)
        if immediate:
            log.backward_group((0, mb))
    if not immediate:
        for mb in range(microbatches, 0, -1):
            log.backward_group((0, mb))
    return log


def test_margin_keeps_the_last_group_of_each_name_when_backward_follows_at_once():
    plan = plan_from_log(_log())
    assert plan.kept == {(0, mb, i) for mb in (1, 2) for i in (2, 3)}
    pipelined = plan_from_log(_log(immediate=False))  # both forwards, then both backwards
    assert pipelined.kept == {(0, 2, 2), (0, 2, 3)}  # only the last forward's, backward first


def test_fraction_keeps_the_later_groups():
    plan = plan_from_log(_log(immediate=False, names=("a", "b", "c", "d")), fraction=0.5)
    # Microbatch 2: margin keeps all four (each name once); microbatch 1: the later half.
    assert {(0, 1, 2), (0, 1, 3)} <= plan.kept and (0, 1, 0) not in plan.kept
    assert plan_from_log(_log(immediate=False), fraction=1.0).kept == {(0, 2, 2), (0, 2, 3)}


def test_delta_keeps_bytes_per_pipeline_rank_in_backward_order():
    log = _log(immediate=False, names=("a", "b", "c", "d"))
    assert plan_from_log(log, pp_rank=0, delta_bytes=250).kept == plan_from_log(log).kept
    kept = plan_from_log(log, pp_rank=1, delta_bytes=250).kept - plan_from_log(log).kept
    assert kept == {(0, 1, 0), (0, 1, 1), (0, 1, 2)}  # 300 bytes >= 250, mb 2 was kept already


# ---------------------------------------------------------------------------- the lifts
def test_validate_args_lift_skips_only_the_te_assertion(monkeypatch):
    from megatron_paging.mcore.offloading import shims as offload_shims

    seen = []

    def validate_args(args, *rest):
        seen.append(args.fine_grained_activation_offloading)
        if args.fine_grained_activation_offloading:
            assert args.transformer_impl == "transformer_engine", "TE only"
        return "validated"

    lifted = offload_shims.lifted_validate_args(validate_args)
    args = argparse.Namespace(fine_grained_activation_offloading=True, transformer_impl="local",
                              paging_offload_backend="paged")
    assert lifted(args) == "validated" and seen == [False]
    assert args.fine_grained_activation_offloading  # restored for everything after validation
    monkeypatch.setattr(offload_shims, "te_available", lambda: True)
    args.paging_offload_backend = "mcore"  # TE present: Megatron-Core's own check stands
    with pytest.raises(AssertionError, match="TE only"):
        lifted(args)


def test_affinity_pinning_tolerates_missing_nvml(caplog):
    from megatron_paging.mcore.offloading import shims as offload_shims

    cause = "Please install cuda-python to enable GPU affinity setting"

    def pin():
        raise RuntimeError(cause)

    with caplog.at_level("INFO", logger="megatron_paging.mcore.offloading.shims"):
        assert offload_shims.tolerant_affinity(pin)() is None  # goes on without pinning
        assert offload_shims.tolerant_affinity(lambda: "pinned")() == "pinned"
    # one record, for the failed pinning only, carrying its cause
    (record,) = caplog.records
    assert cause in record.getMessage()


def test_mcore_backend_without_te_gets_the_fake_cpu_offload_switch():
    from megatron.core.extensions import transformer_engine as te_ext

    from megatron_paging.mcore.installer import PagingInstaller
    from megatron_paging.mcore.offloading import shims as offload_shims

    if offload_shims.te_available():
        pytest.skip("Transformer Engine is installed: Megatron-Core's offloading needs no fake")
    installer = PagingInstaller()
    before = te_ext.cpu_offload
    installer.install(replace_paged_stash=False, offload_backend="mcore")
    try:
        assert te_ext.cpu_offload is offload_shims.FakeTECpuOffload
    finally:
        installer.uninstall()
    assert te_ext.cpu_offload is before
