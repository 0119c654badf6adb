"""The command line: the default job, its output files, and one-line errors for user mistakes."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jaxfed.cli.commands import _parser, config_from_args, main
from jaxfed.errors import ConfigError

SUMMARY_KEYS = {
    "algorithm",
    "dataset",
    "num_clients",
    "rounds",
    "personalized_acc_mean",
    "personalized_acc_weighted",
    "global_acc",
    "best_personalized_acc",
    "bytes_up_total",
    "bytes_down_total",
    "bytes_total",
    "wall_seconds",
}


@pytest.mark.plots
def test_default_run_writes_the_run_directory(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["run"]) == 0
    out = capsys.readouterr()
    assert "fedavg on digits" in out.out and "personalized acc" in out.out
    assert "partition: 20 clients" in out.err
    (run_dir,) = (tmp_path / "runs").iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert SUMMARY_KEYS <= summary.keys()
    assert summary["algorithm"] == "fedavg" and summary["rounds"] == 30 and summary["num_clients"] == 20
    assert summary["global_acc"] > 0.8 and summary["personalized_acc_mean"] > 0.8
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [5, 10, 15, 20, 25, 30]
    assert rows[-1]["bytes_up_total"] == summary["bytes_up_total"] > rows[0]["bytes_up_total"] > 0
    assert summary["bytes_total"] == summary["bytes_up_total"] + summary["bytes_down_total"] == rows[-1]["bytes_total"]
    config = json.loads((run_dir / "config.json").read_text())
    assert config["algorithm"] == "fedavg" and config["dataset"] == "digits"
    for png in ("accuracy.png", "global_accuracy.png"):
        assert (run_dir / png).read_bytes().startswith(b"\x89PNG")
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["10", "20", "30"]


def test_out_and_overrides(tmp_path, capsys):
    out = tmp_path / "local_run"
    code = main(
        [
            "run",
            "local",
            "--out",
            str(out),
            "--quiet",
            "--set",
            "rounds=3",
            "--set",
            "eval_every=2",
            "--set",
            "num_clients=5",
        ]
    )
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["algorithm"] == "local" and summary["rounds"] == 3
    assert summary["global_acc"] is None and summary["bytes_up_total"] == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [2, 3]
    assert json.loads((out / "config.json").read_text())["num_clients"] == 5


@pytest.mark.parametrize(
    "args, expected",
    [
        (["run", "fedavgg"], "algorithm: unknown 'fedavgg' (did you mean 'fedavg'?)"),
        (["run", "--dataset", "imagenet"], "dataset: unknown 'imagenet'"),
        (["run", "--set", "model=resnet99"], "model: unknown 'resnet99'"),
        (["run", "--set", "learning_rate=0.1"], "unknown config key 'learning_rate'"),
        (["run", "--set", "lrr=0.1"], "did you mean lr"),
        (["run", "--set", "alpha=0"], "alpha: must be > 0"),
        (["run", "--set", "alpha=-0.5"], "alpha: must be > 0"),
        (["run", "--set", "participation=0"], "participation: must be in (0, 1]"),
        (["run", "--set", "participation=1.5"], "participation: must be in (0, 1]"),
        (["run", "--set", "num_clients=5000"], "num_clients: 5000 clients but only"),
        (["run", "--set", "rounds=many"], "rounds: expected int"),
        (["run", "--set", "model=cnn"], "model: 'cnn' cannot take inputs of shape (8, 8, 1)"),
    ],
)
def test_user_mistakes_are_one_line_exit_2(args, expected, tmp_path, capsys):
    assert main(args + ["--out", str(tmp_path / "run"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("jaxfed: error: ")
    assert expected in err


def test_real_dataset_absent_offline_says_how_to_get_it(tmp_path, capsys):
    empty = tmp_path / "no_data"
    empty.mkdir()
    assert main(["run", "--dataset", "mnist", "--data-dir", str(empty), "--out", str(tmp_path / "r"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "'mnist' is not available offline" in err and "mnist.npz" in err and "download=true" in err


def test_installed_entry_point_lists_and_fails_cleanly():
    listing = subprocess.run([sys.executable, "-m", "jaxfed.cli", "list"], capture_output=True, text=True, timeout=120)
    assert listing.returncode == 0
    words = ("fedavg", "ensemble", "digits", "cifar100", "synthetic_mlp (model mlp)", "resnet18", "label_groups")
    for word in words:
        assert word in listing.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "jaxfed.cli", "run", "nope"], capture_output=True, text=True, timeout=120
    )
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    from jaxfed.algorithms import registry

    built_in = [name for name in registry.names() if registry.get(name).build.__module__.startswith("jaxfed.")]
    assert bad.stderr.strip().splitlines() == [
        "jaxfed: error: algorithm: unknown 'nope'; an algorithm of your own needs its plugin: --plugin "
        f"FILE_OR_MODULE (also on --resume; key plugins); allowed: {', '.join(built_in)}"
    ]


def test_config_files_apply_in_order_before_the_command_line(tmp_path):
    base, variant = tmp_path / "base.conf", tmp_path / "variant.conf"
    base.write_text("# base settings\nalgorithm = fedprox\nrounds = 7\nlr = 0.2  # paper value\n\nmu = 0.5\n")
    variant.write_text("rounds = 9\n")
    args = _parser().parse_args(["run", "--config", str(base), "--config", str(variant), "--set", "mu=0.1"])
    config = config_from_args(args)
    assert (config.algorithm, config.rounds, config.options.lr, config.options.mu) == ("fedprox", 9, 0.2, 0.1)
    plain = tmp_path / "plain.conf"
    plain.write_text("algorithm = fedprox\nrounds = 3\nlr = 0.2\n")
    args = _parser().parse_args(["run", "local", "--config", str(plain)])
    assert config_from_args(args).algorithm == "local"  # the positional algorithm overrides the file ...
    args = _parser().parse_args(["run", "local", "--config", str(base)])
    # ... whose keys must fit it
    with pytest.raises(ConfigError, match="mu: an option of fedprox, moon, pfedes, not of local"):
        config_from_args(args)


@pytest.mark.parametrize(
    "text, expected",
    [
        (None, "--config: cannot read"),
        ("rounds = 5\nlocal_epochs\n", "line 2: expected 'key = value', got 'local_epochs'"),
        ("roundz = 5\n", "unknown config key 'roundz'; did you mean rounds?"),
    ],
)
def test_bad_config_files_are_one_line_errors(text, expected, tmp_path, capsys):
    path = tmp_path / "run.conf"
    if text is not None:
        path.write_text(text)
    assert main(["run", "--config", str(path), "--out", str(tmp_path / "r"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and expected in err
    assert not (tmp_path / "r").exists()


def test_list_piped_into_a_reader_that_stops_is_not_a_traceback():
    proc = subprocess.run(
        f"{sys.executable} -m jaxfed.cli list | head -1", shell=True, capture_output=True, text=True, timeout=120
    )
    assert proc.stdout.startswith("algorithms:") and "Traceback" not in proc.stderr, proc.stderr


def test_cohort_evaluation_without_the_fixed_cohort_is_a_one_line_error(tmp_path, capsys):
    assert main(["run", "--set", "eval_clients=cohort", "--out", str(tmp_path / "r"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "jaxfed: error: eval_clients: cohort needs sampling=fixed or first (one cohort trains every round)"


def test_the_first_clients_as_the_cohort_from_the_command_line(tmp_path, capsys):
    """``sampling=first`` (PFLlib's 'fix'): clients 0..5 train and are the ones evaluated."""
    settings = ["--quiet", "--set", "sampling=first", "eval_clients=cohort", "participation=0.3", "rounds=1"]
    assert main(["run", *settings, "--out", str(tmp_path / "r")]) == 0
    examples = np.load(tmp_path / "r" / "clients" / "1.npz")["examples"]
    assert np.flatnonzero(examples).tolist() == [0, 1, 2, 3, 4, 5]
    capsys.readouterr()
    assert main(["run", "fedhm", *settings, "--out", str(tmp_path / "t")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("jaxfed: error: sampling: first trains clients 0..5 only, the first tiers of"), err


def test_list_lines_fit_100_columns_and_defaults_are_unquoted(capsys):
    """A plugin's line too (scaffold's docstring line is 110 columns: wrapped under its start)."""
    scaffold = str(Path(__file__).parents[1] / "examples" / "scaffold.py")
    for args in (["list"], ["list", "fedara"], ["list", "--plugin", scaffold]):
        assert main(args) == 0
        lines = capsys.readouterr().out.splitlines()
        assert max(len(line) for line in lines) <= 100
        assert "  num_clients = 20" in lines or "  batch_size = 16" in lines


def test_list_of_an_algorithm_says_how_python_builds_it(capsys):
    from jaxfed.algorithms import registry

    for name in registry.BUILTINS:
        line = registry.python_use(name)
        namespace = {}
        exec(line.split("; ")[0], namespace)  # the import works and gives the algorithm's function
        assert namespace[name].__name__ == name and len(f"python: {line}") <= 100
    assert registry.python_use("fedamp").endswith("fedamp(model, num_clients=..., key=value, ...)")
    assert main(["list", "fedper"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1] == "python: from jaxfed.algorithms.partial import fedper; fedper(model, key=value, ...)"
    assert main(["list", "scaffold", "--plugin", str(Path(__file__).parents[1] / "examples" / "scaffold.py")]) == 0
    assert "python:" not in capsys.readouterr().out  # research code's: its own module says how


def test_the_progress_bar_names_the_rounds_running(tmp_path, capsys):
    assert main(["run", "--out", str(tmp_path / "r"), "--set", "num_clients=4", "rounds=6", "rounds_per_call=3"]) == 0
    err = capsys.readouterr().err
    assert "rounds 1-3 (compiling first)" in err and "rounds 4-5" in err
