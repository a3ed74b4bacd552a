#!/usr/bin/env bash
# On a GPU machine, from the repository root: build the CUDA extension, run the GPU tests, the
# benchmarks and the Megatron example runs. Results (JSON, PNG) land in $OUT (default ./out),
# logs, test XML and loss files in $OUT/logs.tar.gz; a summary table prints last.
#
#   bash scripts/gpu_check.sh [steps...]          (default: info build tests)
#   steps: info build tests sanitizer bench-kernels profile-kernels kernels-ab bench-scheduler
#          bench-offload bench-offload-queues bench-swiglu mcore frontier step-ratio scale
#
# Each step has its own time limit, so one hang cannot take the whole run; `build tests` is sized
# for one 10-minute call (the build ~40 s when not cached, the tests TESTS_LIMIT_S). Environment:
#   GIT_COMMIT          the commit every result file records (default: this checkout's HEAD;
#                       "unknown" in a tree copied without .git)
#   .whl/*.whl          wheels installed into /tmp/site with no package index (megatron-core,
#                       pytest-xdist, execnet, psutil), for a machine that has none
#   PYTEST_WORKERS      pytest-xdist processes sharing the GPU (default 4; each takes the next
#                       test when free); PYTEST_TARGETS test files or node ids (default
#                       tests/); PYTEST_MARKS the marker expression (default "gpu or multigpu
#                       or build"; a suite larger than one call runs in two: "training_run" and
#                       "(gpu or multigpu or build) and not training_run"); PYTEST_EXTRA more
#                       pytest arguments; TESTS_LIMIT_S the tests step's limit (default 530 s; at
#                       the limit pytest is interrupted and still reports what finished, marked
#                       interrupted); TESTS_CONTINUE an earlier call's gpu_tests.jsonl (in the
#                       tree, same GIT_COMMIT): its passed and skipped tests are not run again
#                       and count in this call's record, so a suite spans calls
#   BENCH_KERNELS_ARGS, BENCH_SCHEDULER_ARGS, PROFILE_KERNELS_ARGS   more arguments for those
#                       benchmarks (profile-kernels: Nsight Compute counters, needs ncu)
#   AB_TREES            kernels-ab: source trees to A/B against this one, space separated (each
#                       from `git archive <commit> megatron_paging benchmarks/bench_kernels.py
#                       benchmarks/common.py benchmarks/portable.py`, untracked so it travels);
#                       KERNELS_AB_ARGS more arguments for benchmarks/kernels_ab.py
#                       (--baseline-commit per tree, --chain 20, --max-ctas 32 64)
#   MCORE_LIMIT_S       the mcore step's limit (default 420 s); MODES, STEPS, EXTRA go to
#                       scripts/mcore_gpu_run.sh
#   FRONTIER_TIME_S     benchmarks/bench_frontier.py's time budget (default 500 s; the step's
#                       limit is 40 s more), FRONTIER_RESUME an earlier call's frontier.json,
#                       FRONTIER_ARGS more arguments ("--only moe_compute:paged", ...)
#   STEP_RATIO_TIME_S, STEP_RATIO_ARGS   the same for benchmarks/bench_step_ratio.py
#   SCALE_TIME_S, SCALE_ARGS, SCALE_RESUME   the same for benchmarks/bench_scale.py (one
#                       emulated rank of a frontier layout per arm; docs/scale.md)
set -u
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
: > "$LOG"
export PYTHONUNBUFFERED=1
# A tree copied without .git must not take the commit of a repository around it.
if [ -z "${GIT_COMMIT:-}" ]; then
  GIT_COMMIT=unknown
  [ -e .git ] && GIT_COMMIT=$(git rev-parse HEAD 2>/dev/null || echo unknown)
fi
export GIT_COMMIT
echo "commit recorded in results: $GIT_COMMIT" | tee -a "$LOG"
export XDG_CACHE_HOME=${XDG_CACHE_HOME:-/tmp/xdg-cache}  # the built extension, for every step
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl >>"$LOG" 2>&1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(info build tests)
declare -A status seconds
ran=()

run_step() {  # name, limit seconds, command... (STEP_SIGNAL: what the limit sends, default TERM)
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  echo "=== $name (limit ${limit}s): $*" | tee -a "$LOG"
  timeout -s "${STEP_SIGNAL:-TERM}" --kill-after=20 "$limit" "$@" 2>&1 | tee -a "$LOG" | tail -n 40
  local rc=${PIPESTATUS[0]}
  seconds[$name]=$((SECONDS - t0))
  ran+=("$name")
  if [ "$rc" -eq 0 ]; then status[$name]=ok; else status[$name]="FAIL($rc)"; fi
}

run_gpu_tests() {  # the GPU-marked tests, PYTEST_WORKERS processes side by side on the GPU
  # One test at a time to whichever worker is free; the training runs are collected first
  # (tests/conftest.py), so they start side by side and the short tests fill in around them.
  local workers=(-n "${PYTEST_WORKERS:-4}" --dist load --maxschedchunk 1)
  if ! python3 -c "import xdist" 2>/dev/null; then
    echo "tests: pytest-xdist is not installed (its and execnet's wheels go in .whl/): one process"
    workers=()
  fi
  # A line per test as it finishes (tests/suite_stream.py): the result even if pytest never ends.
  : > "$OUT/gpu_tests.jsonl"
  rm -f "$OUT/gpu_tests.xml"  # pytest writes it only at a clean end: never report an older one
  # shellcheck disable=SC2086
  PAGING_TEST_STREAM="$OUT/gpu_tests.jsonl" PAGING_TEST_CONTINUE="${TESTS_CONTINUE:-}" \
  python3 -m pytest "${workers[@]}" -q -m "${PYTEST_MARKS:-gpu or multigpu or build}" \
    -p no:cacheprovider --junitxml "$OUT/gpu_tests.xml" ${PYTEST_EXTRA:-} ${PYTEST_TARGETS:-tests}
}
export -f run_gpu_tests
export OUT

