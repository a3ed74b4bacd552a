"""The frontier's output: the result JSON (built from the runs), its atomic save, the printed
table with the targets, and the PNG."""

from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from arm_names import NAMING, NAMING_KEY
from common import figure
from portable import dumps

from .arms import ARMS, COMMON_FLAGS, NAME_WIDTH, SIZES, WARMUP_ITERS, expert_bytes, model_config
from .logs import FB_PEAK, STEP_PEAK, removed_runs, summarize
from .plan import provenance
from .targets import _ok, _status, evaluate_targets

if TYPE_CHECKING:
    from .budget import BudgetOptions


# One colour per arm, by name (a new arm keeps the others' colours in old plots' order).
ARM_COLORS = {
    "unpaged": "grey", "paged": "tab:blue", "paged.hold": "tab:olive",
    "mcore": "tab:orange", "recompute": "tab:red",
    "paged.recompute_core_attn": "tab:cyan", "offload": "tab:brown",
    "paged_offload_experts.no_stash": "tab:purple", "paged_offload": "tab:green",
    "unpaged.recompute_fc1": "dimgrey", "paged_recompute_fc1": "navy",
    "paged_offload_experts.recompute_fc1_no_stash": "darkviolet",
    "paged_recompute_fc1.hold": "teal", "paged_recompute_fc1.tight": "darkgreen",
    "paged_recompute_fc1.spill": "goldenrod", "unpaged.unfused": "silver",
}


def build_result(current: dict, settings: dict, runs: dict, calls: list,
                 budget: dict | None, opts: BudgetOptions | None, left: list) -> dict:
    summary = summarize(runs, calls)
    sizes = {}
    for name, size in SIZES.items():
        entry = {"flags": list(size.flags), "note": size.note}
        example = next((r for r in runs.values() if r["kind"] == "arm" and r["size"] == name),
                       None)
        if example:
            entry["config"] = model_config(example["argv"])
            entry["expert_bytes"] = expert_bytes(entry["config"])
        sizes[name] = entry
    arms = {
        name: {"plan_arm": a.plan_arm, "variant": a.variant, "flags": list(a.flags),
               "env": dict(a.env), "paged": a.paged, "exact": a.exact,
               "description": a.description}
        for name, a in ARMS.items()
    }
    result = {
        "benchmark": "frontier",
        NAMING_KEY: NAMING,
        **provenance(runs, current),
        "this_call": current,
        "settings": settings,
        "common_flags": list(COMMON_FLAGS),
        "method": (
            "each run = examples/run_pretrain_1gpu.sh + the size's and the arm's flags; "
            f"step time = median of iterations > {WARMUP_ITERS} (Megatron's 'elapsed time per "
            "iteration'), spread = common.spread; activation = steady_fb_peak_allocated_mib "
            "(the forward-backward peak; the step peak only where a record lacks it, named by "
            "activation_source) - (param_mib + grad_mib + optimizer_state_mib) as the example "
            "prints them; peak = steady_peak_allocated_mib, the whole step's; live "
            "expert bytes computed from the flags (frontier/arms.py: expert_bytes); parity = every "
            "microbatch loss (float.hex) equal to the unpaged run of the same size"),
        "sizes": sizes,
        "arms": arms,
        "removed_arms": removed_runs(runs),
        "summary": summary,
        "budget": {"options": asdict(opts) if opts else None, "outcomes": budget or {}},
        "targets": evaluate_targets(summary, budget),
        "remaining": left,
        "calls": calls,
        "runs": runs,
    }
    return result


