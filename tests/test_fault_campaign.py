"""The held-out fault campaign's cases (issue 35): each one a user tried on a fresh clone that
answered silently wrong, with a traceback or with a misleading hint, now one clear line (or the
right behaviour). docs/reliability.md's table lists them with their outcomes."""

import dataclasses
import json
import os
from pathlib import Path

import numpy as np
import pytest
from test_faults import TINY, _arrays, _one_line_error

import jaxfed
from jaxfed.cli import main
from jaxfed.data import Dataset, federate, load_dataset
from jaxfed.data.validate import DataError
from jaxfed.errors import ConfigError
from jaxfed.runs.build import build
from jaxfed.runs.config import Config, read_config_file
from jaxfed.simulation import Simulation

# ----- values that were accepted silently ------------------------------------------------------


@pytest.mark.parametrize("seed", [2**32, 2**64, 99999999999])
def test_a_seed_jax_cannot_hold_is_refused_not_aliased(seed, tmp_path, capsys):
    assert main(["run", "--quiet", "--out", str(tmp_path / "o"), "--set", f"seed={seed}"]) == 2
    assert f"seed: must be in 0..{2**32 - 1}" in _one_line_error(capsys)
    assert main(["sweep", "--quiet", "--out", str(tmp_path / "s"), "--seeds", f"0,{seed}"]) == 2
    assert f"got {seed}" in _one_line_error(capsys)


def test_negative_seeds_in_a_list_are_checked_not_misparsed(tmp_path, capsys):
    assert main(["sweep", "--quiet", "--out", str(tmp_path / "s"), "--seeds", "-1,2"]) == 2
    assert "seed: must be in 0..4294967295 (JAX's keys hold 32 bits), got -1" in _one_line_error(capsys)


@pytest.mark.parametrize("value", ["1.5", "1.0", "-0.1"])
def test_a_momentum_outside_0_1_is_refused(value, tmp_path, capsys):
    assert main(["run", "--quiet", "--out", str(tmp_path / "o"), "--set", f"momentum={value}"]) == 2
    assert "momentum: must be in [0, 1)" in _one_line_error(capsys)
    with pytest.raises(ConfigError, match=r"momentum: must be in \[0, 1\)"):
        Config(algorithm="feddecomp").with_overrides([f"momentum={value}"]).validate()


@pytest.mark.parametrize("pack_size", ["1000000", "1000000000"])
def test_a_pack_larger_than_the_model_is_refused(pack_size, tmp_path, capsys):
    args = ["run", "fedcspack", "--quiet", "--out", str(tmp_path / "o"), "--set", f"pack_size={pack_size}"]
    assert main(args) == 2
    err = _one_line_error(capsys)
    assert f"pack_size: {pack_size} makes one pack of the model's 55210 parameters" in err
    assert "at most 27605" in err


def test_participation_zero_is_refused_from_python():
    sim = build(Config(num_clients=4)).simulation
    with pytest.raises(ConfigError, match=r"participation: must be in \(0, 1\], got 0"):
        Simulation(sim.algorithm, sim.model, sim.data, participation=0)


def test_a_state_of_another_client_count_is_refused():
    small, large = (build(Config(algorithm="feddecomp", num_clients=n)).simulation for n in (20, 30))
    state = large.init()
    with pytest.raises(ConfigError, match="state: holds 30 client states, but this simulation's data has 20"):
        small.run_rounds(state, 1)
    with pytest.raises(ConfigError, match="state: holds 30 client states"):
        small.evaluate(state)
    with pytest.raises(ConfigError, match="state: holds 20 client states"):
        large.evaluate(small.init())


def test_federate_refuses_part_counts_that_differ_and_float_indices(digits):
    parts = [np.arange(10), np.arange(10, 20)]
    with pytest.raises(DataError, match="3 training parts and 2 test parts"):
        federate(digits, [*parts, np.arange(20, 30)], parts)
    with pytest.raises(DataError, match="client 1's test indices have dtype float64; expected integers"):
        federate(digits, parts, [parts[0], parts[1].astype(float)])


