"""A plan as a table, as JSON (MiB), and as a PNG of stacked bars."""

from __future__ import annotations

import dataclasses
import json

from megatron_paging.plan.arms import ARM_NAMES, ArmMemory
from megatron_paging.plan.model import Plan

MIB = 2**20
# Table rows: (label, ArmMemory field); None separates groups.
ROWS = (
    ("parameters", "params"),
    ("gradients", "grads"),
    ("optimizer state", "optimizer"),
    None,
    ("embedding + loss", "embedding_loss"),
    ("attention", "attention"),
    ("norms + residual", "residual"),
    ("dense MLP + shared", "dense_mlp"),
    ("router", "router"),
    ("dispatch maps", "dispatch"),
    ("experts (device)", "experts"),
    ("  live rows of them", "experts_live"),
    ("pool (device tier)", "pool_device"),
    ("backward working set", "workspace"),
    ("workspace constant", "constant"),
    None,
    ("forward-backward peak", "fb_peak"),
    ("optimizer step extra", "optimizer_extra"),
    ("optimizer step peak", "step_peak"),
    ("PEAK", "peak"),
    None,
    ("host: pool tier", "pool_host"),
    ("host: offloaded", "host_offload"),
)
# Parts stacked in the plot, bottom to top.
STACK = ("params", "grads", "optimizer", "embedding_loss", "attention", "residual", "dense_mlp",
         "router", "dispatch", "experts", "pool_device", "workspace", "constant")


def mib(value: int | float) -> float:
    return value / MIB


def _chunks(plan: Plan) -> str:
    out = []
    for c in plan.chunks:
        parts = (["embedding"] if c["embedding"] else []) + [
            f"{n}{'m' if n in c['moe_layers'] else 'd'}" for n in c["layers"]
        ] + (["loss"] if c["loss"] else [])
        out.append(f"[{c['vp_stage']}] " + (" ".join(parts) or "(empty)"))
    return "; ".join(out)


def format_table(plan: Plan) -> str:
    """The plan as text: the layout, one column per arm (MiB), where each arm peaks, the pool
    advice and the notes."""
    p = plan.parallel
    lines = [
        f"megatron-paging plan: rank {plan.global_rank} = pipeline stage {plan.pipeline_rank} "
        f"of {p['pp']} (chunks: {_chunks(plan)}; layer numbers, m = MoE, d = dense)",
        f"world {plan.world}: TP {p['tp']} x CP {p['cp']} x PP {p['pp']} (VPP {p['vpp']}) x DP "
        f"{p['dp']}; EP {p['ep']} x ETP {p['etp']}, expert DP {p['edp']}; distributed "
        f"optimizer {'on' if p['distributed_optimizer'] else 'off'}",
        f"schedule: {plan.schedule}, {plan.microbatches} microbatches; at most "
        f"{plan.max_in_flight} chunk-microbatch{'' if plan.max_in_flight == 1 else 'es'} "
        "alive at once on this rank",
        f"as launched: {plan.as_launched}; peak by pipeline stage (MiB): "
        + ", ".join(f"{r}: {mib(v):.0f}" for r, v in sorted(plan.stage_peaks.items())),
        "",
    ]
    names = [n for n in ARM_NAMES if n in plan.arms]
    columns = [(n, max(10, len(n) + 1)) for n in names]
    lines.append(f"{'MiB':<22}" + "".join(f"{n:>{w}}" for n, w in columns))
    for row in ROWS:
        if row is None:
            lines.append("-" * (22 + sum(w for _, w in columns)))
            continue
        label, name = row
        cells = "".join(f"{mib(getattr(plan.arms[n], name)):>{w}.1f}" for n, w in columns)
        lines.append(f"{label:<22}{cells}")
    lines.append(f"{'alive at the peak':<22}"
                 + "".join(f"{plan.arms[n].in_flight:>{w}}" for n, w in columns))
    lines.append("")
    for n in names:
        a = plan.arms[n]
        lines.append(f"{n}: peaks in the {a.peak_phase}; forward-backward peak at the "
                     f"{a.peak_moment}")
    if plan.pools is not None:
        lines += ["", *_pool_lines(plan)]
    if plan.notes:
        lines += ["", *(f"note: {n}" for n in plan.notes)]
    lines.append(f"(model: {plan.model_seconds:.2f} s; constants: "
                 + ", ".join(f"{k}={v}" for k, v in plan.constants.items()) + ")")
    return "\n".join(lines)


