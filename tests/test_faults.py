"""Faults and bad input: each case ends in one line and its exit code, and loses nothing written.

Bad data files, bad values, unusable output directories, two processes on one run directory,
resume dead ends, runs whose every client update was skipped. The "Reliability" table (docs/reliability.md)
lists these cases with their outcomes; kills at every point of a run are in test_checkpoint.py.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import flip_state_byte
from conftest import metrics_rows as _rows

from jaxfed.cli import main
from jaxfed.data import Dataset, federate
from jaxfed.data.validate import DataError
from jaxfed.errors import ConfigError
from jaxfed.nn import get_model
from jaxfed.runs.rundir import RunDirectory, new_run_dir

TINY = ["--set", "num_clients=4", "rounds=2", "eval_every=1", "checkpoint_every=1"]


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("jaxfed: error: ")
    return err


def _last_line_error(capsys) -> str:
    """The error line of a run that got as far as logging (partition, resuming ...), no traceback."""
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and err.splitlines()[-1].startswith("jaxfed: error: "), err
    return err.splitlines()[-1]


# ----- data files ---------------------------------------------------------------------------------


def _arrays(n_train=40, n_test=20):
    rng = np.random.default_rng(0)
    return {
        "x_train": rng.integers(0, 255, (n_train, 28, 28)).astype(np.uint8),
        "y_train": rng.integers(0, 10, n_train),
        "x_test": rng.integers(0, 255, (n_test, 28, 28)).astype(np.uint8),
        "y_test": rng.integers(0, 10, n_test),
    }


def _nan_pixel(a):
    x = a["x_train"].astype(np.float32)
    x[0, 3, 3] = np.nan
    return {**a, "x_train": x}


BAD_ARRAYS = {
    "labels above the classes": (lambda a: {**a, "y_train": a["y_train"] + 20}, "y_train has labels 20..29"),
    "negative test labels": (lambda a: {**a, "y_test": a["y_test"] - 1}, "y_test has labels -1.."),
    "a NaN pixel": (_nan_pixel, "x_train has 1 NaN or inf value(s)"),
    "one label short": (lambda a: {**a, "y_train": a["y_train"][:-1]}, "y_train has 39 entries for the 40 examples"),
    "channels first": (
        lambda a: {**a, "x_train": a["x_train"][:, None], "x_test": a["x_test"][:, None]},
        "channels first",
    ),
    "flattened images": (
        lambda a: {**a, "x_train": a["x_train"].reshape(40, -1), "x_test": a["x_test"].reshape(20, -1)},
        "flattened",
    ),
    "2-D labels": (lambda a: {**a, "y_train": a["y_train"][:, None]}, "per example (N,) (y_train.ravel())"),
    "an empty test split": (lambda a: {**a, "x_test": a["x_test"][:0], "y_test": a["y_test"][:0]}, "x_test is empty"),
    "no test split": (lambda a: {"x_train": a["x_train"], "y_train": a["y_train"]}, "lacks x_test, y_test"),
    "float labels": (lambda a: {**a, "y_train": a["y_train"].astype(np.float32)}, "class labels must be integers"),
    "test images of another shape": (lambda a: {**a, "x_test": a["x_test"][:, :20]}, "both splits need one shape"),
    "text labels": (lambda a: {**a, "y_train": a["y_train"].astype(str)}, "y_train has dtype <U"),
}


def _corrupt(path: Path, how: str) -> str:
    np.savez(path, **_arrays())
    data = path.read_bytes()
    if how == "random bytes":
        path.write_bytes(np.random.default_rng(1).bytes(4000))
        return "not an .npz file"
    if how == "a text file":
        path.write_text("x_train,y_train\n1,2\n")
        return "not an .npz file"
    if how == "truncated":
        path.write_bytes(data[: len(data) // 2])
        return "truncated or corrupt"
    if how == "a flipped bit":
        flipped = bytearray(data)
        flipped[len(data) // 3] ^= 0x10
        path.write_bytes(bytes(flipped))
        return "Bad CRC-32"
    if how == "object arrays":
        np.savez(path, **{**_arrays(), "y_train": np.array([object()] * 40, dtype=object)})
        return "object arrays (pickles), which are never loaded"
    raise ValueError(how)


def _run_mnist(data_dir, out, capsys):
    code = main(["run", "--dataset", "mnist", "--data-dir", str(data_dir), "--quiet", "--out", str(out), *TINY])
    return code, _one_line_error(capsys)


@pytest.mark.parametrize("case", sorted(BAD_ARRAYS))
def test_bad_arrays_are_one_line_before_anything_is_built(case, tmp_path, capsys):
    change, expected = BAD_ARRAYS[case]
    np.savez(tmp_path / "mnist.npz", **change(_arrays()))
    code, err = _run_mnist(tmp_path, tmp_path / "out", capsys)
    assert code == 2 and expected in err and "mnist.npz" in err
    assert not RunDirectory(tmp_path / "out").holds_run()


@pytest.mark.parametrize("how", ["random bytes", "a text file", "truncated", "a flipped bit", "object arrays"])
def test_unreadable_npz_files_are_one_line(how, tmp_path, capsys):
    expected = _corrupt(tmp_path / "mnist.npz", how)
    code, err = _run_mnist(tmp_path, tmp_path / "out", capsys)
    assert code == 2 and expected in err


def test_federate_checks_data_passed_from_python():
    a = _arrays()
    x_train, x_test = a["x_train"][..., None] / 255.0, a["x_test"][..., None] / 255.0
    good = Dataset("mine", x_train, a["y_train"], x_test, a["y_test"], 10)
    parts = [np.arange(20), np.arange(20, 40)]
    federate(good, parts, [np.arange(10), np.arange(10, 20)])
    with pytest.raises(DataError, match="client 1's training indices run 20..40; the training split has 40"):
        federate(good, [np.arange(20), np.arange(20, 41)], [np.arange(10), np.arange(10, 20)])
    bad = Dataset("mine", good.x_train, good.y_train + 10, good.x_test, good.y_test, 10)
    with pytest.raises(DataError, match="dataset 'mine': y_train has labels 10..19"):
        federate(bad, parts, [np.arange(10), np.arange(10, 20)])
    x = np.array(good.x_train)
    x[1, 2, 2] = np.inf
    with pytest.raises(DataError, match="x_train has 1 NaN or inf"):
        federate(Dataset("mine", x, good.y_train, good.x_test, good.y_test, 10), parts, parts)
    mixed = Dataset("mine", x_train, a["y_train"].astype(np.float32), x_test, a["y_test"], 10)
    with pytest.raises(DataError, match="y_train has dtype float32, float .regression targets., but y_test int64"):
        federate(mixed, parts, [np.arange(10), np.arange(10, 20)])
    text = Dataset("mine", x_train, a["y_train"].astype(np.float32), x_test, a["y_test"].astype(str), 10)
    with pytest.raises(DataError, match="y_test has dtype <U.*; expected numbers"):
        federate(text, parts, [np.arange(10), np.arange(10, 20)])
    for shape in ((784,), (1, 28, 28), (4, 7, 28)):  # features of any shape (an MLP's, a model of one's own)
        x, x_held = x_train.reshape(40, *shape), x_test.reshape(20, *shape)
        federate(Dataset("mine", x, a["y_train"], x_held, a["y_test"], 10), parts, [np.arange(10), np.arange(10, 20)])


def test_a_misspelt_name_from_python_is_told_the_close_one():
    from jaxfed.data import load_dataset, partition

    y = np.arange(100) % 10
    misspelt = r"^partition: unknown 'dirichlett' \(did you mean 'dirichlet'\?\); allowed: iid, "
    with pytest.raises(ConfigError, match=misspelt):
        partition("dirichlett", y, y, 5, np.random.default_rng(0))
    with pytest.raises(ConfigError, match=r"^dataset: unknown 'mnst' \(did you mean 'mnist'\?\); allowed: digits, "):
        load_dataset("mnst")
    with pytest.raises(ConfigError, match=r"^model: unknown 'resnet9' \(did you mean 'resnet8'\?\); allowed: "):
        get_model("resnet9", (28, 28, 1), 10)
    with pytest.raises(ConfigError, match=r"^norm: unknown 'layer'; allowed: "):  # nothing close: no guess
        get_model("cnn", (28, 28, 1), 10, norm="layer")


@pytest.mark.parametrize(
    "shape, hint",
    [((1, 28, 28), "or give the images channels last: x.transpose(0, 2, 3, 1)"), ((28, 28), "x[..., None]")],
)
def test_a_model_refusing_images_in_another_layout_says_how_to_fix_them(shape, hint):
    with pytest.raises(
        ConfigError, match=rf"^model: 'cnn' cannot take inputs of shape {re.escape(str(shape))} .*{re.escape(hint)}"
    ):
        get_model("cnn", shape, 10)


# ----- values and options -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--set", "seed=-1"], "seed: must be in 0..4294967295 (JAX's keys hold 32 bits), got -1"),
        (["--set", "batch_size=1000000000"], "batch_size: 1000000000 is larger than the 1442 training examples"),
        (["--set", "lr=inf"], "lr: must be a finite number >= 0, got inf"),
        (["--set", "momentum=nan"], "momentum: must be a finite number in [0, 1), got nan"),
        (["--set", "weight_decay=inf"], "weight_decay: must be a finite number >= 0, got inf"),
        (["--set", "rounds=1", "fedavg"], "got 'fedavg' (name the algorithm before --set)"),
        (["--set", "rounds=two"], "rounds"),
    ],
)
def test_bad_values_are_one_line(args, expected, tmp_path, capsys):
    assert main(["run", "--quiet", "--out", str(tmp_path / "out"), *args]) == 2
    assert expected in _one_line_error(capsys)
    assert not RunDirectory(tmp_path / "out").holds_run()


def test_a_set_without_a_value_is_told_to_name_the_algorithm_first_only_when_it_is_one(tmp_path, capsys):
    assert main(["run", "fedavg", "--quiet", "--out", str(tmp_path / "out"), "--set", "lr"]) == 2
    assert _one_line_error(capsys) == "jaxfed: error: --set: expected key=value, got 'lr'"


def test_a_config_file_that_is_not_utf8_is_one_line(tmp_path, capsys):
    (tmp_path / "bad.conf").write_bytes(b"rounds = 2\nlr = 0.1 \xff\n")
    assert main(["run", "--quiet", "--config", str(tmp_path / "bad.conf"), "--out", str(tmp_path / "o")]) == 2
    assert "bad.conf line 2: not UTF-8 text (byte 0xff)" in _one_line_error(capsys)


# ----- output directories -------------------------------------------------------------------------


def test_out_that_is_a_file_or_under_one_is_refused_first(tmp_path, capsys):
    (tmp_path / "afile").write_text("mine")
    cases = ((tmp_path / "afile", "is a file, not a directory"), (tmp_path / "afile" / "sub", "is a file, so"))
    for out, expected in cases:
        # a data directory that would fail too: the output directory is checked before the data
        code = main(["run", "--dataset", "mnist", "--data-dir", str(tmp_path / "none"), "--quiet", "--out", str(out)])
        assert code == 2 and expected in _one_line_error(capsys)
    assert (tmp_path / "afile").read_text() == "mine"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes to read-only directories")
def test_a_read_only_out_is_refused(tmp_path, capsys):
    (tmp_path / "ro").mkdir(mode=0o555)
    assert main(["run", "--quiet", "--out", str(tmp_path / "ro" / "run")]) == 2
    assert "is not writable" in _one_line_error(capsys)


def test_default_run_directories_started_in_the_same_second_differ(tmp_path):
    stem = tmp_path / "runs" / "fedavg_digits"
    made = [new_run_dir(stem) for _ in range(3)]
    assert len(set(made)) == 3 and all(p.is_dir() for p in made)


def test_a_second_process_on_the_same_out_is_refused(tmp_path, capsys):
    out = tmp_path / "run"
    hold = (
        "import sys, time\nfrom jaxfed.runs.rundir import RunDirectory\n"
        "with RunDirectory(sys.argv[1]).locked():\n    print('held', flush=True)\n    time.sleep(60)"
    )
    holder = subprocess.Popen([sys.executable, "-c", hold, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert main(["run", "--quiet", "--out", str(out), *TINY]) == 2
        assert f"another jaxfed process (pid {holder.pid}) is writing this run directory" in _one_line_error(capsys)
        assert not (out / "config.json").exists()
    finally:
        holder.kill()
        holder.wait()
    assert main(["run", "--quiet", "--out", str(out), *TINY]) == 0  # a killed holder's lock is gone


# ----- resume dead ends ---------------------------------------------------------------------------


def test_resume_with_fewer_rounds_than_done_is_refused(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["run", "--quiet", "--out", str(out), *TINY]) == 0
    before = (out / "summary.json").read_text()
    capsys.readouterr()
    assert main(["run", "--quiet", "--out", str(out), "--resume", "--set", "rounds=1"]) == 2
    assert "rounds: 1 is fewer than the 2 rounds the checkpoint has done" in _one_line_error(capsys)
    assert (out / "summary.json").read_text() == before
    assert json.loads((out / "config.json").read_text())["rounds"] == 2


def test_a_run_stopped_before_its_first_checkpoint_can_start_again(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.json").write_text("{}")
    (out / "metrics.jsonl").write_text("")
    assert main(["run", "--quiet", "--out", str(out), "--resume"]) == 2
    assert "start it again without --resume" in _one_line_error(capsys)
    assert main(["run", "--quiet", "--out", str(out), *TINY]) == 0


def test_a_run_without_checkpoints_is_neither_resumed_nor_overwritten(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["run", "--quiet", "--out", str(out), *TINY, "--set", "checkpoint_every=0"]) == 0
    before = (out / "metrics.jsonl").read_text()
    capsys.readouterr()
    assert main(["run", "--quiet", "--out", str(out), "--resume"]) == 2
    assert "delete it or choose another --out" in _one_line_error(capsys)
    assert main(["run", "--quiet", "--out", str(out), *TINY]) == 2
    assert "without checkpoints (checkpoint_every=0), which cannot be resumed" in _one_line_error(capsys)
    assert (out / "metrics.jsonl").read_text() == before


@pytest.mark.slow  # a multi-process campaign (README: Run the tests)
def test_host_devices_split_the_host_before_jax_starts_in_a_sweep_and_a_resume(tmp_path):
    """`jaxfed sweep --set host_devices=2` from a fresh process (it failed: JAX had started), then
    a member resumed by `jaxfed run --resume` without a device count in XLA_FLAGS: the resumed
    process sets it from the run's config before JAX starts. (The suite's other XLA flags stay:
    without them each process compiled at full optimization, 13 s each.)"""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    env = dict(os.environ, XLA_FLAGS=" ".join(flags))
    command = [sys.executable, "-m", "jaxfed.cli", "sweep", "--quiet", "--seeds", "0,1", "--out", str(tmp_path)]
    done = subprocess.run([*command, *TINY, "--set", "host_devices=2"], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    members = sorted(tmp_path.iterdir())
    assert [json.loads((d / "summary.json").read_text())["devices"] for d in members] == [2, 2]
    resume = [sys.executable, "-m", "jaxfed.cli", "run", "--quiet", "--out", str(members[0]), "--resume"]
    again = subprocess.run([*resume, "--set", "rounds=3"], env=env, capture_output=True, text=True)
    assert again.returncode == 0, again.stderr
    summary = json.loads((members[0] / "summary.json").read_text())
    assert (summary["devices"], summary["rounds"]) == (2, 3)


def test_a_sweep_over_host_devices_is_a_one_line_error(tmp_path, capsys):
    args = ["sweep", "--quiet", "--out", str(tmp_path / "s"), *TINY, "--grid", "host_devices=1,2"]
    assert main(args) == 2
    assert "host_devices: one process runs on one set of devices, got [1, 2]" in _one_line_error(capsys)
    assert not (tmp_path / "s").exists()


# ----- what a run reports -------------------------------------------------------------------------


def test_rounds_where_every_update_was_skipped_report_no_train_loss(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["run", "--out", str(out), "--quiet", "--set", "lr=1e30", "nonfinite=skip", *TINY]) == 0
    line = capsys.readouterr().out.strip()
    rows = [json.loads(r) for r in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(r["train_loss"] is None and r["nonfinite_skipped"] > 0 for r in rows)
    skipped = int(sum(r["nonfinite_skipped"] for r in rows))
    assert line.endswith(f"{skipped} non-finite client update(s) skipped (see nonfinite_skipped in metrics.jsonl)")


def test_lock_is_released_when_a_run_ends(tmp_path):
    out = tmp_path / "run"
    with RunDirectory(out).locked():
        with pytest.raises(ConfigError, match="this process is writing this run directory already"):
            with RunDirectory(out).locked():  # one lock per run: taking it twice is a mistake
                pass
    start = time.time()
    with RunDirectory(out).locked():
        pass
    assert time.time() - start < 1


# ----- damaged checkpoints ------------------------------------------------------------------------

CHECKPOINTED = ["--set", "num_clients=4", "rounds=4", "eval_every=2", "checkpoint_every=2"]


def _edit_record(step: Path) -> None:
    record_file = step / "run" / "metadata"
    record = json.loads(record_file.read_text())
    record["rows"][-1]["personalized_acc_mean"] = 0.99
    record_file.write_text(json.dumps(record))


def _edit_record_dropping_its_digests(step: Path) -> None:
    """An edit that also drops the digests, which a record saved before digests lacks."""
    _edit_record(step)
    record_file = step / "run" / "metadata"
    record = json.loads(record_file.read_text())
    del record["integrity"]
    record_file.write_text(json.dumps(record))


DAMAGES = {
    "a flipped state bit": (flip_state_byte, "differs from what was saved (digest mismatch)"),
    "an edited record": (_edit_record, "differs from what was saved (digest mismatch)"),
    "an edited record without its digests": (_edit_record_dropping_its_digests, "lost its digests"),
}


@pytest.fixture(scope="module")
def checkpointed_run(tmp_path_factory):
    """A finished run with checkpoints of rounds 2 and 4: each damage test's reference and (copied) subject."""
    reference = tmp_path_factory.mktemp("damaged") / "reference"
    assert main(["run", "--quiet", "--out", str(reference), *CHECKPOINTED]) == 0
    return reference