def test_complex_images_and_scalar_labels_are_refused(tmp_path, capsys):
    for name, change in {"complex": {"x_train": _arrays()["x_train"] * (1 + 1j)}, "scalar": {"y_train": 3}}.items():
        data = tmp_path / name
        data.mkdir()
        np.savez(data / "mnist.npz", **{**_arrays(), **change})
        args = ["run", "--quiet", "--dataset", "mnist", "--data-dir", str(data), "--out", str(tmp_path / f"o{name}")]
        assert main(args) == 2
        err = _one_line_error(capsys)
        expected = "x_train has dtype complex128; expected real numbers" if name == "complex" else "y_train is a single"
        assert expected in err


# ----- data directories: say where and what -----------------------------------------------------


def _data_dir_error(data_dir, tmp_path, capsys) -> str:
    args = ["run", "--quiet", "--dataset", "mnist", "--data-dir", str(data_dir), "--out", str(tmp_path / "o")]
    assert main(args) == 2
    err = _one_line_error(capsys)
    assert "shared/data/unpack.py" not in err  # not in the repository a user clones
    return err


def test_data_dir_problems_name_the_directory_and_the_problem(tmp_path, capsys, monkeypatch):
    (tmp_path / "loop_a").symlink_to(tmp_path / "loop_b")
    (tmp_path / "loop_b").symlink_to(tmp_path / "loop_a")
    assert "loop_a cannot be read (Too many levels of symbolic links)" in _data_dir_error(
        tmp_path / "loop_a", tmp_path, capsys
    )
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    assert "dangling does not exist (a symbolic link to a missing target)" in _data_dir_error(
        tmp_path / "dangling", tmp_path, capsys
    )
    (tmp_path / "a_file").write_text("x")
    assert "a_file is a file; name the directory that holds <dataset>.npz" in _data_dir_error(
        tmp_path / "a_file", tmp_path, capsys
    )
    empty = tmp_path / "empty"
    empty.mkdir()
    assert f"no mnist.npz in {empty}" in _data_dir_error(empty, tmp_path, capsys)
    (tmp_path / "npz_dir" / "mnist.npz").mkdir(parents=True)
    assert "mnist.npz: is a directory, not an .npz file" in _data_dir_error(tmp_path / "npz_dir", tmp_path, capsys)
    monkeypatch.chdir(tmp_path)  # a relative directory: where it was looked for
    assert f"data_dir: ../elsewhere (from {tmp_path}: {tmp_path}/../elsewhere) does not exist;" in _data_dir_error(
        "../elsewhere", tmp_path, capsys
    )


def test_an_unreadable_npz_is_one_line(tmp_path, capsys, monkeypatch):
    from jaxfed.data import validate

    np.savez(tmp_path / "mnist.npz", **_arrays())

    def unreadable(path, mode="r", *args, **kwargs):  # as chmod 0 does, also for root
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(validate, "open", unreadable, raising=False)
    assert "mnist.npz: cannot be read (Permission denied)" in _data_dir_error(tmp_path, tmp_path, capsys)


def test_a_data_dir_under_home_is_expanded(tmp_path, monkeypatch):
    (tmp_path / "data").mkdir()
    np.savez(tmp_path / "data" / "mnist.npz", **_arrays())
    monkeypatch.setenv("HOME", str(tmp_path))
    assert load_dataset("mnist", "~/data").x_train.shape == (40, 28, 28, 1)


# ----- config files and the Python API ---------------------------------------------------------


def _conf(tmp_path, text: str | bytes) -> Path:
    path = tmp_path / "run.conf"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


def test_config_file_mistakes_are_one_clear_line(tmp_path):
    with pytest.raises(ConfigError, match=r"line 3: 'lr' is set again \(first on line 1\)"):
        read_config_file(_conf(tmp_path, "lr = 0.1\nrounds = 2\nlr = 0.2\n"))
    assert read_config_file(_conf(tmp_path, "lr = 0.1\n[fedprox]\nlr = 0.2\n")) == ["lr=0.1", "fedprox.lr=0.2"]
    assert read_config_file(_conf(tmp_path, "\ufeffrounds = 2\n".encode())) == ["rounds=2"]  # a BOM
    with pytest.raises(ConfigError, match=r"line 1: empty section '\[\]'; write \[ALGORITHM\] or \[run\]"):
        read_config_file(_conf(tmp_path, "[]\nlr = 0.1\n"))


