#!/usr/bin/env bash
# CoCoDiff on a CUDA cluster with torchrun: one rank per GPU, NCCL. Run on every node:
#
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 bash examples/cuda/torchrun.sh   # on node0
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=node0 bash examples/cuda/torchrun.sh   # on node1
#   DRY_RUN=1 NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 GPUS_PER_NODE=8 bash examples/cuda/torchrun.sh
#
# Sources: torchrun's documentation (pytorch.org/docs, "torchrun (Elastic Launch)": static
# rendezvous with --nnodes, --nproc-per-node, --node-rank, --master-addr, --master-port, the
# same master address on every node); the runtime picks each rank's GPU by LOCAL_RANK
# (transports.torch_dist.default_device) and NCCL for CUDA tensors.
set -euo pipefail

: "${NNODES:?set NNODES (nodes in the job)}"
: "${NODE_RANK:?set NODE_RANK (this node, 0..NNODES-1)}"
: "${MASTER_ADDR:?set MASTER_ADDR (the address of node 0, the same on every node)}"
MASTER_PORT=${MASTER_PORT:-29500}
GPUS_PER_NODE=${GPUS_PER_NODE:-$(nvidia-smi --list-gpus | wc -l)}
MODEL=${MODEL:-/path/to/FLUX.1-dev}     # a local diffusers pipeline directory

LAUNCH=(torchrun --nnodes "${NNODES}" --nproc-per-node "${GPUS_PER_NODE}"
        --node-rank "${NODE_RANK}" --master-addr "${MASTER_ADDR}"
        --master-port "${MASTER_PORT}")
DOCTOR=("${LAUNCH[@]}" -m cocodiff doctor --transport torch)
RUN=("${LAUNCH[@]}" -m cocodiff run --model "${MODEL}" --transport torch --dtype bfloat16
     --schedule vfirst --grid "${NNODES}x${GPUS_PER_NODE}x1" --resolution 1024 --steps 28
     --output flux.png --json flux.json)

if [[ "${DRY_RUN:-0}" == 1 ]]; then
    printf '%q ' "${DOCTOR[@]}"; echo
    printf '%q ' "${RUN[@]}"; echo
    exit 0
fi
"${DOCTOR[@]}"
"${RUN[@]}"