@pytest.mark.parametrize("damage, reason", DAMAGES.values(), ids=DAMAGES.keys())
def test_a_damaged_newest_checkpoint_is_set_aside_and_the_resume_is_exact(
    damage, reason, checkpointed_run, tmp_path, capsys
):
    reference, out = checkpointed_run, tmp_path / "run"
    shutil.copytree(reference, out)
    damage(out / "checkpoints" / "4")
    (out / "summary.json").unlink()  # stopped after its last checkpoint (a finished run is left as it is)
    capsys.readouterr()
    assert main(["run", "--quiet", "--out", str(out), "--resume", "--set", "rounds=4"]) == 0
    err = capsys.readouterr().err
    assert "Traceback" not in err and "Exception ignored" not in err
    warnings = [line for line in err.splitlines() if "is unreadable" in line]
    assert len(warnings) == 1 and reason in warnings[0]
    assert (out / "checkpoints" / "4.unreadable").is_dir()
    rows = [(out / name / "metrics.jsonl").read_text() for name in ("",)]
    want = [json.loads(r) for r in (reference / "metrics.jsonl").read_text().splitlines()]
    got = [json.loads(r) for r in rows[0].splitlines()]
    for row in (*want, *got):
        row.pop("round_seconds"), row.pop("wall_seconds")
    assert got == want


