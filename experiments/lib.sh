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
# the script goes on and exits 1 at the end. A variant stopped by a signal (Ctrl-C: jaxfed exits
# 130) stops the script. Running the same command again goes on where it stopped: a sweep
# directory (SEEDS) is resumed (jaxfed sweep --resume: finished members skipped), a run with a
# checkpoint is resumed (jaxfed run --resume: a finished one is left as it is), a run that finished
# without checkpoints is skipped, and one stopped before its first checkpoint starts again. A
# setting changed since is refused by the resume, naming the key. With VARIANTS=a,b (variant
# names: OUT's last part) only those run; the report still takes every finished variant in the
# directory (a table split across sessions).
seen_variants=() ran_dirs=() failed=() _listing=""
# listing: true while the script runs as a listing of its variants (below); a script skips work
# other than run_variant and report_variants under it (`listing || python prepare.py`).
listing() { [[ -n ${_RUN_SH_LISTING:-} ]]; }
run_variant() {
  local out=$1; shift
  local name status=0 resume=()
  name=$(basename "$out")
  seen_variants+=("$name")
  if listing; then echo "$name" >> "$_RUN_SH_LISTING"; return 0; fi
  [[ -z ${VARIANTS:-} || ",$VARIANTS," == *",$name,"* ]] || return 0
  ran_dirs+=("$(dirname "$out")")
  if [[ -n ${SEEDS:-} ]]; then
    [[ -d $out ]] && resume=(--resume)  # jaxfed sweep --resume sorts out each member
    jaxfed sweep "$@" --seeds "$SEEDS" --quiet --out "$out" "${resume[@]}" || status=$?
  else
    if [[ -n $(ls -A "$out/checkpoints" 2> /dev/null) ]]; then
      resume=(--resume)
    elif [[ -f $out/summary.json ]]; then
      echo "run.sh: $out finished already, without a checkpoint to go on from: skipped (delete it to run it again)" >&2
      return 0
    fi
    jaxfed run "$@" --quiet --out "$out" "${resume[@]}" || status=$?
  fi
  if [[ $status -ge 128 ]]; then  # stopped by a signal: 128 + its number (130: Ctrl-C)
    echo "run.sh: $out stopped (exit $status); the same command goes on from there" >&2
    exit "$status"
  fi
  if [[ $status -ne 0 ]]; then
    echo "run.sh: $out failed (exit $status)" >&2
    failed+=("$out")
  fi
}

# _refuse_unknown_variants NAME...: a name in VARIANTS that is not among the script's variants
# (NAME...) is an error (exit 2) naming them.
_refuse_unknown_variants() {
  local name unknown=()
  [[ -n ${VARIANTS:-} ]] || return 0
  for name in ${VARIANTS//,/ }; do
    [[ " $* " == *" $name "* ]] || unknown+=("$name")
  done
  if [[ ${#unknown[@]} -gt 0 ]]; then
    echo "run.sh: VARIANTS: unknown ${unknown[*]}; this script's variants: $(printf '%s\n' "$@" | sort -u | paste -sd, -)" >&2
    exit 2
  fi
}

# At the script's end: a variant that failed is an error (exit 1), and so is a name in VARIANTS
# that no run_variant call had (exit 2: where the script could not be listed up front, below);
# the reports of the rest are written by then.
_finish_run_script() {
  local status=$?
  [[ -z $_listing ]] || rm -f "$_listing"
  [[ $status -ne 0 ]] && return
  [[ ${#failed[@]} -gt 0 ]] && echo "run.sh: ${#failed[@]} variant(s) failed: ${failed[*]}" >&2
  _refuse_unknown_variants "${seen_variants[@]}"
  [[ ${#failed[@]} -eq 0 ]] || exit 1
}
trap _finish_run_script EXIT

# With VARIANTS, the script (its file, $0, with its arguments) first runs as a listing, where
# run_variant only writes its variant's name and report_variants does nothing (and what else the
# script does is skipped under `listing`): a name that is none of them stops it before its first
# run, not when the runs before it have finished. A script that fails as a listing (a usage
# mistake) is left to fail in the real run, with its own message.
_list_variants_first() {
  local names listed=0
  [[ -n ${VARIANTS:-} && -z ${_RUN_SH_LISTING:-} && -f $0 ]] || return 0
  _listing=$(mktemp)  # removed here, or by _finish_run_script if the listing is interrupted
  VARIANTS="" _RUN_SH_LISTING=$_listing bash "$0" "$@" > /dev/null 2>&1 && listed=1
  names=$(sort -u "$_listing")
  rm -f "$_listing"
  _listing=""
  if [[ $listed == 1 ]]; then
    # shellcheck disable=SC2086  # variant names are words
    _refuse_unknown_variants $names
  fi
}
_list_variants_first "$@"

# report_variants DIR [CLAIM...] [--OPTION=VALUE...]: every variant directory in DIR (but report/)
# into DIR/report; a CLAIM is 'A>B' ("variant A beats B") or 'A>B-0.03' ("A at most 0.03 below
# B"); jaxfed report options pass through as written (--paper=fedavg=84.39, --relative-to=fedavg).
# Variants that did not finish are left out, and so are the claims and paper numbers naming them.
# With VARIANTS, a directory where none of them ran keeps its report as it was.
report_variants() {
  local dir=$1; shift
  local variants=() names=() options=() name arg
  if listing; then return 0; fi
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