@pytest.mark.parametrize(
    "text, where, error",
    [
        ("rounds = 2\n[fedcspack]\nlrr = 0.1\n", "line 3 [fedcspack]", "unknown config key 'lrr'; did you mean lr?"),
        ("[fedprox]\nmu = abc\n", "line 2 [fedprox]", "mu: expected float, got 'abc'"),
        ("[fedavgg]\nlr = 0.1\n", "line 2 [fedavgg]", "algorithm: unknown 'fedavgg' (did you mean 'fedavg'?)"),
        ("rounds = two\n", "line 1", "rounds: expected int, got 'two'"),
        ("# a comment\nmu = 0.1\n", "line 2", "mu: an option of fedprox"),  # running fedavg
        ("lr = -1\n", "line 1", "lr: must be >= 0, got -1.0"),
        ("rounds = 2\nsampling = bogus\n", "line 2", "sampling: unknown 'bogus'"),
        ("eval_clients = cohort\n", "line 1", "eval_clients: cohort needs sampling=fixed or first"),
    ],
)
def test_a_config_files_value_errors_name_its_file_line_and_section(tmp_path, capsys, text, where, error):
    conf = _conf(tmp_path, text)
    assert main(["run", "fedavg", "--quiet", "--config", str(conf), "--out", str(tmp_path / "o")]) == 2
    assert _one_line_error(capsys).startswith(f"jaxfed: error: --config: {conf} {where}: {error}")


def test_a_config_file_is_checked_as_the_command_line_leaves_it(tmp_path):
    lines = [("rounds=0", "--config: run.conf line 1"), ("algorithm=fedavgg", "--config: run.conf line 2")]
    with pytest.raises(ConfigError, match=r"^--config: run.conf line 2: algorithm: unknown 'fedavgg'"):
        Config().validated_with(*zip(*lines))
    overridden = Config().validated_with(["rounds=0", "rounds=1"], ["--config: run.conf line 1", None])
    assert overridden.rounds == 1  # the file's value lost to --set: never checked
    with pytest.raises(ConfigError, match=r"^rounds: must be >= 1, got 0$"):  # --set's own: no file to name
        Config().validated_with(["rounds=2", "rounds=0"], ["--config: run.conf line 1", None])


def test_a_huge_value_gives_a_short_line(tmp_path, capsys):
    conf = _conf(tmp_path, "algorithm = " + "x" * 200_000 + "\n")
    assert main(["run", "--quiet", "--config", str(conf), "--out", str(tmp_path / "o")]) == 2
    err = _one_line_error(capsys)
    # the value is clipped (the rest of the line lists the registered algorithms, however many)
    assert err.count("x" * 100) == 0 and "(200000 characters)" in err


def test_a_config_file_without_end_is_refused_after_a_mebibyte(tmp_path, capsys):
    assert main(["run", "--quiet", "--config", "/dev/zero", "--out", str(tmp_path / "o")]) == 2
    assert "--config: /dev/zero is larger than 1 MiB" in _one_line_error(capsys)


def test_run_takes_a_dict_and_wrong_types_name_the_field(tmp_path):
    with pytest.raises(ConfigError, match=r"rounds: expected int, got '2' \(str\)"):
        Config(rounds="2").validate()
    with pytest.raises(ConfigError, match=r"lr: expected float, got \[0.1\] \(list\)"):
        jaxfed.run({"lr": [0.1]}, tmp_path / "o", progress=False)
    with pytest.raises(ConfigError, match="config: expected a jaxfed.Config or a dict of keys, got list"):
        jaxfed.run([("rounds", 1)], tmp_path / "o", progress=False)
    with pytest.raises(ConfigError, match="unknown config key 'round'; did you mean rounds"):
        Config.of({"round": 1})
    as_dict = Config.of({"algorithm": "fedprox", "rounds": 1, "mu": 0.5, "options": {"lr": 0.2}})
    assert (as_dict.rounds, as_dict.options.mu, as_dict.options.lr) == (1, 0.5, 0.2)
    summary = jaxfed.run({"rounds": 1, "num_clients": 4}, tmp_path / "o", progress=False, log=lambda m: None)
    assert summary["rounds"] == 1


# ----- plugins ---------------------------------------------------------------------------------

