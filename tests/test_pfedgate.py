"""pFedGate against its authors' code written out another way: blocks as their sub-block ranges of
torch-layout tensors (indices computed with numpy), the SwitchNorm as their torch forward in numpy
(float64, real examples only), the sparse selection as their greedy loop in Python, a client's
round as plain ``jax.grad`` steps on each batch's real examples, and the personalized model as the
gate over every training example at once."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import one_client, round_info

from jaxfed.algorithms.pfedgate import (
    GatingLayer,
    SwitchNorm,
    greedy_keep,
    kept_blocks,
    parameter_blocks,
    pfedgate,
    selection_floor,
)
from jaxfed.algorithms.training import shuffled_positions
from jaxfed.errors import ConfigError
from jaxfed.nn import Model


def _authors_blocks(shapes: dict, dense: set, split: int):
    """Per leaf name: each element's block, as the authors cut a torch tensor (its elements in
    torch order, ``[out, in, *spatial]`` for a kernel); and the blocks' sizes, Dense flags and
    first flags, in leaf order."""
    ids, sizes, dense_flags, firsts = {}, [], [], []
    for name in sorted(shapes):
        shape = shapes[name]
        n = int(np.prod(shape))
        split_num = split if n >= split else n
        size_each = int(np.ceil(n / split_num))
        split_num = int(np.ceil(n / size_each))
        start = len(sizes)
        sizes += [size_each] * (split_num - 1) + [n - (split_num - 1) * size_each]
        layer = name.rsplit("/", 1)[0]
        dense_flags += [layer in dense] * split_num
        firsts += [True] + [False] * (split_num - 1)
        block = np.empty(shape, np.int64)
        for index in np.ndindex(*shape):
            if name.endswith("kernel") and len(shape) >= 2:
                torch_index = (index[-1], index[-2], *index[:-2])
                torch_shape = (shape[-1], shape[-2], *shape[:-2])
            else:
                torch_index, torch_shape = index, shape
            block[index] = start + np.ravel_multi_index(torch_index, torch_shape) // size_each
        ids[name] = block
    return ids, np.array(sizes), np.array(dense_flags), np.array(firsts)


SHAPES = {"conv/kernel": (3, 3, 2, 5), "conv/bias": (5,), "fc/kernel": (7, 3), "fc/bias": (3,), "odd/scale": (25,)}


def _template(shapes):
    tree = {}
    for name, shape in shapes.items():
        layer, leaf = name.split("/")
        tree.setdefault(layer, {})[leaf] = jax.ShapeDtypeStruct(shape, jnp.float32)
    return tree


@pytest.mark.parametrize("split", [1, 4, 5, 10])
def test_blocks_are_the_authors_sub_blocks_of_torch_layout_tensors(split):
    blocks = parameter_blocks(_template(SHAPES), {"fc"}, split)
    ids, sizes, dense, first = _authors_blocks(SHAPES, {"fc"}, split)
    for name, want in ids.items():
        layer, leaf = name.split("/")
        np.testing.assert_array_equal(blocks.ids[layer][leaf], want, err_msg=name)
    np.testing.assert_array_equal(blocks.sizes, sizes)
    np.testing.assert_array_equal(blocks.dense, dense)
    np.testing.assert_array_equal(blocks.first, first)
    if split == 10:  # the authors' comment: 25 elements in 10 -> 9 sub-blocks of 3, the last of 1
        assert sizes[-9:].tolist() == [3] * 8 + [1]


def _softmax(v):
    e = np.exp(v - v.max())
    return e / e.sum()


def _switchnorm(x, params, running=None, eps=1e-5):
    """The authors' SwitchNorm2d.forward in numpy float64 on ``[N, positions, C]``; ``running``:
    inference mode with those (mean, var); returns ``(y, batch mean, batch var)``."""
    x = np.asarray(x, np.float64)
    mean_in, var_in = x.mean(1), x.var(1, ddof=1)
    mean_ln = mean_in.mean(1, keepdims=True)
    temp = var_in + mean_in**2
    var_ln = temp.mean(1, keepdims=True) - mean_ln**2
    if running is None:
        mean_bn = mean_in.mean(0, keepdims=True)
        var_bn = temp.mean(0, keepdims=True) - mean_bn**2
    else:
        mean_bn, var_bn = (np.asarray(r, np.float64)[None] for r in running)
    mw, vw = _softmax(np.asarray(params["mean_weight"], np.float64)), _softmax(np.asarray(params["var_weight"]))
    mean = mw[0] * mean_in + mw[1] * mean_ln + mw[2] * mean_bn
    var = vw[0] * var_in + vw[1] * var_ln + vw[2] * var_bn
    y = (x - mean[:, None]) / np.sqrt(var[:, None] + eps)
    return y * np.asarray(params["scale"]) + np.asarray(params["bias"]), mean_bn[0], var_bn[0]


def test_switchnorm_is_the_authors_on_the_real_examples_and_keeps_their_running_statistics():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(1.0, 2.0, size=(6, 10, 3)), jnp.float32)
    mask = jnp.arange(6) < 4  # two padding rows
    norm = SwitchNorm()
    variables = norm.init(jax.random.key(0), x, False)
    params = {
        "mean_weight": jnp.asarray(rng.normal(size=3), jnp.float32),
        "var_weight": jnp.asarray(rng.normal(size=3), jnp.float32),
        "scale": jnp.asarray(rng.normal(size=3), jnp.float32),
        "bias": jnp.asarray(rng.normal(size=3), jnp.float32),
    }
    running = {"mean": jnp.asarray(rng.normal(size=3), jnp.float32), "var": jnp.asarray(rng.uniform(1, 2, 3))}
    variables = {"params": params, "batch_stats": running}
    y, new = norm.apply(variables, x, True, mask, mutable=["batch_stats"])
    want, mean_bn, var_bn = _switchnorm(np.asarray(x)[:4], params)
    np.testing.assert_allclose(y[:4], want, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(new["batch_stats"]["mean"], 0.9 * running["mean"] + 0.1 * mean_bn, rtol=1e-5)
    np.testing.assert_allclose(new["batch_stats"]["var"], 0.9 * running["var"] + 0.1 * var_bn, rtol=1e-5)
    y_eval = norm.apply(variables, x, False)  # inference: the running statistics, every row alike
    want_eval, _, _ = _switchnorm(np.asarray(x), params, (running["mean"], running["var"]))
    np.testing.assert_allclose(y_eval, want_eval, rtol=1e-4, atol=1e-5)


def _authors_greedy(values, weights, capacity):
    """``KnapsackSolver01.found_max_value_greedy``: items in decreasing value (ties: their order),
    each taken if it still fits."""
    taken, total = [], 0
    for i in sorted(range(len(values)), key=lambda i: (-values[i], i)):
        if total + weights[i] <= capacity:
            total += weights[i]
            taken.append(i)
    return sorted(taken)


@pytest.mark.parametrize("seed", range(4))
def test_the_greedy_knapsack_is_the_authors_loop(seed):
    rng = np.random.default_rng(seed)
    n = 17
    values, weights = rng.integers(0, 11, n), rng.integers(1, 40, n)
    candidates = rng.random(n) < 0.8
    capacity = int(weights[candidates].sum() * 0.4)
    got = greedy_keep(
        jnp.asarray(values, jnp.float32), jnp.asarray(weights, jnp.int32), jnp.asarray(candidates), capacity
    )
    index = np.flatnonzero(candidates)
    want = index[_authors_greedy(values[index].tolist(), weights[index].tolist(), capacity)]
    assert np.flatnonzero(np.asarray(got)).tolist() == want.tolist()


def _authors_selection(gates, sizes, dense, first, sparse_factor, split):
    """``select_top_trans_weights`` (block_wise_prune): the kept blocks of each group."""
    floor = min(max(1 / split, 0.1), sparse_factor)
    importance = np.around(np.maximum(gates, floor) * 10).astype(int)
    keep = first.copy()
    for group in (dense, ~dense):
        index = np.flatnonzero(group & ~first)
        capacity = round(sizes[index].sum() * (sparse_factor - floor))
        keep[index[_authors_greedy(importance[index].tolist(), sizes[index].tolist(), capacity)]] = True
    return keep


@pytest.mark.parametrize("sparse_factor", [0.3, 0.5, 0.9])
def test_the_sparse_selection_keeps_what_the_authors_keep(sparse_factor):
    blocks = parameter_blocks(_template(SHAPES), {"fc"}, 5)
    gates = np.random.default_rng(1).uniform(0, 1, blocks.sizes.size).astype(np.float32)
    got = kept_blocks(jnp.asarray(gates), blocks, sparse_factor, selection_floor(5, sparse_factor))
    want = _authors_selection(gates, blocks.sizes, blocks.dense, blocks.first, sparse_factor, 5)
    np.testing.assert_array_equal(got, want)
    kept_share = blocks.sizes[want].sum() / blocks.sizes.sum()
    assert kept_share < 1 and not np.all(want)  # something is dropped at every factor here


def _gated_reference(params, ids, weights):
    return jax.tree.map(lambda p, i: p * weights[i], params, ids)


def _ce(model, params, x, y):
    logits = model.apply({"params": params}, x)[0]
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], 1))


def _clipped(grads, norm):
    total = np.sqrt(sum(float(np.sum(np.square(g))) for g in jax.tree.leaves(grads)))
    return jax.tree.map(lambda g: g * min(1.0, norm / total), grads)


@pytest.mark.parametrize("sparse_factor", [1.0, 0.5])
def test_a_client_trains_the_gated_model_and_its_gating_layer_as_plain_steps_on_real_examples(
    sparse_factor, mlp, digits_federation
):
    options = dict(
        lr=0.1,
        momentum=0.0,
        weight_decay=0.01,
        clip_norm=1.0,
        gate_lr_scale=2.0,
        local_epochs=1,
        batch_size=32,
        sparse_factor=sparse_factor,
    )
    alg = pfedgate(mlp, **options)
    server, client = alg.init(jax.random.key(0))
    data, rng = one_client(digits_federation, 3), jax.random.key(5)
    count = int(data.count)
    assert count % 32  # a partial last batch: its padding rows must count for nothing
    new_client, upload, metrics = jax.jit(alg.client_update)(server.params, client, data, rng, round_info(0))

    template = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), server.params)
    shapes = {f"{layer}/{leaf}": v.shape for layer, leaves in template.items() for leaf, v in leaves.items()}
    names = {f"{layer}/{leaf}" for layer, leaves in template.items() for leaf in leaves}
    dense = {name.split("/")[0] for name in names}  # the MLP's layers are all Dense
    ids, sizes, dense_flags, first = _authors_blocks(shapes, dense, 5)
    ids = {layer: {leaf: jnp.asarray(ids[f"{layer}/{leaf}"]) for leaf in leaves} for layer, leaves in template.items()}
    gating = GatingLayer(int(sizes.size))

    padded = -(-data.indices.shape[0] // 32) * 32
    order = np.asarray(shuffled_positions(jax.random.split(rng, 1)[0], data.count, data.indices.shape[0], padded))
    params, gate, stats = server.params, client.gate, client.gate_state
    for start in range(0, count, 32):
        positions = order[start : start + 32]
        rows = np.asarray(data.indices)[positions[positions < count]]
        x, y = data.x[rows], data.y[rows]
        logits, _ = gating.apply({"params": gate, **stats}, x, True, mutable=["batch_stats"])
        gates = np.asarray(jnp.mean(jax.nn.sigmoid(logits), 0))
        keep = (
            np.ones_like(first)
            if sparse_factor == 1
            else _authors_selection(gates, sizes, dense_flags, first, sparse_factor, 5)
        )

        def loss(p, g):
            lg, new_stats = gating.apply({"params": g, **stats}, x, True, mutable=["batch_stats"])
            weights = jnp.mean(jax.nn.sigmoid(lg), 0) * keep
            return _ce(mlp, _gated_reference(p, ids, weights), x, y), new_stats

        (_, new_stats), (g_params, g_gate) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, gate)
        g_params = _clipped(jax.tree.map(lambda g, p: g + 0.01 * p, g_params, params), 1.0)
        g_gate = _clipped(jax.tree.map(lambda g, p: g + 0.01 * p, g_gate, gate), 1.0)
        params = jax.tree.map(lambda p, g: p - 0.1 * g, params, g_params)
        gate = jax.tree.map(lambda p, g: p - 0.2 * g, gate, g_gate)
        stats = dict(new_stats)

    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-6), upload, params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-6), new_client.gate, gate)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-6), new_client.gate_state, stats)
    assert int(metrics["steps"]) == -(-count // 32)


@pytest.mark.parametrize("sparse_factor", [1.0, 0.3])
def test_the_personalized_model_is_gated_by_the_mean_gate_over_every_training_example(
    sparse_factor, mlp, digits_federation
):
    alg = pfedgate(mlp, sparse_factor=sparse_factor, batch_size=16)
    server, client = alg.init(jax.random.key(0))
    trained, _, _ = alg.client_update(
        server.params, client, one_client(digits_federation, 2), jax.random.key(1), round_info(0)
    )  # trained: statistics that are not the initial ones
    data = one_client(digits_federation, 4)
    got = jax.jit(alg.personalize)(server, trained, data, jax.random.key(2), round_info(1))

    rows = np.asarray(data.indices)[: int(data.count)]
    gating_blocks = parameter_blocks(
        jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), server.params), set(server.params), 5
    )  # the MLP's layers are all Dense
    logits = GatingLayer(int(gating_blocks.sizes.size)).apply(
        {"params": trained.gate, **trained.gate_state}, data.x[rows], False
    )
    gates = np.asarray(jnp.mean(jax.nn.sigmoid(logits), 0))
    if sparse_factor < 1:
        keep = _authors_selection(
            gates, gating_blocks.sizes, np.ones_like(gating_blocks.first), gating_blocks.first, sparse_factor, 5
        )
        gates = gates * keep
        kept = gating_blocks.sizes[keep].sum() / gating_blocks.sizes.sum()
        assert kept < 0.5  # about the sparse factor of the model's elements
    want = _gated_reference(server.params, gating_blocks.ids, jnp.asarray(gates))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), got["params"], want)


def test_the_mlp_layers_are_dense(mlp):
    from jaxfed.nn.layers import dense_layers

    assert set(dense_layers(mlp)) == set(mlp.init(jax.random.key(0))["params"])


def test_an_integer_input_model_is_refused_in_one_line():
    import flax.linen as nn

    class Tokens(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(3)(nn.Embed(10, 4)(x).reshape(x.shape[0], -1))

    with pytest.raises(ConfigError, match="pfedgate: the gating layer reads float inputs"):
        pfedgate(Model.wrap(Tokens(), (5,), input_dtype=jnp.int32))


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--set", "sparse_factor=0"], "sparse_factor: must be in (0, 1], got 0"),
        (["--set", "sparse_factor=1.5"], "sparse_factor: must be in (0, 1], got 1.5"),
        (["--set", "block_split=0"], "block_split: must be >= 1, got 0"),
        (["--set", "gate_lr_scale=-1"], "gate_lr_scale: must be >= 0, got -1"),
    ],
)
def test_bad_pfedgate_settings_are_one_line_errors(args, expected, tmp_path, capsys):
    from jaxfed.cli import main

    assert main(["run", "pfedgate", *args, "--out", str(tmp_path / "r"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and expected in err, err
