"""What the example refuses of Megatron's features, by name, before Megatron starts: flags its
model provider would ignore, what its experts (PagedGroupedMLP) and core attention (SDPAttention)
cannot compute, what needs Transformer Engine or other packages not installed, and what this
Megatron-Core would fail on only after the run began (a traceback per rank) or silently skip.
Each refusal is one ``ValueError`` line; :func:`check_features` runs them all."""

from __future__ import annotations

import importlib.util
import os


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


# Megatron flags that shape a model this example's provider does not build (it builds the local
# decoder block with megatron-paging's experts and attention, nothing else): refused by name
# rather than silently ignored.
IGNORED_MODEL_FLAGS = {
    "mtp_num_layers": "multi-token-prediction layers",
    "spec": "a custom layer spec",
    "heterogeneous_layers_config_path": "heterogeneous layers",
    "experimental_attention_variant": "experimental attention variants",
    "use_kitchen": "Kitchen modules",
}


# What the example's experts (PagedGroupedMLP: bf16 GEMMs, no Transformer Engine) refuse when
# they are built; refused here instead, in one line before Megatron starts.
EXPERT_REFUSED_FLAGS = {
    "fp8": "--fp8-format",
    "fp4": "--fp4-format",
    "moe_apply_probs_on_input": "--moe-apply-probs-on-input",
    "moe_latent_size": "--moe-latent-size",
}


def check_model_flags(args) -> None:
    """Refuse layout flags the example's model provider would ignore, and what its experts
    cannot compute."""
    for dest, what in IGNORED_MODEL_FLAGS.items():
        value = getattr(args, dest, None)
        if value:
            flag = "--" + dest.replace("_", "-")
            raise ValueError(f"{flag}: this example builds no {what}; drop the flag")
    if getattr(args, "moe_router_fusion", False) and not _installed("transformer_engine"):
        raise ValueError("--moe-router-fusion needs Transformer Engine's fused router (not "
                         "installed); drop the flag")
    for dest, flag in EXPERT_REFUSED_FLAGS.items():
        if getattr(args, dest, None):
            raise ValueError(
                f"{flag}: the example's experts (PagedGroupedMLP, without Transformer Engine) "
                "do not support it; drop the flag"
            )
    if getattr(args, "cpu_offloading_num_layers", 0) > 0 and not _installed("transformer_engine"):
        raise ValueError("--cpu-offloading-num-layers: Megatron-Core's layer-level CPU "
                         "offloading needs Transformer Engine (not installed); use "
                         "--fine-grained-activation-offloading")
    if (getattr(args, "check_for_spiky_loss", False)
            and getattr(args, "cuda_graph_impl", "none") == "full_iteration"):
        raise ValueError("--check-for-spiky-loss reads every loss on the host, which a "
                         "full-iteration CUDA graph cannot capture; drop one of them (as "
                         "Megatron requires --no-check-for-nan-in-loss-and-grad there)")
    if getattr(args, "context_parallel_size", 1) != 1:
        raise ValueError(
            "--context-parallel-size: the example's SDPA core attention has no context "
            "parallelism; use 1"
        )
    if getattr(args, "transformer_impl", "local") != "local":
        raise ValueError(
            f"--transformer-impl {args.transformer_impl}: this example builds the local "
            "(Transformer-Engine-free) spec; pass --transformer-impl local"
        )


def check_rerun_mode(args) -> None:
    """Refuse a ``--rerun-mode`` Megatron's parser offers but its rerun state machine lacks
    (0.19.2 parses ``report_stats``; its ``RerunMode`` calls that mode
    ``report_determinism_stats``, so ``initialize_megatron`` fails with a traceback)."""
    from megatron.core.rerun_state_machine import RerunMode

    modes = [mode.value for mode in RerunMode]
    mode = getattr(args, "rerun_mode", RerunMode.DISABLED.value)
    if mode not in modes:
        raise ValueError(f"--rerun-mode {mode}: this Megatron-Core cannot start with it (its "
                         f"rerun state machine has {', '.join(modes)}); use validate_results "
                         "or disabled")


