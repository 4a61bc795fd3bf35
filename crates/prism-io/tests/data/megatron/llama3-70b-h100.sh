#!/bin/bash
# Llama 3 70B pre-training with Megatron-LM on H100 nodes (a launch script in the style of
# Megatron-LM's examples, written for Prism's tests).
set -euo pipefail

export CUDA_DEVICE_MAX_CONNECTIONS=1
export NCCL_IB_SL=1

GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NUM_NODES=${SLURM_NNODES:-64}
WORLD_SIZE=$((GPUS_PER_NODE * NUM_NODES))

TP=8
PP=4
VP_LAYERS=5
MBS=1
GBS=1024
SEQ=8192
DTYPE=${DTYPE:-bf16}
TOKENIZER=${1:-"meta-llama/Meta-Llama-3-70B"}

DISTRIBUTED_ARGS=(
    --nproc_per_node $GPUS_PER_NODE
    --nnodes $NUM_NODES
    --rdzv_backend c10d
)

MODEL_ARGS=(
    --use-mcore-models
    --num-layers 80
    --hidden-size 8192
    --ffn-hidden-size 28672
    --num-attention-heads 64
    --group-query-attention
    --num-query-groups 8
    --kv-channels 128
    --seq-length $SEQ
    --max-position-embeddings $SEQ
    --position-embedding-type rope
    --rotary-base 500000
    --swiglu
    --normalization RMSNorm
    --untie-embeddings-and-output-weights
    --disable-bias-linear
    --attention-dropout 0.0
    --hidden-dropout 0.0
)

TRAINING_ARGS=(
    --micro-batch-size $MBS
    --global-batch-size $GBS
    --lr 1.5e-4 --min-lr 1.5e-5 --lr-decay-style cosine
    --weight-decay 0.1 --clip-grad 1.0
    --use-distributed-optimizer
    --overlap-grad-reduce
    --overlap-param-gather
)

if [[ "$DTYPE" == "fp8" ]]; then
    PRECISION_ARGS=( --bf16 "--fp8-format hybrid" --fp8-amax-history-len 1024 )
elif [[ "$DTYPE" == "bf16" ]]; then
    PRECISION_ARGS=( --bf16 )
else
    PRECISION_ARGS=( --fp16 )
fi

PARALLEL_ARGS=(
    --tensor-model-parallel-size $TP
    --pipeline-model-parallel-size $PP
    --num-layers-per-virtual-pipeline-stage $VP_LAYERS
    --sequence-parallel
    --tp-comm-overlap    # Transformer Engine userbuffers
)

DATA_ARGS=(
    --tokenizer-type HuggingFaceTokenizer
    --tokenizer-model "$TOKENIZER"
    --vocab-size 128256
    --data-path /data/llama3_text_document
    --split '99,1,0'
)

torchrun ${DISTRIBUTED_ARGS[@]} pretrain_gpt.py \
    ${MODEL_ARGS[@]} \
    ${TRAINING_ARGS[@]} \
    ${PRECISION_ARGS[@]} \
    ${PARALLEL_ARGS[@]} \
    ${DATA_ARGS[@]} \
    --log-interval 10 --save-interval 1000 --eval-iters 0