# ----- downloads ----------------------------------------------------------------------------------


def test_download_without_tensorflow_fails_in_seconds(tmp_path, capsys, monkeypatch):
    from jaxfed.data import datasets

    monkeypatch.setattr(datasets, "tensorflow_installed", lambda: False)
    start = time.time()
    args = ["--dataset", "mnist", "--data-dir", str(tmp_path / "data"), "--set", "download=true"]
    assert main(["run", "--quiet", "--out", str(tmp_path / "out"), *args]) == 2
    assert "TFDS needs TensorFlow to prepare 'mnist': pip install 'jaxfed[tfds]'" in _one_line_error(capsys)
    assert time.time() - start < 30 and not (tmp_path / "out").exists()


def test_download_without_internet_fails_in_seconds(monkeypatch):
    from jaxfed.data import datasets

    monkeypatch.setattr(datasets, "tensorflow_installed", lambda: True)
    monkeypatch.setattr(datasets, "DOWNLOAD_HOST", ("127.0.0.1", 9))  # nothing listens on discard
    with pytest.raises(ConfigError, match="127.0.0.1 is unreachable .*put cifar10.npz"):
        datasets.check_can_download("cifar10", timeout=2.0)


# ----- disk full ----------------------------------------------------------------------------------


def _disk_full_on(monkeypatch, cls, method, nth):
    calls = {"n": 0}
    original = getattr(cls, method)

    def failing(self, *args):
        calls["n"] += 1
        if calls["n"] == nth:
            raise OSError(28, "No space left on device")
        return original(self, *args)

    monkeypatch.setattr(cls, method, failing)


