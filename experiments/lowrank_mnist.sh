#!/usr/bin/env bash
# The FedLoRU family and FedHM against FedAvg on MNIST (FedAvg CNN): 100 clients, 20 per round,
# Dirichlet 0.5, 30 rounds, 1 local epoch, batch 32, constant lr 0.05 without momentum, LoRA rank 16,
# accumulation every 10 rounds (ALGORITHM.key applies a key to that algorithm only). The FedLoRU
# family's own defaults (momentum, clipping, weight decay, cosine schedule) are pinned off, so every
# algorithm trains alike, as the docs/results.md table was measured.
# Run directories: $RUNS/<algorithm> (RUNS defaults to runs/lowrank_mnist).
# Usage: experiments/lowrank_mnist.sh DATA_DIR [ALGORITHM ...] [-- --set key=value ...]
set -euo pipefail
[[ $# -gt 0 ]] || { echo "usage: experiments/lowrank_mnist.sh DATA_DIR [ALGORITHM ...] [-- --set key=value ...]" >&2; exit 2; }
data_dir=$1; shift
runs=${RUNS:-runs/lowrank_mnist}
algorithms=()
while [[ $# -gt 0 && $1 != "--" ]]; do algorithms+=("$1"); shift; done
[[ $# -gt 0 ]] && shift
[[ ${#algorithms[@]} -eq 0 ]] && algorithms=(fedavg fedlora fedloru pfedloru mfedloru fedhm)
for algorithm in "${algorithms[@]}"; do
  jaxfed run "$algorithm" --dataset mnist --data-dir "$data_dir" --quiet --out "$runs/$algorithm" \
    --set num_clients=100 participation=0.2 rounds=30 local_epochs=1 lr=0.05 batch_size=32 momentum=0 \
    --set clip_norm=0 weight_decay=0 lr_schedule=constant \
    --set eval_every=10 checkpoint_every=0 \
    --set {fedlora,fedloru,pfedloru,mfedloru}.lora_rank=16 {fedloru,pfedloru,mfedloru}.accumulate_every=10 "$@"
done
