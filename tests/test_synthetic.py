"""FLoRAL's synthetic regression tasks and the MSE path through training, evaluation and the run."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxfed.cli import main
from jaxfed.core.losses import masked_loss
from jaxfed.data import ClientData, federate, synthetic_task
from jaxfed.data.synthetic import auto_samples_per_client
from jaxfed.nn import get_model
from jaxfed.runs.build import count_parameters
from jaxfed.simulation.evaluation import evaluate_examples, personalized_metrics


def _reference_truth(seed, dim, outputs, clusters, rank):
    """The ground truth written out with the same draws: W, U, V, b, W_out in that order."""
    rng = np.random.default_rng(seed)
    W = rng.standard_normal((dim, dim)) / np.sqrt(dim)
    U = rng.standard_normal((clusters, dim, rank)) / np.sqrt(dim)
    V = rng.standard_normal((clusters, rank, dim)) / np.sqrt(rank)
    b = rng.standard_normal(dim) / np.sqrt(dim)
    W_out = rng.standard_normal((dim, outputs)) / np.sqrt(dim)
    x = rng.standard_normal  # the inputs are drawn next
    return W, U, V, b, W_out, x


@pytest.mark.parametrize("task, outputs", [("synthetic_linear", 3), ("synthetic_mlp", 1)])
def test_targets_follow_each_clients_cluster_model(task, outputs):
    clients, clusters, n, dim, rank, scale = 6, 3, 10, 5, 2, 2.0
    data, train, test = synthetic_task(task, clients, clusters, n, np.random.default_rng(7), dim=dim, rank=rank)
    W, U, V, b, W_out, draw = _reference_truth(7, dim, outputs, clusters, rank)
    x = draw((clients, n, dim))
    for k in range(clients):
        c = k % clusters
        h = x[k] @ (W + scale * U[c] @ V[c]) + b
        y = h[:, :outputs] if task == "synthetic_linear" else np.maximum(h, 0) @ W_out
        got_x = np.concatenate([data.x_train[train[k]], data.x_test[test[k]]])
        got_y = np.concatenate([data.y_train[train[k]], data.y_test[test[k]]])
        np.testing.assert_allclose(got_x, x[k], rtol=1e-6)
        np.testing.assert_allclose(got_y, y, rtol=1e-5, atol=1e-6)
        assert len(train[k]) == 8 and len(test[k]) == 2  # 80% / 20%
    assert data.y_train.dtype == np.float32 and data.num_classes == outputs


def test_auto_client_size_is_below_the_models_parameter_count():
    for task, model, ratio in (("synthetic_linear", get_model("linear", (10,), 3), 0.25),
                               ("synthetic_mlp", get_model("mlp", (10,), 1, hidden=(20,)), 0.5)):  # fmt: skip
        params = count_parameters(model)
        assert params == {"synthetic_linear": 33, "synthetic_mlp": 241}[task]
        n = auto_samples_per_client(task, params)
        assert n == round(ratio * params) and n < params


def test_masked_mse_and_per_client_evaluation_match_numpy():
    rng = np.random.default_rng(0)
    outputs, targets = rng.normal(size=(6, 2)), rng.normal(size=(6, 2))
    mask = np.array([1, 1, 0, 1, 0, 1], bool)
    expected = np.mean(((outputs - targets) ** 2).mean(-1)[mask])
    got = masked_loss(jnp.asarray(outputs), jnp.asarray(targets, jnp.float32), jnp.asarray(mask))
    np.testing.assert_allclose(got, expected, rtol=1e-5)

    data, train, test = synthetic_task("synthetic_linear", 3, 3, 20, np.random.default_rng(1), dim=4, outputs=2)
    fed = federate(data, train, test)
    model = get_model("linear", (4,), 2)
    variables = model.init(jax.random.key(0))
    kernel, bias = (np.asarray(variables["params"]["head"][k], np.float64) for k in ("kernel", "bias"))
    per_client = []
    for k in range(3):
        view = ClientData(x=fed.x_test, y=fed.y_test, indices=fed.test_idx[k], count=fed.test_count[k])
        _, loss, count = evaluate_examples(model, variables, view, batch_size=3)
        x, y = data.x_test[test[k]], data.y_test[test[k]]
        mse = np.mean((x @ kernel + bias - y) ** 2)
        np.testing.assert_allclose(loss / count, mse, rtol=1e-4)
        per_client.append((float(loss), float(count)))
    loss, count = (jnp.asarray(v) for v in zip(*per_client))
    metrics = personalized_metrics(jnp.zeros(3), loss, count, regression=True)
    np.testing.assert_allclose(
        metrics["personalized_mse_mean"], np.mean(np.asarray(loss) / np.asarray(count)), rtol=1e-5
    )
    assert "personalized_acc_mean" not in metrics


@pytest.mark.plots
def test_a_synthetic_run_reports_mse_and_floral_oracle_beats_fedavg(tmp_path, capsys):
    common = [
        "--dataset", "synthetic_linear", "--set", "num_clients=6", "--set", "num_clusters=2",
        "--set", "participation=1", "--set", "batch_size=4", "--set", "lr=0.1",
        "--set", "local_epochs=1", "--set", "rounds=60", "--set", "eval_every=30", "--set", "rounds_per_call=30",
        "--set", "checkpoint_every=0", "--quiet",
    ]  # fmt: skip
    results = {}
    for name, extra in (("fedavg", []), ("floral", ["--set", "router=oracle", "num_adaptors=2"])):
        out = tmp_path / name
        assert main(["run", name, *common, *extra, "--out", str(out)]) == 0
        summary = json.loads((out / "summary.json").read_text())
        assert summary["task"] == "regression" and "personalized_acc_mean" not in summary
        assert summary["best_personalized_mse"] <= summary["personalized_mse_mean"]
        assert (out / "accuracy.png").exists()
        results[name] = summary["personalized_mse_mean"]
    assert "personalized mse" in capsys.readouterr().out
    assert results["floral"] < 0.5 * results["fedavg"], results
    # jaxfed plot's default metric is the task's: MSE here (it asked for personalized_acc_mean rows)
    assert main(["plot", str(tmp_path / "fedavg"), str(tmp_path / "floral"), "--out", str(tmp_path / "both.png")]) == 0
    assert (tmp_path / "both.png").exists()


@pytest.mark.parametrize(
    "override, expected",
    [
        ("synthetic_outputs=11", "synthetic_outputs: synthetic_linear needs 1..synthetic_dim (10), got 11"),
        ("samples_per_client=1", "samples_per_client: must be >= 2"),
        ("cluster_task=rotation", "cluster_task: synthetic_linear is clustered already"),
        ("mlp_hidden=20", "mlp_hidden: applies to model mlp only, not 'linear'"),
    ],
)
def test_bad_synthetic_settings_are_one_line_errors(override, expected, tmp_path, capsys):
    args = [
        "run",
        "fedavg",
        "--dataset",
        "synthetic_linear",
        "--set",
        override,
        "--out",
        str(tmp_path / "r"),
        "--quiet",
    ]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and expected in err, err
    assert not (tmp_path / "r").exists()


def test_personalized_summaries_over_no_test_example_are_nan_not_zero():
    """A mean over no client (none has a test example) is NaN, as each client's own metric is: it
    was 0, which read as a result; with test examples, the means are numpy's."""
    from jaxfed.simulation.evaluation import personalized_metrics

    correct, loss = np.array([3.0, 0.0, 5.0]), np.array([1.5, 0.0, 2.5])
    none = personalized_metrics(correct * 0, loss * 0, np.zeros(3))
    assert none.keys() == {
        "personalized_acc_mean",
        "personalized_acc_weighted",
        "personalized_acc_std",
        "personalized_loss",
    }
    assert all(np.isnan(float(v)) for v in none.values())
    count = np.array([4.0, 0.0, 10.0])
    some = personalized_metrics(correct, loss, count)
    accuracies = np.array([3 / 4, 5 / 10])
    np.testing.assert_allclose(
        [float(some[k]) for k in ("personalized_acc_mean", "personalized_acc_weighted", "personalized_acc_std")],
        [accuracies.mean(), 8 / 14, accuracies.std()],
        rtol=1e-6,
    )
    assert float(some["personalized_loss"]) == pytest.approx(4.0 / 14)