@pytest.mark.parametrize("target", ["metrics", "checkpoint"])
def test_a_full_disk_is_one_line_and_the_resume_after_it_is_exact(target, tmp_path, capsys, monkeypatch):
    from jaxfed.runs.checkpoint import RunCheckpoints

    reference, out = tmp_path / "reference", tmp_path / "run"
    assert main(["run", "--quiet", "--out", str(reference), *CHECKPOINTED]) == 0
    with monkeypatch.context() as patch:
        if target == "metrics":
            _disk_full_on(patch, RunDirectory, "append_row", 2)  # the round-4 row
        else:
            _disk_full_on(patch, RunCheckpoints, "save", 2)  # the round-4 checkpoint
        capsys.readouterr()
        assert main(["run", "--quiet", "--out", str(out), *CHECKPOINTED]) == 1
        err = _last_line_error(capsys)
    assert "no space left while writing" in err and "the checkpoint of round 2 is intact" in err
    assert main(["run", "--quiet", "--out", str(out), "--resume"]) == 0
    assert _rows(out) == _rows(reference)


@pytest.mark.parametrize(
    "settings, failing_call, advice",
    [
        # ditto's personal models are client states: held on the host they leave the device, resumably
        (
            ["algorithm=ditto"],
            2,
            "continue with --resume --set client_state=host (client states in host memory), or start anew "
            "with a smaller client_chunk or eval_batch_size",
        ),
        # fedavg holds no client state on the digits MLP: the host would free nothing
        (["algorithm=fedavg"], 2, "start anew with a smaller client_chunk or eval_batch_size (a resume keeps them)"),
        # ditto's client states already on the host
        (
            ["algorithm=ditto", "client_state=host"],
            2,
            "start anew with a smaller client_chunk or eval_batch_size (a resume keeps them)",
        ),
        # nothing to resume from
        (
            ["algorithm=ditto"],
            1,
            "no checkpoint was completed: start it again with client_state=host (client states in host "
            "memory) or a smaller client_chunk or eval_batch_size",
        ),
    ],
)
def test_out_of_device_memory_is_one_line_with_the_advice_that_applies(
    settings, failing_call, advice, tmp_path, capsys, monkeypatch
):
    """XLA's RESOURCE_EXHAUSTED "Out of memory" in a round was reported as a full disk ("no space
    left while writing ...; free space"), then with advice that did not apply (client_state=host
    for an algorithm without client states, --resume without a checkpoint): it names device
    memory and what needs less for this run, and a run with client states goes on from its
    intact checkpoint with them on the host."""
    from jaxfed.runs.driver import OneSimulation

    out, config = tmp_path / "run", [*CHECKPOINTED, *settings]
    calls, run_rounds = {"n": 0}, OneSimulation.run_rounds

    def out_of_memory_once(self, state, num_rounds):
        calls["n"] += 1
        if calls["n"] == failing_call:
            raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 149.03GiB")
        return run_rounds(self, state, num_rounds)

    with monkeypatch.context() as patch:
        patch.setattr(OneSimulation, "run_rounds", out_of_memory_once)
        capsys.readouterr()
        assert main(["run", "--quiet", "--out", str(out), *config]) == 1
        err = _last_line_error(capsys)
    intact = "the checkpoint of round 2 is intact: " if failing_call == 2 else ""
    assert (
        err == f"jaxfed: error: out of device memory (RESOURCE_EXHAUSTED: Out of memory while trying to allocate "
        f"149.03GiB); {intact}{advice}"
    )
    if "--resume" in advice:
        reference = tmp_path / "reference"
        assert main(["run", "--quiet", "--out", str(reference), *config]) == 0
        assert main(["run", "--quiet", "--out", str(out), "--resume", "--set", "client_state=host"]) == 0
        assert _rows(out) == _rows(reference)


