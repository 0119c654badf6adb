"""FedKD against its definitions written out another way: the energy truncation and the
compression as numpy float64 SVDs, the mutual-distillation loss as the paper's two losses in
numpy, an engine round as its clients one by one and the server's mean and compression in numpy,
and the bytes as the factors the authors send."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import BatchNormNet, make_federation, module_features, one_client, round_info

from jaxfed.algorithms.fedara import default_decomposed_layers
from jaxfed.algorithms.fedkd import (
    SENT_WHOLE,
    FedKDOptions,
    Trainable,
    compress,
    compressed_bytes,
    energy_threshold,
    fedkd,
    mutual_distillation,
)
from jaxfed.core import lowrank
from jaxfed.data import ClientData
from jaxfed.data.federated import Batch
from jaxfed.errors import ConfigError
from jaxfed.nn import Model, get_model
from jaxfed.nn.factorized import factorized_execution
from jaxfed.runs.build import build
from jaxfed.runs.config import Config
from jaxfed.simulation import Simulation, sampling


def numpy_truncation(matrix, energy):
    """``(M_k, k)``: the fewest singular values whose squares reach ``energy`` of their sum (float64)."""
    left, sigma, right = np.linalg.svd(np.asarray(matrix, np.float64), full_matrices=False)
    share = np.cumsum(sigma**2) / max(np.sum(sigma**2), 1e-300)
    k = 0 if not np.any(sigma) else int(np.argmax(share >= energy - 1e-12)) + 1
    return (left[:, :k] * sigma[:k]) @ right[:k], k


def numpy_matricized(x):
    """A parameter as the matrix it is compressed as: a conv kernel [kh, kw, cin, cout] as
    [(kh cin), (kw cout)], else its last axis against the rest."""
    x = np.asarray(x, np.float64)
    if x.ndim == 4:
        kh, kw, cin, cout = x.shape
        return x.transpose(0, 2, 1, 3).reshape(kh * cin, kw * cout)
    return x.reshape(-1, x.shape[-1])


def factor_bytes(x, k):
    """The bytes of a parameter sent as ``k`` singular triplets (a matrix) or whole (a vector)."""
    if np.ndim(x) < 2:
        return 4 * np.size(x)
    rows, cols = numpy_matricized(x).shape
    return 4 * k * (rows + cols + 1)


def float32_rank(x):
    """The rank of a float32 parameter's matrix: its singular values above float32's rounding."""
    if np.ndim(x) < 2:
        return None
    sigma = np.linalg.svd(numpy_matricized(x), compute_uv=False)
    return int(np.sum(sigma > 1e-4 * sigma[0])) if sigma[0] > 0 else 0


def numpy_compressed(x, energy):
    """``(compressed, kept, bytes)`` of one parameter: a matrix's truncation, a vector whole."""
    x = np.asarray(x, np.float64)
    if x.ndim < 2:
        return x, SENT_WHOLE, factor_bytes(x, None)
    approx, k = numpy_truncation(numpy_matricized(x), energy)
    if x.ndim == 4:
        kh, kw, cin, cout = x.shape
        approx = approx.reshape(kh, cin, kw, cout).transpose(0, 2, 1, 3)
    return approx.reshape(x.shape), k, factor_bytes(x, k)


def spectrum_matrix(seed, rows, cols, decay):
    rng = np.random.default_rng(seed)
    left, _ = np.linalg.qr(rng.normal(size=(rows, rows)))
    right, _ = np.linalg.qr(rng.normal(size=(cols, cols)))
    n = min(rows, cols)
    return (left[:, :n] * decay ** np.arange(n)) @ right[:, :n].T


@pytest.mark.parametrize("energy", [0.5, 0.9, 0.95, 0.98, 1.0])
@pytest.mark.parametrize(("rows", "cols", "decay"), [(12, 7, 0.8), (5, 9, 0.5), (20, 20, 0.97)])
def test_the_energy_truncation_keeps_the_fewest_singular_values_reaching_the_share(energy, rows, cols, decay):
    matrix = spectrum_matrix(rows * cols, rows, cols, decay)
    want, k = numpy_truncation(matrix, energy)
    got, rank = jax.jit(lowrank.energy_truncation)(jnp.float32(matrix), energy)
    assert int(rank) == k
    np.testing.assert_allclose(got, want, atol=2e-6)
    if k > 1:  # one fewer would not reach the share
        sigma = np.linalg.svd(matrix, compute_uv=False)
        assert np.sum(sigma[: k - 1] ** 2) < energy * np.sum(sigma**2) <= np.sum(sigma[:k] ** 2) * (1 + 1e-9)


def test_a_zero_matrix_keeps_nothing():
    got, rank = lowrank.energy_truncation(jnp.zeros((4, 3)), 0.95)
    assert int(rank) == 0 and not np.any(np.asarray(got))


