#!/bin/bash
# A Mistral-7B-shaped model (4,096-token sliding window on every layer) trained at 32k tokens
# with Ulysses-style context parallelism on 4 H100 nodes (a launch script in the style of
# Megatron-LM's examples, written for Prism's tests).
set -euo pipefail

export CUDA_DEVICE_MAX_CONNECTIONS=1

GPUS_PER_NODE=8
NUM_NODES=${SLURM_NNODES:-4}
TP=2
CP=4
SEQ=32768

DISTRIBUTED_ARGS=(
    --nproc_per_node $GPUS_PER_NODE
    --nnodes $NUM_NODES
)

MODEL_ARGS=(
    --use-mcore-models
    --num-layers 32
    --hidden-size 4096
    --ffn-hidden-size 14336
    --num-attention-heads 32
    --group-query-attention
    --num-query-groups 8
    --seq-length $SEQ
    --max-position-embeddings $SEQ
    --position-embedding-type rope
    --window-size "(4095,0)"
    --swiglu
    --normalization RMSNorm
    --untie-embeddings-and-output-weights
    --disable-bias-linear
    --attention-dropout 0.0
    --hidden-dropout 0.0
)

PARALLEL_ARGS=(
    --tensor-model-parallel-size $TP
    --context-parallel-size $CP
    --cp-comm-type a2a
    --sequence-parallel
    --use-distributed-optimizer
    --overlap-grad-reduce
    --overlap-param-gather
)

TRAINING_ARGS=(
    --micro-batch-size 1
    --global-batch-size 64
    --bf16
    --recompute-granularity selective
    --vocab-size 32768
    --tokenizer-type NullTokenizer
)

torchrun ${DISTRIBUTED_ARGS[@]} pretrain_gpt.py \
    ${MODEL_ARGS[@]} \
    ${PARALLEL_ARGS[@]} \
    ${TRAINING_ARGS[@]}