def test_a_sweep_out_of_device_memory_is_told_to_run_its_members_one_after_another(tmp_path, capsys, monkeypatch):
    """Members vmapped together need the most memory: a sweep that ran out is told the resumable
    member_chunk=1, and goes on with it."""
    from jaxfed.runs.sweep import Sweep

    run_rounds = Sweep.run_rounds

    def out_of_memory_on_the_second(self, states, num_rounds, calls=[]):  # noqa: B006
        calls.append(num_rounds)
        if len(calls) == 2:
            raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 9.00GiB")
        return run_rounds(self, states, num_rounds)

    sweep = ["sweep", "--quiet", "--seeds", "0,1", "--out", str(tmp_path / "sweep"), *CHECKPOINTED, "member_chunk=0"]
    with monkeypatch.context() as patch:
        patch.setattr(Sweep, "run_rounds", out_of_memory_on_the_second)
        capsys.readouterr()
        assert main(sweep) == 1
        err = _last_line_error(capsys)
    assert err.endswith(
        "the checkpoint of round 2 is intact: continue with --resume --set member_chunk=1 (the members one after "
        "another), or start anew with a smaller client_chunk or eval_batch_size"
    )
    assert main([*sweep[:-1], "member_chunk=1", "--resume"]) == 0


# ----- killed anywhere ----------------------------------------------------------------------------

