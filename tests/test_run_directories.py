"""Run directories from research code: a resume by another simulation (other options, seed,
participation, data, algorithm) refused in one line with every checkpoint in place, config.json
describing the simulation, the per-evaluation callback, and load_runs' records."""

import dataclasses
import hashlib
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import metrics_rows

import jaxfed
from jaxfed.algorithms import registry
from jaxfed.algorithms.fedavg import FedAvgOptions, fedavg
from jaxfed.errors import ConfigError
from jaxfed.runs.build import build
from jaxfed.runs.checkpoint import INTEGRITY, record_digest
from jaxfed.runs.config import Config
from jaxfed.runs.driver import recorded_config
from jaxfed.runs.fingerprint import check_same_simulation, differences, fingerprint
from jaxfed.runs.plots import run_labels
from jaxfed.runs.rundir import LOCK_FILE, LoopSettings, RunDirectory, RunRecord

# jaxfed.run(TINY) and run_simulation(build(TINY).simulation) compile the same programs (one compile).
TINY = Config().with_overrides(
    ["num_clients=4", "mlp_hidden=16", "local_epochs=1", "batch_size=32", "lr=0.05", "participation=0.5"]
)
SETTINGS = LoopSettings(rounds=2, eval_every=1, checkpoint_every=1)
LONGER = SETTINGS._replace(rounds=3)


def _tiny(*pairs: str):
    return build(TINY.with_overrides(list(pairs))).simulation


def _files(directory) -> dict:
    """Content of every file of a run directory but its lock."""
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(Path(directory).rglob("*"))
        if p.is_file() and p.name != LOCK_FILE
    }


