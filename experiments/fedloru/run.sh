#!/usr/bin/env bash
# FedLoRU against FedLoRA (the same low-rank model, never accumulated) and FedAvg; pFedLoRU
# (personal + global low-rank pairs) against pFedLoRA (full-rank global model + personal LoRA, both
# trained together, App. C.4) and mFedLoRU (nested ranks per tier) against FedHM.
# Usage: experiments/fedloru/run.sh DATA_DIR [reduced] [-- --set key=value ...]
#   reduced: MNIST / FedAvg CNN, 100 clients, 20% per round, 60 rounds (see reduced.conf)
# SEEDS=0,1,2: each variant over those seeds (jaxfed sweep), then $RUNS/<setting>/report/ (mean ±
# std, per-seed values, spread plot, verdicts of fedloru > fedlora and mfedloru > fedhm; FedLoRU
# "within a few points of FedAvg at a fraction of the upload" reads off the table).
# Run directories: $RUNS/<setting>/<variant> (RUNS defaults to runs/fedloru); summary.json in each.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "$here/../lib.sh"
read_run_args fedloru "$@"
set -- "${extra_args[@]}"
require_conf
for variant in fedavg fedlora fedloru pfedloru mfedloru fedhm pfedlora; do
  run_variant "$runs/$setting/$variant" "$variant" --config "$here/$setting.conf" --data-dir "$data_dir" "$@"
done
# "Within a few points of FedAvg" is judged as at most 3 points below it.
# pFedLoRU against pFedLoRA: Table 3 (CIFAR-100, two non-IID levels; 49.65 and 46.50 against 47.45 and 42.28).
report_variants "$runs/$setting" "fedloru>fedavg-0.03" "fedloru>fedlora" "mfedloru>fedhm" "pfedloru>fedloru" \
  "pfedloru>pfedlora" --relative-to=fedavg