def _pool_lines(plan: Plan) -> list[str]:
    a = plan.pools
    lines = [
        f"pool sizing ({a.method}):",
        f"  in flight at the pools' peak: {a.records_at_peak} records, average-token hints "
        f"{a.hint_rows} rows, capacity {a.capacity_rows} rows; live/hint mean {a.mean_ratio:.3f}"
        f", max {a.max_ratio:.3f}",
        f"  the launch line's --moe-paged-stash-buffer-size-factor-cuda {a.line_factor:g}: "
        f"overflow rate ~ {a.line_rate:.2g} per step",
        f"  {'rate':>8} {'cuda (hint)':>12} {'MiB':>9} {'cuda (measured)':>16} {'MiB':>9} "
        f"{'cpu at line':>12} {'host MiB':>9}  estimate",
    ]
    for r in a.rows:
        lines.append(
            f"  {r.rate:>8.0e} {r.cuda_factor:>12.3f} {mib(r.cuda_bytes):>9.1f} "
            f"{r.measured_factor:>16.3f} {mib(r.measured_bytes):>9.1f} {r.cpu_factor:>12.3f} "
            f"{mib(r.cpu_bytes):>9.1f}  {r.method}")
    return lines


def _arm_mib(arm: ArmMemory) -> dict:
    out = {}
    for f in dataclasses.fields(arm):
        value = getattr(arm, f.name)
        out[f.name if isinstance(value, str) or f.name == "in_flight" else f"{f.name}_mib"] = (
            value if isinstance(value, str) or f.name == "in_flight" else round(mib(value), 1))
    return out


def to_dict(plan: Plan) -> dict:
    """The plan with every byte count in MiB (keys ending in ``_mib``)."""
    out = {f.name: getattr(plan, f.name) for f in dataclasses.fields(plan)}
    out["arms"] = {name: _arm_mib(arm) for name, arm in plan.arms.items()}
    out["stage_peaks_mib"] = {str(k): round(mib(v), 1) for k, v in out.pop("stage_peaks").items()}
    if plan.pools is not None:
        pools = dataclasses.asdict(plan.pools)
        pools["rows"] = [
            {k: (round(mib(v), 1) if k.endswith("bytes") else v) for k, v in row.items()}
            for row in pools["rows"]]
        for row in pools["rows"]:
            for k in [k for k in row if k.endswith("bytes")]:
                row[k.replace("bytes", "mib")] = row.pop(k)
        out["pools"] = pools
    return out


def to_json(plan: Plan) -> str:
    return json.dumps(to_dict(plan), indent=1)


def plot(plan: Plan, path: str) -> None:
    """Stacked bars per arm (MiB) with the optimizer step's peak marked; writes a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in ARM_NAMES if n in plan.arms]
    fig, ax = plt.subplots(figsize=(1.6 * len(names) + 3, 5.5))
    bottoms = [0.0] * len(names)
    colors = plt.get_cmap("tab20").colors
    for i, part in enumerate(STACK):
        values = [mib(getattr(plan.arms[n], part)) / 1024 for n in names]
        ax.bar(names, values, bottom=bottoms, label=part, color=colors[i % len(colors)])
        bottoms = [b + v for b, v in zip(bottoms, values, strict=True)]
    steps = [mib(plan.arms[n].step_peak) / 1024 for n in names]
    ax.scatter(names, steps, marker="_", s=900, color="black", label="optimizer step peak")
    ax.set_ylabel("GiB (max_memory_allocated)")
    ax.set_title(f"megatron-paging plan: rank {plan.global_rank} (stage {plan.pipeline_rank}), "
                 f"world {plan.world}")
    ax.tick_params(axis="x", rotation=20)
    handles, labels = ax.get_legend_handles_labels()  # top of the stack first
    ax.legend(handles[::-1], labels[::-1], fontsize=7, loc="upper left",
              bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


__all__ = ["format_table", "plot", "to_dict", "to_json"]
