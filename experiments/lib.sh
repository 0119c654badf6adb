# Shared by the papers' run.sh scripts (sourced): a variant as one run, or as a sweep over the
# seeds in $SEEDS (e.g. SEEDS=0,1,2: one compiled program, a run directory per seed), and the
# report of a setting's variants (jaxfed report: mean ± std over seeds, per-seed CSV/JSON, the
# curves with their spread, and a verdict per claim).

# read_run_args PAPER DATA_DIR [SETTING] [-- --set key=value ...]: sets data_dir, setting (default
# reduced), runs ($RUNS, default runs/PAPER) and extra_args (what follows --, for every run).
read_run_args() {
  local paper=$1; shift
  [[ $# -gt 0 ]] || { echo "run.sh: usage: run.sh DATA_DIR [SETTING] [-- --set key=value ...]" >&2; exit 2; }
  data_dir=$1; shift
  setting=reduced
  if [[ $# -gt 0 && $1 != "--" ]]; then setting=$1; shift; fi
  [[ ${1:-} == "--" ]] && shift
  extra_args=("$@")
  runs=${RUNS:-runs/$paper}
}

# require_conf: the setting must name a config file beside the script ($here/<setting>.conf).
require_conf() {
  if [[ ! -f "$here/$setting.conf" ]]; then
    local allowed
    allowed=$(cd "$here" && ls -- *.conf | sed 's/\.conf$//' | paste -sd, -)
    echo "run.sh: unknown setting '$setting'; allowed: $allowed" >&2
    exit 2
  fi
}

# run_variant OUT ALGORITHM [jaxfed arguments...]; a failure (a diverged run, say) is reported
# and the script goes on.
run_variant() {
  local out=$1; shift
  if [[ -n ${SEEDS:-} ]]; then
    jaxfed sweep "$@" --seeds "$SEEDS" --quiet --out "$out" || echo "run.sh: $out failed (exit $?)" >&2
  else
    jaxfed run "$@" --quiet --out "$out" || echo "run.sh: $out failed (exit $?)" >&2
  fi
}

# report_variants DIR [CLAIM...]: every variant directory in DIR (but report/) into DIR/report;
# a CLAIM is 'A>B' ("variant A beats B"). Variants that did not finish are left out.
report_variants() {
  local dir=$1; shift
  local variants=() claims=() name
  for path in "$dir"/*/; do
    name=$(basename "$path")
    [[ $name == report ]] && continue
    if [[ -f $path/summary.json ]] || compgen -G "$path*/summary.json" > /dev/null; then
      variants+=("$name=$path")
    fi
  done
  for claim in "$@"; do claims+=(--claim "$claim"); done
  jaxfed report "${variants[@]}" "${claims[@]}" --out "$dir/report" || echo "run.sh: no report for $dir" >&2
}
