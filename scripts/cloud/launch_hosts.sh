#!/usr/bin/env bash
# One torchrun per host, over ssh: the node rank is the host's position in HOSTS, node 0 is the master.
#
#   HOSTS="10.0.0.1 10.0.0.2" bash scripts/cloud/launch_hosts.sh [hydra overrides...]
#
# Every host runs scripts/cloud/node_train.sh in REMOTE_DIR (put the code there with `make sync`).
#   HOSTS          hosts, in node-rank order (required)
#   NPROC_PER_NODE processes per host (default: the host's GPU count, or 1 without GPUs)
#   SSH            the command that runs a command line on a host (ssh): $SSH [-i SSH_KEY] SSH_OPTS [SSH_USER@]host 'cmd'
#                  (tests put a stand-in here that runs the command line on this machine)
#   SSH_USER, SSH_KEY, SSH_OPTS   how to reach the hosts
#   REMOTE_DIR     the repo on the hosts, relative to the remote home or absolute (default: this directory's path)
#   REMOTE_SETUP   run first on each host (default: make install)
#   MASTER_PORT, PYTHON, RUN_ID   passed to every node (RUN_ID: one run directory name for all nodes)
set -euo pipefail
cd "$(dirname "$0")/../.."

read -r -a hosts <<< "${HOSTS:?set HOSTS=\"ip1 ip2 ...\" (node 0 first)}"
master="${hosts[0]}"
run_id="${RUN_ID:-hosts-$(date +%Y%m%d-%H%M%S)}"
remote_dir="${REMOTE_DIR:-$PWD}"
overrides="$(printf '%q ' "$@")"

pids=()
for rank in "${!hosts[@]}"; do
  host="${hosts[$rank]}"
  env_vars="NNODES=${#hosts[@]} NODE_RANK=$rank MASTER_ADDR=$master MASTER_PORT=${MASTER_PORT:-29500} RUN_ID=$run_id"
  [ -n "${NPROC_PER_NODE:-}" ] && env_vars+=" NPROC_PER_NODE=$NPROC_PER_NODE"
  [ -n "${PYTHON:-}" ] && env_vars+=" PYTHON=$(printf '%q' "$PYTHON")"
  cmd="cd $(printf '%q' "$remote_dir") && ${REMOTE_SETUP:-make install} && $env_vars bash scripts/cloud/node_train.sh $overrides"
  echo "[launch-hosts] node $rank on $host: $cmd"
  # shellcheck disable=SC2086  # SSH and SSH_OPTS are word lists
  ${SSH:-ssh} ${SSH_KEY:+-i "$SSH_KEY"} ${SSH_OPTS:-} "${SSH_USER:+$SSH_USER@}$host" "$cmd" 2>&1 \
    | sed -u "s/^/[node $rank] /" &
  pids+=($!)
done

status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit "$status"
