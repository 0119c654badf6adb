"""Checkpoints and resume: exact continuation, refused configs, corrupt checkpoints (SIGKILL at every
kind of point: tests/test_faults.py)."""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import metrics_rows as _rows

from jaxfed import load_state, save_state
from jaxfed.cli import main
from jaxfed.runs.build import build
from jaxfed.runs.config import Config
from jaxfed.runs.driver import chunk_schedule
from jaxfed.runs.plots import read_clients
from jaxfed.runs.rundir import LOCK_FILE
from jaxfed.simulation import SimState

SMALL = ["--quiet", "--set", "num_clients=8", "--set", "local_epochs=1", "--set", "eval_every=2"]


def _final_leaves(run_dir, round_):
    state = load_state(Path(run_dir) / "checkpoints" / str(round_) / "state")
    return jax.tree.leaves(state)


def _assert_bitwise(a, b):
    assert len(a) == len(b) > 0
    for x, y in zip(a, b):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _tree_digest(directory):
    """mtime and content of every file of a run directory but its lock (which names the last
    process that held it)."""
    digest = {}
    for path in sorted(Path(directory).rglob("*")):
        if path.name == LOCK_FILE:
            continue
        stat = path.stat()
        digest[str(path)] = (stat.st_mtime_ns, hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "")
    return digest


def test_save_and_load_state_round_trip_bitwise(tmp_path):
    sim = build(Config(algorithm="local", num_clients=6).with_overrides(["local_epochs=1"])).simulation
    state, _ = sim.run_rounds(sim.init(), 2)
    save_state(tmp_path / "ckpt", state)
    restored = load_state(tmp_path / "ckpt", like=sim.init())
    assert isinstance(restored, SimState) and int(restored.round) == 2
    _assert_bitwise(jax.tree.leaves(restored), jax.tree.leaves(state))
    # the restored state runs on: the same next round as the original
    _assert_bitwise(jax.tree.leaves(sim.run_rounds(restored, 1)[0]), jax.tree.leaves(sim.run_rounds(state, 1)[0]))
    as_dicts = load_state(tmp_path / "ckpt")
    assert int(as_dicts["round"]) == 2
    with pytest.raises(ValueError):
        save_state(tmp_path / "ckpt", state)  # no silent overwrite
    save_state(tmp_path / "ckpt", state, overwrite=True)


def test_load_state_reads_a_run_directory_s_newest_checkpoint_or_names_what_to_pass(tmp_path):
    """load_state(RUN) and load_state(RUN/checkpoints/N) read the state a run saved (they raised
    orbax's FileNotFoundError about a metadata file); a directory holding no state is one line."""
    from jaxfed.cli import main
    from jaxfed.errors import ConfigError

    run = tmp_path / "run"
    assert main(["run", "--out", str(run), *SMALL, "--set", "rounds=4", "--set", "checkpoint_every=2"]) == 0
    newest = _final_leaves(run, 4)
    _assert_bitwise(jax.tree.leaves(load_state(run)), newest)
    _assert_bitwise(jax.tree.leaves(load_state(run / "checkpoints" / "4")), newest)
    assert int(load_state(run / "checkpoints" / "2")["round"]) == 2
    with pytest.raises(ConfigError, match=r"^load_state: .* holds no saved state; pass what save_state wrote"):
        load_state(tmp_path)


@pytest.mark.parametrize(
    "start, rounds, eval_every, per_call, checkpoint_every, expected",
    [
        (0, 7, 3, 5, 0, [(3, True, False), (3, True, False), (1, True, False)]),
        (0, 7, 3, 5, 2, [(2, False, True), (1, True, False), (1, False, True), (2, True, True), (1, True, True)]),
        (4, 7, 3, 5, 2, [(2, True, True), (1, True, True)]),  # resumed at a checkpoint: the same calls
        (5, 5, 3, 5, 2, []),
    ],
)
def test_chunk_schedule_is_aligned_to_absolute_rounds(start, rounds, eval_every, per_call, checkpoint_every, expected):
    assert list(chunk_schedule(start, rounds, eval_every, per_call, checkpoint_every)) == expected


