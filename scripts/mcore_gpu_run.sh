#!/usr/bin/env bash
# Train the example GPT-MoE (examples/run_pretrain_1gpu.sh: 8 layers, hidden 1024, 16 experts
# top-2, seq 2048, 8 microbatches, bf16) for STEPS steps in several modes, same seeds, capacity
# and flags (every mode runs --no-check-for-nan-in-loss-and-grad, which graphs need):
#   unpaged          - no paging (control)
#   paged            - --moe-paged-stash through megatron-paging
#   mcore            - --moe-paged-stash through Megatron-Core 0.19.2's own manager + Triton
#                      kernels (MEGATRON_PAGING_BENCH_IMPLEMENTATION=mcore)
#   graphed_unpaged  - unpaged under --cuda-graph-impl full_iteration
#   graphed_paged    - paged under --cuda-graph-impl full_iteration
#   offload_<backend>_<set>[_stash][_graphed][_inflightN]
#                    - --fine-grained-activation-offloading --paging-offload-backend <backend>
#                      (mcore | paged) of the module set (experts: expert_fc1 moe_act; dense:
#                      attn_norm qkv_linear core_attn attn_proj mlp_norm; both), with
#                      --moe-paged-stash for _stash, full-iteration CUDA graphs for _graphed
#                      (with --fine-grained-offloading-max-inflight-offloads N, default 2)
# then print per-step losses / grad norms, bitwise parity of every microbatch loss against the
# control (graphed modes also against graphed_unpaged when it ran), peak memory and step time,
# write $OUT/mcore_run.json and, when the modes include unpaged and paged,
# benchmarks/report_mcore.py's $OUT/mcore_report.json + .png.
#
# Usage: bash scripts/mcore_gpu_run.sh [OUT] ; env: STEPS (20), MODES ("unpaged paged mcore"),
#        DETERMINISTIC (1: --deterministic-mode, needed for bitwise parity), EXTRA (more flags),
#        MEGATRON_PAGING_BENCH_PROFILE_ITER (profile that iteration in every mode: top kernels
#        and host ops in the mode's log, its kernel timeline in mcore_<mode>_timeline.json.rank0,
#        read by python -m megatron_paging.tools.kernel_timeline),
#        MEGATRON_PAGING_BENCH_MEMORY_ITER (what is alive at that iteration's memory peak).
set -u
OUT=${1:-${OUT:-$PWD/out}}
mkdir -p "$OUT"
STEPS=${STEPS:-20}
MODES=${MODES:-unpaged paged mcore}
DETERMINISTIC=${DETERMINISTIC:-1}
PYTHON=${PYTHON:-python3}
cd "$(dirname "$0")/.."

det=()
[ "$DETERMINISTIC" = 1 ] && det=(--deterministic-mode)
status=0
for mode in $MODES; do
  log="$OUT/mcore_$mode.log"
  rm -f "$OUT/mcore_${mode}_loss".rank*
  implementation=ours  # MEGATRON_PAGING_BENCH_IMPLEMENTATION of the run
  case $mode in
    unpaged) paged=0; impl=() ;;
    paged) paged=1; impl=() ;;
    mcore) paged=1; impl=(); implementation=mcore ;;
    graphed_unpaged) paged=0; impl=(--cuda-graph-impl full_iteration) ;;
    graphed_paged) paged=1; impl=(--cuda-graph-impl full_iteration) ;;
    offload_*)
      IFS=_ read -r _ backend set rest <<<"$mode"
      case $set in
        experts) mods=(expert_fc1 moe_act) ;;
        dense) mods=(attn_norm qkv_linear core_attn attn_proj mlp_norm) ;;
        both) mods=(attn_norm qkv_linear core_attn attn_proj mlp_norm expert_fc1 moe_act) ;;
        *) echo "unknown module set in $mode"; exit 2 ;;
      esac
      paged=0; [[ "_${rest}_" == *_stash_* ]] && paged=1
      impl=(--fine-grained-activation-offloading --offload-modules "${mods[@]}"
            --paging-offload-backend "$backend")
      if [[ "_${rest}_" == *_graphed_* ]]; then
        impl+=(--cuda-graph-impl full_iteration)
        # Megatron-Core's own backend refuses full-iteration graphs without an in-flight cap;
        # both backends get the same one (ours: how many offload groups of a module may stay
        # in flight under capture, docs/offload.md); an inflightN token picks it (default 2).
        cap=2; [[ "_${rest}_" =~ _inflight([0-9]+)_ ]] && cap=${BASH_REMATCH[1]}
        impl+=(--fine-grained-offloading-max-inflight-offloads "$cap")
      fi ;;
    *) echo "unknown mode $mode"; exit 2 ;;
  esac
  echo "=== mcore run: $mode ($STEPS steps) -> $log"
  t0=$SECONDS
  # shellcheck disable=SC2086
  MEGATRON_PAGING_BENCH_LOSS_LOG="$OUT/mcore_${mode}_loss" PAGED=$paged PYTHON=$PYTHON \
    MEGATRON_PAGING_BENCH_IMPLEMENTATION=$implementation \
    MEGATRON_PAGING_BENCH_PROFILE_JSON=${MEGATRON_PAGING_BENCH_PROFILE_ITER:+$OUT/mcore_${mode}_timeline.json} \
    bash examples/run_pretrain_1gpu.sh --train-iters "$STEPS" --no-check-for-nan-in-loss-and-grad \
    "${det[@]}" "${impl[@]}" \
    ${EXTRA:-} >"$log" 2>&1
  rc=$?
  echo "    exit $rc after $((SECONDS - t0)) s"
  if [ $rc -ne 0 ]; then
    status=1
    tail -n 30 "$log"
  fi
