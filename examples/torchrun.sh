#!/bin/bash
# AutoSP under torchrun (Lightning detects TorchElasticEnvironment).
#
# One node, 2 CPU processes, the demo job:
#   bash examples/torchrun.sh
# Several nodes: run on each node with its --node_rank and the same --master_addr, e.g.
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 NPROC=8 CONFIG=configs/llama_sp8.yaml bash examples/torchrun.sh
set -euo pipefail
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
NPROC=${NPROC:-2}
CONFIG=${CONFIG:-configs/demo_cpu.yaml}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}

torchrun --nnodes="$NNODES" --node_rank="$NODE_RANK" --nproc_per_node="$NPROC" \
  --master_addr="$MASTER_ADDR" --master_port="$MASTER_PORT" \
  -m lightning_autosp.cli fit --config "$CONFIG" \
  --trainer.num_nodes="$NNODES" --trainer.devices="$NPROC"
