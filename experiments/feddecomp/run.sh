#!/usr/bin/env bash
# FedDecomp (alternating and simultaneous) against FedAvg and Local over the paper's alphas.
# Usage: experiments/feddecomp/run.sh DATA_DIR [reduced|cifar10] [-- --set key=value ...]
#   reduced: Fashion-MNIST, alpha 0.1 and 0.5 (2 CPU cores, SEEDS=0,1,2: 6-9 minutes per variant, 31 per alpha)
#   cifar10: the paper's CIFAR-10 / ResNet-8 setting, alpha 0.1, 0.5 and 1.0 (an accelerator's job)
# SEEDS=0,1,2: each variant over those seeds (jaxfed sweep), then $RUNS/<setting>/alpha<alpha>/report/
# (mean ± std, per-seed values, spread plot, verdicts of the paper's claims).
# ALPHAS=0.1: only those alphas (comma-separated), e.g. to split a CPU run across sessions.
# Run directories: $RUNS/<setting>/alpha<alpha>/<variant> (RUNS defaults to runs/feddecomp);
# summary.json in each.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "$here/../lib.sh"
read_run_args feddecomp "$@"
set -- "${extra_args[@]}"
case $setting in
  reduced) alphas=(0.1 0.5) ;;
  cifar10) alphas=(0.1 0.5 1.0) ;;
  *) echo "run.sh: unknown setting '$setting'; allowed: reduced, cifar10" >&2; exit 2 ;;
esac
[[ -n ${ALPHAS:-} ]] && IFS=, read -r -a alphas <<< "$ALPHAS"
for alpha in "${alphas[@]}"; do
  for variant in feddecomp feddecomp_simultaneous fedavg local; do
    algorithm=${variant%_simultaneous}
    extra=(); [[ $variant == feddecomp_simultaneous ]] && extra=(--set schedule=simultaneous)
    run_variant "$runs/$setting/alpha$alpha/$variant" "$algorithm" --config "$here/$setting.conf" \
      --data-dir "$data_dir" --set alpha="$alpha" "${extra[@]}" "$@"
  done
  # The paper's numbers: CIFAR-10 / ResNet-8, Table 1 (and Table 3 for the simultaneous schedule, alpha 0.1).
  paper=()
  case $alpha in
    0.1) paper=(--paper=feddecomp=85.47 --paper=feddecomp_simultaneous=85.45 --paper=fedavg=60.39 --paper=local=81.91) ;;
    0.5) paper=(--paper=feddecomp=72.78 --paper=fedavg=60.41 --paper=local=60.15) ;;
    1.0) paper=(--paper=feddecomp=69.09 --paper=fedavg=60.91 --paper=local=52.24) ;;
  esac
  report_variants "$runs/$setting/alpha$alpha" "feddecomp>fedavg" "feddecomp>local" "feddecomp>feddecomp_simultaneous" \
    "${paper[@]}"
done
