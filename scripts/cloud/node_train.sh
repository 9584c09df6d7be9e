#!/usr/bin/env bash
# One node of a multi-node DDP run: start torchrun here with this node's rank, then src/train.py trainer=ddp.
#
#   bash scripts/cloud/node_train.sh [hydra overrides...]
#
# Node layout, from SkyPilot's variables, or set by hand / by scripts/cloud/launch_hosts.sh:
#   NNODES          number of nodes          (SkyPilot: SKYPILOT_NUM_NODES)
#   NODE_RANK       this node's rank, 0..N-1 (SkyPilot: SKYPILOT_NODE_RANK)
#   MASTER_ADDR     node 0's address         (SkyPilot: first line of SKYPILOT_NODE_IPS)
#   NPROC_PER_NODE  processes on this node   (SkyPilot: SKYPILOT_NUM_GPUS_PER_NODE; 0 GPUs -> 1 CPU process)
#   MASTER_PORT     rendezvous port on node 0 (29500)
#   RUN_ID          shared by all nodes; names the run directory (SkyPilot: SKYPILOT_TASK_ID; else MASTER_PORT)
#   PYTHON          interpreter (python)
set -euo pipefail
cd "$(dirname "$0")/../.."

NNODES="${NNODES:-${SKYPILOT_NUM_NODES:-1}}"
NODE_RANK="${NODE_RANK:-${SKYPILOT_NODE_RANK:-0}}"
MASTER_ADDR="${MASTER_ADDR:-$(printf '%s\n' "${SKYPILOT_NODE_IPS:-127.0.0.1}" | head -n 1)}"
NPROC_PER_NODE="${NPROC_PER_NODE:-${SKYPILOT_NUM_GPUS_PER_NODE:-$(nvidia-smi -L 2>/dev/null | wc -l)}}"
[ "$NPROC_PER_NODE" -gt 0 ] || NPROC_PER_NODE=1
MASTER_PORT="${MASTER_PORT:-29500}"
RUN_ID="${RUN_ID:-${SKYPILOT_TASK_ID:-none}}"

echo "node $NODE_RANK/$NNODES: $NPROC_PER_NODE processes, master $MASTER_ADDR:$MASTER_PORT, run id $RUN_ID"
exec "${PYTHON:-python}" -m torch.distributed.run \
  --nnodes="$NNODES" --node_rank="$NODE_RANK" --nproc_per_node="$NPROC_PER_NODE" \
  --master_addr="$MASTER_ADDR" --master_port="$MASTER_PORT" --rdzv_id="$RUN_ID" \
  src/train.py trainer=ddp trainer.devices="$NPROC_PER_NODE" trainer.num_nodes="$NNODES" "$@"
