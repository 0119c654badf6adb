"""FedDecomp: ranks, phases, what is uploaded, aggregation, FedAvg as a special case, errors."""

import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import fedopt_reference, round_info

from jaxfed.algorithms.fedavg import fedavg
from jaxfed.algorithms.feddecomp import (
    FedDecompOptions,
    SharedModel,
    auto_lora_epochs,
    decomposition_ranks,
    feddecomp,
    layer_scales,
)
from jaxfed.algorithms.pfedlora import pfedlora
from jaxfed.cli import main
from jaxfed.core import lowrank, tree_bytes
from jaxfed.data import ClientData
from jaxfed.errors import ConfigError
from jaxfed.nn import split_variables
from jaxfed.nn.models import Model
from jaxfed.simulation import Simulation, server_step


def _feddecomp(model, local_epochs=1, lora_epochs=0, lr=0.05, momentum=0.0, **options):
    return feddecomp(
        model, lr=lr, momentum=momentum, local_epochs=local_epochs, lora_epochs=lora_epochs, batch_size=32, **options
    )


def _one_client_update(alg, fed, client=2, seed=1):
    server, client_state = alg.init(jax.random.key(0))
    data = fed.train_data(jnp.array([client]))
    view = ClientData(x=data.x, y=data.y, indices=data.indices[0], count=data.count[0])
    message = alg.broadcast(server, round_info(0, 0))
    new_client, upload, metrics = jax.jit(alg.client_update)(
        message, client_state, view, jax.random.key(seed), round_info()
    )
    return message, client_state, new_client, upload, metrics


