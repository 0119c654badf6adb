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
# and the script goes on. With VARIANTS=a,b (variant names: OUT's last part) only those run; the
# report still takes every finished variant in the directory (a table split across sessions).
run_variant() {
  local out=$1; shift
  [[ -z ${VARIANTS:-} || ",$VARIANTS," == *",$(basename "$out"),"* ]] || return 0
  if [[ -n ${SEEDS:-} ]]; then
    jaxfed sweep "$@" --seeds "$SEEDS" --quiet --out "$out" || echo "run.sh: $out failed (exit $?)" >&2
  else
    jaxfed run "$@" --quiet --out "$out" || echo "run.sh: $out failed (exit $?)" >&2
  fi
}

# report_variants DIR [CLAIM...] [--OPTION=VALUE...]: every variant directory in DIR (but report/)
# into DIR/report; a CLAIM is 'A>B' ("variant A beats B") or 'A>B-0.03' ("A at most 0.03 below
# B"); jaxfed report options pass through as written (--paper=fedavg=84.39, --relative-to=fedavg).
# Variants that did not finish are left out, and so are the claims and paper numbers naming them.
report_variants() {
  local dir=$1; shift
  local variants=() names=() options=() name arg
  for path in "$dir"/*/; do
    name=$(basename "$path")
    [[ $name == report ]] && continue
    if [[ -f $path/summary.json ]] || compgen -G "$path*/summary.json" > /dev/null; then
      variants+=("$name=$path")
      names+=("$name")
    fi
  done
  if [[ ${#variants[@]} -eq 0 ]]; then
    echo "run.sh: no variant in $dir finished; no report" >&2
    return 0
  fi
  for arg in "$@"; do
    if [[ $arg == --* ]]; then
      _names_finished "${arg#*=}" && options+=("$arg")
    else
      _names_finished "$arg" && options+=(--claim "$arg")
    fi
  done
  jaxfed report "${variants[@]}" "${options[@]}" --out "$dir/report" || echo "run.sh: no report for $dir" >&2
}

# _names_finished TEXT: TEXT (a claim 'A>B[-M]', 'VARIANT=NUMBER' or 'VARIANT') names only
# variants in $names; otherwise a note on stderr.
_names_finished() {
  local text=$1 part
  text=${text%%=*}
  for part in ${text//>/ }; do
    part=${part%-[0-9.]*}
    if [[ " ${names[*]} " != *" $part "* ]]; then
      echo "run.sh: '$1' left out of the report: $part did not finish" >&2
      return 1
    fi
  done
}
