"""install()/uninstall(): every importer of Megatron-Core's paged-stash API (and of
get_forward_backward_func) is rebound, and uninstall restores identity (real megatron-core
0.19.2 modules)."""

from __future__ import annotations

import logging
import sys
import types

import pytest

pytest.importorskip("megatron.core")

from megatron.core.transformer.moe import paged_stash  # noqa: E402

import megatron_paging.mcore  # noqa: E402
from megatron_paging import env  # noqa: E402
from megatron_paging.config import PagingConfig  # noqa: E402
from megatron_paging.mcore import installer as install_mod  # noqa: E402
from megatron_paging.mcore.api import API_FUNCTION_NAMES, MCorePagingAPI  # noqa: E402

# Importers by name in megatron-core 0.19.2 (grep of `from ...paged_stash import`).
EXPECTED_IMPORTERS = {
    "megatron.core.transformer.moe.experts": (
        "paged_stash_group_start",
        "get_paged_stash_context",
        "paged_stash_group_commit",
    ),
    "megatron.core.models.gpt.gpt_model": ("paged_stash_init_chunk_handler",),
    "megatron.core.models.hybrid.hybrid_model": ("paged_stash_init_chunk_handler",),
    "megatron.core.pipeline_parallel.schedules": ("paged_stash_reset",),
    "megatron.core.transformer.moe.paged_stash": API_FUNCTION_NAMES + ("PagedStashRunner",),
    "megatron.training.training": ("PagedStashRunner",),
}
ORIGINALS = {
    name: getattr(paged_stash, name) for name in API_FUNCTION_NAMES + ("PagedStashRunner",)
}
GETTER_IMPORTERS = (
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel",
    "megatron.training.training",
)


def _holders_of(obj) -> list[str]:
    """Every (module.attr) in sys.modules whose value is ``obj`` (by identity)."""
    found = []
    for module_name, module in list(sys.modules.items()):
        if module is None:
            continue
        for attr, value in list(vars(module).items()):
            if value is obj:
                found.append(f"{module_name}.{attr}")
    return found


@pytest.fixture
def installer():
    inst = install_mod.PagingInstaller()
    yield inst
    inst.uninstall()


@pytest.fixture
def alias_importer():
    """A user module that imported an API function under another name before install."""
    module = types.ModuleType("user_code_importing_paged_stash")
    module.reset_alias = paged_stash.paged_stash_reset
    sys.modules[module.__name__] = module
    yield module
    del sys.modules[module.__name__]


def test_install_rebinds_every_importer(installer, alias_importer, caplog):
    with caplog.at_level(logging.INFO, logger=install_mod.__name__):
        api = installer.install()
    assert isinstance(api, MCorePagingAPI)
    for module_name, names in EXPECTED_IMPORTERS.items():
        module = sys.modules[module_name]
        for name in names:
            value = getattr(module, name)
            assert value is not ORIGINALS[name], f"{module_name}.{name} still Megatron-Core's"
            if name in API_FUNCTION_NAMES:
                assert value == getattr(api, name), f"{module_name}.{name} not bound to the api"
    assert alias_importer.reset_alias == api.paged_stash_reset
    # No module anywhere still holds an original API function.
    for name in API_FUNCTION_NAMES:
        assert _holders_of(ORIGINALS[name]) == [], name
    from megatron.core.pipeline_parallel import schedules

    getter = schedules.get_forward_backward_func
    assert getter.megatron_paging_finishing
    for module_name in GETTER_IMPORTERS:
        assert sys.modules[module_name].get_forward_backward_func is getter
    install_lines = [r for r in caplog.records if r.name == install_mod.__name__]
    assert len(install_lines) == 1 and "schedules" in install_lines[0].getMessage()
    assert "get_forward_backward_func" in install_lines[0].getMessage()


