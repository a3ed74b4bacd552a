#!/usr/bin/env bash
# GPT-MoE with paged expert activations on one GPU: 8 layers, hidden 1024, 16 experts top-2,
# sequence 2048, 8 microbatches per step, bf16, local (TE-free) spec, static sync-free dispatch.
#
#   bash examples/run_pretrain_1gpu.sh                      # paged
#   PAGED=0 bash examples/run_pretrain_1gpu.sh              # unpaged control, same capacity
#   bash examples/run_pretrain_1gpu.sh --train-iters 50     # extra flags are appended
#
# Multi-GPU: the same script and flags plus EP/PP (and NPROC GPUs), e.g.
#   NPROC=8 bash examples/run_pretrain_1gpu.sh --expert-model-parallel-size 4 \
#       --pipeline-model-parallel-size 2 --global-batch-size 16
set -euo pipefail
cd "$(dirname "$0")/.."
# The project's .venv (made by `make demo` / `make test`) when it exists, else python3; PYTHON=
# chooses another interpreter.
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
  echo "run_pretrain_1gpu.sh: using $PYTHON (set PYTHON= to choose another)" >&2
fi
NPROC=${NPROC:-1}
PAGED=${PAGED:-1}
case $PAGED in
  0 | 1) ;;
  *) echo "error: PAGED must be 1 (paged) or 0 (the unpaged control), got '$PAGED'" >&2; exit 2 ;;
esac
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
# torch 2.11's Inductor fails an assertion ("256 v.s. 64") fusing the split reductions of
# Megatron-Core's compiled functions at DeepSeek-V3's MLA and router sizes (mix-order reduction;
# pytorch/pytorch#177419). Off unless the caller says otherwise.
export TORCHINDUCTOR_MIX_ORDER_REDUCTION=${TORCHINDUCTOR_MIX_ORDER_REDUCTION:-0}
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD

MODEL=(
  --num-layers 8 --hidden-size 1024 --num-attention-heads 16 --ffn-hidden-size 4096
  --seq-length 2048 --max-position-embeddings 2048
  --transformer-impl local --normalization RMSNorm --swiglu --disable-bias-linear
  --position-embedding-type rope --untie-embeddings-and-output-weights
  --no-persist-layer-norm --no-gradient-accumulation-fusion --no-masked-softmax-fusion
  --no-bias-dropout-fusion --no-rope-fusion
)
MOE=(
  --num-experts 16 --moe-router-topk 2 --moe-ffn-hidden-size 1024
  --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2 --moe-router-dtype fp32
  --moe-token-dispatcher-type flex --moe-flex-dispatcher-backend static
  --moe-expert-rank-capacity-factor 1.5
)
# Megatron refuses a global batch beside a batch schedule: the default gives way to one
BATCH=(--global-batch-size 8)
case " $* " in *" --step-batch-size-schedule "*) BATCH=() ;; esac
TRAIN=(
  --micro-batch-size 1 "${BATCH[@]}" --train-iters 20
  --lr 1e-4 --min-lr 1e-5 --lr-decay-style cosine --lr-warmup-iters 2
  --weight-decay 0.1 --clip-grad 1.0 --bf16 --seed 1234
  --mock-data --tokenizer-type NullTokenizer --vocab-size 32000
  --log-interval 1 --eval-iters 0 --eval-interval 100000
)
PAGING=()
if [ "$PAGED" = 1 ]; then
  PAGING=(--moe-paged-stash --moe-paged-stash-page-size 64
          --moe-paged-stash-buffer-size-factor-cuda 1.10 --paging-overflow-policy rerun)
fi

ARGS=("${MODEL[@]}" "${MOE[@]}" "${TRAIN[@]}" "${PAGING[@]}" "$@")
if [ "${DRY_RUN:-0}" = 1 ]; then  # print the example's arguments, one per line
  printf '%s\n' "${ARGS[@]}"
  exit 0
fi
# The interpreter, NPROC / WORLD_SIZE / RANK, the flags (Megatron's parser and validate_args),
# the benchmark controls and a GPU, checked before torchrun starts anything: a refusal is one
# "error:" line (the last one printed) and exit status 2.
NPROC=$NPROC "$PYTHON" examples/preflight.py "${ARGS[@]}" || exit $?
case " ${ARGS[*]} " in
  *" --fake-process-group "*)
    # One emulated rank of a WORLD_SIZE-rank job, in this one process (docs/scale.md).
    LOCAL_RANK=0 exec "$PYTHON" examples/pretrain_gpt_moe_paged.py "${ARGS[@]}" ;;
esac
exec "$PYTHON" -m torch.distributed.run --nproc-per-node "$NPROC" \
  examples/pretrain_gpt_moe_paged.py "${ARGS[@]}"