done

"$PYTHON" - "$OUT" "$STEPS" $MODES <<'EOF'
import json, os, re, subprocess, sys, time
from pathlib import Path

out, steps, modes = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
ITER = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([\d.]+)")
LOSS = re.compile(r"lm loss: ([-+.\dEe]+)")
GNORM = re.compile(r"grad norm: ([-+.\dEe]+|nan|inf)")
MEM = re.compile(r"paging-example rank 0: (.*)")
WARMUP = re.compile(r"cuda_graph_warmup_steps \.+ (\d+)")
# Iterations a diagnostic slows (the profiled or traced one, and the next, which prints it).
PERTURBED = {i + d for env in ("MEGATRON_PAGING_BENCH_PROFILE_ITER",
                               "MEGATRON_PAGING_BENCH_MEMORY_ITER")
             for i in (int(v) for v in os.environ.get(env, "").split(",") if v.strip())
             for d in (0, 1)}


def parse(mode):
    text = (out / f"mcore_{mode}.log").read_text(errors="replace") if (out / f"mcore_{mode}.log").exists() else ""
    rows = []
    for line in text.splitlines():
        m = ITER.search(line)
        if m:
            loss, gnorm = LOSS.search(line), GNORM.search(line)
            rows.append(dict(iteration=int(m.group(1)), ms=float(m.group(2)),
                             lm_loss=loss.group(1) if loss else None,
                             grad_norm=gnorm.group(1) if gnorm else None))
    mem = {}
    for m in MEM.finditer(text):
        mem = dict(kv.split("=") for kv in m.group(1).split())
    loss_file = out / f"mcore_{mode}_loss.rank0"
    exact = loss_file.read_text().split("\n") if loss_file.exists() else []
    return dict(iterations=rows, memory=mem, microbatch_losses=[l for l in exact if l],
                reruns=text.count("rerunning") + text.count("rerun "),
                captures=text.count("Capture CUDA graph for training"),
                graph_warmup_steps=int(WARMUP.search(text).group(1)) if WARMUP.search(text)
                else None,
                installed=[l for l in text.splitlines() if "megatron-paging installed" in l][:1])


runs = {mode: parse(mode) for mode in modes}
try:
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.strip()
except OSError:
    gpu = "unknown"
from megatron_paging.env import git_commit
commit = git_commit()
control = runs.get("unpaged", {}).get("microbatch_losses")
graphed_control = runs.get("graphed_unpaged", {}).get("microbatch_losses")
summary = {}
for mode, run in runs.items():
    its = run["iterations"]
    # Steady steps: from step 3 on (eager), after the eager warm-up steps and the capture step
    # (graphed); never an iteration a diagnostic slowed.
    first = 3
    if "graphed" in mode and run["graph_warmup_steps"] is not None:
        first = run["graph_warmup_steps"] + 2
    timed = sorted(r["ms"] for r in its if r["iteration"] >= first
                   and r["iteration"] not in PERTURBED)
    summary[mode] = dict(
        steps_logged=len(its),
        median_step_ms=timed[len(timed) // 2] if timed else None,
        step_ms_p25_p75=[timed[len(timed) // 4], timed[(3 * len(timed)) // 4]] if timed else None,
        steady_steps=len(timed),
        # None when this call ran no unpaged control (nothing to compare with)
        bitwise_equal_to_unpaged=(run["microbatch_losses"] == control)
        if mode != "unpaged" and control else None,
        # graphed arms against the graphed control of the same call, when it ran
        **({"bitwise_equal_to_graphed_unpaged":
            run["microbatch_losses"] == graphed_control and bool(graphed_control)}
           if "graphed" in mode and mode != "graphed_unpaged" and graphed_control else {}),
        **run["memory"],
    )
print()
print(f"{'iter':>4} " + " ".join(f"{m + ' loss':>14} {m + ' gnorm':>12}" for m in modes))
for i in range(max((len(r["iterations"]) for r in runs.values()), default=0)):
    cells = []
    for m in modes:
        its = runs[m]["iterations"]
        r = its[i] if i < len(its) else {}
        cells.append(f"{r.get('lm_loss') or '-':>14} {r.get('grad_norm') or '-':>12}")
    print(f"{i + 1:>4} " + " ".join(cells))
print()
for mode, s in summary.items():
    print(f"{mode:>8}: " + ", ".join(f"{k}={v}" for k, v in s.items()))
json.dump(dict(gpu=gpu, date=time.strftime("%Y-%m-%d %H:%M:%S"), commit=commit, steps=steps,
               summary=summary, runs=runs), open(out / "mcore_run.json", "w"), indent=1)
print(f"wrote {out / 'mcore_run.json'}")
EOF
# Targets, device time, peak breakdown and a PNG (benchmarks/report_mcore.py).
case " $MODES " in
  *" unpaged "*" paged "* | *" paged "*" unpaged "*)
    "$PYTHON" benchmarks/report_mcore.py "$OUT" --json "$OUT/mcore_report.json" \
      --png "$OUT/mcore_report.png" || status=1 ;;
esac
exit $status
