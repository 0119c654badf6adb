"""The Ensemble baseline: C full models mixed by a private router, members averaged with p(k|c)."""

import jax
import jax.numpy as jnp
import numpy as np
from conftest import round_info

from jaxfed.algorithms.ensemble import Upload, ensemble
from jaxfed.data import ClientData
from jaxfed.nn.models import Mixture
from jaxfed.simulation import server_step


def _ensemble(model, **options):
    return ensemble(model, lr=0.05, local_epochs=1, batch_size=32, **options)


def test_mixture_output_is_the_router_weighted_sum_of_member_outputs(mlp, digits):
    members = jax.vmap(mlp.init)(jax.random.split(jax.random.key(0), 3))
    weights = jnp.array([0.2, 0.5, 0.3])
    x = jnp.asarray(digits.x_test[:7])
    got, _ = Mixture(mlp).apply({"params": {"members": members["params"], "weights": weights}}, x)
    expected = sum(
        float(weights[c]) * np.asarray(mlp.apply(jax.tree.map(lambda a: a[c], members), x)[0], np.float64)
        for c in range(3)
    )
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_members_are_averaged_with_p_k_given_c_and_routers_stay_private(mlp, digits_federation):
    alg = _ensemble(mlp, num_members=2)
    server, client = alg.init(jax.random.key(0))
    rng = np.random.default_rng(1)
    stacked = jax.tree.map(lambda a: jnp.asarray(rng.normal(size=(3,) + a.shape), jnp.float32), server.members)
    pi = jnp.asarray([[0.9, 0.1], [0.2, 0.8], [0.5, 0.5]], jnp.float32)
    weights = np.array([20.0, 50.0, 30.0])
    new = server_step(alg, server, Upload(stacked, pi), jnp.asarray(weights))
    w = weights[:, None] * np.asarray(pi, np.float64)
    w = w / w.sum(0)
    for got, rows in zip(jax.tree.leaves(new.members), jax.tree.leaves(stacked)):
        rows = np.asarray(rows, np.float64)
        expected = np.stack([np.tensordot(w[:, c], rows[:, c], axes=1) for c in range(2)])
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)

    data = digits_federation.train_data(jnp.array([1]))
    view = ClientData(x=data.x, y=data.y, indices=data.indices[0], count=data.count[0])
    client = client._replace(router=jnp.array([0.3, -0.3]))
    info = round_info()
    new_client, upload, _ = jax.jit(alg.client_update)(
        alg.broadcast(server, info), client, view, jax.random.key(2), info
    )
    assert set(upload._fields) == {"members", "mixture_weights"}
    assert not np.array_equal(new_client.router, [0.3, -0.3])  # trained, kept on the client
    np.testing.assert_allclose(upload.mixture_weights, jax.nn.softmax(new_client.router), rtol=1e-6)