KILLER = """
import json, os, signal, sys
from jaxfed import cli
from jaxfed.runs import checkpoint, driver, rundir

point, nth = sys.argv[1], int(sys.argv[2])
calls = [0]

def reached():
    calls[0] += 1
    return calls[0] == nth

def die():
    os.kill(os.getpid(), signal.SIGKILL)

def before(cls, name, action=die):
    original = getattr(cls, name)
    def wrapped(self, *args):
        if reached():
            action(self, *args) if action is not die else die()
        return original(self, *args)
    setattr(cls, name, wrapped)

def half_a_row(self, row):
    line = json.dumps(row) + "\\n"
    with open(self.metrics_path, "a") as f:
        f.write(line[: len(line) // 2])
    die()

def after(cls, name):
    original = getattr(cls, name)
    def wrapped(self, *args):
        result = original(self, *args)
        if reached():
            die()
        return result
    setattr(cls, name, wrapped)

if point == "in a compiled call":
    after(driver.OneSimulation, "run_rounds")
elif point == "before an evaluation row":
    before(rundir.RunRecord, "add_row")
elif point == "inside a metrics write":
    before(rundir.RunDirectory, "append_row", half_a_row)
elif point == "inside a checkpoint write":
    after(checkpoint.RunCheckpoints, "save")
elif point == "before the last wait":
    before(checkpoint.RunCheckpoints, "wait")
sys.exit(cli.main(sys.argv[3:]))
"""

