"""The benchmarks' one arm vocabulary (benchmarks/arm_names.py): every arm is a plan arm with an
optional variant, an arm without a variant is the line the plan derives that arm from, and
result files of the old names are read under the current ones."""

from __future__ import annotations

import json

import frontier_bench  # noqa: F401 (a plain import, so sorted first: puts benchmarks/ on sys.path)
import pytest
import scale_layouts
from arm_names import NAMING, NAMING_KEY, OLD_NAMES, arm_name, current_name, split_name
from frontier import arms as frontier_arms

from megatron_paging.plan.arms import ARM_NAMES

TABLES = {"frontier": frontier_arms.ARMS, "scale": scale_layouts.ARMS}


@pytest.mark.parametrize("benchmark", sorted(TABLES))
def test_every_arm_is_a_plan_arm_and_a_variant(benchmark):
    for name, arm in TABLES[benchmark].items():
        assert arm.plan_arm in ARM_NAMES
        assert name == arm.name == arm_name(arm.plan_arm, arm.variant)
        assert split_name(name) == (arm.plan_arm, arm.variant)


def test_a_name_outside_the_plan_is_refused():
    with pytest.raises(ValueError, match="'recompute_moe' is not an arm of the plan"):
        arm_name("recompute_moe")
    with pytest.raises(ValueError, match="contains '.'"):
        arm_name("paged", "a.b")


@pytest.mark.parametrize("benchmark", sorted(TABLES))
def test_old_names_map_to_current_arms(benchmark):
    assert set(OLD_NAMES[benchmark].values()) <= set(TABLES[benchmark])
    # paged_offload is the one old name that is a plan arm too (of another run): files tell
    # which naming they use.
    assert set(OLD_NAMES[benchmark]) & set(ARM_NAMES) <= {"paged_offload"}
    assert current_name("paged_prefetch_dispatcher", benchmark) == "paged_prefetch_dispatcher"


def test_plain_frontier_arms_are_the_lines_the_plan_derives_them_from():
    pytest.importorskip("megatron.training")
    from megatron_paging.mcore import plan_inputs

    for name, arm in frontier_arms.ARMS.items():
        if arm.variant:
            continue
        argv = frontier_arms.script_argv(frontier_arms.frontier_extra("small", name), arm.paged)
        with plan_inputs.quiet():
            args = plan_inputs.parse_megatron(argv, world_size=1)
        assert plan_inputs.as_launched(args, arm.env) == arm.plan_arm, name


def test_plain_scale_arms_are_the_lines_the_plan_derives_them_from():
    pytest.importorskip("megatron.training")
    from megatron_paging.mcore import plan_inputs

    layout = scale_layouts.LAYOUTS["qwen3_235b"]
    for arm in scale_layouts.ARMS.values():
        if arm.variant:
            continue
        argv = [*layout.flags(0), "--moe-expert-rank-capacity-factor", "2.0", *arm.flags]
        with plan_inputs.quiet():
            args = plan_inputs.parse_megatron(argv, world_size=layout.world_size, rank=0)
        assert plan_inputs.as_launched(args, arm.env) == arm.plan_arm, arm.name


def test_an_old_frontier_file_resumes_under_the_current_names(tmp_path):
    from frontier.plan import load_runs

    run = {"kind": "arm", "size": "small", "arm": "paged_stash_plus_offload", "status": "failed"}
    budget = {"kind": "budget", "size": "small", "arm": "recompute_moe", "status": "oom"}
    old = {"benchmark": "frontier", "runs": {
        "small:paged_stash_plus_offload": run,
        "budget:small:recompute_moe:4096:36GiB:expandable_segments:True": budget}}
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    runs, _ = load_runs(path)
    assert {key: r["arm"] for key, r in runs.items()} == {
        "small:paged_offload": "paged_offload",
        "budget:small:recompute:4096:36GiB:expandable_segments:True": "recompute"}
    path.write_text(json.dumps({**old, NAMING_KEY: NAMING}))  # written under this naming
    assert set(load_runs(path)[0]) == set(old["runs"])


def test_old_scale_files_are_read_under_the_current_names(tmp_path):
    import bench_scale
    import report_plan

    old = {"benchmark": "scale", "runs": [{"arm": "paged_offload"}, {"arm": "mcore_manager"}]}
    path = tmp_path / "scale.json"
    path.write_text(json.dumps(old))
    loaded = bench_scale.load_result(path)
    assert [r["arm"] for r in loaded["runs"]] == ["paged_offload_experts", "mcore"]
    assert [r["arm"] for r in report_plan.scale_records(old, "runs")] == [
        "paged_offload_experts", "mcore"]
    marked = {**old, NAMING_KEY: NAMING}
    assert report_plan.scale_records(marked, "runs") == old["runs"]