SAVE_SHARDED = """
import sys, jax, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxfed import save_state
mesh = Mesh(np.array(jax.devices()), ("clients",))
x = np.arange(4.0 * jax.device_count()).reshape(jax.device_count(), 4).astype(np.float32)
state = {"clients": jax.device_put(x, NamedSharding(mesh, PartitionSpec("clients"))), "round": np.int32(3)}
save_state(sys.argv[1], state)
"""


def test_a_state_saved_on_more_devices_loads_without_like(tmp_path):
    """A checkpoint sharded over more devices than this process has (a run on 8 devices read on a
    laptop) loads onto this process's first device."""
    saved_on = jax.device_count() + 1
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    flags.append(f"--xla_force_host_platform_device_count={saved_on}")
    env = dict(os.environ, XLA_FLAGS=" ".join(flags), JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-c", SAVE_SHARDED, str(tmp_path / "s")], env=env, capture_output=True)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    state = load_state(tmp_path / "s")
    np.testing.assert_array_equal(state["clients"], np.arange(4.0 * saved_on).reshape(saved_on, 4))
    assert int(state["round"]) == 3 and state["clients"].sharding.device_set == {jax.local_devices()[0]}


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    """SMALL for 8 rounds, checkpoints every 2, left alone."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    assert main(["run", "--out", str(run_dir), *SMALL, "--set", "rounds=8", "--set", "checkpoint_every=2"]) == 0
    return run_dir


def test_resume_extends_a_finished_run(tmp_path, reference_run):
    assert main(["run", "--out", str(tmp_path / "a"), *SMALL, "--set", "rounds=4", "--set", "checkpoint_every=4"]) == 0
    np.savez(tmp_path / "a" / "clients" / "6.npz", acc=np.zeros(8))  # as a run stopped after round 6 left it
    assert main(["run", "--out", str(tmp_path / "a"), "--resume", "--quiet", "--set", "rounds=8"]) == 0
    assert _rows(tmp_path / "a") == _rows(reference_run)
    # each evaluation's per-client arrays: the same as the run left alone, the row's mean their mean
    resumed, alone = read_clients(tmp_path / "a"), read_clients(reference_run)
    assert list(resumed) == list(alone) == [2, 4, 6, 8]
    for round_, row in zip(resumed, _rows(reference_run)):
        assert resumed[round_].keys() == {"acc", "loss", "examples"}
        for name, values in alone[round_].items():
            np.testing.assert_array_equal(resumed[round_][name], values)
        assert np.mean(resumed[round_]["acc"]) == pytest.approx(row["personalized_acc_mean"], rel=1e-6)
    assert [r["round"] for r in _rows(tmp_path / "a")] == [2, 4, 6, 8]
    _assert_bitwise(_final_leaves(tmp_path / "a", 8), _final_leaves(reference_run, 8))
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert summary["rounds"] == 8


def test_resume_with_a_different_config_is_refused_and_changes_nothing(reference_run, capsys):
    run_dir = reference_run
    before = _tree_digest(run_dir)
    capsys.readouterr()
    code = main(["run", "--out", str(run_dir), "--resume", "--quiet", "--set", "lr=0.2", "--set", "batch_size=8"])
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "lr (0.05 -> 0.2)" in err and "batch_size (32 -> 8)" in err
    assert _tree_digest(run_dir) == before


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--resume"], "--resume: needs --out DIR"),
        (["--resume", "--out", "{empty}"], "does not exist; start the run without --resume"),
        (["--out", "{done}"], "already holds a run; pass --resume"),
        (["--out", "{new}", "--set", "nonfinite=ignore"], "nonfinite: unknown 'ignore'; allowed: error, skip"),
        (["--out", "{new}", "--set", "checkpoint_every=-1"], "checkpoint_every: must be >= 0"),
        (["--out", "{new}", "--set", "keep_checkpoints=0"], "keep_checkpoints: must be >= 1"),
    ],
)
def test_lifecycle_mistakes_are_one_line_exit_2(args, expected, tmp_path, reference_run, capsys):
    paths = {"{empty}": str(tmp_path / "empty"), "{done}": str(reference_run), "{new}": str(tmp_path / "new")}
    assert main(["run", "--quiet", *[paths.get(a, a) for a in args]]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and expected in err


def test_corrupt_newest_checkpoint_is_skipped_with_a_warning(tmp_path, reference_run, capsys):
    run_dir = tmp_path / "run"
    assert main(["run", "--out", str(run_dir), *SMALL, "--set", "rounds=6", "--set", "checkpoint_every=2"]) == 0
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["2", "4", "6"]
    for path in (run_dir / "checkpoints" / "6" / "state").rglob("*"):
        if path.is_file() and path.stat().st_size > 64:
            path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])  # truncated
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"round": 8, "personalized_acc')  # a partial line, as if killed mid-write
    capsys.readouterr()
    assert main(["run", "--out", str(run_dir), "--resume", "--quiet", "--set", "rounds=8"]) == 0
    err = capsys.readouterr().err
    assert "checkpoints/6 is unreadable" in err and "resuming from round 4" in err
    assert _rows(run_dir) == _rows(reference_run)
    assert [r["round"] for r in _rows(run_dir)] == [2, 4, 6, 8]
    _assert_bitwise(_final_leaves(run_dir, 8), _final_leaves(reference_run, 8))


def test_keep_checkpoints_keeps_the_newest(tmp_path):
    args = ["--set", "rounds=5", "--set", "checkpoint_every=1", "--set", "keep_checkpoints=2"]
    assert main(["run", "--out", str(tmp_path / "run"), *SMALL, *args]) == 0
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["4", "5"]


def test_a_resumed_fedloru_run_counts_the_cached_download_as_one_left_alone(tmp_path):
    """Each client's W round is client state and the cached total a run-record total: both
    survive a resume, so the rows (bytes_down_cached_* included) match the run left alone."""
    fedloru = ["fedloru", *SMALL, "--set", "participation=0.5", "--set", "checkpoint_every=2"]
    fedloru += ["--set", "lora_rank=4", "--set", "accumulate_every=2"]
    assert main(["run", *fedloru, "--out", str(tmp_path / "alone"), "--set", "rounds=6"]) == 0
    assert main(["run", *fedloru, "--out", str(tmp_path / "a"), "--set", "rounds=2"]) == 0
    assert main(["run", "--out", str(tmp_path / "a"), "--resume", "--quiet", "--set", "rounds=6"]) == 0
    rows = _rows(tmp_path / "a")
    assert rows == _rows(tmp_path / "alone")
    assert 0 < rows[-1]["bytes_down_cached_total"] < rows[-1]["bytes_down_total"]


def test_a_checkpoint_holds_the_record_as_it_was_when_saved(tmp_path):
    """The save writes in the background while training goes on updating the live record (its
    totals, pending metrics and rows): what is written, and its digest, are the record at save."""
    from jaxfed.runs.checkpoint import RunCheckpoints

    checkpoints = RunCheckpoints(tmp_path / "checkpoints")
    record = {"totals": {"bytes_up": 1.0}, "pending": {"train_loss": [0.5]}, "rows": [{"round": 2}]}
    checkpoints.save(2, {"x": np.zeros(3, np.float32)}, record)
    record["totals"]["bytes_up"] += 1.0
    record["pending"]["train_loss"].append(0.4)
    record["rows"].append({"round": 3})
    checkpoints.wait()
    saved = checkpoints.read_record(2)  # raises on a digest mismatch
    assert saved["totals"] == {"bytes_up": 1.0} and saved["pending"] == {"train_loss": [0.5]}
    assert saved["rows"] == [{"round": 2}]