for step in "${steps[@]}"; do
  case $step in
    info) run_step info 60 python3 -m megatron_paging.cli info ;;
    build) run_step build 300 python3 -m megatron_paging.kernels.build --verbose ;;
    # Interrupted at the limit (SIGINT), pytest still prints its failures and writes the XML.
    tests) STEP_SIGNAL=INT run_step tests "${TESTS_LIMIT_S:-530}" bash -c run_gpu_tests ;;
    sanitizer)
      if command -v compute-sanitizer >/dev/null && [ -f scripts/sanitizer_run.py ]; then
        run_step memcheck 150 compute-sanitizer --tool memcheck --error-exitcode 7 \
          python3 scripts/sanitizer_run.py
        run_step racecheck 150 compute-sanitizer --tool racecheck --error-exitcode 7 \
          python3 scripts/sanitizer_run.py
        python3 - "$LOG" "$OUT/sanitizer.json" "${status[memcheck]}" "${status[racecheck]}" <<'PY'
import datetime, json, os, re, sys, torch
log, out, memcheck, racecheck = sys.argv[1:]
summaries = re.findall(r"=+ (?:ERROR|RACECHECK) SUMMARY: .*", open(log).read())
json.dump({"benchmark": "sanitizer", "gpu": torch.cuda.get_device_name(),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "commit": os.environ["GIT_COMMIT"], "memcheck": memcheck, "racecheck": racecheck,
           "command": "compute-sanitizer --tool memcheck|racecheck --error-exitcode 7 "
                      "python3 scripts/sanitizer_run.py", "summaries": summaries},
          open(out, "w"), indent=1)
PY
      else
        echo "sanitizer: skipped (compute-sanitizer or scripts/sanitizer_run.py missing)" | tee -a "$LOG"
      fi ;;
    # shellcheck disable=SC2086
    bench-kernels) run_step bench-kernels 300 python3 benchmarks/bench_kernels.py \
                     --out "$OUT/kernels.json" ${BENCH_KERNELS_ARGS:-} ;;
    kernels-ab)
      ab_args=()
      for tree in ${AB_TREES:-}; do ab_args+=(--baseline "$tree"); done
      if [ ${#ab_args[@]} -eq 0 ]; then
        echo "kernels-ab: AB_TREES names no source tree to compare with" | tee -a "$LOG"
        status[kernels-ab]="FAIL(no AB_TREES)"; seconds[kernels-ab]=0; ran+=(kernels-ab)
      else
        # shellcheck disable=SC2086
        run_step kernels-ab 420 python3 benchmarks/kernels_ab.py "${ab_args[@]}" \
          --out "$OUT/kernels_ab.json" ${KERNELS_AB_ARGS:-}
      fi ;;
    # shellcheck disable=SC2086
    profile-kernels) run_step profile-kernels 240 python3 benchmarks/profile_kernels.py \
                       --out "$OUT/kernels_profile.json" ${PROFILE_KERNELS_ARGS:-} ;;
    # shellcheck disable=SC2086
    bench-scheduler) run_step bench-scheduler 240 python3 benchmarks/bench_scheduler.py \
                       --out "$OUT/scheduler.json" ${BENCH_SCHEDULER_ARGS:-} ;;
    bench-offload) run_step bench-offload 180 python3 benchmarks/bench_offload.py \
                     --out "$OUT/offload.json" ;;
    bench-offload-queues) run_step bench-offload-queues 150 \
                            python3 benchmarks/bench_offload_queues.py --out "$OUT/offload_queues.json" ;;
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
    mcore) run_step mcore "${MCORE_LIMIT_S:-420}" bash scripts/mcore_gpu_run.sh "$OUT" ;;
    scale)
      sctime=${SCALE_TIME_S:-500}
      [ -n "${SCALE_RESUME:-}" ] && cp "$SCALE_RESUME" "$OUT/scale.json"
      # shellcheck disable=SC2086
      run_step scale $((sctime + 320)) python3 benchmarks/bench_scale.py \
        --out "$OUT/scale.json" --time-budget "$sctime" ${SCALE_ARGS:-} ;;
    *) echo "unknown step $step" | tee -a "$LOG" ;;
  esac
done

echo
echo "==================== gpu_check summary ===================="
printf '%-18s %-10s %s\n' step status seconds
for step in "${ran[@]}"; do  # every step that ran, in the order it ran
  printf '%-18s %-10s %s\n' "$step" "${status[$step]}" "${seconds[$step]}"
done
if [ -s "$OUT/gpu_tests.jsonl" ]; then
  python3 benchmarks/report_gpu_tests.py "$OUT/gpu_tests.jsonl" --out "$OUT/gpu_tests.json"
fi
# Logs, test XML, loss logs and kernel timelines as one archive; results (JSON, PNG) as they are.
(cd "$OUT" && shopt -s nullglob && logs=(*.log *.xml *loss.rank* *timeline.json.rank*) && [ ${#logs[@]} -gt 0 ] &&
  tar czf logs.tar.gz "${logs[@]}" && rm -f "${logs[@]}")
ls -1 "$OUT"