def _lines(path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A run_simulation run of TINY (2 rounds, evaluated and checkpointed each), its callback's rows."""
    sim, out, heard = _tiny(), tmp_path_factory.mktemp("base") / "run", []
    jaxfed.run_simulation(
        sim, out, SETTINGS, config={"dataset": "digits"}, progress=False, log=lambda m: None, on_evaluation=heard.append
    )
    return SimpleNamespace(sim=sim, out=out, heard=heard)


def test_a_resume_by_another_simulation_is_refused_in_one_line_naming_what_differs(base):
    before = _files(base.out)
    cases = [
        (
            _tiny("lr=0.2", "seed=3", "participation=1.0"),
            ["lr (0.05 -> 0.2)", "seed (0 -> 3)", "participation (0.5 -> 1.0)"],
        ),
        (_tiny("alpha=0.1"), ["partition ('#", "resume with the simulation that wrote it"]),  # the data's partition
    ]
    for sim, named in cases:
        with pytest.raises(ConfigError) as refused:
            jaxfed.run_simulation(sim, base.out, LONGER, resume=True, progress=False, log=lambda m: None)
        message = str(refused.value)
        assert len(message.splitlines()) == 1 and all(n in message for n in named), message
        assert "examples (" not in message and "algorithm (" not in message  # only what differs
    assert "lr (" not in message and "seed (" not in message
    assert _files(base.out) == before


def test_an_option_added_since_a_checkpoint_is_compared_at_its_default(base, tmp_path):
    """A checkpoint recorded before fedavg had ``client_optimizer`` (its record lacks the key)
    resumes with the option at its default, and is refused with another value."""
    out = tmp_path / "run"
    shutil.copytree(base.out, out)
    records = sorted((out / "checkpoints").glob("*/run/metadata"))
    assert records
    for path in records:  # each checkpoint's record as an older jaxfed wrote it, its digest renewed
        record = json.loads(path.read_text())
        del record["fingerprint"]["options"]["client_optimizer"]
        record[INTEGRITY]["record"] = record_digest(record)
        path.write_text(json.dumps(record))
    with pytest.raises(ConfigError, match=r"client_optimizer \('sgd' -> 'adam'\)"):
        jaxfed.run_simulation(_tiny("client_optimizer=adam"), out, LONGER, resume=True, progress=False)
    jaxfed.run_simulation(base.sim, out, LONGER, resume=True, progress=False, log=lambda m: None)
    options = fingerprint(base.sim)["options"]
    saved = {"algorithm": "fedavg", "options": {k: v for k, v in options.items() if k != "lr"}}
    current = {"algorithm": "fedavg", "options": options}
    assert differences(saved, current) == ["lr (None -> 0.05)"]  # no defaults given: compared as absent
    assert differences(saved, current, {"lr": 0.05}) == []
    assert differences(saved, current, {"lr": 0.01}) == ["lr (0.01 -> 0.05)"]


def _written_by(other, path: Path, fingerprinted: bool) -> None:
    """A run directory of ``other`` with checkpoints of rounds 1 and 2 (its initial state renumbered),
    its records with ``other``'s fingerprint or (``fingerprinted`` False, as before fingerprints) none."""
    directory = RunDirectory(path)
    directory.start({"algorithm": other.algorithm.name}, [])
    record = RunRecord({"algorithm": other.algorithm.name}, fingerprint=fingerprint(other) if fingerprinted else None)
    state = other.init()
    for round_ in (1, 2):
        directory.save(state.replace(round=state.round + round_), record, 0.0, 1)
    directory.checkpoints.wait()
    directory.checkpoints.close()


@pytest.fixture(scope="module")
def local_sim():
    return _tiny("algorithm=local")


@pytest.mark.parametrize(
    "fingerprinted, expected",
    [
        (True, "differs from the one that wrote"),
        (False, "holds a state of another structure: it lacks server.params.fc1.bias"),
    ],
)
def test_a_checkpoint_of_another_algorithm_is_refused_in_one_line_and_every_checkpoint_kept(
    base, local_sim, tmp_path, fingerprinted, expected
):
    _written_by(local_sim, tmp_path / "local", fingerprinted)
    before, warnings = _files(tmp_path / "local"), []
    with pytest.raises(ConfigError) as refused:
        jaxfed.run_simulation(base.sim, tmp_path / "local", LONGER, resume=True, progress=False, log=warnings.append)
    message = str(refused.value)
    assert len(message.splitlines()) == 1 and expected in message, message
    assert fingerprinted or "resume with the simulation that wrote it" in message
    assert not fingerprinted or "algorithm ('local' -> 'fedavg')" in message
    assert sorted(p.name for p in (tmp_path / "local" / "checkpoints").iterdir()) == ["1", "2"]
    assert _files(tmp_path / "local") == before
    assert not any("unreadable" in w for w in warnings)
    assert fingerprinted or any("records no simulation fingerprint" in w for w in warnings)


def test_a_run_stopped_by_its_callback_resumes_unchanged(base, tmp_path):
    """A callback that raises stops the run with its exception, the directory as a stopped run
    leaves it; the same simulation (built again: the same fingerprint) resumes it to the rows of
    the run left alone."""

    def stop(row):
        raise RuntimeError(f"seen round {row['round']}")

    with pytest.raises(RuntimeError, match="seen round 1"):
        jaxfed.run_simulation(base.sim, tmp_path / "run", SETTINGS, progress=False, on_evaluation=stop)
    assert [p.name for p in (tmp_path / "run" / "checkpoints").iterdir()] == ["1"]
    assert fingerprint(_tiny()) == fingerprint(base.sim)  # (resumed with base.sim: not traced again)
    jaxfed.run_simulation(base.sim, tmp_path / "run", SETTINGS, resume=True, progress=False, log=lambda m: None)
    assert metrics_rows(tmp_path / "run") == metrics_rows(base.out)


def test_a_directory_without_fingerprints_still_resumes_with_a_warning(base, tmp_path):
    old = RunDirectory(tmp_path / "old")  # as jaxfed wrote it before fingerprints: its record has none
    old.start(recorded_config(base.sim, SETTINGS), [])
    old.save(base.sim.init(), RunRecord(recorded_config(base.sim, SETTINGS)), 0.0, 1)
    old.checkpoints.wait()
    old.checkpoints.close()
    warnings = []
    jaxfed.run_simulation(base.sim, tmp_path / "old", SETTINGS, resume=True, progress=False, log=warnings.append)
    assert metrics_rows(tmp_path / "old") == metrics_rows(base.out)
    assert sum("records no simulation fingerprint" in w for w in warnings) == 1


def test_config_json_describes_the_simulation_so_two_runs_get_their_own_labels(base):
    data = base.sim.data
    expected = {
        "algorithm": "fedavg",
        "options": FedAvgOptions(lr=0.05, local_epochs=1, batch_size=32).to_dict(),
        "model": "mlp",
        "num_clients": 4,
        "participation": 0.5,
        "sampling": "uniform",
        "eval_clients": "all",
        "eval_batch_size": 256,
        "matmul_precision": "default",
        "seed": 0,
        "new_client_ids": [],
        "data": {
            "train_examples": int(data.x_train.shape[0]),
            "test_examples": int(data.x_test.shape[0]),
            "input_shape": [8, 8, 1],
            "num_classes": 10,
        },
        "rounds": 2,
        "eval_every": 1,
        "rounds_per_call": 5,
        "checkpoint_every": 1,
        "keep_checkpoints": 3,
        "dataset": "digits",  # the caller's config, added
    }
    written = json.loads((base.out / "config.json").read_text())
    assert written == expected
    other = recorded_config(_tiny("lr=0.2", "seed=1"), SETTINGS)
    assert other["dataset"] == "digits"  # the data's own name where the caller records none (was null)
    assert run_labels([written, other]) == ["fedavg lr=0.05 seed=0", "fedavg lr=0.2 seed=1"]
    # a registered builder that leaves the record's options unset: the registry's build sets them
    jaxfed.register(
        "fedavg_undescribed", FedAvgOptions, lambda m, o, c: fedavg(m, o)._replace(options=None), replace=True
    )
    options = FedAvgOptions(lr=0.3)
    assert registry.get("fedavg_undescribed").build(base.sim.model, options, None).options is options


def test_the_callback_hears_exactly_the_rows_of_metrics_jsonl(base):
    assert [r["round"] for r in base.heard] == [1, 2]
    assert base.heard == _lines(base.out / "metrics.jsonl")


def _flattened(values: dict, prefix: str = "") -> dict:
    """The reference flattening: nested dicts to dotted keys, lists to tuples."""
    out = {}
    for key, value in values.items():
        if isinstance(value, dict):
            out.update(_flattened(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = tuple(value) if isinstance(value, list) else value
    return out


def _expected_records(run_dir: Path, per: str) -> list[dict]:
    config = json.loads((run_dir / "config.json").read_text())
    flat = {**config.pop("options", {}), **_flattened(config), "run_dir": str(run_dir)}
    if per == "run":  # the summary's values, but a None over a config key
        summary = _flattened(json.loads((run_dir / "summary.json").read_text()))
        return [{**flat, "finished": True, **{k: v for k, v in summary.items() if v is not None or k not in flat}}]
    return [{**flat, **_flattened(row)} for row in _lines(run_dir / "metrics.jsonl")]


def test_jaxfed_run_calls_back_and_load_runs_gives_what_the_files_hold(base, tmp_path):
    heard = []
    jaxfed.run(
        dataclasses.replace(TINY, rounds=2, eval_every=1),
        tmp_path / "cli",
        progress=False,
        log=lambda m: None,
        on_evaluation=heard.append,
    )
    assert heard == _lines(tmp_path / "cli" / "metrics.jsonl") and len(heard) == 2
    # a directory of run directories (as a sweep's) stands for those below it
    shutil.copytree(base.out, tmp_path / "sweep" / "a")
    shutil.copytree(tmp_path / "cli", tmp_path / "sweep" / "b")
    for per in ("row", "run"):
        expected = [r for d in ("a", "b") for r in _expected_records(tmp_path / "sweep" / d, per)]
        assert jaxfed.load_runs(tmp_path / "sweep", per=per) == expected
        assert jaxfed.load_runs([tmp_path / "sweep" / "a", tmp_path / "sweep" / "b"], per=per) == expected
    records = jaxfed.load_runs(tmp_path / "sweep")
    assert len(records) == 4 and {r["lr"] for r in records} == {0.05}
    # a member stopped before its first row (config.json alone): no rows, not finished
    (tmp_path / "sweep" / "c").mkdir()
    shutil.copy(tmp_path / "cli" / "config.json", tmp_path / "sweep" / "c")
    assert jaxfed.load_runs(tmp_path / "sweep") == records
    assert [r["finished"] for r in jaxfed.load_runs(tmp_path / "sweep", per="run")] == [True, True, False]
    shutil.rmtree(tmp_path / "sweep" / "c")
    assert records[0]["data.input_shape"] == (8, 8, 1) and records[2]["partition"] == "dirichlet"
    with pytest.raises(ConfigError, match="per: unknown 'cell'; allowed: row, run"):
        jaxfed.load_runs(tmp_path / "sweep", per="cell")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="empty holds no metrics.jsonl and no run directories"):
        jaxfed.load_runs(tmp_path / "empty")


def test_options_known_on_neither_side_are_not_compared_and_said_so():
    """An algorithm built without ``options=`` (the SCAFFOLD example did so) resumed with other
    options silently; now the resume warns that they were not compared."""
    for saved_options, current_options, said in (
        (None, None, "records no options"),
        ({"lr": 0.1}, None, "known for the checkpoint only"),
        ({"lr": 0.1}, {"lr": 0.1}, None),
    ):
        warnings = []
        saved, current = ({"algorithm": "x", "options": o} for o in (saved_options, current_options))
        check_same_simulation(saved, current, "RUN", warnings.append, code_warning=False)
        assert [said in w for w in warnings] == ([True] if said else []), warnings


def test_the_cli_resume_of_a_run_written_from_python_says_to_resume_it_from_python(base, capsys):
    """`jaxfed run --out DIR --resume` of run_simulation's directory read its config.json as a
    config: `dataset: unknown 'mnist_sub'`, or the default digits config and a fingerprint mismatch."""
    from jaxfed.cli import main

    before = _files(base.out)
    assert main(["run", "--quiet", "--out", str(base.out), "--resume"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "was written by jaxfed.run_simulation" in err and "resume=True" in err
    assert _files(base.out) == before


def test_config_json_records_the_data_directory_the_environment_gave(tmp_path, monkeypatch):
    """A run that read mnist from ``$JAXFED_DATA_DIR`` recorded ``data_dir: ""``, so its resume in
    a shell without the variable could not find the data; the directory is now recorded (as an
    absolute path), and only for a dataset read from files."""
    from jaxfed.runs.config import Config

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("JAXFED_DATA_DIR", "data")
    assert Config(dataset="mnist").recorded()["data_dir"] == str(tmp_path / "data")
    assert Config(dataset="mnist", data_dir=str(tmp_path / "own")).recorded()["data_dir"] == str(tmp_path / "own")
    assert Config(dataset="digits").recorded()["data_dir"] == ""
    monkeypatch.delenv("JAXFED_DATA_DIR")
    assert Config(dataset="mnist").recorded()["data_dir"] == ""
