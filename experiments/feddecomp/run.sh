#!/usr/bin/env bash
# FedDecomp (alternating and simultaneous) against FedAvg, Local and the personalized baselines of
# its Table 1 that jaxfed has (FedRep, FedPer, FedRoD; FedBN on cifar10, whose ResNet-8 has
# normalization layers: the reduced setting's CNN has none) over the paper's alphas.
# Usage: experiments/feddecomp/run.sh DATA_DIR [reduced|cifar10] [-- --set key=value ...]
#   reduced: Fashion-MNIST, alpha 0.1 and 0.5 (2 CPU cores, SEEDS=0,1,2: 6-9 minutes per variant, 7 variants
#   per alpha: about 55 minutes)
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
  variants=(feddecomp feddecomp_simultaneous fedavg local fedrep fedper fedrod)
  [[ $setting == cifar10 ]] && variants+=(fedbn)
  for variant in "${variants[@]}"; do
    algorithm=${variant%_simultaneous}
    extra=(); [[ $variant == feddecomp_simultaneous ]] && extra=(--set schedule=simultaneous)
    run_variant "$runs/$setting/alpha$alpha/$variant" "$algorithm" --config "$here/$setting.conf" \
      --data-dir "$data_dir" --set alpha="$alpha" "${extra[@]}" "$@"
  done
  # The paper's numbers: CIFAR-10 / ResNet-8, Table 1 (and Table 3 for the simultaneous schedule, alpha 0.1).
  paper=(); fedbn=
  case $alpha in
    0.1) paper=(--paper=feddecomp=85.47 --paper=feddecomp_simultaneous=85.45 --paper=fedavg=60.39 --paper=local=81.91
                --paper=fedrep=84.59 --paper=fedper=84.43 --paper=fedrod=86.23); fedbn=83.55 ;;
    0.5) paper=(--paper=feddecomp=72.78 --paper=fedavg=60.41 --paper=local=60.15
                --paper=fedrep=67.69 --paper=fedper=68.80 --paper=fedrod=72.34); fedbn=66.79 ;;
    1.0) paper=(--paper=feddecomp=69.09 --paper=fedavg=60.91 --paper=local=52.24
                --paper=fedrep=60.52 --paper=fedper=64.92 --paper=fedrod=68.45); fedbn=62.20 ;;
  esac
  claims=("feddecomp>fedavg" "feddecomp>local" "feddecomp>feddecomp_simultaneous" "feddecomp>fedrep" "feddecomp>fedper"
          "feddecomp>fedrod")
  if [[ $setting == cifar10 ]]; then
    claims+=("feddecomp>fedbn")
    [[ -n $fedbn ]] && paper+=(--paper=fedbn=$fedbn)
  fi
  report_variants "$runs/$setting/alpha$alpha" "${claims[@]}" "${paper[@]}"
done
