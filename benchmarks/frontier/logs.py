"""One run's log as the JSON keeps it: Megatron's iteration lines, the example's final report,
the outcome of a run, its record, loss parity, and the per-size summary."""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

from common import spread

from .arms import ARMS, CONTROL, WARMUP_ITERS, expert_bytes, model_config

if TYPE_CHECKING:
    from .task import Task

ITER = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([\d.]+)")
LOSS = re.compile(r"lm loss: ([-+.\dEe]+)")
GNORM = re.compile(r"grad norm: ([-+.\dEe]+|nan|inf)")
REPORT = re.compile(r"paging-example rank 0: (.*)")
OOM = re.compile(
    r"out of memory|OutOfMemoryError|CUBLAS_STATUS_ALLOC_FAILED|cudaErrorMemoryAllocation",
    re.IGNORECASE,
)


def parse_iterations(text: str) -> list[dict]:
    rows = []
    for line in text.splitlines():
        m = ITER.search(line)
        if m:
            loss, gnorm = LOSS.search(line), GNORM.search(line)
            rows.append({"iteration": int(m.group(1)), "ms": float(m.group(2)),
                         "lm_loss": loss.group(1) if loss else None,
                         "grad_norm": gnorm.group(1) if gnorm else None})
    return rows


def parse_report(text: str) -> dict:
    """The example's final ``paging-example rank 0: key=value ...`` line (numbers as floats)."""
    fields: dict = {}
    for m in REPORT.finditer(text):
        fields = {}
        for item in m.group(1).split():
            key, _, value = item.partition("=")
            try:
                fields[key] = float(value)
            except ValueError:
                fields[key] = value
    return fields


def read_losses(path: Path) -> list[str]:
    """The loss log's lines (``<loss float.hex> <tokens>``, one per microbatch)."""
    try:
        return [line.strip() for line in path.read_text().splitlines() if line.strip()]
    except OSError:
        return []


def classify(text: str, rc: int | None, timed_out: bool) -> str:
    """``ok`` (exit 0 and the final report), ``oom``, ``timeout`` or ``error``."""
    if timed_out:
        return "timeout"
    if rc == 0 and REPORT.search(text):
        return "ok"
    if OOM.search(text):
        return "oom"
    return "error"


def steady_step_ms(iterations: list[dict], warmup: int = WARMUP_ITERS) -> list[float]:
    return [r["ms"] for r in iterations if r["iteration"] > warmup]


FB_PEAK = "steady_fb_peak_allocated_mib"
STEP_PEAK = "steady_peak_allocated_mib"
SPLIT_KEYS = ("state_mib", "activation_mib", "activation_source")


def memory_split(report: dict) -> dict:
    """Activation memory = steady forward-backward peak - (parameters + gradients + optimizer
    state); ``activation_source`` names the peak used.

    Not the whole step's peak: where the optimizer step peaks above the forward-backward (its
    transient buffers, plus whatever persists through it, such as a page pool), step peak - state
    measures the optimizer, not the activations. A report without the forward-backward peak (an
    older example) falls back to the step peak and says so.
    """
    keys = ("param_mib", "grad_mib", "optimizer_state_mib")
    if not all(isinstance(report.get(k), float) for k in keys):
        return {}
    source = next((k for k in (FB_PEAK, STEP_PEAK) if isinstance(report.get(k), float)), None)
    if source is None:
        return {}
    state = report["param_mib"] + report["grad_mib"] + report["optimizer_state_mib"]
    return {"state_mib": state, "activation_mib": report[source] - state,
            "activation_source": source}


def refresh_memory_split(runs: dict) -> dict:
    """Recompute every record's split from its raw report, so a file written under an earlier
    definition reads with the current one (the report's numbers are what was measured)."""
    for rec in runs.values():
        for key in SPLIT_KEYS:
            rec.pop(key, None)
        rec.update(memory_split(rec.get("memory") or {}))
    return runs


def spread_of(values: list[float]) -> dict | None:
    return spread(values) if values else None


