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

# run_variant OUT ALGORITHM [jaxfed arguments...]; a failure (a diverged run, say) is reported,
# the script goes on and exits 1 at the end. An interrupted variant (Ctrl-C) stops the script.
# A variant whose OUT exists is resumed (jaxfed's --resume): running the same command again
# continues an interrupted script, skips what finished and refuses a changed setting. With
# VARIANTS=a,b (variant names: OUT's last part) only those run; the report still takes every
# finished variant in the directory (a table split across sessions).
seen_variants=() ran_dirs=() failed=()
run_variant() {
  local out=$1; shift
  local name status=0 resume=()
  name=$(basename "$out")
  seen_variants+=("$name")
  [[ -z ${VARIANTS:-} || ",$VARIANTS," == *",$name,"* ]] || return 0
  ran_dirs+=("$(dirname "$out")")
  [[ -d $out ]] && resume=(--resume)
  if [[ -n ${SEEDS:-} ]]; then
    jaxfed sweep "$@" --seeds "$SEEDS" --quiet --out "$out" "${resume[@]}" || status=$?
  else
    jaxfed run "$@" --quiet --out "$out" "${resume[@]}" || status=$?
  fi
  if [[ $status -eq 130 ]]; then
    echo "run.sh: interrupted in $out; the same command continues from its last checkpoint" >&2
    exit 130
  fi
  if [[ $status -ne 0 ]]; then
    echo "run.sh: $out failed (exit $status)" >&2
    failed+=("$out")
  fi
}

# At the script's end: a name in VARIANTS that no run_variant call had is an error (exit 2), and
# so is a variant that failed (exit 1); the reports of the rest are written by then.
_finish_run_script() {
  local status=$? name unknown=()
  [[ $status -ne 0 ]] && return
  if [[ -n ${VARIANTS:-} ]]; then
    for name in ${VARIANTS//,/ }; do
      [[ " ${seen_variants[*]} " == *" $name "* ]] || unknown+=("$name")
    done
    if [[ ${#unknown[@]} -gt 0 ]]; then
      echo "run.sh: VARIANTS: unknown ${unknown[*]}; this script's variants: $(printf '%s\n' "${seen_variants[@]}" | sort -u | paste -sd, -)" >&2
      exit 2
    fi
  fi
  if [[ ${#failed[@]} -gt 0 ]]; then
    echo "run.sh: ${#failed[@]} variant(s) failed: ${failed[*]}" >&2
    exit 1
  fi
}
trap _finish_run_script EXIT

# report_variants DIR [CLAIM...] [--OPTION=VALUE...]: every variant directory in DIR (but report/)
# into DIR/report; a CLAIM is 'A>B' ("variant A beats B") or 'A>B-0.03' ("A at most 0.03 below
# B"); jaxfed report options pass through as written (--paper=fedavg=84.39, --relative-to=fedavg).
# Variants that did not finish are left out, and so are the claims and paper numbers naming them.
# With VARIANTS, a directory where none of them ran keeps its report as it was.
report_variants() {
  local dir=$1; shift
  local variants=() names=() options=() name arg
  if [[ -n ${VARIANTS:-} && " ${ran_dirs[*]} " != *" $dir "* ]]; then
    echo "run.sh: VARIANTS=$VARIANTS ran nothing in $dir; its report is left as it was" >&2
    return 0
  fi
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
      echo "run.sh: '$1' left out of the report: $part has no finished run there" >&2
      return 1
    fi
  done
}
