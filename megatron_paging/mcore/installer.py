"""The one install point: make Megatron-Core 0.19.2 page through megatron-paging.

Call ``megatron_paging.mcore.install()`` (this module's :func:`install`) before building any
model or ``TransformerConfig``.

Megatron-Core imports its paged-stash API *by name* (``from ...paged_stash import
paged_stash_reset``), so replacing the function in ``paged_stash.py`` alone changes nothing for
the importers. :meth:`PagingInstaller.install` therefore

1. checks the megatron-core version (only 0.19.2's hook points are known);
2. imports the known importers (``experts``, ``gpt_model``, ``hybrid_model``, ``schedules``,
   ``training``) so that they exist before the scan;
3. scans ``sys.modules`` for every attribute that *is* one of Megatron-Core's original objects
   (by identity, so aliases are found too) and rebinds it to ours, remembering each rebinding:
   the seven API functions go to the bound methods of one :class:`MCorePagingAPI`,
   ``PagedStashRunner`` to ours when :mod:`megatron_paging.mcore.runner` provides one,
   ``get_forward_backward_func`` to one whose functions end every forward-backward with the
   API's ``paged_stash_finish`` (Megatron-Core has no end-of-step hook; a full-iteration CUDA
   graph captures that end too), and ``MoEFlexTokenDispatcher`` in ``moe_layer`` to a subclass
   that adds the ``static`` backend, and ``should_free_input`` so that combined 1F1B keeps
   that backend's expert input (:func:`~.dispatcher.keeping_expert_inputs`);
4. installs the config-validation shim (the one place that teaches ``TransformerConfig`` about
   the ``static`` dispatch backend, see :func:`.validation.static_backend_post_init`);
5. with ``offload_backend="paged"``: rebinds ``FineGrainedActivationOffloadingInterface``
   everywhere to the paged offloading backend (:mod:`.offloading.backend`) over the same API, and
   applies the offloading lifts of :mod:`.offloading.shims`; with ``"mcore"``, only the lifts
   Megatron-Core's own offloading needs without Transformer Engine;
6. rebinds Megatron's ``wrap_model_chunks_with_ddp`` so DDP's gradient accumulators are made on
   the training stream instead of Megatron's side stream (:mod:`.ddp_stream` says why);
7. logs one line saying what it replaced.

:meth:`PagingInstaller.uninstall` puts every original object back (identity restored).
``install()`` is idempotent (a call asking for another config reinstalls). Modules
imported *after* install keep Megatron-Core's names: call ``install()`` before building the
model (the example script does it first thing).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import sys
from dataclasses import dataclass

from megatron_paging.config import OFFLOAD_BACKENDS, PagingConfig
from megatron_paging.env import check_megatron_core_version
from megatron_paging.mcore import ddp_stream
from megatron_paging.mcore.api import MCorePagingAPI
from megatron_paging.mcore.dispatcher import (
    PagingFlexTokenDispatcher,
    keeping_expert_inputs,
    numbering_dispatcher,
)
from megatron_paging.mcore.flags import allow_static_backend
from megatron_paging.mcore.offloading import shims
from megatron_paging.mcore.offloading.backend import PagedOffloadManager, make_interface
from megatron_paging.mcore.validation import CONFIG_MODULE, static_backend_post_init

logger = logging.getLogger(__name__)

SCHEDULE_NODE_MODULE = "megatron.core.models.common.utils"
PAGED_STASH_MODULE = "megatron.core.transformer.moe.paged_stash"
MOE_LAYER_MODULE = "megatron.core.transformer.moe.moe_layer"
TOKEN_DISPATCHER_MODULE = "megatron.core.transformer.moe.token_dispatcher"
SCHEDULES_MODULE = "megatron.core.pipeline_parallel.schedules"
OFFLOAD_MODULE = "megatron.core.pipeline_parallel.fine_grained_activation_offload"
OFFLOAD_INTERFACE = "FineGrainedActivationOffloadingInterface"
KNOWN_IMPORTERS = (
    PAGED_STASH_MODULE,
    OFFLOAD_MODULE,
    "megatron.core.pipeline_parallel",
    "megatron.core.transformer.moe.experts",
    "megatron.core.transformer.attention",
    "megatron.core.transformer.multi_latent_attention",
    "megatron.core.transformer.transformer_layer",
    "megatron.core.models.gpt.gpt_model",
    "megatron.core.models.gpt.fine_grained_callables",
    "megatron.core.models.hybrid.hybrid_model",
    "megatron.core.pipeline_parallel.schedules",
    MOE_LAYER_MODULE,
    "megatron.training.training",
)
RUNNER_NAME = "PagedStashRunner"
FORWARD_BACKWARD_GETTER = "get_forward_backward_func"


class FinishingForwardBackward:
    """A ``forward_backward_func`` that ends every call with the API's ``paged_stash_finish``
    (and, with emulated peers, begins it with their ``begin_step``).

    Inside a full-iteration CUDA-graph capture that end is captured too: it joins the paging
    stream back into the capture stream, which the capture requires. Attributes of the wrapped
    function stay reachable (``__getattr__``).
    """

    def __init__(self, forward_backward_func, api: MCorePagingAPI | None, peers=None):
        self.forward_backward_func = forward_backward_func
        self.api = api
        self.peers = peers

    def __call__(self, *args, **kwargs):
        if self.peers is not None:  # a rerun of an iteration gets that iteration's exchanges
            self.peers.begin_step(_training_iteration(),
                                  evaluation=bool(kwargs.get("forward_only", False)))
        result = self.forward_backward_func(*args, **kwargs)
        if self.api is not None:
            self.api.paged_stash_finish()
        return result

    def __getattr__(self, name):
        if name == "forward_backward_func":  # not set yet (copying): no recursion
            raise AttributeError(name)
        return getattr(self.forward_backward_func, name)


def _training_iteration() -> int | None:
    """Megatron's ``args.curr_iteration`` (what ``train()`` sets before each step), or None
    outside Megatron's training loop."""
    global_vars = sys.modules.get("megatron.training.global_vars")
    args = getattr(global_vars, "_GLOBAL_ARGS", None)
    iteration = getattr(args, "curr_iteration", None)
    return iteration if isinstance(iteration, int) else None


