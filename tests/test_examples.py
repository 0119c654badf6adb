"""The research-code examples run: SCAFFOLD registered from a plugin file and run from the CLI
(with its own option, checkpoints and resume), and a custom Flax model through two low-rank
algorithms. SCAFFOLD's maths is checked against independent references."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import metrics_rows as _rows
from conftest import one_client, round_info

from jaxfed.algorithms import registry
from jaxfed.algorithms.fedavg import fedavg
from jaxfed.algorithms.records import ClientStats
from jaxfed.cli import main
from jaxfed.simulation import server_step

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
SCAFFOLD = str(EXAMPLES / "scaffold.py")


@pytest.fixture(scope="module")
def scaffold_module():
    registry.import_plugin(SCAFFOLD)
    return sys.modules["jaxfed_plugin_scaffold"]


def test_scaffold_runs_from_the_cli_with_its_own_option_and_resumes_bit_for_bit(tmp_path, capsys):
    common = ["run", "scaffold", "--plugin", SCAFFOLD, "--quiet", "--set", "server_lr=0.5", "num_clients=6"]
    common += ["--set", "local_epochs=1", "eval_every=2", "checkpoint_every=2"]
    assert main([*common, "--set", "rounds=4", "--out", str(tmp_path / "whole")]) == 0
    assert main([*common, "--set", "rounds=2", "--out", str(tmp_path / "split")]) == 0
    assert main(["run", "--out", str(tmp_path / "split"), "--resume", "--quiet", "--set", "rounds=4"]) == 0
    assert _rows(tmp_path / "split") == _rows(tmp_path / "whole")
    config = json.loads((tmp_path / "whole" / "config.json").read_text())
    assert config["algorithm"] == "scaffold" and config["options"]["server_lr"] == 0.5
    assert config["plugins"] == [SCAFFOLD]
    capsys.readouterr()
    assert main(["list", "scaffold", "--plugin", SCAFFOLD]) == 0
    assert "server_lr = 1.0" in capsys.readouterr().out


def test_scaffold_client_step_matches_fedavg_then_the_control_formula(scaffold_module, mlp, digits_federation):
    """With zero control variates the correction vanishes: the local model is FedAvg's (same
    keys); the new control is ``(x - y) / (K lr)`` and the upload ``y - x`` (numpy, float64)."""
    alg = scaffold_module.scaffold(mlp, num_clients=10, lr=0.05, local_epochs=1, batch_size=16)
    server, client = alg.init(jax.random.key(0))
    data, rng = one_client(digits_federation, 1), jax.random.key(3)
    new_client, upload, metrics = jax.jit(alg.client_update)(server, client, data, rng, round_info())

    plain = fedavg(mlp, lr=0.05, local_epochs=1, batch_size=16)
    _, y, plain_metrics = jax.jit(plain.client_update)(server.params, ClientStats({}), data, rng, round_info())
    chex.assert_trees_all_close(jax.tree.map(jnp.add, server.params, upload.delta_params), y, rtol=1e-5, atol=1e-6)
    steps = float(plain_metrics["steps"])
    assert float(metrics["steps"]) == steps > 0
    for x, y_leaf, c in zip(*(jax.tree.leaves(t) for t in (server.params, y, new_client.control))):
        expected = (np.float64(x) - np.float64(y_leaf)) / (steps * 0.05)
        np.testing.assert_allclose(c, expected, rtol=1e-3, atol=1e-4)


def test_scaffold_server_step_is_the_papers_formula(scaffold_module, mlp):
    alg = scaffold_module.scaffold(mlp, num_clients=8, server_lr=0.5)
    assert alg.options.server_lr == 0.5  # recorded, so that a resume compares them
    server, _ = alg.init(jax.random.key(0))
    rng = np.random.default_rng(0)
    uploads = [
        scaffold_module.Upload(
            *(
                jax.tree.map(lambda a: jnp.asarray(rng.normal(size=a.shape), jnp.float32), server.params)
                for _ in range(2)
            )
        )
        for _ in range(3)
    ]
    stacked = jax.tree.map(lambda *rows: jnp.stack(rows), *uploads)
    weights = jnp.array([40.0, 0.0, 10.0])  # the middle row is padding: weight 0
    new = server_step(alg, server, stacked, weights)
    for key in ("fc1", "head"):
        dx = [np.float64(u.delta_params[key]["kernel"]) for u in uploads]
        dc = [np.float64(u.delta_control[key]["kernel"]) for u in uploads]
        x = np.float64(server.params[key]["kernel"]) + 0.5 * (dx[0] + dx[2]) / 2
        c = np.float64(server.control[key]["kernel"]) + 2 / 8 * (dc[0] + dc[2]) / 2
        np.testing.assert_allclose(new.params[key]["kernel"], x, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(new.control[key]["kernel"], c, rtol=1e-5, atol=1e-6)


def test_the_custom_model_example_runs_a_low_rank_algorithm(tmp_path):
    sys.path.insert(0, str(EXAMPLES))
    try:
        import custom_model
    finally:
        sys.path.remove(str(EXAMPLES))
    # one of its two algorithms (test_any_model trains both on a user's conv module)
    summaries = custom_model.main(["--rounds", "1", "--clients", "3", "--out", str(tmp_path), "--algorithms", "fedhm"])
    assert set(summaries) == {"fedhm"}
    for name, summary in summaries.items():
        assert summary["rounds"] == 1 and 0.0 < summary["personalized_acc_mean"] <= 1.0
        assert (tmp_path / name / "summary.json").exists() and (tmp_path / name / "checkpoints" / "1").exists()