def test_documented_entry_point_installs(installer, monkeypatch):
    # README: megatron_paging.mcore.install() / uninstall() are the installer's functions.
    monkeypatch.setattr(install_mod, "INSTALLER", installer)
    api = megatron_paging.mcore.install()
    assert installer.installed and installer.api is api
    megatron_paging.mcore.uninstall()
    assert not installer.installed


def test_every_forward_backward_ends_its_paging_step(installer):
    api = installer.install()
    from megatron.core.pipeline_parallel import schedules

    calls = []

    def schedule_fn(**kwargs):
        calls.append(("schedule", api.engine.step_open))
        return "losses"

    wrapped = install_mod.FinishingForwardBackward(schedule_fn, api)
    api.paged_stash_reset(enabled=True, config=None)
    assert api.engine.step_open
    assert wrapped(forward_only=False) == "losses"
    assert calls == [("schedule", True)] and not api.engine.step_open
    # The getter Megatron's train() calls returns such a wrapper, attributes passed through.
    fn = schedules.get_forward_backward_func(pp_size=1, vp_size=None)
    assert isinstance(fn, install_mod.FinishingForwardBackward) and fn.api is api
    assert fn.__name__ == fn.forward_backward_func.__name__


def test_rebound_names_drive_the_api(installer):
    api = installer.install()
    from megatron.core.pipeline_parallel import schedules

    before = api.iteration
    schedules.paged_stash_reset(enabled=False, config=None)
    assert api.iteration == before + 1 and api.enabled is False
    overflow = paged_stash.check_paged_stash_overflow()
    assert overflow.dtype.is_floating_point is False and not bool(overflow.any())


def test_uninstall_restores_identity(installer, alias_importer):
    from megatron.core.transformer.moe import moe_layer, token_dispatcher
    from megatron.core.transformer.transformer_config import TransformerConfig

    post_init = TransformerConfig.__dict__["__post_init__"]
    installer.install()
    assert moe_layer.MoEFlexTokenDispatcher is not token_dispatcher.MoEFlexTokenDispatcher
    assert TransformerConfig.__dict__["__post_init__"] is not post_init
    installer.uninstall()
    for module_name, names in EXPECTED_IMPORTERS.items():
        for name in names:
            assert getattr(sys.modules[module_name], name) is ORIGINALS[name]
    assert alias_importer.reset_alias is ORIGINALS["paged_stash_reset"]
    assert moe_layer.MoEFlexTokenDispatcher is token_dispatcher.MoEFlexTokenDispatcher
    assert TransformerConfig.__dict__["__post_init__"] is post_init
    assert installer.rebindings == [] and not installer.installed


def test_install_is_idempotent(installer):
    api = installer.install()
    count = len(installer.rebindings)
    assert installer.install() is api
    assert len(installer.rebindings) == count
    other = MCorePagingAPI()
    assert installer.install(api=other) is other
    assert paged_stash.paged_stash_reset == other.paged_stash_reset
    assert len(installer.rebindings) == count
    installer.uninstall()
    installer.uninstall()  # a second uninstall is a no-op
    assert paged_stash.paged_stash_reset is ORIGINALS["paged_stash_reset"]


def test_install_refuses_other_megatron_core_versions(installer, monkeypatch):
    monkeypatch.setattr(env, "_dist_version", lambda name: "0.18.0")
    with pytest.raises(RuntimeError, match="megatron-core 0.18.0 is installed"):
        installer.install()
    assert not installer.installed
    assert paged_stash.paged_stash_reset is ORIGINALS["paged_stash_reset"]


def test_config_shim_accepts_static_backend_only_when_installed(installer):
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = dict(
        num_layers=1,
        hidden_size=32,
        num_attention_heads=4,
        num_moe_experts=4,
        moe_router_topk=2,
        moe_token_dispatcher_type="flex",
        moe_flex_dispatcher_backend="static",
        moe_expert_rank_capacity_factor=1.5,
        moe_paged_stash=True,
    )
    with pytest.raises(ValueError, match="moe_expert_rank_capacity_factor requires"):
        TransformerConfig(**fields)
    installer.install()
    config = TransformerConfig(**fields)
    assert config.moe_flex_dispatcher_backend == "static"
    with pytest.raises(ValueError, match="requires moe_token_dispatcher_type='flex'"):
        TransformerConfig(**{**fields, "moe_token_dispatcher_type": "alltoall"})
    # Other backends keep Megatron-Core's own validation.
    with pytest.raises(ValueError, match="moe_expert_rank_capacity_factor requires"):
        TransformerConfig(**{**fields, "moe_flex_dispatcher_backend": "deepep"})


