"""One entry path from the command line to the engine, each check once: a config validated once,
one lock per run directory, a resumed run's checkpoint record read once, no process-wide setting
changed by building, a sweep loading its dataset once, and what a sweep needs of an algorithm."""

import dataclasses
import os

import jax
import pytest

import jaxfed
from jaxfed.cli import main
from jaxfed.errors import ConfigError
from jaxfed.options import Options, TrainingOptions, option
from jaxfed.runs import build as build_module
from jaxfed.runs import rundir
from jaxfed.runs.checkpoint import RunCheckpoints
from jaxfed.runs.config import Config
from jaxfed.runs.sweep import Sweep, sweep_configs

TINY = ["num_clients=4", "rounds=2", "checkpoint_every=2", "eval_every=2"]


def _counting(monkeypatch, owner, name):
    """Wrap ``owner.name`` so that calls to it are counted: returns the list of calls."""
    calls, original = [], getattr(owner, name)

    def counted(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)
    return calls


def test_a_config_is_checked_once_however_many_layers_it_passes(monkeypatch, tmp_path):
    checks = _counting(monkeypatch, Config, "check")
    config = Config().with_overrides(TINY).validate()
    jaxfed.run(config, tmp_path / "run", progress=False, log=lambda message: None)
    assert len(checks) == 1
    assert dataclasses.replace(config, rounds=3).validate() and len(checks) == 2  # a changed config is new


def test_a_run_locks_its_directory_once(monkeypatch, tmp_path):
    locks = _counting(monkeypatch, rundir, "_acquire_lock")
    assert main(["run", "--quiet", "--out", str(tmp_path / "run"), "--set", *TINY]) == 0
    assert len(locks) == 1
    assert main(["run", "--quiet", "--out", str(tmp_path / "run"), "--resume", "--set", "rounds=4"]) == 0
    assert len(locks) == 2


def test_a_resumed_run_reads_its_newest_checkpoint_once(monkeypatch, tmp_path):
    out = str(tmp_path / "run")
    assert main(["run", "--quiet", "--out", out, "--set", *TINY]) == 0
    records = _counting(monkeypatch, RunCheckpoints, "read_record")
    states = _counting(monkeypatch, RunCheckpoints, "restore")
    assert main(["run", "--quiet", "--out", out, "--resume", "--set", "rounds=4"]) == 0
    assert (len(records), len(states)) == (1, 1)  # the record before building, the state after


def test_building_changes_no_process_setting():
    flags, precision = os.environ.get("XLA_FLAGS"), jax.config.jax_default_matmul_precision
    sim = build_module.build(Config().with_overrides([*TINY, "matmul_precision=highest"])).simulation
    sim.run_rounds(sim.init(), 1)
    assert (os.environ.get("XLA_FLAGS"), jax.config.jax_default_matmul_precision) == (flags, precision)


def test_a_sweep_loads_its_dataset_once_and_partitions_once_per_seed(monkeypatch):
    loads = _counting(monkeypatch, build_module, "load_dataset")
    partitions = _counting(monkeypatch, build_module, "partition")
    configs = sweep_configs(Config().with_overrides(TINY), seeds=[0, 1], lrs=[0.05, 0.1])
    sweep = Sweep(configs)
    assert (len(loads), len(partitions), sweep.num_members) == (1, 2, 4)
    assert [part.data.train_idx.shape for part in sweep.parts] == [p.data.train_idx.shape for p in sweep.parts]


@dataclasses.dataclass(frozen=True)
class _NoLearningRate(Options):
    steps: int = option(1, "local steps")


def test_a_sweep_says_what_it_needs_of_an_algorithm_in_one_line(capsys, tmp_path):
    jaxfed.register("no_lr_for_sweeps", _NoLearningRate, lambda model, options, config: None, replace=True)
    with pytest.raises(ConfigError, match="^sweep: algorithm no_lr_for_sweeps has no float option lr"):
        sweep_configs(Config(algorithm="no_lr_for_sweeps"), seeds=[0, 1])
    assert main(["sweep", "no_lr_for_sweeps", "--seeds", "0,1", "--out", str(tmp_path / "s")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "has no float option lr" in err[0]
    assert TrainingOptions.field_for("lr") is not None  # what the message points to has one


def test_a_sweep_traces_with_its_members_matmul_precision():
    configs = sweep_configs(Config().with_overrides([*TINY, "matmul_precision=highest"]), seeds=[0, 1])
    sweep = Sweep(configs)
    states = sweep.init()
    with sweep.template.precision():
        text = jax.jit(sweep.members_run(1)).lower(sweep.seeds, sweep.values, states, sweep.data).as_text()
    assert "HIGHEST" in text
    sweep.run_rounds(states, 1)
    assert jax.config.jax_default_matmul_precision is None


def test_a_config_checked_before_is_checked_again_when_its_algorithm_is_replaced():
    jaxfed.register("replaced_later", _NoLearningRate, lambda model, options, config: None, replace=True)
    config = Config(algorithm="replaced_later", options=_NoLearningRate()).validate()

    @dataclasses.dataclass(frozen=True)
    class Other(Options):
        other: int = option(1, "another option")

    jaxfed.register("replaced_later", Other, lambda model, options, config: None, replace=True)
    with pytest.raises(ConfigError, match="options: _NoLearningRate given for algorithm replaced_later"):
        config.validate()


def test_an_lr_written_as_an_int_is_still_a_float_option_for_sweeps():
    configs = sweep_configs(Config.of({"lr": 1, **dict(pair.split("=") for pair in TINY)}), seeds=[0, 1])
    assert [c.options.lr for c in configs] == [1.0, 1.0]


def test_a_stale_resume_point_is_read_again_under_the_lock_and_sets_nothing_aside(tmp_path):
    from jaxfed.runs.driver import ResumePoint, resume_point

    out = tmp_path / "run"
    assert main(["run", "--quiet", "--out", str(out), "--set", *TINY]) == 0
    config, stale = resume_point(out)
    assert main(["run", "--quiet", "--out", str(out), "--resume", "--set", "rounds=4"]) == 0  # moves on meanwhile
    assert stale.round == 2 and RunCheckpoints(out / "checkpoints").rounds() == [2, 4]
    config = dataclasses.replace(config, rounds=6)
    summary = jaxfed.run(config, out, resume=ResumePoint(*stale), progress=False, log=lambda message: None)
    assert summary["rounds"] == 6
    assert not list((out / "checkpoints").glob("*.unreadable*"))