def _changed(a, b):
    return any(not np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_ranks_follow_the_paper_formulas(small_cnn, mlp):
    for model, ratios in ((small_cnn, (0.6, 0.6)), (mlp, (0.4, 0.8))):
        template, _ = split_variables(jax.eval_shape(model.init, jax.random.key(0)))
        ranks = decomposition_ranks(template, rank_dense=ratios[0], rank_conv=ratios[1])
        kernels = {
            ".".join(p.key for p in path[:-1]): leaf.shape
            for path, leaf in jax.tree_util.tree_leaves_with_path(template)
            if path[-1].key == "kernel"
        }
        assert set(ranks) == set(kernels)  # every Dense and Conv kernel, the first layer and the head too
        for key, shape in kernels.items():
            if len(shape) == 2:
                expected = max(1, int(np.floor(ratios[0] * min(shape) + 0.5)))
            else:
                k, _, cin, cout = shape
                expected = max(1, int(np.floor(ratios[1] * min(cin, cout) * k + 0.5)))
            assert ranks[key] == expected, key


def _expected_scale(scaling, alpha, rank, kernel_shape, rank_conv):
    """loralib as the FedDecomp authors use it: Linear alpha / r; ConvLoRA alpha / int(R_c * cout)."""
    if scaling == "none":
        return 1.0
    if scaling == "authors" and len(kernel_shape) == 4:
        return alpha / int(rank_conv * kernel_shape[3])
    return alpha / rank


@pytest.mark.parametrize("scaling, alpha", [("authors", 1.0), ("authors", 2.0), ("rank", 2.0), ("none", 1.0)])
def test_personalized_model_is_sigma_plus_the_scaled_folded_low_rank_part(small_cnn, scaling, alpha):
    alg = _feddecomp(small_cnn, lora_scaling=scaling, lora_alpha=alpha, rank_conv=0.5)
    server, client = alg.init(jax.random.key(0))
    rng = np.random.default_rng(0)
    tau = jax.tree.map(lambda a: jnp.asarray(rng.normal(size=a.shape), jnp.float32), client.tau)
    params = alg.eval_params(server, client._replace(tau=tau))["params"]
    for key, lora in tau.items():
        layer, sigma = params, server.params
        for part in key.split("."):
            layer, sigma = layer[part], sigma[part]
        rank = lora.down.shape[1]
        scale = _expected_scale(scaling, alpha, rank, sigma["kernel"].shape, rank_conv=0.5)
        product = scale * np.asarray(lora.down, np.float64) @ np.asarray(lora.up, np.float64)
        if sigma["kernel"].ndim == 4:  # rows (kh, cin), columns (kw, cout)
            kh, kw, cin, cout = sigma["kernel"].shape
            product = product.reshape(kh, cin, kw, cout).transpose(0, 2, 1, 3)
        expected = np.asarray(sigma["kernel"], np.float64) + product
        np.testing.assert_allclose(layer["kernel"], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("phase", ["tau", "sigma"])
def test_each_phase_trains_only_its_part(mlp, digits_federation, phase):
    epochs = {"local_epochs": 1, "lora_epochs": 1 if phase == "tau" else 0}
    message, before, after, upload, metrics = _one_client_update(_feddecomp(mlp, **epochs), digits_federation)
    assert (_changed(before.tau, after.tau), _changed(message, upload)) == (
        (True, False) if phase == "tau" else (False, True)
    )
    assert float(metrics["steps"]) > 0


def test_alternating_is_the_tau_phase_then_the_sigma_phase_with_tau_fixed(mlp, digits_federation):
    both = _one_client_update(_feddecomp(mlp, local_epochs=2, lora_epochs=1), digits_federation)
    tau_only = _one_client_update(_feddecomp(mlp, local_epochs=1, lora_epochs=1), digits_federation)
    # The sigma phase does not touch tau: tau is what the tau phase alone gives.
    for a, b in zip(jax.tree.leaves(both[2].tau), jax.tree.leaves(tau_only[2].tau)):
        np.testing.assert_array_equal(a, b)
    assert _changed(both[0], both[3])  # and sigma trained afterwards


def test_simultaneous_trains_both_parts(mlp, digits_federation):
    alg = _feddecomp(mlp, local_epochs=1, lora_epochs=1, schedule="simultaneous")
    message, before, after, upload, _ = _one_client_update(alg, digits_federation)
    assert _changed(before.tau, after.tau) and _changed(message, upload)


def test_the_low_rank_part_never_leaves_the_client(mlp, digits_federation):
    message, _, after, upload, _ = _one_client_update(_feddecomp(mlp, local_epochs=2, lora_epochs=1), digits_federation)
    assert jax.tree.structure(upload) == jax.tree.structure(message)  # sigma's tree: the model's params
    assert tree_bytes(upload) == tree_bytes(message)
    tau_leaves = [np.asarray(x) for x in jax.tree.leaves(after.tau)]
    for leaf in jax.tree.leaves(upload):
        assert not any(t.shape == np.shape(leaf) and np.array_equal(t, leaf) for t in tau_leaves)


@pytest.mark.parametrize("aggregation", ["uniform", "samples"])
def test_server_mean_is_uniform_or_sample_weighted(mlp, aggregation):
    alg = _feddecomp(mlp, aggregation=aggregation)
    server, _ = alg.init(jax.random.key(0))
    rng = np.random.default_rng(0)
    uploads = jax.tree.map(lambda a: jnp.asarray(rng.normal(size=(3,) + a.shape), jnp.float32), server)
    counts = np.array([10.0, 30.0, 0.0])  # the third is padding
    new = server_step(alg, server, uploads, jnp.asarray(counts))
    p = counts / counts.sum() if aggregation == "samples" else np.array([0.5, 0.5, 0.0])
    for got, stacked in zip(jax.tree.leaves(new.params), jax.tree.leaves(uploads)):
        expected = np.tensordot(p, np.asarray(stacked, np.float64), axes=1)
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("build", [feddecomp, pfedlora])
def test_a_server_optimizer_steps_sigma_from_the_clients_average(mlp, build):
    """FedDecomp and pFedLoRA with FedYogi on the server: two rounds of given uploads, sigma against
    Algorithm 2 (float64) from the plain server's means of the same uploads; the broadcast is sigma
    alone, and without the option the server state is as it was (its checkpoints restore)."""
    options = dict(server_lr=0.3, server_b1=0.8, server_b2=0.95, server_eps=0.01)
    plain, yogi = build(mlp), build(mlp, server_optimizer="yogi", **options)
    assert type(plain.init(jax.random.key(0))[0]) is SharedModel
    start, _ = yogi.init(jax.random.key(0))
    assert type(yogi.broadcast(start, round_info(0))) is SharedModel
    rng = np.random.default_rng(0)
    weights = jnp.asarray([3.0, 1.0])
    state, means = start, []
    for round_ in range(2):
        uploads = jax.tree.map(
            lambda a: jnp.asarray(a + rng.normal(size=(2,) + a.shape), jnp.float32),
            yogi.broadcast(state, round_info(round_)),
        )
        plain_state = SharedModel(state.params, state.model_state)  # the same server without the optimizer's state
        means.append(server_step(plain, plain_state, uploads, weights, round_).params)
        state = server_step(yogi, state, uploads, weights, round_)
    for x0, *rounds, got in zip(*map(jax.tree.leaves, (start.params, *means, state.params)), strict=True):
        want = fedopt_reference("yogi", x0, rounds, 0.3, 0.8, 0.95, 0.01)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_no_lora_epochs_with_sample_weights_follows_fedavg(mlp, digits_federation):
    servers = []
    for alg in (
        _feddecomp(mlp, local_epochs=1, lora_epochs=0, aggregation="samples", momentum=0.9),
        fedavg(mlp, lr=0.05, momentum=0.9, local_epochs=1, batch_size=32),
    ):
        sim = Simulation(alg, mlp, digits_federation, participation=0.5)
        servers.append(sim.run_rounds(sim.init(), 3)[0].server.params)
    for a, b in zip(jax.tree.leaves(servers[0]), jax.tree.leaves(servers[1])):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_all_epochs_on_the_low_rank_part_never_change_the_global_model(mlp, digits_federation):
    sim = Simulation(_feddecomp(mlp, local_epochs=1, lora_epochs=1), mlp, digits_federation, participation=0.5)
    start = sim.init()
    state, _ = sim.run_rounds(start, 2)
    for a, b in zip(jax.tree.leaves(start.server), jax.tree.leaves(state.server)):
        np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-7)  # the mean of equal uploads, up to rounding
    assert _changed(start.clients.tau, state.clients.tau)


def test_runs_from_a_config_file_with_the_per_client_dirichlet_partition(tmp_path, capsys):
    config = tmp_path / "feddecomp.conf"
    config.write_text(
        "# FedDecomp on digits, the paper's per-client Dirichlet partition\n"
        "algorithm = feddecomp\npartition = client_dirichlet\nalpha = 0.1\n"
        "num_clients = 10\nclient_train_size = 100\nclient_test_size = 30\nparticipation = 1.0\n"
        "rounds = 6\neval_every = 3\nlr = 0.1\nbatch_size = 32\nlocal_epochs = 3   # lora_epochs auto: 1\n"
    )
    out = tmp_path / "run"
    assert main(["run", "--config", str(config), "--out", str(out), "--quiet", "--set", "checkpoint_every=0"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["algorithm"] == "feddecomp" and summary["rounds"] == 6
    assert summary["partition"]["examples"] == [100, 100, 100]  # min / median / max per client
    assert summary["personalized_acc_mean"] > 0.8 and summary["personalized_acc_mean"] > summary["global_acc"]
    assert summary["best_personalized_acc"] >= summary["personalized_acc_mean"]


@pytest.mark.parametrize(
    "override, expected",
    [
        ("rank_conv=1.5", "rank_conv: a rank ratio must be in (0, 1], got 1.5"),
        ("rank_dense=0", "rank_dense: a rank ratio must be in (0, 1], got 0.0"),
        ("lora_epochs=6", "lora_epochs: must be -1 (auto) or in 0..local_epochs (5), got 6"),
        ("schedule=both", "schedule: unknown 'both'; allowed: alternating, simultaneous"),
        ("aggregation=mean", "aggregation: unknown 'mean'; allowed: uniform, samples"),
        ("lora_scaling=loralib", "lora_scaling: unknown 'loralib'; allowed: authors, rank, none"),
        ("batch_stats=mean", "batch_stats: unknown 'mean'; allowed: shared, private"),
        ("lora_alpha=0", "lora_alpha: must be > 0, got 0.0"),
    ],
)
def test_bad_settings_are_one_line_errors(override, expected, tmp_path, capsys):
    assert main(["run", "feddecomp", "--set", override, "--out", str(tmp_path / "r"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"jaxfed: error: {expected}"
    assert not (tmp_path / "r").exists()


def test_bad_ratios_are_errors_from_the_python_api(mlp):
    with pytest.raises(ConfigError, match=r"rank_conv: a rank ratio must be in \(0, 1\], got 1.2"):
        _feddecomp(mlp, rank_conv=1.2)
    with pytest.raises(ConfigError, match=r"lora_epochs: must be -1 \(auto\) or in 0..local_epochs \(1\), got 2"):
        _feddecomp(mlp, local_epochs=1, lora_epochs=2)


def test_the_auto_tau_epochs_never_leave_a_part_without_an_epoch(mlp):
    assert [auto_lora_epochs(e) for e in (2, 3, 4, 5, 10)] == [1, 1, 2, 2, 4]  # round(0.4 E), in 1..E-1
    with pytest.raises(ConfigError, match=r"^lora_epochs: the auto rule needs local_epochs >= 2"):
        _feddecomp(mlp, local_epochs=1, lora_epochs=-1)
    _feddecomp(mlp, local_epochs=1, lora_epochs=1)  # explicit: allowed


def test_the_default_scaling_is_the_authors_code(small_cnn):
    defaults = FedDecompOptions()
    assert (defaults.lora_scaling, defaults.lora_alpha, defaults.momentum) == ("authors", 1.0, 0.0)
    template, _ = split_variables(jax.eval_shape(small_cnn.init, jax.random.key(0)))
    ranks = decomposition_ranks(template, defaults.rank_dense, defaults.rank_conv)
    scales = layer_scales(template, ranks, defaults)
    conv = {k: v for k, v in ranks.items() if lowrank_kernel(template, k).ndim == 4}
    assert conv and all(scales[k] == 1.0 / int(0.6 * lowrank_kernel(template, k).shape[3]) for k in conv)


def lowrank_kernel(template, key):
    return lowrank.get_layer(template, key)["kernel"]


class _BatchNormMLP(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.Dense(16)(x.reshape(x.shape[0], -1))
        x = nn.BatchNorm(use_running_average=not train, momentum=0.5)(x)
        return nn.Dense(10)(nn.relu(x))


@pytest.mark.parametrize("batch_stats", ["shared", "private"])
def test_batchnorm_statistics_are_averaged_with_sigma_or_kept_by_each_client(digits, digits_federation, batch_stats):
    model = Model.wrap(_BatchNormMLP(), digits.input_shape, name="bn_mlp")
    alg = _feddecomp(model, local_epochs=2, lora_epochs=1, batch_stats=batch_stats)
    server, client = alg.init(jax.random.key(0))
    update = jax.jit(alg.client_update)
    uploads, clients = [], []
    for k in range(3):  # a Python loop over clients, then one server step on the stacked uploads
        data = digits_federation.train_data(jnp.array([k]))
        view = ClientData(x=data.x, y=data.y, indices=data.indices[0], count=data.count[0])
        new_client, upload, _ = update(
            alg.broadcast(server, round_info()), client, view, jax.random.key(k), round_info()
        )
        uploads.append(upload)
        clients.append(new_client)
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *uploads)
    new_server = server_step(alg, server, stacked, jnp.ones(3))
    evaluated = alg.eval_params(new_server, clients[0])
    if batch_stats == "shared":
        assert jax.tree.leaves(new_server.model_state) and not jax.tree.leaves(clients[0].model_state)
        for got, *each in zip(
            jax.tree.leaves(new_server.model_state), *(jax.tree.leaves(u.model_state) for u in uploads)
        ):
            np.testing.assert_allclose(got, np.mean(np.stack(each), axis=0), rtol=1e-6, atol=1e-7)
        assert _changed(server.model_state, new_server.model_state)
        expected_stats = new_server.model_state
        assert alg.global_params is not None  # sigma with the averaged statistics is a global model
    else:
        assert not jax.tree.leaves(new_server.model_state) and not jax.tree.leaves(stacked.model_state)
        assert _changed(client.model_state, clients[0].model_state)
        expected_stats = clients[0].model_state
        assert alg.global_params is None
    for a, b in zip(jax.tree.leaves(evaluated["batch_stats"]), jax.tree.leaves(expected_stats["batch_stats"])):
        np.testing.assert_array_equal(a, b)
