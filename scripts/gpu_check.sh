#!/usr/bin/env bash
# One call on the lent GPU machine: build the extension, run the GPU tests, the benchmarks and the
# Megatron runs, write JSON/PNG/logs under $OUT, and print a short table last.
#
# Usage (device tool, repo root; .whl carries megatron-core's wheel):
#   bash scripts/gpu_check.sh [steps...]     steps: info build tests sanitizer bench-kernels
#                                            host-cost bench-scheduler bench-offload
#                                            bench-swiglu mcore frontier step-ratio
#                                            (default: all but frontier and step-ratio)
# Each step has its own time limit so one hang cannot eat the whole call. Everything together
# takes longer than one 10-minute device call; split it, for example
#   GIT_COMMIT=$(git rev-parse HEAD) bash scripts/gpu_check.sh build tests sanitizer
#   GIT_COMMIT=... bash scripts/gpu_check.sh build bench-kernels bench-scheduler mcore
# (GIT_COMMIT: the commit benchmarks record in their JSON; set it: git on the device machine may
#  answer a stale commit (seen 2026-12-03). A warning is printed without it.
#  PYTEST_EXTRA: more pytest arguments, e.g. "--deselect tests/test_example_pretrain.py";
#  PYTEST_TARGETS: test files or node ids instead of the whole tests/ tree.
#  PYTEST_SHARDS: run the tests as that many pytest processes side by side (default 1);
#  TESTS_LIMIT_S: the tests step's time limit (default 420 s).
#  MCORE_LIMIT_S: the mcore step's time limit (default 420 s; MODES/STEPS go to mcore_gpu_run.sh).
#  host-cost measures this tree ("after") and, when .old_tree/megatron_paging exists (carry it:
#  `git archive <commit> megatron_paging | tar -x -C .old_tree`), that tree too ("before").
#  frontier: benchmarks/bench_frontier.py, resumable over several calls (docs/benchmarks.md):
#  FRONTIER_TIME_S its own time budget (default 500 s; the step's limit is 40 s more),
#  BENCH_KERNELS_ARGS: more bench_kernels.py arguments ("--regimes 0,1 --variants bulk-dyn ...");
#  BENCH_SCHEDULER_ARGS likewise for bench_scheduler.py ("--arms paged paged_hold --rounds 3").
#  step-ratio: benchmarks/bench_step_ratio.py (arms round-robin against unpaged, one call):
#  STEP_RATIO_TIME_S its time budget (default 500 s), STEP_RATIO_ARGS its arguments
#  ("--arms paged --rounds 3 --env CUDA_DEVICE_MAX_CONNECTIONS=32").
#  FRONTIER_RESUME an earlier call's frontier.json carried in the tree (e.g.
#  benchmarks/results/frontier_h200.json), FRONTIER_ARGS more arguments ("--budget only", ...).)
set -u
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
: > "$LOG"
export PYTHONUNBUFFERED=1
if [ -z "${GIT_COMMIT:-}" ]; then
  # Seen 2026-12-03: git on the device machine answered a commit other than the tree's.
  echo "warning: GIT_COMMIT is not set; result files will record whatever git answers here" \
    | tee -a "$LOG" >&2
fi
export MEGATRON_PAGING_EXT_DIR=${MEGATRON_PAGING_EXT_DIR:-/tmp/megatron_paging_ext}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl >>"$LOG" 2>&1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(info build tests sanitizer bench-kernels host-cost bench-scheduler mcore)
declare -A status seconds

run_step() {  # name, limit seconds, command...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  echo "=== $name (limit ${limit}s): $*" | tee -a "$LOG"
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$LOG" | tail -n 40
  local rc=${PIPESTATUS[0]}
  seconds[$name]=$((SECONDS - t0))
  if [ "$rc" -eq 0 ]; then status[$name]=ok; else status[$name]="FAIL($rc)"; fi
}

run_gpu_tests() {  # PYTEST_SHARDS processes side by side on the one GPU (tests/conftest.py)
  local shards=${PYTEST_SHARDS:-1} pids=() rc=0 i shard
  for ((i = 0; i < shards; i++)); do
    shard=""; ((shards > 1)) && shard="$i/$shards"
    # shellcheck disable=SC2086
    PYTEST_SHARD=$shard python3 -m pytest -q \
      -m "gpu or multigpu or build" -p no:cacheprovider --junitxml "$OUT/gpu_tests_$i.xml" \
      ${PYTEST_EXTRA:-} ${PYTEST_TARGETS:-tests} >"$OUT/gpu_tests_$i.log" 2>&1 &
    pids+=($!)
  done
  for i in "${!pids[@]}"; do
    # pytest exits 5 when a shard got no test (few PYTEST_TARGETS over many shards): not a failure
    wait "${pids[$i]}"; local shard_rc=$?
    ((shard_rc != 0 && shard_rc != 5)) && rc=1
    echo "--- shard $i of $shards"; tail -n 25 "$OUT/gpu_tests_$i.log"
  done
  return $rc
}
export -f run_gpu_tests
export OUT

