#!/usr/bin/env bash
# Start one composer launcher on this node; it starts one training process per GPU.
#
#   NNODES=4 NODE_RANK=0 MASTER_ADDR=node0 launch/multinode.sh yamls/RUN.yaml [key=value ...]
#
# Run it on every node with the same NNODES, MASTER_ADDR and MASTER_PORT and that node's NODE_RANK
# (0 on MASTER_ADDR's node). Under Slurm, launch/slurm.sbatch runs it once per node with srun and
# NNODES / NODE_RANK / GPUS_PER_NODE come from SLURM_NNODES / SLURM_NODEID / SLURM_GPUS_ON_NODE.
# Nothing in the YAML depends on the node count: the per-device batch is
# global_train_batch_size / (NNODES x GPUS_PER_NODE), checked to divide evenly at start-up.
set -euo pipefail

nnodes=${NNODES:-${SLURM_NNODES:-1}}
node_rank=${NODE_RANK:-${SLURM_NODEID:-0}}
gpus_per_node=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}
master_addr=${MASTER_ADDR:?set MASTER_ADDR to the hostname of node rank 0}
master_port=${MASTER_PORT:-29500}  # must be free on the rank-0 node; the same on every node
world_size=$((nnodes * gpus_per_node))

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"  # train.py and the relative paths in yamls/ are relative to the repo root
composer=${COMPOSER:-composer}
if [[ -z ${COMPOSER:-} && -x .venv/bin/composer ]]; then
    composer=.venv/bin/composer  # the repo's own venv (make install), unless COMPOSER says otherwise
fi

echo "node ${node_rank}/${nnodes}: ${gpus_per_node} processes, world size ${world_size}," \
    "rendezvous ${master_addr}:${master_port}" >&2
exec "$composer" \
    --nproc "$gpus_per_node" \
    --world_size "$world_size" \
    --node_rank "$node_rank" \
    --master_addr "$master_addr" \
    --master_port "$master_port" \
    train.py "$@"
