#!/usr/bin/env bash
# FedCSPACK against FedAvg, FedProx, MOON, FedNTD and FedSPU (its Table 1), and its weight ablation
# (|cos + KL|, |cos|, |KL|).
# Usage: experiments/fedcspack/run.sh DATA_DIR [reduced|fmnist|fmnist_authors|fmnist_authors_data|cifar10] [-- --set key=value ...]
#   reduced: Fashion-MNIST, 30 rounds of 2 epochs (2 CPU cores: about 7 minutes per run; with SEEDS=0,1,2 about 20 minutes per variant, 8 variants)
#   fmnist, cifar10: the paper's settings (100 rounds of 5 epochs: an accelerator's job)
#   fmnist_authors: fmnist as the authors' code runs it (fixed cohort, merge=full, all_below, E=3, drop_last;
#     100 rounds of 3 epochs: about 30 minutes per run on 2 CPU cores)
#   fmnist_authors_data: fmnist_authors on the authors' own clients and model (authors_data.py; about 13
#     minutes per run)
# SEEDS=0,1,2: each variant over those seeds (jaxfed sweep), then $RUNS/<setting>/report/ (mean ±
# std, per-seed values, spread plot, verdicts of the paper's claims).
# Run directories: $RUNS/<setting>/<variant> (RUNS defaults to runs/fedcspack); summary.json in each.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "$here/../lib.sh"
read_run_args fedcspack "$@"
set -- "${extra_args[@]}"
require_conf
configs=(--config "$here/$setting.conf")
if [[ $setting == fmnist_authors_data ]]; then  # the authors' own clients, drawn once beside the runs
  authors="$runs/$setting/data"
  [[ -f $authors/authors_parts.npz ]] || listing || python "$here/authors_data.py" "$data_dir" "$authors" > /dev/null
  data_dir=$authors
  configs=(--config "$here/fmnist_authors.conf" "${configs[@]}"
    --set "partition_file=$authors/authors_parts.npz" "model=$here/models.py:AuthorsFMNISTCNN")
fi
for variant in fedcspack fedavg fedcspack_cos fedcspack_kl fedprox moon fedntd fedspu; do
  case $variant in
    fedcspack_cos) args=(fedcspack --set weight=cos) ;;
    fedcspack_kl) args=(fedcspack --set weight=kl) ;;
    *) args=("$variant") ;;
  esac
  run_variant "$runs/$setting/$variant" "${args[@]}" "${configs[@]}" --data-dir "$data_dir" "$@"
done
# The paper's numbers: Table 1 (percent; the Fashion-MNIST Dir 0.3 column, or the CIFAR-10 Dir 0.3
# column for the cifar10 setting) and Table 3 (the weight ablation, on CIFAR-10 Dir 0.5, round 100).
case $setting in
  cifar10) t1=(73.23 69.71 69.58 70.03 70.32 67.38); column="Table 1, CIFAR-10" ;;
  *) t1=(88.13 84.39 84.39 85.44 84.35 85.29); column="Table 1" ;;
esac
report_variants "$runs/$setting" "fedcspack>fedavg" "fedcspack>fedcspack_cos" "fedcspack>fedcspack_kl" \
  "fedcspack>fedprox" "fedcspack>moon" "fedcspack>fedntd" "fedcspack>fedspu" \
  --relative-to=fedavg "--paper=fedcspack=${t1[0]} ($column); 0.79 (Table 3)" "--paper=fedavg=${t1[1]} ($column)" \
  "--paper=fedprox=${t1[2]} ($column)" "--paper=moon=${t1[3]} ($column)" "--paper=fedntd=${t1[4]} ($column)" \
  "--paper=fedspu=${t1[5]} ($column)" \
  "--paper=fedcspack_cos=0.74 (Table 3)" "--paper=fedcspack_kl=0.69 (Table 3)"
