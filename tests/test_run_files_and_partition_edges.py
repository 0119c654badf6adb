"""Run files, fingerprints and partitions at their edges: a half-written or damaged per-client file,
new_client_updates in the fingerprint, labels that skip values (each test failed before its fix)."""

import numpy as np
import pytest

from jaxfed.data import partition
from jaxfed.errors import ConfigError
from jaxfed.runs.build import build
from jaxfed.runs.config import Config
from jaxfed.runs.fingerprint import differences, fingerprint
from jaxfed.runs.plots import read_clients
from jaxfed.runs.rundir import RunDirectory

TINY = Config().with_overrides(["num_clients=4", "mlp_hidden=16", "local_epochs=1", "batch_size=32"])


def test_read_clients_ignores_a_half_written_temporary_file(tmp_path):
    """write_clients writes ``clients/<round>.tmp.npz`` then renames it: a run killed between the
    two leaves the temporary file, which is not an evaluated round's result."""
    directory = RunDirectory(tmp_path / "run")
    directory.path.mkdir()
    directory.write_clients(2, {"acc": np.array([0.5, 0.25])})
    (directory.clients_path / "4.tmp.npz").write_bytes(b"PK\x03\x04 truncated")  # killed mid-write
    clients = read_clients(directory.path)
    assert list(clients) == [2]
    np.testing.assert_array_equal(clients[2]["acc"], [0.5, 0.25])
    directory.drop_clients_after(2)  # a resume from round 2 clears the leftover too
    assert sorted(p.name for p in directory.clients_path.iterdir()) == ["2.npz"]


def test_the_fingerprint_tells_apart_new_client_updates():
    """``new_client_updates`` decides every new_* metric a resumed run reports: a resume by a
    simulation with another count mixes two evaluations in one metrics.jsonl."""
    one = build(TINY.with_overrides(["new_client_ids=3", "new_client_updates=1"])).simulation
    five = build(TINY.with_overrides(["new_client_ids=3", "new_client_updates=5"])).simulation
    assert differences(fingerprint(one), fingerprint(five)) == ["new_client_updates (1 -> 5)"]


def test_read_clients_says_damaged_in_one_line_for_a_truncated_file(tmp_path):
    directory = RunDirectory(tmp_path / "run")
    directory.path.mkdir()
    directory.write_clients(2, {"acc": np.arange(1000.0)})
    path = directory.clients_path / "2.npz"
    path.write_bytes(path.read_bytes()[:200])  # truncated (a full disk, a copy cut short)
    with pytest.raises(ConfigError, match=r"2\.npz: damaged"):
        read_clients(directory.path)


@pytest.mark.parametrize("seed", range(5))
def test_pathological_gives_every_client_its_classes_when_labels_skip_values(seed):
    """Labels {0, 2, 5} (non-contiguous): each client holds classes_per_client classes that have
    examples, never an absent class (an empty client, or one class short)."""
    labels = np.random.default_rng(0).choice([0, 2, 5], 300)
    test = np.random.default_rng(1).choice([0, 2, 5], 60)
    train, _ = partition("pathological", labels, test, 3, np.random.default_rng(seed), classes_per_client=2)
    assert [len(np.unique(labels[part])) for part in train] == [2, 2, 2]


def test_pathological_draw_is_unchanged_when_every_class_is_present():
    labels = np.repeat(np.arange(10), 20)
    train, _ = partition("pathological", labels, labels, 7, np.random.default_rng(3), classes_per_client=2)
    order = np.random.default_rng(3).permutation(10)  # what the partition drew before
    for k, part in enumerate(train):
        assert set(labels[part]) == {int(order[(2 * k) % 10]), int(order[(2 * k + 1) % 10])}


def test_bfloat16_arrays_are_numbers_and_their_nan_is_found():
    """numpy's issubdtype does not know ml_dtypes' bfloat16: bfloat16 inputs were refused as
    "expected numbers", and the NaN check would have passed over them."""
    import ml_dtypes

    from jaxfed.data.validate import DataError, check_arrays

    rng = np.random.default_rng(0)
    arrays = {
        "x_train": rng.normal(size=(20, 4, 4)).astype(ml_dtypes.bfloat16),
        "y_train": rng.integers(0, 3, 20),
        "x_test": rng.normal(size=(6, 4, 4)).astype(ml_dtypes.bfloat16),
        "y_test": rng.integers(0, 3, 6),
    }
    check_arrays("mine", arrays, 3)
    arrays["x_train"][3, 1, 1] = np.nan
    with pytest.raises(DataError, match=r"^mine: x_train has 1 NaN or inf value\(s\)"):
        check_arrays("mine", arrays, 3)


def test_a_run_whose_clients_hold_no_test_example_reports_null_not_zero(tmp_path, capsys):
    """Every client's test part empty: the personalized summaries are null (they were 0.0000, as if
    measured), the global model is still evaluated, and the run finishes (the progress bar took the
    null for a number and crashed)."""
    import json

    from jaxfed.cli import main
    from jaxfed.data import save_partition

    train = np.array_split(np.arange(1437), 3)
    save_partition(tmp_path / "parts.npz", train, [np.array([], np.int64)] * 3)
    out = tmp_path / "run"
    keys = [f"partition_file={tmp_path / 'parts.npz'}", "partition=file", "num_clients=3", "rounds=1", "mlp_hidden=16"]
    assert main(["run", "--out", str(out), "--set", *keys]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["personalized_acc_mean"] is None and summary["best_personalized_acc"] is None
    assert summary["global_acc"] > 0.2
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert "personalized acc null (weighted null)" in line and line.endswith(
        "null: not finite, or no client has test examples"
    )
