#!/usr/bin/env bash
# Kimi-K2-style 1T MoE pretraining with official Megatron-LM pretrain_gpt.py and the Titan plugins.
#
# Model (Kimi-K2 tech report, arXiv 2507.20534): 61 layers (first 1 dense), hidden 7168, 64 MLA
# heads (q/kv LoRA ranks 1536/512, qk 128 + rope 64, v 128), 384 routed experts top-8 + 1 shared,
# expert FFN 2048, dense FFN 18432, vocab 163840, sigmoid router with aux-free expert bias.
#
# Default layout = Kimi-K2's published one: PP16 with 2 virtual stages per rank (interleaved 1F1B)
# x EP16, ZeRO-1 data parallel, on 4096 GPUs (512 nodes x 8). The layout string puts the embedding
# plus 1 layer first and the loss alone last: ranks 0 / 1-14 / 15 hold 3 / 4 / 2 layers.
# Adapt it to a cluster by setting variables, e.g.:
#   NNODES=64 NODE_RANK=$RANK MASTER_ADDR=host0 bash pretrain_kimi_1000B.sh
# and check memory before launching:
#   titan-plugins plan entrypoints/pretrain_kimi_1000B.sh --device-memory 80GB
#
# Titan plugins: installed plugins activate automatically; these switches (exported, so torchrun
# workers inherit them) choose which. fp8 compute/storage comes from the fp8 flags below.
export TITAN_PLUGINS=${TITAN_PLUGINS:-1}                  # 0: every plugin off
export TITAN_FP8_BLOCKWISE=${TITAN_FP8_BLOCKWISE:-1}      # blockwise FP8 linears + FP8 saved inputs
export TITAN_MOE_EP_OVERLAP=${TITAN_MOE_EP_OVERLAP:-1}    # DeepEP-style dispatch/combine overlap
export TITAN_ACT_OFFLOAD=${TITAN_ACT_OFFLOAD:-1}          # activations of waiting microbatches to host
export TITAN_PP_RDMA=${TITAN_PP_RDMA:-0}                  # pipeline P2P over Mooncake RDMA
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-32}  # >1 for EP A2A overlap

# Cluster (torchrun rendezvous).
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NNODES=${NNODES:-512}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-6000}

# Parallel layout (data parallel = GPUs / (TP * PP); expert data parallel = GPUs / (EP * PP)).
TP=${TP:-1}
PP=${PP:-16}
EP=${EP:-16}
# Layer layout over PP * VPP virtual stages (E embedding, t layer, L loss, | stage boundary). The
# default has 32 stages: PP16 x VPP2 (Kimi-K2), also PP8 x VPP4, PP32 x VPP1 or PP4 x VPP8.
PP_LAYOUT=${PP_LAYOUT:-"Et|(tt|)*30L"}
MBS=${MBS:-1}
GBS=${GBS:-16384}                         # 16384 x 4096 tokens = Kimi-K2's 67M-token batch
SEQ_LEN=${SEQ_LEN:-4096}

# Memory switches (Kimi-K2: selective recompute of norms, SwiGLU and MLA up-projections).
RECOMPUTE_MODULES=${RECOMPUTE_MODULES:-"layernorm mla_up_proj moe_act"}
FP8_ARGS=${FP8_ARGS:-"--fp8-format e4m3 --fp8-recipe blockwise"}  # "" for bf16 linears

# Data and tokenizer: mock data with the NullTokenizer unless DATA_ARGS says otherwise, e.g.
#   DATA_ARGS="--data-path /data/kimi_text_document --tokenizer-type HuggingFaceTokenizer
#              --tokenizer-model moonshotai/Kimi-K2-Instruct"
DATA_ARGS=${DATA_ARGS:-"--mock-data --tokenizer-type NullTokenizer"}
CHECKPOINT_PATH=${CHECKPOINT_PATH:-./checkpoints/kimi_1000B}
MEGATRON_LM=${MEGATRON_LM:-.}             # Megatron-LM checkout holding pretrain_gpt.py

MODEL_ARGS=(
    --num-layers 61
    --hidden-size 7168
    --ffn-hidden-size 18432
    --num-attention-heads 64
    --seq-length "$SEQ_LEN"
    --max-position-embeddings "$SEQ_LEN"
    --vocab-size 163840
    --make-vocab-size-divisible-by 128
    --untie-embeddings-and-output-weights
    --normalization RMSNorm
    --norm-epsilon 1e-6
    --swiglu
    --disable-bias-linear
    --position-embedding-type rope
    --rotary-base 50000
    --attention-dropout 0.0
    --hidden-dropout 0.0
    --multi-latent-attention
    --q-lora-rank 1536
    --kv-lora-rank 512
    --qk-head-dim 128
    --qk-pos-emb-head-dim 64
    --v-head-dim 128
    --qk-layernorm
)

MOE_ARGS=(
    --num-experts 384
    --moe-layer-freq "([0]*1+[1]*60)"
    --moe-ffn-hidden-size 2048
    --moe-shared-expert-intermediate-size 2048
    --moe-router-topk 8
    --moe-router-score-function sigmoid
    --moe-router-enable-expert-bias
    --moe-router-topk-scaling-factor 2.827
    --moe-router-load-balancing-type seq_aux_loss
    --moe-aux-loss-coeff 1e-4
    --moe-router-dtype fp32
    --moe-grouped-gemm
    --moe-token-dispatcher-type alltoall
    --moe-permute-fusion
)

PARALLEL_ARGS=(
    --tensor-model-parallel-size "$TP"
    --pipeline-model-parallel-size "$PP"
    --expert-model-parallel-size "$EP"
    --expert-tensor-parallel-size 1
    --pipeline-model-parallel-layout "$PP_LAYOUT"
    --use-distributed-optimizer
    --overlap-grad-reduce
    --overlap-param-gather
)

TRAINING_ARGS=(
    --micro-batch-size "$MBS"
    --global-batch-size "$GBS"
    --train-iters 500000
    --lr 2e-4
    --min-lr 2e-5
    --lr-decay-style cosine
    --lr-warmup-iters 2000
    --weight-decay 0.1
    --clip-grad 1.0
    --bf16
    --recompute-granularity selective
    --recompute-modules $RECOMPUTE_MODULES
    $FP8_ARGS
    --transformer-impl transformer_engine
    --attention-backend auto
)

OUTPUT_ARGS=(
    --save "$CHECKPOINT_PATH"
    --load "$CHECKPOINT_PATH"
    --save-interval 1000
    --eval-interval 1000
    --eval-iters 10
    --log-interval 1
)

torchrun --nproc-per-node "$GPUS_PER_NODE" --nnodes "$NNODES" --node-rank "$NODE_RANK" \
    --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" \
    "$MEGATRON_LM/pretrain_gpt.py" \
    "${MODEL_ARGS[@]}" "${MOE_ARGS[@]}" "${PARALLEL_ARGS[@]}" \
    "${TRAINING_ARGS[@]}" $DATA_ARGS --split 99,1,0 "${OUTPUT_ARGS[@]}"