def test_baseline_install_keeps_megatron_cores_paged_stash(installer):
    from megatron.core.transformer.moe import moe_layer, token_dispatcher

    installer.install(replace_paged_stash=False)
    for module_name, names in EXPECTED_IMPORTERS.items():
        for name in names:
            assert getattr(sys.modules[module_name], name) is ORIGINALS[name]
    assert moe_layer.MoEFlexTokenDispatcher is not token_dispatcher.MoEFlexTokenDispatcher
    api = installer.install()  # switching to ours re-installs
    assert paged_stash.paged_stash_reset == api.paged_stash_reset


def test_install_with_another_config_reinstalls(installer, caplog):
    api = installer.install()
    count = len(installer.rebindings)
    assert installer.install(api.engine.config) is api  # the same config
    with caplog.at_level(logging.INFO, logger=install_mod.__name__):
        other = installer.install(PagingConfig(prefetch_distance=4, kernel_backend="reference"))
    assert other is not api
    assert other.engine.config.prefetch_distance == 4
    assert other.engine.config.kernel_backend == "reference"
    assert paged_stash.paged_stash_reset == other.paged_stash_reset
    assert len(installer.rebindings) == count
    reinstall = [r for r in caplog.records if "reinstalling" in r.getMessage()]
    assert len(reinstall) == 1 and "prefetch_distance=4" in reinstall[0].getMessage()
    assert installer.install() is other  # no config: keep what is installed


def test_a_config_that_would_be_unused_is_rejected(installer):
    with pytest.raises(ValueError, match="no effect with replace_paged_stash=False"):
        installer.install(PagingConfig(prefetch_distance=2), replace_paged_stash=False)
    assert not installer.installed
    with pytest.raises(ValueError, match="no effect next to an explicit api"):
        installer.install(PagingConfig(prefetch_distance=2), api=MCorePagingAPI())
    assert not installer.installed


def test_combined_1f1b_keeps_what_the_static_dispatchers_neighbours_save(installer):
    """Megatron-Core's combined 1F1B frees the ``mlp`` schedule node's input after forward for
    flex dispatchers, and the ``moe_dispatch`` node's; the static backend passes both through to
    modules that save them (the experts, the router), so after install those nodes keep them.
    Other nodes and other backends keep Megatron-Core's answer; uninstall restores the original
    function."""
    from megatron.core.models.common import utils as node_utils

    original = node_utils.should_free_input
    static = types.SimpleNamespace(moe_token_dispatcher_type="flex", fp8=None, fp4=None,
                                   moe_flex_dispatcher_backend="static", cuda_graph_modules=[])
    deepep = types.SimpleNamespace(**{**vars(static), "moe_flex_dispatcher_backend": "deepep"})
    assert original("mlp", True, static, 2) is True  # what combined 1F1B did before
    installer.install()
    wrapped = node_utils.should_free_input
    assert wrapped is not original
    assert original("moe_dispatch", True, static, 2) is True
    assert wrapped("mlp", True, static, 2) is False
    assert wrapped("moe_dispatch", True, static, 2) is False
    for name in ("moe_combine", "pre_dispatch_computation"):
        assert wrapped(name, True, static, 2) == original(name, True, static, 2)
    for name in ("mlp", "moe_dispatch", "moe_combine"):
        assert wrapped(name, True, deepep, 2) == original(name, True, deepep, 2)
    installer.uninstall()
    assert node_utils.should_free_input is original