def _finishing_getter(get_forward_backward_func, api: MCorePagingAPI | None, peers=None):
    @functools.wraps(get_forward_backward_func)
    def getter(*args, **kwargs):
        return FinishingForwardBackward(get_forward_backward_func(*args, **kwargs), api, peers)

    getter.megatron_paging_finishing = True
    return getter


@dataclass(frozen=True)
class Rebinding:
    """One module attribute we replaced, and what it held before."""

    module: object  # the module object (it may have left sys.modules by uninstall time)
    attr: str
    original: object
    replacement: object

    @property
    def module_name(self) -> str:
        return getattr(self.module, "__name__", repr(self.module))


def _with_static_backend(add_megatron_arguments):
    """Wrap Megatron's parser builder so every parser it builds accepts the static backend."""

    @functools.wraps(add_megatron_arguments)
    def wrapped(parser):
        return allow_static_backend(add_megatron_arguments(parser))

    return wrapped


def _our_runner(api: MCorePagingAPI):
    """Our ``PagedStashRunner`` bound to ``api`` (None when mcore/runner.py has none)."""
    try:
        runner_module = importlib.import_module("megatron_paging.mcore.runner")
    except ImportError:
        return None
    runner_cls = getattr(runner_module, RUNNER_NAME, None)
    if runner_cls is None:
        return None
    params = inspect.signature(runner_cls).parameters
    for keyword in ("paging", "api"):
        if keyword in params:
            return functools.partial(runner_cls, **{keyword: api})
    return runner_cls


