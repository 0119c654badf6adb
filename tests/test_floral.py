"""FLoRAL: adaptor aggregation weights p(k|c), private routers, stateless clients, learning, errors."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import make_federation, round_info

from jaxfed.algorithms.floral import FLoRALOptions, Upload, _local_optimizer, _plan, floral, local_adaptor
from jaxfed.cli import main
from jaxfed.core import adaptors as ad
from jaxfed.core import mean_of
from jaxfed.core.routing import mixture_share
from jaxfed.data import ClientData
from jaxfed.nn import Model
from jaxfed.simulation import Simulation, server_step


def _floral(model, **options):
    return floral(model, lr=0.05, local_epochs=1, batch_size=32, **options)


def test_summed_mixture_shares_average_each_component_with_p_k_given_c():
    rng = np.random.default_rng(0)
    pi = rng.dirichlet(np.ones(3), size=4)
    p = np.array([10.0, 30.0, 0.0, 60.0])  # the third is padding
    x = rng.normal(size=(4, 3, 5))
    previous = rng.normal(size=(3, 5))
    shares = [mixture_share(jnp.asarray(x[k], jnp.float32), jnp.asarray(pi[k], jnp.float32), p[k]) for k in range(4)]
    got = mean_of(jax.tree.map(lambda *s: sum(s), *shares), jnp.asarray(previous, jnp.float32))
    p_k_c = np.array([[p[k] * pi[k, c] / sum(p[j] * pi[j, c] for j in range(4)) for c in range(3)] for k in range(4)])
    expected = np.einsum("kc,kcd->cd", p_k_c, x)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    unused = mean_of(mixture_share(jnp.asarray(x[0], jnp.float32), jnp.array([1.0, 0.0, 0.0]), 5.0), previous)
    np.testing.assert_array_equal(unused[1:], np.float32(previous[1:]))  # a component nobody used keeps its value


def test_server_averages_base_by_samples_and_each_adaptor_by_p_k_given_c(mlp):
    alg = _floral(mlp, num_adaptors=2, adaptor_rank=4)
    server, _ = alg.init(jax.random.key(0))
    rng = np.random.default_rng(1)
    n = 3
    stacked = jax.tree.map(lambda a: jnp.asarray(rng.normal(size=(n,) + a.shape), jnp.float32), server)
    pi = jnp.asarray([[0.9, 0.1], [0.2, 0.8], [0.5, 0.5]], jnp.float32)
    weights = np.array([20.0, 50.0, 30.0])
    new = server_step(alg, server, Upload(stacked.base, stacked.adaptors, pi), jnp.asarray(weights))
    p = weights / weights.sum()
    for got, rows in zip(jax.tree.leaves(new.base), jax.tree.leaves(stacked.base)):
        np.testing.assert_allclose(got, np.tensordot(p, np.asarray(rows, np.float64), axes=1), rtol=1e-5, atol=1e-6)
    w = np.asarray(weights)[:, None] * np.asarray(pi, np.float64)
    w = w / w.sum(0)
    for got, rows in zip(jax.tree.leaves(new.adaptors), jax.tree.leaves(stacked.adaptors)):
        rows = np.asarray(rows, np.float64)  # [n, C, ...]
        expected = np.stack([np.tensordot(w[:, c], rows[:, c], axes=1) for c in range(2)])
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("stateful", [True, False])
def test_routers_stay_on_the_client(mlp, digits_federation, stateful):
    alg = _floral(mlp, num_adaptors=3, adaptor_rank=4, stateful=stateful)
    server, client = alg.init(jax.random.key(0))
    client = client._replace(router=jnp.array([0.5, -0.5, 2.0]))
    data = digits_federation.train_data(jnp.array([1]))
    view = ClientData(x=data.x, y=data.y, indices=data.indices[0], count=data.count[0])
    new_client, upload, _ = jax.jit(alg.client_update)(
        alg.broadcast(server, round_info()), client, view, jax.random.key(2), round_info()
    )
    assert set(upload._fields) == {"base", "adaptors", "mixture_weights"}
    router = np.asarray(new_client.router)
    assert not np.array_equal(router, [0.5, -0.5, 2.0])  # the router trained
    for leaf in jax.tree.leaves(upload):
        assert not (np.shape(leaf) == router.shape and np.array_equal(leaf, router))
    np.testing.assert_allclose(upload.mixture_weights, jax.nn.softmax(new_client.router), rtol=1e-6)
    if not stateful:  # a stateless client started from zero logits
        alg_from_zero = _floral(mlp, num_adaptors=3, adaptor_rank=4)
        zero = client._replace(router=jnp.zeros(3))
        again, _, _ = jax.jit(alg_from_zero.client_update)(
            alg.broadcast(server, round_info()), zero, view, jax.random.key(2), round_info()
        )
        np.testing.assert_allclose(new_client.router, again.router, rtol=1e-6)


def test_floral_learns_digits(mlp, digits):
    fed = make_federation(digits, num_clients=8, name="iid")
    sim = Simulation(_floral(mlp, num_adaptors=2, rho=0.1), mlp, fed, participation=1.0)
    start = sim.init()
    state, _ = sim.run_rounds(start, 3)
    before, after = (sim.evaluate(s) for s in (start, state))
    assert (
        after["personalized_acc_mean"] > 0.7 and after["personalized_acc_mean"] > before["personalized_acc_mean"] + 0.4
    )
    assert "global_acc" not in after


@pytest.mark.parametrize(
    "override, expected",
    [
        ("rho=0", "rho: must be in (0, 1], got 0.0"),
        ("rho=2", "rho: must be in (0, 1], got 2.0"),
        ("num_adaptors=0", "num_adaptors: must be >= 1, got 0"),
        ("conv_adaptor=diagonal", "conv_adaptor: unknown 'diagonal'"),
        ("router_temperature=0", "router_temperature: must be > 0, got 0.0"),
        (
            "adaptor_rank=21",
            "adaptor_rank: 21 is not a valid rank for head (kernel (200, 10), matricized (200, 10)): allowed 1..10",
        ),
    ],
)
def test_bad_settings_are_one_line_errors(override, expected, tmp_path, capsys):
    assert main(["run", "floral", "--set", override, "--out", str(tmp_path / "r"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and expected in err


def test_local_adaptor_uploads_only_the_base_and_keeps_its_adaptor(mlp, digits_federation):
    alg = local_adaptor(mlp, lr=0.05, local_epochs=1, batch_size=32, adaptor_rank=4)
    server, client = alg.init(jax.random.key(0))
    data = digits_federation.train_data(jnp.array([1]))
    view = ClientData(x=data.x, y=data.y, indices=data.indices[0], count=data.count[0])
    new_client, upload, _ = jax.jit(alg.client_update)(
        alg.broadcast(server, round_info()), client, view, jax.random.key(2), round_info()
    )
    assert jax.tree.structure(upload) == jax.tree.structure(server.params)
    ups = [np.asarray(a["up"]) for a in new_client.adaptors["kernels"].values()]
    assert all(float(np.abs(u).max()) > 0 for u in ups)  # trained (they start at zero)
    for leaf in jax.tree.leaves(upload):
        assert not any(u.shape == np.shape(leaf) and np.array_equal(u, leaf) for u in ups)
    assert jax.tree.structure(new_client.adaptors) == jax.tree.structure(client.adaptors)


def test_oracle_router_is_one_hot_on_the_cluster_and_never_trains(mlp, digits):
    fed = make_federation(digits, num_clients=4, name="iid")
    alg = _floral(mlp, num_adaptors=3, adaptor_rank=4, router="oracle", num_clusters=2)
    sim = Simulation(alg, mlp, fed, participation=1.0)
    start = sim.init()
    pi = np.asarray(jax.nn.softmax(start.clients.router))
    np.testing.assert_allclose(pi, np.eye(3)[[0, 1, 0, 1]], atol=1e-30)
    state, _ = sim.run_rounds(start, 1)
    np.testing.assert_array_equal(state.clients.router, start.clients.router)
    assert not np.allclose(state.server.adaptors["kernels"]["head"]["up"][0], 0)  # cluster 0's adaptor trained
    np.testing.assert_array_equal(state.server.adaptors["kernels"]["head"]["up"][2], 0)  # nobody's: unchanged


def test_router_noise_is_drawn_afresh_at_every_step():
    """run_epochs hands step t the key fold_in(fold_in(rng, STEP_KEY_STREAM), t)."""
    from jaxfed.algorithms.training import STEP_KEY_STREAM, run_epochs

    data = ClientData(x=jnp.zeros((10, 1)), y=jnp.zeros(10, jnp.int32), indices=jnp.arange(10), count=jnp.int32(10))

    def step(total, batch):  # total = [sum_t (t + 1) * U(key_t), steps so far]
        weighted, steps = total
        return jnp.stack([weighted + (steps + 1) * jax.random.uniform(batch.key), steps + 1]), 0.0

    rng = jax.random.key(3)
    got, _ = run_epochs(step, jnp.zeros(2), data, rng, epochs=2, batch_size=4)
    root = jax.random.fold_in(rng, STEP_KEY_STREAM)
    expected = sum((t + 1) * float(jax.random.uniform(jax.random.fold_in(root, t))) for t in range(6))
    np.testing.assert_allclose(got, [expected, 6.0], rtol=1e-6)


def test_oracle_needs_clusters_and_enough_adaptors(mlp, tmp_path, capsys):
    with pytest.raises(Exception, match="needs num_adaptors >= 4, got 2"):
        _floral(mlp, num_adaptors=2, router="oracle", num_clusters=4)
    assert main(["run", "floral", "--set", "router=oracle", "--out", str(tmp_path / "r"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "router: oracle needs ground-truth clusters" in err


class _NormNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.GroupNorm(num_groups=2)(nn.Dense(8)(x.reshape(x.shape[0], -1))))
        return nn.Dense(10)(h)


def test_norm_adaptors_are_opt_in_as_in_the_authors_code(digits):
    model = Model.wrap(_NormNet(), digits.input_shape)
    off, on = _floral(model, adaptor_rank=2), _floral(model, adaptor_rank=2, norm_adaptors=True)

    def norm_adaptors(alg):
        return jax.eval_shape(alg.init, jax.random.key(0))[0].adaptors.get("norms")

    assert not norm_adaptors(off) and norm_adaptors(on)


class _OffsetNormNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.LayerNorm(use_scale=False)(nn.Dense(8)(x.reshape(x.shape[0], -1))))
        return nn.Dense(10)(h)


def test_norm_adaptors_adapt_an_offset_only_norm_layer(digits):
    """FLoRAL's own plan (not only ``adaptor_plan``): a LayerNorm without a scale gets an adaptor on
    its offset; the plan used to look for a 'scale' parameter and gave it none."""
    model = Model.wrap(_OffsetNormNet(), digits.input_shape)
    norms = jax.eval_shape(_floral(model, adaptor_rank=2, norm_adaptors=True).init, jax.random.key(0))[0].adaptors
    assert {key: set(layer) for key, layer in norms["norms"].items()} == {"LayerNorm_0": {"bias"}}


def test_bias_adaptors_are_scaled_by_alpha(mlp):
    template = mlp.init(jax.random.key(0))["params"]
    plan = ad.adaptor_plan(template, 2, rank=2, alpha=2.5)
    adaptors = ad.init_adaptors(jax.random.key(1), template, plan)
    rng = np.random.default_rng(0)
    adaptors["biases"] = {k: jnp.asarray(rng.normal(size=v.shape), jnp.float32) for k, v in adaptors["biases"].items()}
    pi = jnp.array([0.3, 0.7])
    mixed = ad.mix(template, adaptors, pi, plan)
    for key in plan.biases:
        expected = np.float64(template[key]["bias"]) + 2.5 * (np.float64(pi) @ np.float64(adaptors["biases"][key]))
        np.testing.assert_allclose(mixed[key]["bias"], expected, rtol=1e-5, atol=1e-6)


def test_mixture_floor_clamps_the_clients_weights_and_the_server_weighs_by_the_softmax(mlp, digits_federation):
    """As the authors' code: the floor clamps the weights a client computes (and is evaluated)
    with; the upload carries the unclamped softmax, which the server weighs components by."""
    alg = _floral(mlp, num_adaptors=3, adaptor_rank=4, mixture_floor=0.05)
    server, client = alg.init(jax.random.key(0))
    client = client._replace(router=jnp.array([6.0, 0.0, -6.0]))
    data = digits_federation.train_data(jnp.array([1]))
    view = ClientData(x=data.x, y=data.y, indices=data.indices[0], count=data.count[0])
    new_client, upload, _ = jax.jit(alg.client_update)(
        alg.broadcast(server, round_info()), client, view, jax.random.key(2), round_info()
    )
    softmax = np.asarray(jax.nn.softmax(new_client.router), np.float64)
    clamped = np.maximum(softmax, 0.05)
    assert clamped.min() == 0.05 and softmax.min() < 0.01  # the floor binds
    np.testing.assert_allclose(upload.mixture_weights, softmax, rtol=1e-6)
    server = server._replace(adaptors=jax.tree.map(lambda a: a + 0.1, server.adaptors))
    mixed = alg.eval_params(server, new_client)["params"]
    plan = ad.adaptor_plan(server.base, 3, rank=4)
    expected = ad.mix(server.base, server.adaptors, jnp.asarray(clamped, jnp.float32), plan)
    for got, want in zip(jax.tree.leaves(mixed), jax.tree.leaves(expected)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def test_conv_precondition_reaches_the_conv_adaptors(small_cnn, digits_federation):
    """The two conv forms give the conv adaptors different updates."""
    data = digits_federation.train_data(jnp.array([1]))
    view = ClientData(x=data.x, y=data.y, indices=data.indices[0], count=data.count[0])
    uploads = {}
    for form in ad.CONV_PRECONDITIONERS:
        alg = _floral(small_cnn, num_adaptors=2, adaptor_rank=2, conv_precondition=form)
        server, client = alg.init(jax.random.key(0))
        server = server._replace(  # nonzero up factors, so the conv Gram tensors are not zero
            adaptors=jax.tree.map(lambda a: a + 0.05, server.adaptors)
        )
        uploads[form] = jax.jit(alg.client_update)(
            alg.broadcast(server, round_info()), client, view, jax.random.key(2), round_info()
        )[1]
    plan = ad.adaptor_plan(jax.eval_shape(small_cnn.init, jax.random.key(0))["params"], 2, rank=2)
    kinds = {key: spec.kind for key, spec in plan.kernels.items()}
    assert "dense" in kinds.values() and set(kinds.values()) - {"dense"}
    per_tap, matricized = (uploads[f].adaptors["kernels"] for f in ad.CONV_PRECONDITIONERS)
    for key, kind in kinds.items():
        if kind != "dense":
            assert not np.allclose(per_tap[key]["up"], matricized[key]["up"], rtol=1e-4, atol=0)


def test_floral_clips_the_local_gradient_to_one_global_norm(mlp):
    """``clip_norm`` clips each local gradient to that global norm (options help, docs: "clip each
    local gradient to this global norm before the optimizer's step"). FLoRAL's local gradient is
    that of the base and the adaptors together; ``per_key`` clipped each of the two to the norm
    on its own, so one SGD step moved the pair by up to sqrt(2) times the clipped norm."""
    options = FLoRALOptions(lr=1.0, clip_norm=1.0, precondition=False, momentum=0.0, weight_decay=0.0)
    _, plan = _plan(mlp, options, options.num_adaptors)
    params = {"base": {"w": jnp.zeros((3, 5))}, "adaptors": {"down": jnp.zeros((4, 3, 2))}, "router": jnp.zeros(4)}
    grads = {"base": {"w": jnp.full((3, 5), 10.0)}, "adaptors": {"down": jnp.full((4, 3, 2), 10.0)}}
    grads["router"] = jnp.ones(4)
    opt = _local_optimizer(plan, options, jnp.int32(0), router=True)
    updates, _ = opt.update(grads, opt.init(params), params)
    shared = {k: updates[k] for k in ("base", "adaptors")}
    np.testing.assert_allclose(optax.tree.norm(shared), 1.0, rtol=1e-5)  # was sqrt(2)
    # the two parts keep their direction: the whole gradient scaled by one factor
    scale = 1.0 / float(optax.tree.norm({k: grads[k] for k in ("base", "adaptors")}))
    np.testing.assert_allclose(updates["base"]["w"], -scale * grads["base"]["w"], rtol=1e-5)
    np.testing.assert_allclose(updates["adaptors"]["down"], -scale * grads["adaptors"]["down"], rtol=1e-5)
    np.testing.assert_allclose(updates["router"], -options.router_lr * grads["router"], rtol=1e-6)  # unclipped