PLUGINS = {
    "syntax": ("def f(:\n", "SyntaxError: invalid syntax"),
    "raises": ("raise RuntimeError('boom')\n", "RuntimeError: boom"),
    "existing": (
        "import jaxfed\nfrom jaxfed.algorithms.fedavg import FedAvgOptions\n"
        "jaxfed.register('fedavg', FedAvgOptions, lambda m, o, c: None)\n",
        "register: algorithm 'fedavg' exists already",
    ),
    "shadows": (
        "import dataclasses, jaxfed\nfrom jaxfed.options import TrainingOptions, option\n"
        "@dataclasses.dataclass(frozen=True)\nclass O(TrainingOptions):\n    rounds: int = option(3, 'x')\n"
        "jaxfed.register('shadowing', O, lambda m, o, c: None)\n",
        "option(s) rounds shadow run-level config keys",
    ),
}


@pytest.mark.parametrize("case", PLUGINS)
def test_a_broken_plugin_is_one_line_naming_it(case, tmp_path, capsys):
    source, expected = PLUGINS[case]
    plugin = tmp_path / f"broken_{case}.py"
    plugin.write_text(source)
    assert main(["run", "--quiet", "--plugin", str(plugin), "--out", str(tmp_path / "o")]) == 2
    err = _one_line_error(capsys)
    assert f"plugins: importing {plugin} failed: " in err and expected in err and str(plugin) + " line" in err


MOVING_PLUGIN = """import jaxfed
from jaxfed.algorithms.fedavg import FedAvgOptions, fedavg

jaxfed.register("fedavg_moving", FedAvgOptions, lambda model, options, config: fedavg(model, options))
"""


def test_a_moved_plugin_resumes_from_its_new_path(tmp_path, capsys):
    first, moved = tmp_path / "first", tmp_path / "moved"
    first.mkdir()
    (first / "moving.py").write_text(MOVING_PLUGIN)
    out = str(tmp_path / "run")
    assert main(["run", "fedavg_moving", "--quiet", "--plugin", str(first / "moving.py"), "--out", out, *TINY]) == 0
    first.rename(moved)
    capsys.readouterr()
    assert main(["run", "--quiet", "--resume", "--out", out, "--set", "rounds=3"]) == 2
    assert "(a plugin that moved: pass --plugin with its new path)" in _one_line_error(capsys)
    assert (
        main(["run", "--quiet", "--resume", "--out", out, "--plugin", str(moved / "moving.py"), "--set", "rounds=3"])
        == 0
    )
    assert json.loads((Path(out) / "config.json").read_text())["plugins"] == [str(moved / "moving.py")]


# ----- run directories: nothing lost, the right hint --------------------------------------------


def test_a_finished_run_without_its_checkpoints_is_not_overwritten(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["run", "--quiet", "--out", str(out), *TINY]) == 0
    for step in (out / "checkpoints").iterdir():
        for f in sorted(step.rglob("*"), reverse=True):
            f.unlink() if f.is_file() else f.rmdir()
        step.rmdir()
    (out / "checkpoints").rmdir()
    before = {f: f.read_bytes() for f in (out / "metrics.jsonl", out / "summary.json")}
    capsys.readouterr()
    assert main(["run", "--quiet", "--out", str(out), *TINY]) == 2
    assert "holds a finished run (summary.json) whose checkpoints are gone" in _one_line_error(capsys)
    assert main(["run", "--quiet", "--resume", "--out", str(out)]) == 2
    err = _one_line_error(capsys)
    assert "it finished and its checkpoints are gone" in err and "before its first checkpoint" not in err
    assert {f: f.read_bytes() for f in before} == before


def test_a_sweep_directory_is_not_a_run_directory(tmp_path, capsys):
    parent = tmp_path / "sweep"
    assert main(["sweep", "--quiet", "--seeds", "0,1", "--out", str(parent), *TINY]) == 0
    capsys.readouterr()
    assert main(["run", "--quiet", "--out", str(parent), *TINY]) == 2
    assert "holds run directories (seed0_lr0.05, seed1_lr0.05: a sweep's?)" in _one_line_error(capsys)
    assert not (parent / "config.json").exists()