for step in "${steps[@]}"; do
  case $step in
    info) run_step info 60 python3 -m megatron_paging.cli info ;;
    build) run_step build 300 python3 -m megatron_paging.kernels.build --verbose ;;
    tests) run_step tests "${TESTS_LIMIT_S:-420}" bash -c run_gpu_tests ;;
    sanitizer)
      if command -v compute-sanitizer >/dev/null && [ -f scripts/sanitizer_run.py ]; then
        run_step memcheck 150 compute-sanitizer --tool memcheck --error-exitcode 7 \
          python3 scripts/sanitizer_run.py
        run_step racecheck 150 compute-sanitizer --tool racecheck --error-exitcode 7 \
          python3 scripts/sanitizer_run.py
      else
        echo "sanitizer: skipped (compute-sanitizer or scripts/sanitizer_run.py missing)" | tee -a "$LOG"
      fi ;;
    # shellcheck disable=SC2086
    bench-kernels) run_step bench-kernels 300 python3 benchmarks/bench_kernels.py \
                     --out "$OUT/kernels.json" ${BENCH_KERNELS_ARGS:-} ;;
    host-cost)
      run_step host-cost 120 python3 benchmarks/bench_host_cost.py --label after \
        --out "$OUT/host_after.json"
      if [ -d .old_tree/megatron_paging ]; then
        run_step host-cost-before 300 env PYTHONPATH="/tmp/site:$PWD/.old_tree" \
          MEGATRON_PAGING_EXT_DIR=/tmp/megatron_paging_ext_old \
          python3 benchmarks/bench_host_cost.py --label before --out "$OUT/host_before.json"
      fi ;;
    # shellcheck disable=SC2086
    bench-scheduler) run_step bench-scheduler 240 python3 benchmarks/bench_scheduler.py \
                       --out "$OUT/scheduler.json" ${BENCH_SCHEDULER_ARGS:-} ;;
    bench-offload) run_step bench-offload 180 python3 benchmarks/bench_offload.py \
                     --out "$OUT/offload.json" ;;
    bench-swiglu) run_step bench-swiglu 120 python3 benchmarks/bench_weighted_swiglu.py \
                    --out "$OUT/weighted_swiglu.json" ;;
    frontier)
      ftime=${FRONTIER_TIME_S:-500}
      resume=()
      [ -n "${FRONTIER_RESUME:-}" ] && resume=(--resume "$FRONTIER_RESUME")
      # shellcheck disable=SC2086
      run_step frontier $((ftime + 40)) python3 benchmarks/bench_frontier.py \
        --out "$OUT/frontier.json" --time-budget-s "$ftime" "${resume[@]}" ${FRONTIER_ARGS:-} ;;
    step-ratio)
      stime=${STEP_RATIO_TIME_S:-500}
      # shellcheck disable=SC2086
      run_step step-ratio $((stime + 40)) python3 benchmarks/bench_step_ratio.py \
        --out "$OUT/step_ratio.json" --time-budget-s "$stime" ${STEP_RATIO_ARGS:-} ;;
    mcore)
      if [ -f scripts/mcore_gpu_run.sh ]; then
        run_step mcore "${MCORE_LIMIT_S:-420}" bash scripts/mcore_gpu_run.sh "$OUT"
      else
        echo "mcore: skipped (scripts/mcore_gpu_run.sh missing)" | tee -a "$LOG"
      fi ;;
    *) echo "unknown step $step" | tee -a "$LOG" ;;
  esac
done

echo
echo "==================== gpu_check summary ===================="
printf '%-18s %-10s %s\n' step status seconds
for step in info build tests memcheck racecheck bench-kernels host-cost host-cost-before \
            bench-scheduler bench-offload bench-swiglu mcore frontier step-ratio; do
  [ -n "${status[$step]:-}" ] && printf '%-18s %-10s %s\n' "$step" "${status[$step]}" "${seconds[$step]}"
done
if ls "$OUT"/gpu_tests_*.xml >/dev/null 2>&1; then
  python3 - "$OUT"/gpu_tests_*.xml <<'EOF'
import sys, xml.etree.ElementTree as ET
totals = dict.fromkeys(("tests", "failures", "errors", "skipped"), 0)
for path in sys.argv[1:]:
    root = ET.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    for key in totals:
        totals[key] += int(suite.get(key, 0))
print("gpu tests ({} shards): {tests} run, {failures} failed, {errors} errors, {skipped} skipped"
      .format(len(sys.argv) - 1, **totals))
EOF
fi
# The device tool returns at most 8 files: logs, test XML and loss files travel as one archive,
# results (JSON, PNG) as themselves.
(cd "$OUT" && shopt -s nullglob && logs=(*.log *.xml *loss.rank* *timeline.json.rank*) && [ ${#logs[@]} -gt 0 ] &&
  tar czf logs.tar.gz "${logs[@]}" && rm -f "${logs[@]}")
ls -1 "$OUT"