def test_compression_truncates_each_matrix_and_sends_vectors_whole():
    keys = iter(jax.random.split(jax.random.key(0), 8))
    tree = {
        "conv": {"kernel": jax.random.normal(next(keys), (3, 3, 4, 6)), "bias": jax.random.normal(next(keys), (6,))},
        "dense": {"kernel": jax.random.normal(next(keys), (10, 5))},
        "factor": {"u": jax.random.normal(next(keys), (3, 4, 2))},  # a decomposed conv's u [kh, cin, r]
    }
    compressed, ranks = jax.jit(compress)(tree, 0.9)
    total = 0
    for path, x in jax.tree_util.tree_leaves_with_path(tree):
        want, k, size = numpy_compressed(x, 0.9)
        got = [leaf for p, leaf in jax.tree_util.tree_leaves_with_path(compressed) if p == path][0]
        rank = [leaf for p, leaf in jax.tree_util.tree_leaves_with_path(ranks) if p == path][0]
        np.testing.assert_allclose(got, want, atol=1e-5, err_msg=jax.tree_util.keystr(path))
        assert int(rank) == k, jax.tree_util.keystr(path)
        total += size
    assert float(compressed_bytes(compressed, ranks)) == total
    assert int(ranks["conv"]["kernel"]) < 12  # a random 12 x 18 matrix at 90%: truncated


def test_the_energy_threshold_rises_linearly_then_stays():
    options = FedKDOptions(energy_start=0.9, energy_end=0.98, energy_rounds=4)
    got = [float(energy_threshold(options, jnp.int32(r))) for r in range(6)]
    np.testing.assert_allclose(got, [0.92, 0.94, 0.96, 0.98, 0.98, 0.98], rtol=1e-6)


def papers_loss(xp, logits_t, logits_s, h_t, h_s, projection, y):
    """``L_t + L_s`` (the paper's two losses, summed) over a batch of real examples, in ``xp``:
    numpy for float64 values, jax.numpy for the gradient."""
    rows = xp.arange(len(y))

    def log_softmax(z):
        z = z - z.max(-1, keepdims=True)
        return z - xp.log(xp.exp(z).sum(-1, keepdims=True))

    log_t, log_s = log_softmax(logits_t), log_softmax(logits_s)
    ce_t, ce_s = -xp.mean(log_t[rows, y]), -xp.mean(log_s[rows, y])
    kl_s_t = xp.mean(xp.sum(xp.exp(log_s) * (log_s - log_t), -1))  # KL(y_s, y_t): the mentor's
    kl_t_s = xp.mean(xp.sum(xp.exp(log_t) * (log_t - log_s), -1))  # KL(y_t, y_s): the mentee's
    hidden = xp.mean((h_t - h_s @ projection) ** 2)
    return ce_t + (kl_s_t + hidden) / (ce_t + ce_s) + ce_s + (kl_t_s + hidden) / (ce_t + ce_s)


def test_the_loss_is_the_mentors_and_the_mentees_losses_summed(mlp, digits):
    """``L_t + L_s`` of the module's docstring in numpy float64 from each model's logits and
    features, over the batch's real examples (two padded rows carry garbage labels)."""
    params_t = mlp.init(jax.random.key(1))["params"]
    params_s = mlp.init(jax.random.key(2))["params"]
    dim = lowrank.get_layer(params_t, "head")["kernel"].shape[0]
    projection = 0.3 * jax.random.normal(jax.random.key(3), (dim, dim))
    x, y = jnp.asarray(digits.x_train[:10]), jnp.asarray(digits.y_train[:10])
    mask = jnp.arange(10) < 8
    batch = Batch(x, y.at[8:].set(0), mask, jax.random.key(4))
    trainable, states = Trainable(params_t, params_s, projection), {"mentor": {}, "mentee": {}}
    got, _ = mutual_distillation(mlp, "head")(trainable, states, batch)

    def outputs(params):
        logits = np.asarray(mlp.apply({"params": params}, x)[0], np.float64)[:8]
        return logits, np.asarray(module_features(mlp, params, x), np.float64)[:8]

    (logits_t, h_t), (logits_s, h_s) = outputs(params_t), outputs(params_s)
    want = papers_loss(np, logits_t, logits_s, h_t, h_s, np.asarray(projection, np.float64), np.asarray(y[:8]))
    np.testing.assert_allclose(float(got), want, rtol=1e-5)


def reference_loss(model, trainable: Trainable, x, y):
    """:func:`papers_loss` of a :class:`Trainable`'s two models on a batch (jax.numpy: for its gradient)."""
    outputs = [(model.apply({"params": p}, x)[0], module_features(model, p, x)) for p in trainable[:2]]
    (logits_t, h_t), (logits_s, h_s) = outputs
    return papers_loss(jnp, logits_t, logits_s, h_t, h_s, trainable.projection, y)


