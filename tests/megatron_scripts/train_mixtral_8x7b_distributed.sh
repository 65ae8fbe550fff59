#!/bin/bash

# Megatron-LM's examples/mixtral/train_mixtral_8x7b_distributed.sh (commit d98e8a6), run with
# hybridlm: every flag kept; pretrain_gpt.py is scripts/pretrain.py; the sizes read ${NAME:-Megatron's value}
# so that a test can shrink them (tests/test_megatron_scripts.py: 4 CPU ranks, PP2 x EP2), and so does
# the split (a 40-document test corpus has no 8-in-100,000 validation share).

# Runs Mixtral 8x7B model

export CUDA_DEVICE_MAX_CONNECTIONS=1

GPUS_PER_NODE=${GPUS_PER_NODE:-8}
# Change for multinode config
MASTER_ADDR=${MASTER_ADDR:-"localhost"}
MASTER_PORT=${MASTER_PORT:-"29500"}
NNODES=${SLURM_NNODES:-"1"}
NODE_RANK=${RANK:-"0"}
WORLD_SIZE=$(($GPUS_PER_NODE*$NNODES))

CHECKPOINT_PATH=$1
TOKENIZER_MODEL=$2
DATA_PATH=$3
HYBRIDLM=${HYBRIDLM:-$(cd "$(dirname "$0")/../.." && pwd)}

DISTRIBUTED_ARGS=(
    --nproc_per_node $GPUS_PER_NODE
    --nnodes $NNODES
    --node_rank $NODE_RANK
    --master_addr $MASTER_ADDR
    --master_port $MASTER_PORT
)

MODEL_ARGS=(
    --use-mcore-models
    --disable-bias-linear
    --seq-length ${SEQ_LENGTH:-4096}
    --max-position-embeddings ${MAX_POSITION_EMBEDDINGS:-32768}
    --num-layers ${NUM_LAYERS:-32}
    --hidden-size ${HIDDEN_SIZE:-4096}
    --ffn-hidden-size ${FFN_HIDDEN_SIZE:-14336}
    --num-attention-heads ${NUM_ATTENTION_HEADS:-32}
    --init-method-std 0.01
    --attention-dropout 0.0
    --hidden-dropout 0.0
    --normalization RMSNorm
    --position-embedding-type rope
    --swiglu
    --untie-embeddings-and-output-weights
    --group-query-attention
    --num-query-groups ${NUM_QUERY_GROUPS:-8}
    --no-masked-softmax-fusion
    --no-position-embedding
    --rotary-base 1000000
)

MOE_ARGS=(
    --num-experts ${NUM_EXPERTS:-8}
    --moe-router-topk 2
    --moe-router-load-balancing-type aux_loss
    --moe-aux-loss-coeff 1e-2
    --moe-grouped-gemm
    --moe-token-dispatcher-type alltoall
    --overlap-param-gather
    --overlap-grad-reduce
)

DATA_ARGS=(
    --tokenizer-type Llama2Tokenizer
    --tokenizer-model ${TOKENIZER_MODEL}
    --data-path $DATA_PATH
    --split ${SPLIT:-99990,8,2}
)

TRAINING_ARGS=(
    --micro-batch-size 1
    --global-batch-size ${GLOBAL_BATCH_SIZE:-256}
    --lr 1e-4
    --train-iters ${TRAIN_ITERS:-500000}
    --lr-decay-iters ${LR_DECAY_ITERS:-320000}
    --lr-decay-style cosine
    --min-lr 1.0e-5
    --weight-decay 0.1
    --lr-warmup-iters ${LR_WARMUP_ITERS:-500}
    --clip-grad 1.0
    --bf16
)

MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size 1
    --pipeline-model-parallel-size ${PIPELINE_MODEL_PARALLEL_SIZE:-4}
    --expert-model-parallel-size ${EXPERT_MODEL_PARALLEL_SIZE:-8}
    --use-distributed-optimizer
    --sequence-parallel
)

LOGGING_ARGS=(
    --log-interval 1 \
    --save-interval ${SAVE_INTERVAL:-10000} \
    --eval-interval ${EVAL_INTERVAL:-1000} \
    --eval-iters ${EVAL_ITERS:-10} \
    --save $CHECKPOINT_PATH \
    --load $CHECKPOINT_PATH \
    --tensorboard-dir "${CHECKPOINT_PATH}/tensorboard" \
    --no-load-optim \
    --no-load-rng
)

if [ -n "${WANDB_API_KEY}" ]; then
    LOGGING_ARGS+=(
        --wandb-project ${WANDB_PROJECT:-"Mixtral"}
        --wandb-exp-name ${WANDB_NAME:-"Mixtral_8x7B"}
    )
fi


torchrun ${DISTRIBUTED_ARGS[@]} "$HYBRIDLM/scripts/pretrain.py" \
    ${MODEL_ARGS[@]} \
    ${MOE_ARGS[@]} \
    ${DATA_ARGS[@]} \
    ${TRAINING_ARGS[@]} \
    ${MODEL_PARALLEL_ARGS[@]} \
    ${LOGGING_ARGS[@]}
