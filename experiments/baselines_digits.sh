#!/usr/bin/env bash
# FedAvg, FedProx and Local on the embedded digits data: the README's results table.
set -euo pipefail
for algorithm in fedavg fedprox local; do
  jaxfed run "$algorithm" --quiet --out "${RUNS:-runs/baselines_digits}/$algorithm" --set rounds=50 "$@"
done