def test_one_step_trains_mentor_mentee_and_projection_down_the_losses_gradient(mlp, digits):
    """A client whose examples fit one batch takes one SGD step: its new mentor and W_h (kept) and
    its mentee (uploaded uncompressed at T = 1) are the received ones minus lr times the gradient
    of the loss written out above, with nothing detached."""
    fed = make_federation(digits, num_clients=20, alpha=0.5)
    client_id = int(np.argmin(np.asarray(fed.train_count)))
    count = int(fed.train_count[client_id])
    alg = fedkd(mlp, lr=0.1, batch_size=count, local_epochs=1, energy_start=1.0, energy_end=1.0)
    server, client = alg.init(jax.random.key(0))
    client = client._replace(projection=client.projection + 0.05)  # features a W_h of 0 would not see
    data = one_client(fed, client_id)
    new, upload, _ = jax.jit(alg.client_update)(server, client, data, jax.random.key(1), round_info())
    idx = np.asarray(data.indices[:count])
    x, y = jnp.asarray(digits.x_train[idx]), jnp.asarray(digits.y_train[idx])
    start = Trainable(client.params, server.mentee, client.projection)
    grad = jax.grad(lambda t: reference_loss(mlp, t, x, y))(start)
    want = jax.tree.map(lambda p, g: p - 0.1 * g, start, grad)
    chex.assert_trees_all_close(new.params, want.mentor, rtol=1e-4, atol=1e-6)
    chex.assert_trees_all_close(new.projection, want.projection, rtol=1e-4, atol=1e-6)
    sent = jax.tree.map(jnp.add, server.mentee, upload.update)
    chex.assert_trees_all_close(sent, want.mentee, rtol=1e-4, atol=1e-6)
    for before, after in ((client.params, new.params), (client.projection, new.projection)):
        assert not np.allclose(jax.tree.leaves(before)[0], jax.tree.leaves(after)[0])


def test_both_models_batchnorm_statistics_stay_with_the_client(digits, digits_federation):
    model = Model("bn_net", BatchNormNet(digits.num_classes), digits.input_shape)
    alg = fedkd(model, local_epochs=1, batch_size=16)
    server, client = alg.init(jax.random.key(0))
    assert alg.global_params is None  # the mentee's statistics are the clients'
    new, upload, _ = jax.jit(alg.client_update)(
        server, client, one_client(digits_federation, 0), jax.random.key(1), round_info()
    )
    for before, after in ((client.model_state, new.model_state), (client.mentee_state, new.mentee_state)):
        assert jax.tree.structure(before) == jax.tree.structure(after) and jax.tree.leaves(before)
        assert not any(np.allclose(a, b) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)))
    assert jax.tree.structure(upload.update) == jax.tree.structure(server.mentee)


def test_a_batch_both_models_fit_exactly_gives_a_finite_loss(mlp, digits):
    """Both cross-entropies 0 in float32 (logits scaled until the margins pass 100): the adaptive
    divisor is floored, where the paper's formula divides by zero."""
    params = mlp.init(jax.random.key(1))["params"]
    params = {**params, "head": jax.tree.map(lambda w: 1e4 * w, params["head"])}
    x = jnp.asarray(digits.x_train[:8])
    y = jnp.argmax(mlp.apply({"params": params}, x)[0], -1)
    dim = params["head"]["kernel"].shape[0]
    trainable = Trainable(params, params, 0.01 * jnp.ones((dim, dim)))
    batch = Batch(x, y, jnp.ones(8, bool), jax.random.key(0))
    loss, _ = mutual_distillation(mlp, "head")(trainable, {"mentor": {}, "mentee": {}}, batch)
    assert np.isfinite(float(loss))


