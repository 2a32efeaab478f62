#!/usr/bin/env bash
# One node's share of a multi-node `pretrain train`: torchrun starts this node's ranks, resuming from the
# newest checkpoint in the (shared) checkpoint directory, so a requeued or restarted job continues the run.
# SLURM (pretrain.sbatch), Kubernetes (jobset.yaml) and SkyPilot (skypilot.yaml) all run this same line.
#
#   NNODES, GPUS_PER_NODE, MASTER_ADDR (the first node), MASTER_PORT (29500),
#   NODE_RANK (else SLURM_NODEID, JOB_COMPLETION_INDEX or SKYPILOT_NODE_RANK),
#   RUN_ID (the run lock's job id where there is no SLURM_JOB_ID: a restart takes over its own lock),
#   PREEMPT_TIMEOUT_S (120: [train].preempt_timeout_s; torchrun gives its ranks that long to save after a SIGTERM)
#   PRETRAIN_COMMAND (train; certify: the layout certified on the nodes, before the long job)
#   tools/cluster/node.sh CONFIG [--set key=value ...]
set -euo pipefail
config=${1:?usage: tools/cluster/node.sh CONFIG [--set key=value ...]}
shift
node_rank=${NODE_RANK:-${SLURM_NODEID:-${JOB_COMPLETION_INDEX:-${SKYPILOT_NODE_RANK:?NODE_RANK is not set}}}}
# the checkout's materialised environment, not `uv run`: no node syncs it while another node starts from it
python=${PRETRAIN_PYTHON:-.venv/bin/python}
case ${PRETRAIN_COMMAND:-train} in
train) set -- train "$config" --set checkpoint.resume=true "$@" ;;
certify) set -- certify "$config" "$@" ;;
*) echo "error: PRETRAIN_COMMAND=${PRETRAIN_COMMAND} is not train or certify" >&2; exit 2 ;;
esac
# torchrun's stderr through pretrain's console filter: its C++ frames and its own report after a rank's
# `error:` line go to the run's log dir, the line naming a failed (e.g. dead) rank stays the console's last.
# Static rendezvous on the first node: node N's ranks are N*GPUS_PER_NODE.., so global rank 0 (which holds the
# run lock) is on MASTER_ADDR. exec: torchrun receives the scheduler's SIGTERM itself and passes it to the ranks.
exec "$python" -m torch.distributed.run --nnodes="${NNODES:?}" --node-rank="$node_rank" \
  --nproc-per-node="${GPUS_PER_NODE:?}" --master-addr="${MASTER_ADDR:?}" --master-port="${MASTER_PORT:-29500}" \
  --rdzv-id="${RUN_ID:-none}" --shutdown-timeout="${PREEMPT_TIMEOUT_S:-120}" \
  -m pretrain "$@" 2> >("$python" -m pretrain.runtime.console_filter >&2)