def make_record(task: Task, argv: list[str], text: str, rc: int | None, timed_out: bool,
                wall_s: float, losses: list[str], meta: dict) -> dict:
    """One finished run as the JSON keeps it (everything computed from its log)."""
    status = classify(text, rc, timed_out)
    iterations = parse_iterations(text)
    report = parse_report(text)
    cfg = model_config(argv)
    step = spread_of(steady_step_ms(iterations))
    tokens = cfg["seq_length"] * cfg["global_batch_size"]
    record = {
        "key": task.key, "kind": task.kind, "size": task.size, "arm": task.arm,
        "seq": cfg["seq_length"], "train_iters": task.iters, "status": status, "rc": rc,
        "wall_s": round(wall_s, 1), "extra": list(task.extra), "argv": argv,
        "env": {"PAGED": "1" if task.paged else "0", **task.env}, "log": task.log_name,
        "iterations": iterations, "step_ms": step, "timed_iterations": len(steady_step_ms(
            iterations)),
        "memory": report, **memory_split(report), **expert_bytes(cfg),
        "tokens_per_step": tokens,
        "tokens_per_s": tokens / (step["median"] / 1e3) if step else None,
        "time_per_token_us": step["median"] * 1e3 / tokens if step else None,
        "microbatch_losses": losses, "grad_norms": [r["grad_norm"] for r in iterations],
        **meta,
    }
    if task.search is not None:
        record["search"] = task.search
        record["cap_gib"] = task.cap_gib
    if status != "ok":
        record["log_tail"] = text.splitlines()[-25:]
    return record


def parity(losses: list[str], control: list[str]) -> dict | None:
    """Every microbatch loss (and its token count) against the control's, exactly."""
    if not losses or not control:
        return None
    diffs = []
    for a, b in zip(losses, control, strict=False):
        x, y = float.fromhex(a.split()[0]), float.fromhex(b.split()[0])
        diffs.append(abs(x - y) / max(abs(y), 1e-30))
    return {"bitwise_equal": losses == control, "compared": min(len(losses), len(control)),
            "lengths": [len(losses), len(control)], "max_rel_loss_diff": max(diffs)}


def removed_runs(runs: dict) -> dict:
    """{key: what it was} of the frontier runs whose arm is no longer in ``ARMS`` (a file
    written by another tree): listed by the report, never summarized or run."""
    return {key: {"arm": rec["arm"], "size": rec.get("size"), "status": rec.get("status"),
                  "reason": "not an arm of this tree"}
            for key, rec in runs.items() if rec.get("kind") == "arm" and rec["arm"] not in ARMS}


def call_of_runs(calls: list) -> dict:
    """Run key -> index of the device call that measured it last (``calls[i]["ran"]``)."""
    where = {}
    for index, call in enumerate(calls or []):
        for key in call.get("ran") or []:
            where[key] = index
    return where


def summarize(runs: dict, calls: list | None = None) -> dict:
    """{size: {arm: row}} of the frontier runs of the current arms (:func:`removed_runs` lists
    the others), with parity against the size's control and the index of the call that ran
    each (None where ``calls`` does not say)."""
    where = call_of_runs(calls)
    out: dict = {}
    for key, rec in runs.items():
        if rec["kind"] != "arm" or rec["arm"] not in ARMS:
            continue
        control = runs.get(f"{rec['size']}:{CONTROL}")
        row = {k: rec.get(k) for k in (
            "status", "seq", "activation_mib", "activation_source", "state_mib",
            "live_expert_mib", "capacity_expert_mib", "one_layer_capacity_mib",
            "paged_bound_mib", "tokens_per_s", "commit")}  # fmt: skip
        mem = rec.get("memory", {})
        for k in (STEP_PEAK, FB_PEAK, "peak_allocated_mib", "peak_reserved_mib",
                  "pool_cuda_mib", "overflow_actions", "paging_mode", "paged_steps"):
            row[k] = mem.get(k)
        # A paged arm whose engine never paged would be a second control: say so.
        row["paged_as_asked"] = not ARMS[rec["arm"]].paged or bool(mem.get("paged_steps"))
        step = rec.get("step_ms")
        row["step_ms"] = step["median"] if step else None
        row["step_spread"] = step
        row["parity_required"] = ARMS[rec["arm"]].exact
        row["call"] = where.get(key)
        if rec["arm"] != CONTROL and control and control.get("status") == "ok":
            row["parity"] = parity(rec.get("microbatch_losses", []),
                                   control.get("microbatch_losses", []))
            row["grad_norms_equal"] = (rec.get("grad_norms") == control.get("grad_norms")
                                       and bool(rec.get("grad_norms")))
        out.setdefault(rec["size"], {})[rec["arm"]] = row
    return out
