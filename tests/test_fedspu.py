"""FedSPU against its definition written out: the sub-model as the weights between drawn units
(index arithmetic in numpy), a client's round as training through a model whose frozen part is a
constant (no optimizer mask), and the server's step as a per-weight mean in float64. Its defaults
learning and its private model staying private are tests/test_defaults.py's and
tests/test_privacy.py's."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_federation, round_info
from small_models import BatchNormNet

from jaxfed.algorithms import registry
from jaxfed.algorithms.fedspu import ClientState, Upload, draw_units, fedspu, neuron_chain, submodel_mask, unit_counts
from jaxfed.algorithms.records import GlobalParams
from jaxfed.algorithms.training import train_parameters
from jaxfed.data import ClientData
from jaxfed.errors import ConfigError
from jaxfed.nn import Model, get_model, split_variables
from jaxfed.runs.config import Config
from jaxfed.simulation import Simulation, server_step


def _drawn(model, rate, seed=0):
    chain = neuron_chain(model)
    drawn = draw_units(jax.random.key(seed), chain, unit_counts(chain, rate))
    return chain, {key: np.asarray(d) for key, d in drawn.items()}


def test_the_submodel_is_every_weight_between_drawn_units_of_the_cnn():
    """conv1 -> conv2 -> flatten (4 x 4 x 64) -> fc1 -> head: a kernel weight is in the sub-model when
    its input unit (every input of conv1; the channel of a flattened position for fc1) and its output
    unit (every class of the head) are drawn; a bias when its unit is."""
    model = get_model("cnn", (28, 28, 1), 10)
    params = model.init(jax.random.key(0))["params"]
    chain, drawn = _drawn(model, 0.3)
    assert {key: int(d.sum()) for key, d in drawn.items()} == {"conv1": 9, "conv2": 19, "fc1": 153}  # int(n * 0.3)
    mask = jax.tree.map(np.asarray, submodel_mask(params, chain, {k: jnp.asarray(d) for k, d in drawn.items()}))

    positions = mask["fc1"]["kernel"].shape[0] // 64  # conv2's output map, 4 x 4 x 64, flattened
    channel = np.broadcast_to(np.arange(64), (positions, 64)).reshape(-1)  # a flattened NHWC position's channel
    unit_in = {"conv1": np.ones(1, bool), "conv2": drawn["conv1"], "fc1": drawn["conv2"][channel], "head": drawn["fc1"]}
    unit_out = {**drawn, "head": np.ones(10, bool)}
    for layer in ("conv1", "conv2", "fc1", "head"):
        between = np.logical_and.outer(unit_in[layer], unit_out[layer])  # [inputs, outputs]
        np.testing.assert_array_equal(mask[layer]["kernel"], np.broadcast_to(between, mask[layer]["kernel"].shape))
        np.testing.assert_array_equal(mask[layer]["bias"], unit_out[layer], err_msg=layer)

    whole = submodel_mask(params, chain, draw_units(jax.random.key(0), chain, unit_counts(chain, 1.0)))
    assert all(np.all(m) for m in jax.tree.leaves(whole))  # rate 1.0: the whole model


def test_a_normalization_layer_follows_the_units_of_the_layer_before_it_and_a_shortcut_is_refused(digits):
    model = Model("bn_net", BatchNormNet(digits.num_classes), digits.input_shape)
    params = model.init(jax.random.key(0))["params"]
    chain, drawn = _drawn(model, 0.5)
    assert list(chain.units) == ["Dense_0", "hidden"] and chain.norms == {"Norm_0.BatchNorm_0": "Dense_0"}
    mask = submodel_mask(params, chain, {k: jnp.asarray(d) for k, d in drawn.items()})
    for leaf in mask["Norm_0"]["BatchNorm_0"].values():
        np.testing.assert_array_equal(leaf, drawn["Dense_0"])

    vgg = neuron_chain(get_model("vgg8", (32, 32, 3), 10))  # convs, each with a GroupNorm after it, then Dense layers
    assert [layer.repeat for layer in vgg.layers] == [1, 1, 1, 1, 1, 4, 1, 1]  # fc1 reads conv5's 2 x 2 map
    assert all(norm.rsplit(".", 1)[0].replace("norm", "conv") == conv for norm, conv in vgg.norms.items())
    with pytest.raises(ConfigError, match=r"model: fedspu's layer 'layer2_0\.shortcut' takes 16 inputs .* sequential"):
        neuron_chain(get_model("resnet8", (32, 32, 3), 10))
    config = Config(algorithm="fedspu", num_clients=4)
    with pytest.raises(ConfigError, match=r"^rates: 5 client blocks for 4 clients; give at most 4 rates$"):
        registry.get("fedspu").build(model, config.options, config)


def test_a_client_trains_its_submodel_from_the_global_values_and_keeps_the_rest(mlp, digits_federation):
    alg = fedspu(mlp, rates=(0.5,), lr=0.1, local_epochs=1, batch_size=32)
    chain = neuron_chain(mlp)
    own, _ = split_variables(mlp.init(jax.random.key(1)))
    server, _ = alg.init(jax.random.key(0))
    data = digits_federation.train_data(jnp.array([3]))
    data = ClientData(x=data.x, y=data.y, indices=data.indices[0], count=data.count[0])
    rng = jax.random.key(7)
    message = alg.broadcast(server, round_info(0))
    client, upload, _ = jax.jit(alg.client_update)(message, ClientState(own, {}), data, rng, round_info(0))

    draw_rng, train_rng = jax.random.split(rng)
    mask = submodel_mask(own, chain, draw_units(draw_rng, chain, message.counts))
    frozen = jax.tree.map(lambda m, x: jnp.where(m, 0.0, x), mask, own)  # a constant: no gradient reaches it

    def to_params(trainable):  # the model with the sub-model's places taken from the trained tree
        return jax.tree.map(lambda m, t, c: jnp.where(m, t, c), mask, trainable, frozen)

    start = jax.tree.map(lambda m, g: jnp.where(m, g, 0.0), mask, server.params)
    trained, _, _ = train_parameters(
        mlp, alg.options.optimizer(0), start, {}, data, train_rng, epochs=1, batch_size=32, to_params=to_params
    )
    want = to_params(trained)
    for got, ref, m, mine in zip(*map(jax.tree.leaves, (client.params, want, mask, own)), strict=True):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(np.asarray(got)[~np.asarray(m)], np.asarray(mine)[~np.asarray(m)])
    for sent, ref, m in zip(*map(jax.tree.leaves, (upload.sub, want, mask)), strict=True):
        np.testing.assert_allclose(sent, np.where(m, ref, 0.0), rtol=1e-5, atol=1e-6)
    assert 0 < sum(int(np.sum(m)) for m in jax.tree.leaves(mask)) < sum(x.size for x in jax.tree.leaves(own))


def test_the_server_averages_each_weight_over_the_clients_that_trained_it(mlp):
    """Three uploads (the second of weight 0) in float64: per weight, sum_k n_k m_k x_k / sum_k n_k m_k;
    the global value where no client trained it."""
    alg = fedspu(mlp, rates=(0.25,))
    chain = neuron_chain(mlp)
    server, _ = alg.init(jax.random.key(0))
    counts = unit_counts(chain, 0.25)
    uploads, masks = [], []
    for k in range(3):
        drawn = draw_units(jax.random.key(10 + k), chain, counts)
        mask = submodel_mask(server.params, chain, drawn)
        values = jax.tree.map(lambda x, i=k: jax.random.normal(jax.random.key(20 + i), x.shape), server.params)
        uploads.append(Upload(jax.tree.map(lambda m, v: jnp.where(m, v, 0.0), mask, values), drawn))
        masks.append(mask)
    weights = np.array([3.0, 0.0, 5.0])
    stacked = jax.tree.map(lambda *rows: jnp.stack(rows), *uploads)
    new = server_step(alg, server, stacked, jnp.asarray(weights, jnp.float32))

    untouched = 0
    for path, got in jax.tree_util.tree_leaves_with_path(new.params):
        old = np.asarray(_at(server.params, path), np.float64)
        m = np.stack([np.asarray(_at(mask, path)) for mask in masks]).astype(np.float64)
        x = np.stack([np.asarray(_at(u.sub, path), np.float64) for u in uploads])
        w = weights.reshape((3,) + (1,) * old.ndim) * m
        den = w.sum(0)
        want = np.where(den > 0, (w * x).sum(0) / np.where(den > 0, den, 1.0), old)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=jax.tree_util.keystr(path))
        untouched += int(np.sum(den == 0))
    assert untouched > 0  # some weights no client trained
    assert isinstance(new, GlobalParams)


def _at(tree, path):
    for key in path:
        tree = tree[key.key]
    return tree


def test_each_client_block_draws_at_its_rate_and_every_block_runs_in_one_group(mlp, digits):
    """Two blocks (rates 0.5 and 1.0), half the clients a round, one client at a time: the blocks'
    messages share one shape, so they run as one group, with the numbers of one group per block
    (padding rows, clients carrying their models over rounds). A client uploads its sub-model's
    values and, where a layer keeps part of its units, their indices; it needs the sub-model's
    global values (4 bytes each)."""
    built = fedspu(mlp, rates=(0.5, 1.0), local_epochs=1)
    fed = make_federation(digits, num_clients=4, alpha=1.0)
    runs = {}
    for name, alg in (("one", built), ("per_block", built._replace(pad_tier=None))):
        sim = Simulation(alg, mlp, fed, participation=0.5, client_chunk=1)
        assert sim._tiers_in_one_group() == (name == "one")
        runs[name] = sim.run_rounds(sim.init(), 2)
    (state, metrics), (want_state, want_metrics) = runs["one"], runs["per_block"]
    for got, want in zip(jax.tree.leaves(state), jax.tree.leaves(want_state), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    untiered = fedspu(mlp, rates=(0.5,))._replace(pad_tier=lambda message, info: message)
    assert not Simulation(untiered, mlp, fed, client_chunk=1)._tiers_in_one_group()

    chain = neuron_chain(mlp)
    params = mlp.init(jax.random.key(0))["params"]
    half = unit_counts(chain, 0.5)
    sub = submodel_mask(params, chain, draw_units(jax.random.key(3), chain, half))
    values = [sum(int(np.sum(m)) for m in jax.tree.leaves(sub)), sum(x.size for x in jax.tree.leaves(params))]
    up = [4 * (values[0] + sum(half.values())), 4 * values[1]]  # a whole layer needs no indices
    for r in range(2):
        blocks = [int(i) * 2 // 4 for i in sim.sampled_ids(r)]
        assert float(metrics["bytes_up"][r]) == float(want_metrics["bytes_up"][r]) == sum(up[b] for b in blocks)
        assert float(metrics["bytes_down_cached"][r]) == sum(4 * values[b] for b in blocks)
