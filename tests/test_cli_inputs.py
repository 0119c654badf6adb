"""Command-line and config inputs that broke the one-line-error promise: each was
silently wrong, a traceback, or a misleading line."""

import hashlib
import json
from pathlib import Path

import pytest
from test_faults import _one_line_error

import jaxfed.cli.bench as bench
from jaxfed.cli import main
from jaxfed.errors import ConfigError
from jaxfed.runs.config import Config

SMALL = ["num_clients=4", "rounds=1"]


def _digest(directory: Path) -> dict:
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def test_a_grid_key_given_twice_is_refused_not_half_dropped(tmp_path, capsys):
    """`--grid rounds=1 --grid rounds=2` ran rounds=2 alone: the first axis vanished silently."""
    out = tmp_path / "s"
    args = ["sweep", "--quiet", "--out", str(out), "--grid", "rounds=1", "--grid", "rounds=2", "--set", SMALL[0]]
    assert main(args) == 2
    assert "--grid: rounds given twice" in _one_line_error(capsys)
    assert not out.exists()


@pytest.mark.parametrize("resume", [False, True])
def test_a_sweep_into_a_run_directory_is_refused(tmp_path, capsys, resume):
    """`jaxfed sweep --out RUN_DIR` put its members inside a finished run, after which `jaxfed
    report RUN_DIR` refused the directory (a run directory holding run directories)."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"algorithm": "fedavg"}))
    (run / "metrics.jsonl").write_text('{"round": 1}\n')
    (run / "summary.json").write_text("{}")
    before = _digest(run)
    args = ["sweep", "--quiet", "--out", str(run), "--set", *SMALL] + (["--resume"] if resume else [])
    assert main(args) == 2
    assert f"--out {run}: is a run directory" in _one_line_error(capsys)
    assert _digest(run) == before and sorted(p.name for p in run.iterdir()) == sorted(before)


def test_a_run_key_in_an_algorithm_section_says_so(tmp_path, capsys):
    """`[fedprox]\\nrounds = 5` said `unknown config key 'rounds'; did you mean rounds?`."""
    conf = tmp_path / "c.conf"
    conf.write_text("[fedprox]\nrounds = 5\n")
    assert main(["run", "fedprox", "--config", str(conf), "--out", str(tmp_path / "o")]) == 2
    err = _one_line_error(capsys)
    assert "did you mean rounds" not in err and "fedprox.rounds: rounds is a run key" in err


@pytest.mark.parametrize("pair", ["fedprox.muu=0.1", "fedprox.rounds=5", "fedprox.mu=abc"])
def test_an_algorithm_sections_keys_are_checked_whichever_algorithm_runs(pair):
    """A typo under `[fedprox]` was ignored silently while fedavg ran (the file serves several
    algorithms; an unknown algorithm there was refused, an unknown key was not)."""
    with pytest.raises(ConfigError, match=r"mu|rounds"):
        Config().with_overrides([pair, *SMALL]).validate()


@pytest.mark.parametrize("target", ["missing/bench.json", "."])
def test_bench_json_that_cannot_be_written_is_refused_before_the_benchmark(tmp_path, capsys, monkeypatch, target):
    """`jaxfed bench --json missing/x.json` timed the workload, then ended in a FileNotFoundError
    traceback: the JSON of minutes of measuring was lost."""
    ran = []
    monkeypatch.setattr(bench, "run_benchmark", lambda *a, **k: ran.append(1) or {})
    monkeypatch.setattr(bench, "summary_lines", lambda result: ["measured"])
    assert main(["bench", "w2", "--baseline", "none", "--json", str(tmp_path / target)]) == 2
    assert "--json" in _one_line_error(capsys) and not ran


@pytest.mark.parametrize("key", ["local_epochs", "rounds", "eval_every"])
def test_a_count_jax_cannot_hold_is_refused(key):
    with pytest.raises(ConfigError, match=rf"^{key}: must be in 1\.\.2147483647, got 3000000000"):
        Config().with_overrides([f"{key}=3000000000"]).validate()


def test_a_huge_local_epochs_is_one_line_not_an_overflow_traceback(tmp_path, capsys):
    """`--set local_epochs=3000000000` compiled, then raised OverflowError inside jit (exit 1)."""
    args = ["run", "--quiet", "--out", str(tmp_path / "o"), "--set", *SMALL, "local_epochs=3000000000"]
    assert main(args) == 2
    assert "local_epochs: must be in 1..2147483647" in _one_line_error(capsys)


def test_an_eval_batch_larger_than_the_test_set_is_not_a_full_disk(tmp_path, capsys):
    """`--set eval_batch_size=1000000000` asked XLA for 1.6 TB for the pooled evaluation, and the
    out-of-memory error was reported as `no space left while writing DIR ...; free space, then
    continue with --resume` (exit 1). A batch beyond the test set only pads: it is the test set."""
    out = tmp_path / "o"
    assert main(["run", "--quiet", "--out", str(out), "--set", *SMALL, "eval_batch_size=1000000000"]) == 0
    assert "no space left" not in capsys.readouterr().err
    assert json.loads((out / "summary.json").read_text())["global_acc"] > 0


@pytest.mark.parametrize("value", ["nan", "inf"])
def test_a_non_finite_synthetic_scale_names_the_field(value):
    """`synthetic_scale=nan` ran until the data check said `y_train has NaN or inf targets`."""
    with pytest.raises(ConfigError, match=rf"^synthetic_scale: must be a finite number, got {value}"):
        Config().with_overrides(["dataset=synthetic_linear", f"synthetic_scale={value}"]).validate()
