#!/usr/bin/env bash
# FedAvg, FedProx and Local on MNIST (FedAvg CNN), 100 clients, 10 per round, Dirichlet 0.5.
# Run directories: $RUNS/<algorithm> (RUNS defaults to runs/baselines_mnist).
# Usage: experiments/baselines_mnist.sh DATA_DIR [--set key=value ...]
set -euo pipefail
[[ $# -gt 0 ]] || { echo "usage: experiments/baselines_mnist.sh DATA_DIR [--set key=value ...]" >&2; exit 2; }
data_dir=$1; shift
runs=${RUNS:-runs/baselines_mnist}
for algorithm in fedavg fedprox local; do
  jaxfed run "$algorithm" --dataset mnist --data-dir "$data_dir" --quiet --out "$runs/$algorithm" \
    --set num_clients=100 --set participation=0.1 --set rounds=30 --set local_epochs=1 --set eval_every=10 "$@"
done
