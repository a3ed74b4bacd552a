"""The plan's committed predictions beside a measured scale benchmark: predicted vs measured MiB
and the relative error, per run and per arm.

Reads ``plan_predictions.py``'s JSON (made before the GPU run) and ``bench_scale.py``'s JSON
(``runs``: one record per layout, rank, arm and capacity factor, ``report`` the example's
numbers) and pairs them by (layout, rank, arm, capacity factor). A pair whose launch lines differ
is kept and marked (``flags_differ``): the prediction was for another line. A run that recorded
the plan of its own commit (``predicted_peak_mib``) and whose plan differs from the file's is
compared with its own, peak only (``plan_recorded_with_run``).

    python benchmarks/report_plan.py benchmarks/results/scale_h200.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from arm_names import NAMING, NAMING_KEY, current_name, named_by_plan, split_name
from common import figure, write
from plan_validation import QUANTITIES, Comparison
from scale_layouts import MEMORY_ARMS

RESULTS = Path(__file__).resolve().parent / "results"
PREDICTIONS = RESULTS / "plan_predictions_frontier.json"
# The quantities summarized per arm (all are written per run).
SUMMARY = ("peak", "fb_peak")


def key(record: dict) -> tuple:
    return (record["layout"], int(record["rank"]), record["arm"],
            float(record["capacity_factor"]))


def pair(prediction: dict, run: dict) -> dict:
    """One run: predicted, measured, error (MiB) and relative error per quantity."""
    row = {"layout": run["layout"], "rank": run["rank"], "arm": run["arm"],
           "capacity_factor": run["capacity_factor"], "status": run["status"],
           "plan_arm": prediction["plan_arm"]}
    if "model_note" in prediction:
        row["model_note"] = prediction["model_note"]
    if run.get("flags") is not None and list(run["flags"]) != list(prediction["flags"]):
        row["flags_differ"] = True
    predicted = prediction["predicted"]
    own = run.get("predicted_peak_mib")
    if own is not None and abs(own - predicted["peak_mib"]) > 0.05:
        # The run was measured at a commit whose plan differs from the prediction file's:
        # its peak is compared with the plan recorded beside it, the rest is left uncompared.
        predicted = {"peak_mib": own}
        row["plan_recorded_with_run"] = True
    row["predicted_peak_mib"] = predicted["peak_mib"]
    if run["status"] != "ok":
        return row
    row["iteration_ms"] = run.get("median_steady_iteration_ms")
    measured = run.get("report", {})
    quantities = {}
    for field, measured_key in QUANTITIES:
        value = measured.get(measured_key)
        if value in (None, "") or f"{field}_mib" not in predicted:
            continue
        c = Comparison(run["arm"], field, float(predicted[f"{field}_mib"]), float(value))
        quantities[field] = {"predicted_mib": c.predicted_mib, "measured_mib": c.measured_mib,
                             "error_mib": round(c.error_mib, 1),
                             "relative_error": c.relative_error}
    row["quantities"] = quantities
    return row


def per_arm(rows: list[dict]) -> dict:
    """Per arm: the runs compared and the range and mean of |relative error| of each summary
    quantity (runs that did not finish are counted apart)."""
    out: dict[str, dict] = {}
    for row in rows:
        arm = out.setdefault(row["arm"], {"runs": 0, "not_ok": 0})
        if row["status"] != "ok":
            arm["not_ok"] += 1
            continue
        arm["runs"] += 1
        for field in SUMMARY:
            q = row["quantities"].get(field)
            if q is not None:
                arm.setdefault(field, []).append(q["relative_error"])
    for arm in out.values():
        for field in SUMMARY:
            errors = arm.pop(field, [])
            if errors:
                arm[f"{field}_relative_error"] = {
                    "min": min(errors), "max": max(errors),
                    "mean_abs": sum(abs(e) for e in errors) / len(errors)}
    return out


def scale_records(data: dict, field: str) -> list[dict]:
    """``data[field]`` (a scale-benchmark file's runs or a prediction file's entries), the arms of
    a file written under the old arm names renamed."""
    records = data.get(field, [])
    if named_by_plan(data):
        return records
    return [{**r, "arm": current_name(r["arm"], "scale")} for r in records]


def compare_files(predictions: dict, measured: dict) -> dict:
    by_key = {key(e): e for e in scale_records(predictions, "entries")}
    runs = scale_records(measured, "runs")
    rows, unpredicted = [], []
    timing_only = [list(key(run)) for run in runs if run["arm"] not in MEMORY_ARMS]
    for run in runs:
        if run["arm"] not in MEMORY_ARMS:
            continue  # the rerun pair: its peak holds a hot step the plan does not model
        prediction = by_key.get(key(run))
        plan_arm, variant = split_name(run["arm"])
        if prediction is None and variant:
            # A variant the plan models as its plan arm (the parity pair's deterministic
            # kernels): that arm's prediction at the same rank, marked as borrowed.
            prediction = by_key.get((*key(run)[:2], plan_arm, key(run)[3]))
            if prediction is not None:
                rows.append({**pair(prediction, run), "prediction_of": plan_arm})
                continue
        if prediction is None:
            unpredicted.append(list(key(run)))
            continue
        rows.append(pair(prediction, run))
    measured_keys = {key(r) for r in runs}
    return {
        "benchmark": "plan_vs_measured",
        NAMING_KEY: NAMING,
        "predictions": {"commit": predictions.get("commit"), "date": predictions.get("date"),
                        "constants": predictions.get("constants")},
        "measured": {"commit": measured.get("commit"), "date": measured.get("date"),
                     "gpu": measured.get("gpu"),
                     "device_memory_mib": measured.get("device_memory_mib")},
        "runs": rows,
        "per_arm": per_arm(rows),
        "measured_without_prediction": unpredicted,
        "timing_only": timing_only,
        "predicted_not_measured": [list(k) for k in by_key if k not in measured_keys],
    }


def format_rows(result: dict) -> str:
    # The arm column as wide as the longest name (".connections_32" variants run long).
    width = max([22, *(len(name) + 1 for name in result["per_arm"])])
    lines = [f"{'layout':<12}{'rank':>6} {'arm':<{width}}{'cf':>4}{'pred peak':>11}"
             f"{'meas peak':>11}{'rel':>8}{'pred fb':>11}{'meas fb':>11}{'rel':>8}"]
    for r in result["runs"]:
        head = f"{r['layout']:<12}{r['rank']:>6} {r['arm']:<{width}}{r['capacity_factor']:>4g}"
        if r["status"] != "ok":
            lines.append(f"{head}{r['predicted_peak_mib']:>11.1f}  ({r['status']})")
            continue
        cells = ""
        for field in SUMMARY:
            q = r["quantities"].get(field)
            cells += (f"{q['predicted_mib']:>11.1f}{q['measured_mib']:>11.1f}"
                      f"{100 * q['relative_error']:>7.2f}%" if q else f"{'-':>11}{'-':>11}{'-':>8}")
        mark = (" *" if "model_note" in r else "") + (
            f" (plan of {r['prediction_of']})" if "prediction_of" in r
            else " (flags differ)" if r.get("flags_differ") else "") + (
            " (plan recorded with the run)" if r.get("plan_recorded_with_run") else "")
        lines.append(head + cells + mark)
    lines.append("")
    for arm, s in result["per_arm"].items():
        peak = s.get("peak_relative_error")
        text = (f"peak rel. error {100 * peak['min']:+.2f}..{100 * peak['max']:+.2f} % "
                f"(mean |e| {100 * peak['mean_abs']:.2f} %)" if peak else "no finished run")
        lines.append(f"{arm:<{width}}{s['runs']} run(s), {s['not_ok']} not finished: {text}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("measured", type=Path, help="bench_scale.py's result JSON")
    parser.add_argument("--predictions", type=Path, default=PREDICTIONS)
    parser.add_argument("--out", type=Path, default=None,
                        help="default: results/plan_vs_<measured file name>")
    args = parser.parse_args(argv)
    result = compare_files(json.loads(args.predictions.read_text()),
                           json.loads(args.measured.read_text()))
    print(format_rows(result))
    write(result, args.out or RESULTS / f"plan_vs_{args.measured.name}",
          lambda png: plot(result, png))
    return 0


def plot(result: dict, png: Path) -> None:
    """Per run: predicted and measured peak (a run out of memory: its predicted bar alone,
    marked); beside it each finished run's median step time."""
    runs = result["runs"]
    labels = [f"{r['layout']}\nrank {r['rank']} cf {r['capacity_factor']:g}\n"
              + r["arm"].replace(".", "\n.") for r in runs]
    fig = figure(max(8.0, 1.3 * len(runs)), 7.5)
    peaks, steps = fig.add_subplot(2, 1, 1), fig.add_subplot(2, 1, 2)
    x = range(len(runs))
    measured = [r["quantities"]["peak"]["measured_mib"] / 1024 if r["status"] == "ok" else 0
                for r in runs]
    peaks.bar([i - 0.2 for i in x], [r["predicted_peak_mib"] / 1024 for r in runs], 0.4,
              label="plan")
    peaks.bar([i + 0.2 for i in x], measured, 0.4, label="measured")
    for i, r in enumerate(runs):
        if r["status"] != "ok":
            peaks.text(i + 0.2, 1, r["status"], rotation=90, ha="center", va="bottom", fontsize=7)
    memory = result["measured"].get("device_memory_mib")
    if memory:  # files written before the scale benchmark recorded it have none
        peaks.axhline(memory / 1024, color="gray", linestyle="--", linewidth=1,
                      label="GPU memory")
    peaks.set_ylabel("peak GiB")
    peaks.set_title(f"plan vs measured on {result['measured']['gpu']} "
                    f"(commit {str(result['measured']['commit'])[:10]})", fontsize=9)
    peaks.legend(fontsize=7)
    steps.bar(list(x), [(r.get("iteration_ms") or 0) / 1000 for r in runs], 0.5)
    steps.set_ylabel("median step s (compute only)")
    for axes in (peaks, steps):
        axes.set_xticks(list(x))
        axes.set_xticklabels(labels, fontsize=6)
    fig.tight_layout()
    fig.savefig(png)


if __name__ == "__main__":
    sys.exit(main())
