"""Run directories as plain records, for a table: ``pandas.DataFrame(jaxfed.load_runs(dirs))``.

:func:`load_runs` reads run directories (``jaxfed run``'s, ``jaxfed sweep``'s members,
``run_simulation``'s; a directory of run directories, such as a sweep's, stands for those below
it) into a list of flat dicts, one per evaluated metrics row (``per="row"``) or one per run
(``per="run"``: its ``summary.json``). A record holds the run's config keys with the algorithm's
options beside them (:func:`~jaxfed.runs.plots.flat_config`), nested values flattened to dotted
keys (``data.train_examples``) and lists as tuples (hashable: a column to group by), the run
directory's path (``run_dir``), then the row's (or summary's) metrics, which win over a config
key of the same name (a summary's None does not hide a config value: ``run_simulation``'s
summary has no ``partition`` where its caller's config may). It reads files only: no JAX, and
no pandas (a list of dicts is what ``pandas.DataFrame`` takes).
"""

from __future__ import annotations

from pathlib import Path

from jaxfed.errors import ConfigError, unknown_choice
from jaxfed.runs.plots import flat_config, read_json, read_run, with_members

PER = ("row", "run")


def load_runs(dirs, per: str = "row") -> list[dict]:
    """The records of the run directories ``dirs`` (one path or several; a directory holding run
    directories, e.g. a sweep's, gives each of them): ``per="row"``, one record per evaluated
    row of ``metrics.jsonl``; ``per="run"``, one per run, with its ``summary.json`` (``finished``
    says whether there is one; an unfinished run's record has its config alone)."""
    if per not in PER:
        raise ConfigError(f"per: {unknown_choice(per, PER)}")
    records = []
    for run_dir in run_directories(dirs):
        config, rows = read_run(run_dir)
        base = {**flat_record(flat_config(config)), "run_dir": str(run_dir)}
        if per == "row":
            records += [{**base, **flat_record(row)} for row in rows]
        else:
            summary_file = run_dir / "summary.json"
            finished = summary_file.is_file()
            summary = flat_record(read_json(summary_file)) if finished else {}
            summary = {k: v for k, v in summary.items() if v is not None or k not in base}
            records.append({**base, "finished": finished, **summary})
    return records


def run_directories(dirs) -> list[Path]:
    """``dirs`` (a path or paths) as run directories: a directory with ``metrics.jsonl`` is one;
    another stands for the run directories right below it (a ConfigError when it holds none)."""
    paths = [dirs] if isinstance(dirs, (str, Path)) else list(dirs)
    found = []
    for path in map(Path, paths):
        runs = with_members([path])
        if runs == [path] and not (path / "metrics.jsonl").is_file():
            what = "does not exist" if not path.exists() else "holds no metrics.jsonl and no run directories"
            raise ConfigError(f"load_runs: {path} {what}; pass run directories or a directory of them (a sweep's)")
        found += runs
    return found


def flat_record(values: dict, prefix: str = "") -> dict:
    """``values`` with nested dicts flattened to dotted keys and lists made tuples."""
    flat = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flat_record(value, f"{name}."))
        else:
            flat[name] = _hashable(value)
    return flat


def _hashable(value):
    return tuple(_hashable(v) for v in value) if isinstance(value, list) else value
