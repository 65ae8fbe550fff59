#!/bin/bash

# Megatron-LM's examples/gpt3/train_gpt3_175b_distributed.sh (commit d98e8a6), run with hybridlm:
# pretrain_gpt.py is scripts/pretrain.py; the sizes read ${NAME:-Megatron's value} so that a test
# can shrink them (tests/test_megatron_scripts.py: 2 CPU ranks, PP2). Three changes, each one that
# Megatron-LM itself needs at that commit:
#  - --tokenizer-type GPT2BPETokenizer added: without a tokenizer type Megatron-LM's build_tokenizer
#    raises ("tokenizer_type None is not supported"), and hybridlm refuses --vocab-file in one sentence;
#  - --step-batch-size-schedule dropped: Megatron-LM refuses it together with --global-batch-size
#    (arguments.py: "Cannot specify both --step-batch-size-schedule and --global-batch-size"), and
#    hybridlm has no batch-size ramp (it refuses the flag in one sentence);
#  - ${PRECISION:---fp16}: DeepSpeed has no fp16 on a CPU, so the CPU test trains in fp32 (PRECISION=" ").

# Runs the "175B" parameter model

export CUDA_DEVICE_MAX_CONNECTIONS=1

GPUS_PER_NODE=${GPUS_PER_NODE:-8}
# Change for multinode config
MASTER_ADDR=localhost
MASTER_PORT=${MASTER_PORT:-29500}
NUM_NODES=1
NODE_RANK=0
WORLD_SIZE=$(($GPUS_PER_NODE*$NUM_NODES))

CHECKPOINT_PATH=$1 #<Specify path>
TENSORBOARD_LOGS_PATH=$2 #<Specify path>
VOCAB_FILE=$3 #<Specify path to file>/gpt2-vocab.json
MERGE_FILE=$4 #<Specify path to file>/gpt2-merges.txt
DATA_PATH=$5 #<Specify path and file prefix>_text_document
HYBRIDLM=${HYBRIDLM:-$(cd "$(dirname "$0")/../.." && pwd)}

DISTRIBUTED_ARGS=(
    --nproc_per_node $GPUS_PER_NODE 
    --nnodes $NUM_NODES 
    --master_addr $MASTER_ADDR 
    --master_port $MASTER_PORT
)

GPT_MODEL_ARGS=(
    --num-layers ${NUM_LAYERS:-96} 
    --hidden-size ${HIDDEN_SIZE:-12288} 
    --num-attention-heads ${NUM_ATTENTION_HEADS:-96} 
    --seq-length ${SEQ_LENGTH:-2048} 
    --max-position-embeddings ${MAX_POSITION_EMBEDDINGS:-2048} 
    --attention-backend auto # Can use (flash/fused/unfused/local)
)

TRAINING_ARGS=(
    --micro-batch-size 1 
    --global-batch-size ${GLOBAL_BATCH_SIZE:-1536}
    --train-iters ${TRAIN_ITERS:-500000}
    --weight-decay 0.1 
    --adam-beta1 0.9 
    --adam-beta2 0.95 
    --init-method-std 0.006 
    --clip-grad 1.0 
    ${PRECISION:---fp16}
    --lr 6.0e-5 
    --lr-decay-style cosine 
    --min-lr 6.0e-6
    --lr-warmup-fraction .001 
    --lr-decay-iters ${LR_DECAY_ITERS:-430000} 
)

MODEL_PARALLEL_ARGS=(
	--tensor-model-parallel-size ${TENSOR_MODEL_PARALLEL_SIZE:-8} 
	--pipeline-model-parallel-size ${PIPELINE_MODEL_PARALLEL_SIZE:-16} 
)

DATA_ARGS=(
    --data-path $DATA_PATH 
    --tokenizer-type GPT2BPETokenizer
    --vocab-file $VOCAB_FILE 
    --merge-file $MERGE_FILE 
    --split ${SPLIT:-949,50,1}
)

EVAL_AND_LOGGING_ARGS=(
    --log-interval ${LOG_INTERVAL:-100}
    --save-interval ${SAVE_INTERVAL:-10000} 
    --eval-interval ${EVAL_INTERVAL:-1000} 
    --save $CHECKPOINT_PATH 
    --load $CHECKPOINT_PATH 
    --eval-iters ${EVAL_ITERS:-10}
    --tensorboard-dir $TENSORBOARD_LOGS_PATH 
)

torchrun ${DISTRIBUTED_ARGS[@]} "$HYBRIDLM/scripts/pretrain.py" \
    ${GPT_MODEL_ARGS[@]} \
    ${TRAINING_ARGS[@]} \
    ${MODEL_PARALLEL_ARGS[@]} \
    ${DATA_ARGS[@]} \
    ${EVAL_AND_LOGGING_ARGS[@]}