# One kill of each kind, each a real SIGKILL of the process at that point (a kill at a random moment
# of a long run, which the suite ran once as well, lands in one of these), in one chain: each
# process is killed at its point, the next continues the run (the first: fresh, so its checkpoint
# is the run's first) until the last runs it to the end.
KILL_CHAIN = [
    ("inside a checkpoint write", 1),  # the first checkpoint half written: the run starts again
    ("inside a metrics write", 3),
    ("before an evaluation row", 1),
    ("in a compiled call", 1),
    ("before the last wait", 1),
]
KILL_RUN = ["--quiet", "--set", "num_clients=4", "rounds=8", "eval_every=2", "checkpoint_every=2", "rounds_per_call=1"]


def _state_digest(run_dir: Path, round_: int) -> str:
    return json.loads((run_dir / "checkpoints" / str(round_) / "run" / "metadata").read_text())["integrity"]["state"]


@pytest.mark.slow  # a multi-process campaign (README: Run the tests)
def test_killed_anywhere_the_run_continues_bit_for_bit(tmp_path):
    alone, out = tmp_path / "alone", tmp_path / "run"
    assert main(["run", "--out", str(alone), *KILL_RUN]) == 0
    env = dict(os.environ)  # the suite's XLA_FLAGS and compilation cache, as the in-process run left alone had
    for point, nth in [*KILL_CHAIN, (None, 0)]:
        again = ["--resume"] if RunDirectory(out).checkpoints.rounds() else KILL_RUN  # what the resume error says
        command = ["-c", KILLER, point, str(nth)] if point else ["-m", "jaxfed.cli"]
        done = subprocess.run(
            [sys.executable, *command, "run", "--quiet", "--out", str(out), *again],
            env=env,
            capture_output=True,
            text=True,
        )
        assert done.returncode == (-9 if point else 0), (point, done.stderr[-2000:])
    assert _rows(out) == _rows(alone)
    assert _state_digest(out, 8) == _state_digest(alone, 8)


# ----- runs across processes ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--coordinator", "127.0.0.1:1234", "--num-processes", "2", "--process-id", "0"], "needs --out DIR"),
        (["--coordinator", "127.0.0.1:1234", "--out", "{out}"], "--num-processes, --process-id: needed too"),
        (["--coordinator", "h:1", "--num-processes", "2", "--process-id", "2", "--out", "{out}"], "must be in 0..1"),
        (["--coordinator", "nohost", "--num-processes", "2", "--process-id", "0", "--out", "{out}"], "HOST:PORT"),
    ],
)
def test_bad_process_settings_are_one_line(args, expected, tmp_path, capsys):
    args = [str(tmp_path / "out") if a == "{out}" else a for a in args]
    assert main(["run", "--quiet", *args]) == 2
    assert expected in _one_line_error(capsys)