def test_an_engine_round_is_the_clients_one_by_one_then_the_servers_compressed_mean(mlp, digits):
    """Three of five clients sampled, two rounds: each client's update by itself; the server's new
    mentee is the old one plus the numpy truncation of the plain mean of their (compressed)
    updates. The round's bytes: each upload's factors; down, the whole mentee, except the last
    global update's factors for a client that received the mentee the round before."""
    fed = make_federation(digits, num_clients=5, alpha=0.5)
    alg = fedkd(mlp, lr=0.05, energy_start=0.9, energy_end=0.95, energy_rounds=2)
    sim = Simulation(alg, mlp, fed, participation=0.6)
    state, previous, update_bytes = sim.init(), set(), None
    whole = sum(4 * x.size for x in jax.tree.leaves(state.server.mentee))
    for _ in range(2):
        round_ = int(state.round)
        energy = 0.9 + 0.05 * (round_ + 1) / 2
        ids = np.sort(np.asarray(sim.sampled_ids(round_)))
        message = alg.broadcast(state.server, round_info(round_))
        updates, up_bytes = [], 0
        for i in ids:
            client = jax.tree.map(lambda x: x[i], state.clients)  # noqa: B023
            data = fed.train_data(jnp.array([i]))
            view = ClientData(x=data.x, y=data.y, indices=data.indices[0], count=data.count[0])
            key = sampling.client_keys(sampling.round_key(sim.root, round_), jnp.array([i]))[0]
            new, upload, _ = jax.jit(alg.client_update)(message, client, view, key, round_info(round_))
            assert int(new.held) == round_
            updates.append(upload.update)
            up_bytes += sum(factor_bytes(x, float32_rank(x)) for x in jax.tree.leaves(upload.update))
        mean = jax.tree.map(lambda *u: np.mean(np.asarray(u, np.float64), axis=0), *updates)
        step = jax.tree.map(lambda m: numpy_compressed(m, energy)[0], mean)
        want = jax.tree.map(lambda w, s: np.asarray(w, np.float64) + s, state.server.mentee, step)
        down = sum(update_bytes if int(i) in previous else whole for i in ids)
        update_bytes = sum(numpy_compressed(m, energy)[2] for m in jax.tree.leaves(mean))
        state, metrics = jax.jit(sim.round)(state, fed)
        chex.assert_trees_all_close(state.server.mentee, want, rtol=1e-4, atol=2e-6)
        np.testing.assert_allclose(float(metrics["bytes_up"]), up_bytes, rtol=1e-6)
        np.testing.assert_allclose(float(metrics["bytes_down_cached"]), down, rtol=1e-6)
        assert float(metrics["bytes_down"]) == whole * len(ids)
        previous = {int(i) for i in ids}
    assert float(state.server.update_bytes) == update_bytes < whole


def test_a_smaller_mentee_runs_its_decomposed_layers_as_factors(small_cnn, digits_federation):
    alg = fedkd(small_cnn, mentee_ratio=0.25)
    server, client = alg.init(jax.random.key(0))
    layers = default_decomposed_layers(small_cnn, "head")
    for key in layers:
        layer = lowrank.get_layer(server.mentee, key)
        assert "kernel" not in layer and layer["u"].shape[-1] < lowrank.max_rank(lowrank.kernel_shape_of(layer))
    x = jnp.asarray(digits_federation.x_test[:4])
    with factorized_execution():
        factored = small_cnn.apply({"params": server.mentee}, x)[0]
    whole = small_cnn.apply(alg.global_params(server), x)[0]  # the global model: the kernels rebuilt
    np.testing.assert_allclose(factored, whole, rtol=1e-4, atol=1e-5)
    new, upload, _ = jax.jit(alg.client_update)(
        server, client, one_client(digits_federation, 0), jax.random.key(1), round_info()
    )
    assert jax.tree.structure(upload.update) == jax.tree.structure(server.mentee)
    assert any(np.any(np.asarray(x)) for x in jax.tree.leaves(upload.update))


def test_mentors_of_model_tiers_and_the_cached_download_through_the_wrapper():
    """Every client in every round: from round 2 on, each downloads only the last global update."""
    config = Config(algorithm="fedkd", num_clients=4, participation=1.0).with_overrides(["model_tiers=1,0.25"])
    sim = build(config.validate()).simulation
    state, metrics = sim.run_rounds(sim.init(), 2)
    assert float(state.clients.kernel_on["fc2"][3]) == 0.0  # tier 2's mentor runs fc2 as factors
    cached, whole = np.asarray(metrics["bytes_down_cached"]), np.asarray(metrics["bytes_down"])
    assert cached[0] == whole[0] and 0 < cached[1] < whole[1] / 2
    assert np.isfinite(np.asarray(metrics["train_loss"])).all()


def test_a_mentee_ratio_without_layers_to_decompose_is_one_line(digits):
    linear = get_model("linear", digits.input_shape, digits.num_classes)
    with pytest.raises(ConfigError, match=r"^mentee_ratio: the model has no feature-extractor layer") as caught:
        fedkd(linear, mentee_ratio=0.5)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    ("values", "key"),
    [(["energy_start=0"], "energy_start"), (["energy_end=1.5"], "energy_end"), (["mentee_ratio=0"], "mentee_ratio"),
     (["energy_start=0.99"], "energy_end")],
)  # fmt: skip
def test_a_bad_option_is_one_line(values, key):
    with pytest.raises(ConfigError, match=f"^{key}") as caught:
        Config(algorithm="fedkd").with_overrides(values).validate()
    assert "\n" not in str(caught.value)