class PagingInstaller:
    """Installs one :class:`MCorePagingAPI` into Megatron-Core and can take it out again."""

    def __init__(self):
        self.api: MCorePagingAPI | None = None
        self.rebindings: list[Rebinding] = []
        self.replaced = False  # whether the paged-stash API itself is ours
        self.offload_backend: str | None = None
        self.peers = None

    @property
    def installed(self) -> bool:
        return self.api is not None

    def install(
        self,
        config: PagingConfig | None = None,
        api: MCorePagingAPI | None = None,
        replace_paged_stash: bool = True,
        offload_backend: str | None = None,
        peers=None,
    ) -> MCorePagingAPI:
        """Rebind Megatron-Core's paged-stash hook points to ``api`` (default: one made for
        ``config``, itself defaulting to ``PagingConfig.from_env()``).

        ``offload_backend``: None (offloading untouched), ``"paged"`` (Megatron-Core's
        fine-grained activation offloading through our runtime; needs
        ``replace_paged_stash``) or ``"mcore"`` (Megatron-Core's own, made to run without TE).

        ``peers``: :class:`~megatron_paging.mcore.peers.EmulatedPeers` of a rank emulated under
        ``--fake-process-group`` (:func:`megatron_paging.mcore.peers.wiring`), or None.

        ``replace_paged_stash=False`` installs only the ``static`` dispatch backend and its config
        shim and leaves Megatron-Core's own paged-stash manager, kernels and runner in place (the
        baseline that benchmarks compare against); the returned ``api`` is then unused, and a
        ``config`` (which would be unused too) raises ``ValueError``, as it does next to an
        explicit ``api``.

        Idempotent: installing again returns the installed API, unless it asks for something
        else: a new ``api``, another ``replace_paged_stash``, or a ``config`` that differs from
        the installed engine's; then it uninstalls and installs afresh (logging one line).
        """
        if config is not None and not replace_paged_stash:
            raise ValueError(
                "a paging config has no effect with replace_paged_stash=False "
                "(Megatron-Core's own paged stash)"
            )
        if config is not None and api is not None:
            raise ValueError("a paging config has no effect next to an explicit api")
        if offload_backend not in (None, *OFFLOAD_BACKENDS):
            raise ValueError(
                f"offload_backend must be None or one of {OFFLOAD_BACKENDS}, got "
                f"{offload_backend!r}"
            )
        if offload_backend == "paged" and not replace_paged_stash:
            raise ValueError(
                "the paged offloading backend runs on megatron-paging's runtime; it cannot be "
                "combined with Megatron-Core's own paged stash (replace_paged_stash=False)"
            )
        if self.installed:
            same_api = api is None or api is self.api
            same_config = config is None or config == self.api.engine.config
            same_offload = offload_backend == self.offload_backend
            same = same_api and same_config and same_offload and peers is self.peers
            if same and replace_paged_stash == self.replaced:
                return self.api
            if not same_config:
                logger.info(
                    "megatron-paging: reinstalling with %s (was %s)", config, self.api.engine.config
                )
            self.uninstall()
        version = check_megatron_core_version()
        for name in KNOWN_IMPORTERS:
            importlib.import_module(name)
        if api is None:
            api = MCorePagingAPI(config=config)

        paged_stash = sys.modules[PAGED_STASH_MODULE]
        replacements = {}
        if replace_paged_stash:
            replacements = {id(getattr(paged_stash, n)): (n, f) for n, f in api.functions().items()}
            runner = _our_runner(api)
            if runner is not None:
                replacements[id(getattr(paged_stash, RUNNER_NAME))] = (RUNNER_NAME, runner)
        originals = {
            id(getattr(paged_stash, n)): getattr(paged_stash, n) for n, _ in replacements.values()
        }
        # A Megatron-Core patched by patches/ already ends every forward-backward itself.
        patched = hasattr(paged_stash, "paged_stash_finishing")
        finishing = replace_paged_stash and not patched
        if finishing or peers is not None:
            getter = getattr(sys.modules[SCHEDULES_MODULE], FORWARD_BACKWARD_GETTER)
            replacements[id(getter)] = (
                FORWARD_BACKWARD_GETTER,
                _finishing_getter(getter, api if finishing else None, peers),
            )
            originals[id(getter)] = getter
        if offload_backend == "paged":
            interface = getattr(sys.modules[OFFLOAD_MODULE], OFFLOAD_INTERFACE)
            api.offload = PagedOffloadManager(api)
            replacements[id(interface)] = (OFFLOAD_INTERFACE, make_interface(api.offload))
            originals[id(interface)] = interface
        self.rebindings = self._rebind_everywhere(replacements, originals)
        self.replaced = replace_paged_stash
        self.offload_backend = offload_backend

        # The dispatcher is constructed in one place only: MoELayer.__init__; it learns its
        # layer's global number when the transformer layer sets the MoE layer's.
        moe_layer = sys.modules[MOE_LAYER_MODULE]
        self._rebind(moe_layer, "MoEFlexTokenDispatcher", PagingFlexTokenDispatcher)
        self._rebind(moe_layer.MoELayer, "set_layer_number",
                     numbering_dispatcher(moe_layer.MoELayer.set_layer_number))
        # Combined 1F1B must not free what the static dispatcher passes through.
        node_utils = importlib.import_module(SCHEDULE_NODE_MODULE)
        self._rebind(node_utils, "should_free_input",
                     keeping_expert_inputs(node_utils.should_free_input))
        if peers is not None:  # a diagnostic: imported only when a run emulates peers
            from megatron_paging.mcore.peers import wiring

            for owner, attr, replacement in wiring(peers):
                self._rebind(owner, attr, replacement)
        self.peers = peers

        # Megatron's training loop re-parses the command line without our extra_args_provider
        # (in-process restart, fault tolerance): its own parser must accept `static` too.
        arguments = importlib.import_module("megatron.training.arguments")
        self._rebind(arguments, "add_megatron_arguments",
                     _with_static_backend(arguments.add_megatron_arguments))

        config_cls = sys.modules[CONFIG_MODULE].TransformerConfig
        original_post_init = config_cls.__dict__["__post_init__"]
        config_cls.__post_init__ = static_backend_post_init(original_post_init)
        self.rebindings.append(
            Rebinding(
                config_cls,
                "__post_init__",
                original_post_init,
                config_cls.__post_init__,
            )
        )
        if offload_backend is not None:
            self._install_offload_lifts(offload_backend, config_cls)
        training = importlib.import_module(ddp_stream.TRAINING_MODULE)
        wrap = getattr(training, ddp_stream.WRAP_NAME)
        self._rebind(training, ddp_stream.WRAP_NAME, ddp_stream.on_training_stream(wrap))
        self.api = api

        where: dict[str, list[str]] = {}
        for r in self.rebindings:
            where.setdefault(r.attr, []).append(r.module_name.rsplit(".", 1)[-1])
        logger.info(
            "megatron-paging installed into megatron-core %s, %d rebindings: %s",
            version,
            len(self.rebindings),
            "; ".join(
                f"{attr} in {','.join(sorted(mods))}" for attr, mods in sorted(where.items())
            ),
        )
        return api

    def uninstall(self) -> None:
        """Put every original object back. A no-op when nothing is installed."""
        for r in reversed(self.rebindings):
            setattr(r.module, r.attr, r.original)
        if self.rebindings:
            logger.info("megatron-paging uninstalled: %d rebindings restored", len(self.rebindings))
        self.rebindings = []
        self.api = None
        self.replaced = False
        self.offload_backend = None
        self.peers = None

    def _install_offload_lifts(self, offload_backend: str, config_cls) -> None:
        """The lifts of :mod:`.offloading.shims` the chosen offloading backend needs."""
        arguments = importlib.import_module(shims.ARGUMENTS_MODULE)
        self._rebind(
            arguments, "validate_args", shims.lifted_validate_args(arguments.validate_args)
        )
        affinity = importlib.import_module(shims.AFFINITY_MODULE)
        self._rebind(
            affinity, shims.AFFINITY_NAME,
            shims.tolerant_affinity(getattr(affinity, shims.AFFINITY_NAME)),
        )
        if offload_backend == "paged":
            self._rebind(
                config_cls, "__post_init__",
                shims.lifted_post_init(config_cls.__dict__["__post_init__"]),
            )
        elif not shims.te_available():
            te = importlib.import_module(shims.TE_EXTENSION_MODULE)
            if getattr(te, "cpu_offload", None) is None:
                self._rebind(te, "cpu_offload", shims.FakeTECpuOffload)

    def _rebind_everywhere(self, replacements: dict, originals: dict) -> list[Rebinding]:
        done = []
        for module_name, module in list(sys.modules.items()):
            if module is None or module_name.startswith("megatron_paging"):
                continue
            namespace = getattr(module, "__dict__", None)
            if not isinstance(namespace, dict):
                continue  # lazy or proxy objects registered in sys.modules
            for attr, value in list(namespace.items()):
                if id(value) in replacements and value is originals[id(value)]:
                    _, replacement = replacements[id(value)]
                    setattr(module, attr, replacement)
                    done.append(Rebinding(module, attr, value, replacement))
        return done

    def _rebind(self, module, attr: str, replacement) -> None:
        self.rebindings.append(Rebinding(module, attr, getattr(module, attr), replacement))
        setattr(module, attr, replacement)


INSTALLER = PagingInstaller()


def install(
    config: PagingConfig | None = None,
    api: MCorePagingAPI | None = None,
    replace_paged_stash: bool = True,
    offload_backend: str | None = None,
    peers=None,
) -> MCorePagingAPI:
    """Install megatron-paging into Megatron-Core (see :meth:`PagingInstaller.install`)."""
    return INSTALLER.install(config, api, replace_paged_stash, offload_backend, peers)


def uninstall() -> None:
    """Restore Megatron-Core's own paged-stash objects."""
    INSTALLER.uninstall()


__all__ = [
    "INSTALLER",
    "KNOWN_IMPORTERS",
    "FinishingForwardBackward",
    "PagingInstaller",
    "Rebinding",
    "install",
    "uninstall",
]
