#!/usr/bin/env bash
# FedARA (lambda > 0), its lambda = 0 ablation and FedHM over the same tiers.
# Usage: experiments/fedara/run.sh DATA_DIR [SETTING] [-- --set key=value ...]
#   SETTING: reduced (default; Fashion-MNIST, about 10 minutes per run on 2 CPU cores, 3 runs),
#   cifar10_dir, cifar10_pat, cifar100_dir, cifar100_pat (the paper's: an accelerator's job)
# Run directories: $RUNS/<setting>/<variant> (RUNS defaults to runs/fedara); summary.json in each.
set -euo pipefail
data_dir=$1; shift
setting=${1:-reduced}; [[ $# -gt 0 ]] && shift
[[ ${1:-} == "--" ]] && shift
here=$(cd "$(dirname "$0")" && pwd)
runs=${RUNS:-runs/fedara}
[[ -f "$here/$setting.conf" ]] || { echo "run.sh: unknown setting '$setting'; see $here/*.conf" >&2; exit 2; }
for variant in fedara fedara_lambda0 fedhm; do
  case $variant in
    fedara_lambda0) args=(fedara --set lambda=0) ;;
    *) args=("$variant") ;;
  esac
  # A run that fails (a diverged one, say) is reported and the sweep goes on.
  jaxfed run "${args[@]}" --config "$here/$setting.conf" --data-dir "$data_dir" --quiet \
    --out "$runs/$setting/$variant" "$@" || echo "run.sh: $variant failed (exit $?)" >&2
done