def check_checkpointing(args) -> None:
    """Refuse a ``--save`` Megatron-Core's torch_dist writer would fail at the first save, after
    the run's first interval (it imports psutil then; megatron-core does not declare it), and a
    checkpoint of FSDP-sharded experts (mcore/experts_checkpoint.py splits whole local experts;
    Megatron-FSDP's fsdp_dtensor format finds experts by Megatron-Core's own module keys)."""
    for fsdp in ("use_torch_fsdp2", "use_megatron_fsdp"):
        for flag in ("save", "load"):
            if getattr(args, fsdp, False) and getattr(args, flag, None):
                raise ValueError(
                    f"--{flag} with --{fsdp.replace('_', '-')}: the example's experts "
                    "(PagedGroupedMLP) checkpoint whole local experts, not FSDP-sharded ones; "
                    "use Megatron's DDP to checkpoint")
    if (getattr(args, "save", None) and getattr(args, "ckpt_format", "torch_dist") == "torch_dist"
            and not _installed("psutil")):
        raise ValueError("--save: Megatron-Core's torch_dist checkpoint writer needs psutil (not "
                         "installed in this interpreter); pip install psutil")
    if (getattr(args, "use_distributed_optimizer", False) and _loads_optimizer_state(args)
            and not (_installed("transformer_engine") or _installed("apex"))):
        # DistributedOptimizer.state_dict reads torch Adam's per-parameter 'step' to build the
        # load template, before any step made one (an AssertionError per rank).
        raise ValueError(
            f"--load {args.load} with --use-distributed-optimizer: this Megatron-Core cannot "
            "load the distributed optimizer's state without Transformer Engine or Apex (not "
            "installed); install one, or pass --no-load-optim to resume without Adam's state")


def _loads_optimizer_state(args) -> bool:
    """Whether Megatron would load an optimizer state from ``--load``: a checkpoint is there
    (its tracker file, or ``--ckpt-step``) and neither ``--no-load-optim`` nor ``--finetune``
    is set. A first launch with ``--load`` naming the ``--save`` directory loads nothing."""
    load = getattr(args, "load", None)
    if not load or getattr(args, "no_load_optim", False) or getattr(args, "finetune", False):
        return False
    tracker = os.path.join(load, "latest_checkpointed_iteration.txt")
    return bool(getattr(args, "ckpt_step", None)) or os.path.isfile(tracker)


# Flags the run accepts and only fails on after it began, or silently skips.
ATTENTION_REFUSED = {  # SDPAttention refuses these when the model is built
    "window_size": ("--window-size", lambda value: value is not None),
    "softmax_type": ("--softmax-type", lambda value: value not in (None, "vanilla")),
    "qk_clip": ("--qk-clip", bool),
}
NEEDS_TRANSFORMER_ENGINE = {  # Megatron-Core builds these from TE's modules
    "use_precision_aware_optimizer": "--use-precision-aware-optimizer",
    "optimizer_cpu_offload": "--optimizer-cpu-offload",
}


def check_run_features(args) -> None:
    """What the run would fail on after it began, or silently skip."""
    etp = getattr(args, "expert_tensor_parallel_size", None)
    if etp not in (None, 1):
        raise ValueError(f"--expert-tensor-parallel-size {etp}: the example's experts "
                         "(PagedGroupedMLP) and static dispatcher hold whole experts; use 1")
    for dest, (flag, refused) in ATTENTION_REFUSED.items():
        if refused(getattr(args, dest, None)):
            raise ValueError(f"{flag}: the example's core attention (SDPAttention) does not "
                             "support it; drop the flag")
    if not _installed("transformer_engine"):
        for dest, flag in NEEDS_TRANSFORMER_ENGINE.items():
            if getattr(args, dest, False):
                raise ValueError(f"{flag} needs Transformer Engine (not installed); drop the "
                                 "flag")
        if getattr(args, "moe_flex_dispatcher_backend", None) == "ncclep":
            raise ValueError("--moe-flex-dispatcher-backend ncclep needs Transformer Engine "
                             "(not installed); use static")
    if getattr(args, "moe_use_upcycling", False):
        raise ValueError("--moe-use-upcycling: Megatron's upcycling converts SequentialMLP or "
                         "TEGroupedMLP experts, not the example's PagedGroupedMLP; drop the flag")
    if getattr(args, "inprocess_restart", False):
        raise ValueError("--inprocess-restart: the example does not run under Megatron's "
                         "in-process restart wrapper (pretrain_gpt.py's); drop the flag")
    if getattr(args, "enable_ft_package", False) and not _installed("nvidia_resiliency_ext"):
        raise ValueError("--enable-ft-package needs nvidia-resiliency-ext (not installed); drop "
                         "the flag")
    if getattr(args, "use_checkpoint_args", False):
        raise ValueError("--use-checkpoint-args: Megatron would replace this line's model flags "
                         "from the checkpoint after the start-up checks read them; pass them on "
                         "the line")


def check_features(args) -> None:
    """Every refusal here, in one call: one ``ValueError`` line for the first that applies."""
    check_model_flags(args)
    check_run_features(args)
    check_rerun_mode(args)
    check_checkpointing(args)


__all__ = ["ATTENTION_REFUSED", "EXPERT_REFUSED_FLAGS", "IGNORED_MODEL_FLAGS",
           "NEEDS_TRANSFORMER_ENGINE", "check_features"]