def save(result: dict, out: Path) -> None:
    """The JSON, written atomically (a run killed mid-write leaves the previous file)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(dumps(result))
    os.replace(tmp, out)


def _fmt(value, spec: str = ".1f", none: str = "-") -> str:
    return none if value is None else format(value, spec)


def table(result: dict) -> list[str]:
    lines = [f"frontier: {result.get('gpu') or 'no GPU'}, commit {result.get('commit')}"]
    head = (f"{'size':<18} {'arm':<{NAME_WIDTH}} {'status':<7} {'step ms':>8} {'spread':>7} "
            f"{'peak MiB':>9} {'fb MiB':>9} {'act MiB':>9} {'rsv MiB':>9} {'live MiB':>9} "
            f"{'bitwise':>8}")
    lines += [head, "-" * len(head)]
    fallback = False
    for size, rows in result["summary"].items():
        for arm in ARMS:
            row = rows.get(arm)
            if row is None:
                continue
            spread = (row.get("step_spread") or {}).get("relative_spread")
            par = row.get("parity")
            status = row["status"] if row.get("paged_as_asked") is not False else "nopage"
            act = _fmt(row.get("activation_mib"))
            if row.get("activation_source") == STEP_PEAK:
                act, fallback = act + "*", True
            lines.append(
                f"{size:<18} {arm:<{NAME_WIDTH}} {status:<7} {_fmt(row['step_ms']):>8} "
                f"{_fmt(spread * 100 if spread is not None else None, '.1f') + '%':>7} "
                f"{_fmt(row.get(STEP_PEAK)):>9} {_fmt(row.get(FB_PEAK)):>9} "
                f"{act:>9} {_fmt(row.get('peak_reserved_mib')):>9} "
                f"{_fmt(row.get('live_expert_mib')):>9} "
                f"{'-' if par is None else ('yes' if par['bitwise_equal'] else 'NO'):>8}")
    lines.append("peak = steady step peak (optimizer step included); fb = forward-backward peak; "
                 "act = fb - params - grads - optimizer state; rsv = reserved peak (what the "
                 "process holds: blocks freed with pending stream uses stay reserved)"
                 + ("; * = from the step peak (no fb peak in the record)" if fallback else ""))
    outcomes = result["budget"]["outcomes"]
    if outcomes:
        opts = result["budget"]["options"]
        alloc = opts.get("alloc_conf") or "the allocator's default"
        lines.append(f"budget: {opts['size']} under {opts['cap_gib']:g} GiB "
                     f"(MEGATRON_PAGING_BENCH_MEMORY_FRACTION), {opts['iters']} iterations per "
                     f"run, PYTORCH_CUDA_ALLOC_CONF {alloc}")
        for arm, o in outcomes.items():
            lines.append(
                f"  {arm:<{NAME_WIDTH}} max seq {_fmt(o['max_seq'], 'd'):>6}  tokens/s "
                f"{_fmt(o['tokens_per_s'], '.0f'):>8}  "
                f"us/token {_fmt(o['time_per_token_us'], '.2f')}  alloc retries "
                f"{_fmt(o.get('steady_alloc_retries'), '.0f')}"
                f"  tried {o['candidates']}{'' if o['concluded'] else '  (not concluded)'}")
    lines.append("targets:")
    for scope, targets in result["targets"].items():
        if scope == "budget":
            lines.append(f"  budget: paged longer than unpaged at <= 1.01x time/token: "
                         f"{targets['status']}"
                         + (f" (paged {targets['paged_max_seq']} vs unpaged "
                            f"{targets['unpaged_max_seq']}, time/token ratio "
                            f"{targets['time_per_token_ratio']:.3f})"
                            if targets.get("met") is not None else ""))
            if targets.get("time_per_token_ratio_at_unpaged_max"):
                lines.append(f"    informational: at unpaged's longest length "
                             f"({targets['unpaged_max_seq']}) paged's time/token is "
                             f"{targets['time_per_token_ratio_at_unpaged_max']:.3f}x unpaged's")
            continue
        for name, t in targets.items():
            detail = ""
            if "reason" in t:
                detail = f" (ratio {t['ratio']:.3f}: {t['reason']})"
            elif "ratio" in t:
                detail = f" (ratio {t['ratio']:.3f}" + (", within noise)" if t["within_noise"]
                                                         else ")")
            elif name.startswith("paged_activation") and t.get("met") is not None:
                detail = (f" (activation {t['activation_mib']:.0f} MiB vs bound "
                          f"{t['bound_mib']:.0f} MiB"
                          + (f"; expert share {t['expert_activation_mib']:.0f} MiB: "
                             f"{_status(t['expert_share_met'])}" if "expert_share_met" in t
                             else "") + ")")
            elif name.startswith("paged_1.2x"):
                detail = "".join(_vs_recompute(a, v) for a, v in t["per_arm"].items())
                if t.get("required"):
                    detail += " (required at this size)"
            elif name.startswith("paged_step_peak") and t.get("met") is not None:
                detail = (f" (paged {t['paged_step_peak_mib']:.1f} vs unpaged "
                          f"{t['unpaged_step_peak_mib']:.1f} MiB, "
                          f"{t['difference_mib']:+.1f} MiB; pool "
                          f"{_fmt(t.get('pool_cuda_mib'), '.0f')} MiB)")
            if t.get("informational") is True:
                detail += " (informational)"
            lines.append(f"  {scope}: {name}: {t['status']}{detail}")
            for a, v in t.get("same_model_per_arm", {}).items():
                if "expert_activation_mib" in v:
                    lines.append(f"  {scope}:   informational, same model: [{a}: expert share "
                                 f"{v['expert_activation_mib']:.0f} MiB vs bound "
                                 f"{v['bound_mib']:.0f} MiB (non-expert from "
                                 f"{v['unpaged_arm']})]: {v['status']}")
                    continue
                lines.append(f"  {scope}:   informational, same model: [{a} vs "
                             f"{v['unpaged_arm']}: {v['ratio']:.3f}x"
                             + (", within noise" if v.get("within_noise") else "")
                             + (", different calls" if "reason" in v else "")
                             + f"]: {v['status']}")
            for a, v in t.get("informational_per_arm", {}).items():
                lines.append(f"  {scope}:   informational, not the strict target:"
                             f"{_vs_recompute(a, v)}: {_status(v['met'])}")
    for key, r in result.get("removed_arms", {}).items():
        lines.append(f"removed arm, not reported: {key} ({r['status']}): {r['reason']}")
    if result["remaining"]:
        lines.append("left to run: " + ", ".join(result["remaining"]))
    return lines


def _vs_recompute(arm: str, v: dict) -> str:
    # Each arm says whether it meets the target itself: a PASS needs only one of them.
    return (f" [{arm}: {v['speedup_vs_recompute']:.2f}x, act {v['activation_mib']:.0f} vs "
            f"{v['recompute_activation_mib']:.0f} MiB: {'meets' if v['met'] else 'misses'}]")


def plot(result: dict):
    def draw(png: Path) -> None:
        sizes = [s for s, rows in result["summary"].items()
                 if any(_ok(r) and r.get("activation_mib") is not None for r in rows.values())]
        outcomes = result["budget"]["outcomes"]
        if not any(o["candidates"] for o in outcomes.values()):
            outcomes = {}  # no candidate has run: an empty panel would read as "none fit"
        panels = len(sizes) + (1 if outcomes else 0)
        if panels == 0:
            return
        fig = figure(5.2 * panels, 4.6)
        colors = {arm: ARM_COLORS.get(arm, "black") for arm in ARMS}
        for i, size in enumerate(sizes):
            ax = fig.add_subplot(1, panels, i + 1)
            for arm, row in result["summary"][size].items():
                if not _ok(row) or row.get("activation_mib") is None:
                    continue
                s = row["step_spread"]
                # Hollow: the record lacks the forward-backward peak (step peak used).
                hollow = row.get("activation_source") == STEP_PEAK
                ax.errorbar([row["activation_mib"] / 1024], [s["median"]],
                            yerr=[[s["median"] - s["min"]], [s["max"] - s["median"]]],
                            fmt="o", color=colors.get(arm, "k"), capsize=3,
                            mfc="none" if hollow else None,
                            label=arm + (" (step peak)" if hollow else ""))
            live = next((r.get("live_expert_mib") for r in result["summary"][size].values()
                         if r.get("live_expert_mib")), None)
            ax.set_xlabel("activation memory (GiB): forward-backward peak - params - grads - "
                          "optimizer state", fontsize=8)
            ax.set_ylabel("median step time (ms), bars: min-max")
            ax.set_title(f"{size}" + (f" (live expert rows {live / 1024:.2f} GiB)"
                                      if live else ""), fontsize=9)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7, loc="best")
        if outcomes:
            ax = fig.add_subplot(1, panels, panels)
            names = list(outcomes)
            seqs = [outcomes[n]["max_seq"] or 0 for n in names]
            ax.bar(names, seqs, color=[colors.get(n, "k") for n in names])
            for j, n in enumerate(names):
                tps = outcomes[n]["tokens_per_s"]
                label = "not run" if not outcomes[n]["candidates"] else "none fit"
                ax.text(j, seqs[j], f"{tps:.0f} tok/s" if tps else label, ha="center",
                        va="bottom", fontsize=7)
            opts = result["budget"]["options"]
            ax.set_ylabel("longest sequence trained")
            ax.set_title(f"{opts['size']} under {opts['cap_gib']:g} GiB", fontsize=9)
            ax.tick_params(axis="x", labelsize=7, rotation=15)
        fig.suptitle(f"Megatron GPT-MoE frontier, {result.get('gpu') or 'no GPU'}, "
                     f"{str(result.get('commit'))[:8]}", fontsize=10)
        fig.tight_layout()
        fig.savefig(png)

    return draw