def test_a_resume_may_move_to_other_devices_and_says_so(tmp_path, capsys, monkeypatch):
    """A run resumes on the devices the resume names (``devices``, ``host_devices``: the host is
    split into the resume's count before the checkpoint is read, else the run's), with a warning
    that its rounds match the run left alone to float tolerance; other keys stay refused."""
    from jaxfed.runs import driver
    from jaxfed.runs.rundir import RunRecord, check_resumable, warn_other_devices

    saved = Config(host_devices=8, devices=0)
    check_resumable(saved, dataclasses.replace(saved, host_devices=4, devices=2))
    with pytest.raises(ConfigError, match=r"in seed \(0 -> 1\); only .*devices.*host_devices"):
        check_resumable(saved, dataclasses.replace(saved, host_devices=4, seed=1))
    out = tmp_path / "run"
    assert main(["run", "--quiet", "--out", str(out), *TINY, "--set", "checkpoint_every=1"]) == 0
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "host_devices": 8}))  # as a run on 8 would
    splits = []
    monkeypatch.setattr(driver, "split_host", splits.append)
    driver.resume_point(out, log=lambda line: None, host_devices=2)
    driver.resume_point(out, log=lambda line: None)
    assert splits == [2, 8]
    asked = []  # the command line's host_devices reach resume_point (the last one given)

    def resume_point(out_dir, log=None, plugins=(), host_devices=None):
        asked.append(host_devices)
        raise ConfigError("stopped here")

    monkeypatch.setattr(driver, "resume_point", resume_point)
    for given in (["host_devices=3", "host_devices=2"], ["rounds=3"]):
        assert main(["run", "--quiet", "--resume", "--out", str(out), "--set", *given]) == 2
    assert asked == [2, None]
    lines = []
    warn_other_devices(RunRecord({}, {"devices": 8}), 4, lines.append, name="seed0")
    warn_other_devices(RunRecord({}, {"devices": 4}), 4, lines.append)
    assert lines == [
        "warning: seed0: checkpoint written on 8 device(s), resuming on 4: results match to float tolerance, "
        "not bit for bit"
    ]


def test_out_names_too_long_are_one_line(tmp_path, capsys):
    assert main(["run", "--quiet", "--out", str(tmp_path / ("a" * 300))]) == 2
    err = _one_line_error(capsys)
    assert "a name in the path is 300 bytes; at most 255" in err and len(err) < 300


def test_a_full_disk_while_taking_the_lock_is_one_line(tmp_path, capsys, monkeypatch):
    def full(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)
    assert main(["run", "--quiet", "--out", str(tmp_path / "o")]) == 1
    assert "no space left to start" in _one_line_error(capsys)


def test_options_fields_keep_their_types(tmp_path):
    """Type checks run before each field's own check, also for an options class (Python callers)."""
    options = dataclasses.replace(Config(algorithm="fedprox").options, mu="0.1")
    with pytest.raises(ConfigError, match=r"mu: expected float, got '0.1' \(str\)"):
        options.validate()
    assert dataclasses.replace(options, mu=np.float32(0.1)).validate()  # numpy numbers are numbers


def test_dataset_from_python_still_federates(digits):
    """The checks above keep good data passing (integer numpy and list parts)."""
    parts = [list(range(10)), np.arange(10, 20)]
    assert federate(Dataset("mine", *(getattr(digits, k) for k in ("x_train", "y_train")), digits.x_test,
                            digits.y_test, 10), parts, parts).num_clients == 2  # fmt: skip


def test_loading_a_run_checkpoints_state_logs_no_warning(tmp_path, caplog):
    import logging

    out = tmp_path / "run"
    assert main(["run", "--quiet", "--out", str(out), *TINY]) == 0
    with caplog.at_level(logging.WARNING):
        state = jaxfed.load_state(out / "checkpoints" / "2" / "state")
    assert int(state["round"]) == 2
    assert "Metadata file does not exist" not in caplog.text


def test_an_algorithm_on_a_task_it_cannot_run_is_one_line(tmp_path, capsys):
    """FedARA's anchors are class means: on a regression task it used to fail inside jit."""
    assert main(["run", "fedara", "--quiet", "--dataset", "synthetic_linear", "--out", str(tmp_path / "o")]) == 2
    assert "dataset: synthetic_linear is a regression task; fedara runs classification tasks only" in (
        _one_line_error(capsys)
    )
