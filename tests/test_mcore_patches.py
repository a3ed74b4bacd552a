"""patches/megatron-core-0.19.2 on a vendored copy of the installed megatron-core: apply / check /
revert round trip, and the patched sources page a real MoELayer through megatron_paging without
install() (bitwise equal to unpaged)."""

from __future__ import annotations

import filecmp
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

megatron_core = pytest.importorskip("megatron.core")

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "apply_patches.sh"
PATCHED_FILES = (
    "megatron/core/transformer/moe/paged_stash.py",
    "megatron/core/pipeline_parallel/schedules.py",
    "megatron/core/transformer/moe/moe_layer.py",
    "megatron/core/transformer/transformer_config.py",
    "megatron/core/models/common/utils.py",
)

CHECK_PATCHED = """
import sys
sys.path[:0] = [{site!r}, {tests!r}]
import megatron.core
assert megatron.core.__file__.startswith({site!r}), megatron.core.__file__
import torch, torch.distributed as dist
from mcore_fixtures import free_port, moe_config
dist.init_process_group("gloo", world_size=1, rank=0, init_method=f"tcp://127.0.0.1:{{free_port()}}")
from megatron.core import parallel_state
parallel_state.initialize_model_parallel()
from megatron.core.transformer.moe import experts, moe_layer, paged_stash
from megatron.core.pipeline_parallel import schedules
from megatron_paging.mcore.installer import INSTALLER, FinishingForwardBackward
assert not INSTALLER.installed
assert moe_layer.MoEFlexTokenDispatcher.__name__ == "PagingFlexTokenDispatcher"
config = moe_config(moe_paged_stash=True, moe_expert_rank_capacity_factor=2.0)  # no shim needed
# Combined 1F1B's schedule nodes keep what the static backend passes through (before install).
from megatron.core.models.common import utils as node_utils
assert not INSTALLER.installed and config.moe_flex_dispatcher_backend == "static"
assert not any(node_utils.should_free_input(n, True, config, 2) for n in ("mlp", "moe_dispatch"))
import test_mcore_experts as t
layer = t._moe_layer(config)
api = paged_stash._megatron_paging_api()
paged = t._train_steps(api, layer, config, paged=True)
unpaged = t._train_steps(api, layer, config, paged=False)
assert api.engine.pools is not None and INSTALLER.installed
# Every forward-backward ends its paging step (what full-iteration CUDA graphs need).
fn = schedules.get_forward_backward_func(pp_size=1, vp_size=None)
assert isinstance(fn, FinishingForwardBackward) and fn.api is api
assert not getattr(schedules.get_forward_backward_func, "megatron_paging_finishing", False)
for (lp, gp, hp), (lu, gu, hu) in zip(paged, unpaged, strict=True):
    assert all(torch.equal(a, b) for a, b in zip(lp + gp + hp, lu + gu + hu, strict=True))
print("PATCHED-OK")
"""


def _run(action: str, site: Path) -> str:
    result = subprocess.run(
        ["bash", str(SCRIPT), action, str(site)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.fixture(scope="module")
def vendored(tmp_path_factory) -> Path:
    site = tmp_path_factory.mktemp("vendored")
    installed = Path(megatron_core.__file__).resolve().parent.parent
    shutil.copytree(installed, site / "megatron", ignore=shutil.ignore_patterns("__pycache__"))
    return site


def test_apply_check_revert_round_trip(vendored):
    original = vendored / "original"
    for rel in PATCHED_FILES:
        (original / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(vendored / rel, original / rel)
    assert "apply cleanly" in _run("check", vendored)
    assert f"applied {len(PATCHED_FILES)} patches" in _run("apply", vendored)
    assert "applied in" in _run("check", vendored)
    assert "already applied" in _run("apply", vendored)
    assert all(
        not filecmp.cmp(vendored / rel, original / rel, shallow=False) for rel in PATCHED_FILES
    )
    assert f"reverted {len(PATCHED_FILES)} patches" in _run("revert", vendored)
    assert all(filecmp.cmp(vendored / rel, original / rel, shallow=False) for rel in PATCHED_FILES)
    shutil.rmtree(original)


def test_patched_megatron_core_pages_through_megatron_paging(vendored):
    _run("apply", vendored)
    try:
        code = CHECK_PATCHED.format(site=str(vendored), tests=str(ROOT / "tests"))
        result = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=240, cwd=ROOT
        )
        assert "PATCHED-OK" in result.stdout, result.stdout[-2000:] + result.stderr[-4000:]
    finally:
        _run("revert", vendored)


def test_bad_usage_is_refused(vendored, tmp_path):
    def run(*argv):
        return subprocess.run(["bash", str(SCRIPT), *argv], capture_output=True, text=True)

    no_site = run("check", str(tmp_path))
    assert no_site.returncode == 2 and "has no megatron/ directory" in no_site.stderr
    unknown = run("frobnicate", str(vendored))
    assert unknown.returncode == 2 and "usage:" in unknown.stderr


def test_apply_names_the_patch_that_does_not_apply(tmp_path):
    installed = Path(megatron_core.__file__).resolve().parent.parent.parent  # holds megatron/
    for rel in PATCHED_FILES:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(installed / rel, tmp_path / rel)
    broken = tmp_path / "megatron/core/pipeline_parallel/schedules.py"
    broken.write_text("")  # no hunk of schedules.patch finds its context
    before = {rel: (tmp_path / rel).read_bytes() for rel in PATCHED_FILES}
    result = subprocess.run(["bash", str(SCRIPT), "apply", str(tmp_path)],
                            capture_output=True, text=True, timeout=60)
    lines = result.stderr.strip().splitlines()
    assert result.returncode != 0 and len(lines) == 1 and "schedules.patch" in lines[0]
    assert {rel: (tmp_path / rel).read_bytes() for rel in PATCHED_FILES} == before
