"""``jaxfed plot``: PNGs from run directories, labels from the config keys that differ."""

import json

import pytest

from jaxfed.cli import main
from jaxfed.runs.plots import read_run, run_labels

pytestmark = pytest.mark.plots  # every test here draws its figures (tests/conftest.py)
PNG = b"\x89PNG\r\n\x1a\n"


def _fake_run(directory, config, accuracies, bytes_per_round):
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(config))
    rows = [
        {
            "round": 5 * (i + 1),
            "personalized_acc_mean": a,
            "global_acc": None,
            "bytes_up_total": bytes_per_round * (i + 1),
        }
        for i, a in enumerate(accuracies)
    ]
    (directory / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"round": 2')
    return directory


def test_labels_name_the_algorithm_and_the_differing_keys():
    configs = [
        {"algorithm": "fedavg", "lr": 0.05, "seed": 0, "eval_every": 5},
        {"algorithm": "fedavg", "lr": 0.1, "seed": 0, "eval_every": 2},
        {"algorithm": "local", "lr": 0.05, "seed": 0, "eval_every": 5},
    ]
    assert run_labels(configs) == ["fedavg lr=0.05", "fedavg lr=0.1", "local lr=0.05"]


def test_runs_of_one_configuration_are_labelled_by_their_directories(tmp_path):
    from jaxfed.runs.plots import plot_labels

    configs = [{"algorithm": "fedavg", "lr": 0.05}, {"algorithm": "fedavg", "lr": 0.05}, {"algorithm": "local"}]
    dirs = [tmp_path / "a", tmp_path / "copy", tmp_path / "l"]
    assert plot_labels(dirs, configs) == ["fedavg (a)", "fedavg (copy)", "local"]  # were "fedavg" twice


def test_plot_command_writes_a_png(tmp_path, capsys):
    a = _fake_run(tmp_path / "a", {"algorithm": "fedavg", "lr": 0.05}, [0.5, 0.7, 0.8], 1e6)
    b = _fake_run(tmp_path / "b", {"algorithm": "fedprox", "lr": 0.05}, [0.4, 0.6], 2e6)
    config, rows = read_run(a)
    assert [r["round"] for r in rows] == [5, 10, 15]  # the unfinished last line is ignored
    out = tmp_path / "plots" / "cmp.png"
    assert main(["plot", str(a), str(b), "--out", str(out)]) == 0
    assert out.read_bytes().startswith(PNG) and out.stat().st_size > 10_000
    assert main(["plot", str(a)]) == 0
    assert (a / "accuracy.png").read_bytes().startswith(PNG)
    capsys.readouterr()
    assert main(["plot", str(a), "--metric", "global_acc"]) == 2  # no run has it
    assert "no run has global_acc" in capsys.readouterr().err


def test_a_sweeps_directory_is_plotted_as_its_members(tmp_path):
    """`jaxfed plot SWEEP` said "no metrics.jsonl (not a jaxfed run directory)", where `jaxfed
    report SWEEP` takes it: a sweep's directory stands for its members."""
    from jaxfed.runs.plots import with_members

    sweep = tmp_path / "sweep"
    members = [_fake_run(sweep / f"seed{s}", {"algorithm": "fedavg", "seed": s}, [0.5, 0.6], 1e6) for s in (0, 1)]
    alone = _fake_run(tmp_path / "alone", {"algorithm": "fedavg"}, [0.5], 1e6)
    assert with_members([sweep, alone]) == [*members, alone]
    assert with_members([tmp_path / "empty"]) == [tmp_path / "empty"]  # read_run says what it is not
    assert main(["plot", str(sweep), "--out", str(tmp_path / "sweep.png")]) == 0
    assert (tmp_path / "sweep.png").read_bytes().startswith(PNG)


def test_plot_of_something_that_is_not_a_run_is_one_line_exit_2(tmp_path, capsys):
    assert main(["plot", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no metrics.jsonl (not a jaxfed run directory)" in err
    _fake_run(tmp_path / "a", {"algorithm": "fedavg"}, [0.5], 1e6)
    assert main(["plot", str(tmp_path / "a"), "--metric", "accuracy"]) == 2
    assert "--metric: unknown 'accuracy'" in capsys.readouterr().err
    regression = _fake_run(tmp_path / "r", {"algorithm": "fedavg"}, [0.5], 1e6)
    (regression / "metrics.jsonl").write_text(
        (regression / "metrics.jsonl").read_text().replace("personalized_acc_mean", "personalized_mse_mean")
    )
    assert main(["plot", str(tmp_path / "a"), str(regression), "--out", str(tmp_path / "mixed.png")]) == 2
    assert "plot: the runs mix regression (MSE) and classification (accuracy)" in capsys.readouterr().err
    (tmp_path / "a" / "metrics.jsonl").write_text("")  # a run that has not evaluated yet
    assert main(["plot", str(tmp_path / "a")]) == 2
    assert "plot: no run has evaluated yet (metrics.jsonl is empty or missing)" in capsys.readouterr().err


def test_labels_name_differing_options_and_never_dump_an_options_dict():
    from jaxfed.runs.plots import run_labels

    floral = {"algorithm": "floral", "seed": 0, "options": {"lr": 0.1, "rho": 0.01, "num_adaptors": 4}}
    other_rho = {**floral, "options": {**floral["options"], "rho": 0.1}}
    configs = [floral, other_rho, {"algorithm": "fedavg", "seed": 0, "options": {"lr": 0.1}}]
    assert run_labels(configs[:2]) == ["floral rho=0.01", "floral rho=0.1"]
    assert run_labels([configs[0], configs[2]]) == ["floral", "fedavg"]
    assert run_labels([configs[0], {**configs[2], "seed": 1}]) == ["floral seed=0", "fedavg seed=1"]


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("jaxfed: error: "), err
    return err


def test_a_damaged_config_is_one_line_naming_the_file(tmp_path, capsys):
    run = _fake_run(tmp_path / "a", {"algorithm": "fedavg"}, [0.5], 1e6)
    (run / "config.json").write_text('{"algorithm": "fed')
    assert main(["plot", str(run)]) == 2
    err = _one_line(capsys)
    assert f"{run / 'config.json'}: damaged (Unterminated string" in err
    assert f"`jaxfed run --out {run} --resume` writes it again" in err


def test_an_out_that_cannot_be_written_is_one_line(tmp_path, capsys):
    run = _fake_run(tmp_path / "a", {"algorithm": "fedavg"}, [0.5], 1e6)
    (tmp_path / "afile").write_text("mine")
    for out, reason in ((tmp_path / "afile" / "x.png", "Not a directory"), (tmp_path, "Is a directory")):
        assert main(["plot", str(run), "--out", str(out)]) == 2
        assert f"{out}: cannot be written ({reason})" in _one_line(capsys)
    assert (tmp_path / "afile").read_text() == "mine"


def test_a_plot_that_fails_at_the_end_of_a_run_is_a_warning_and_the_run_is_kept(tmp_path, capsys, monkeypatch):
    from matplotlib.figure import Figure

    def full(self, *args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Figure, "savefig", full)
    out = tmp_path / "run"
    assert main(["run", "--quiet", "--out", str(out), "--set", "rounds=1", "num_clients=4"]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning")]
    assert warnings == [
        f"warning: could not draw {name}: {out / name}: cannot be written (No space left on device)"
        for name in ("accuracy.png", "global_accuracy.png")
    ]
    assert json.loads((out / "summary.json").read_text())["rounds"] == 1 and not (out / "accuracy.png").exists()


def test_any_number_of_the_rows_plots_by_round_and_bytes_into_its_own_file(tmp_path, capsys, monkeypatch):
    """Losses, steps, bytes: any number the runs' rows hold is a --metric, drawn as it is in the rows,
    into DIR/<metric>.png (DIR/accuracy.png is the run's own figure); other names list them."""
    from jaxfed.runs import plots

    run = _fake_run(tmp_path / "a", {"algorithm": "fedavg"}, [0.5, 0.7, 0.8], 1e6)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()[:-1]]
    losses = [2.0, 1.25, 0.5]
    # "skipped_loss" null in every row (as train_loss when every update was skipped)
    rows = [{**row, "train_loss": loss, "converged": False, "skipped_loss": None} for row, loss in zip(rows, losses)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    drawn = []
    save = plots._save
    monkeypatch.setattr(
        plots, "_save", lambda fig, out: drawn.append([a.lines[0].get_data() for a in fig.axes]) or save(fig, out)
    )
    assert main(["plot", str(run), "--metric", "train_loss"]) == 0
    assert capsys.readouterr().out.strip() == str(run / "train_loss.png")
    assert (run / "train_loss.png").read_bytes().startswith(PNG) and not (run / "accuracy.png").exists()
    (by_round_x, by_round_y), (by_bytes_x, by_bytes_y) = drawn[0]
    assert list(by_round_x) == [5, 10, 15] and list(by_round_y) == losses == list(by_bytes_y)
    assert list(by_bytes_x) == [1.0, 2.0, 3.0]  # MB uploaded
    for name in ("round", "converged", "train_losses"):  # the x axis, a flag, a typo
        assert main(["plot", str(run), "--metric", name]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"--metric: unknown '{name}'" in err
        assert err.endswith("bytes_up_total, skipped_loss, train_loss") and "converged" not in err.split("allowed:")[1]
    assert main(["plot", str(run), "--metric", "skipped_loss"]) == 2
    assert "--metric: no run has skipped_loss rows to plot" in capsys.readouterr().err
