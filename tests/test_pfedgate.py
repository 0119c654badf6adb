"""pFedGate against its authors' code written out another way: blocks as their sub-block ranges of
torch-layout tensors (indices computed with numpy), the SwitchNorm as their torch forward in numpy
(float64, real examples only) and the gating layer's Dense and BatchNorm as numpy, the sparse
selection as their greedy loop in Python and their straight-through mask, a client's round as
plain ``jax.grad`` steps on each batch's real examples (the MLP, a BatchNorm model, a CNN), the
personalized model as the gate over every training example at once, and the server as the
weighted mean written out."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import BatchNormNet, one_client, round_info

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
from jaxfed.nn.layers import dense_layers
from jaxfed.simulation import server_step


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


@pytest.mark.parametrize("sparse_factor, split", [(0.1, 5), (0.3, 5), (0.5, 20), (0.9, 5)])
def test_the_sparse_selection_keeps_what_the_authors_keep(sparse_factor, split):
    blocks = parameter_blocks(_template(SHAPES), {"fc"}, split)
    gates = np.random.default_rng(1).uniform(0, 1, blocks.sizes.size).astype(np.float32)
    assert (gates < 0.1).any()  # some gates below every floor here: their rank is the floor's
    got = kept_blocks(jnp.asarray(gates), blocks, sparse_factor, selection_floor(split, sparse_factor))
    want = _authors_selection(gates, blocks.sizes, blocks.dense, blocks.first, sparse_factor, split)
    np.testing.assert_array_equal(got, want)
    assert not np.all(want)  # something is dropped at every factor here


def _gated_reference(params, ids, weights):
    return jax.tree.map(lambda p, i: p * weights[i], params, ids)


def _ce(model, params, model_state, x, y):
    """Mean cross-entropy over exactly the examples given, the model in training mode."""
    logits, new_state = model.apply({"params": params, **model_state}, x, train=True)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], 1)), new_state


def _clipped(grads, norm):
    """torch's ``clip_grad_norm_``: the gradient scaled to at most ``norm``; and whether it was."""
    total = np.sqrt(sum(float(np.sum(np.square(g))) for g in jax.tree.leaves(grads)))
    return jax.tree.map(lambda g: g * min(1.0, norm / total), grads), total > norm


def _leaf_names(params):
    return ["/".join(str(k.key) for k in path) for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]


def _reference_blocks(model, params, split):
    """The authors' blocks of ``params`` as a tree of ids, with their sizes, Dense flags and firsts."""
    names = _leaf_names(params)
    shapes = dict(zip(names, (p.shape for p in jax.tree.leaves(params)), strict=True))
    dense = {key.replace(".", "/") for key in dense_layers(model)}
    ids, sizes, dense_flags, first = _authors_blocks(shapes, dense, split)
    tree = jax.tree_util.tree_unflatten(jax.tree.structure(params), [jnp.asarray(ids[n]) for n in names])
    return tree, sizes, dense_flags, first


def _weights(gates, keep, floor):
    """The authors' weights of the blocks (``select_top_trans_weights``): the gate, times the
    straight-through mask ``(1 - g.detach()) + g`` of the clipped gate ``g`` where kept, else 0."""
    if keep is None:
        return gates
    clipped = jnp.maximum(gates, floor)
    return gates * (((1.0 - jax.lax.stop_gradient(clipped)) + clipped) * keep)


MODELS = ["mlp", "batchnorm", "cnn"]


def _model(name, digits, mlp, small_cnn):
    return {"mlp": mlp, "cnn": small_cnn}.get(name) or Model("bn", BatchNormNet(digits.num_classes), digits.input_shape)


@pytest.mark.parametrize("model_name, sparse_factor", [("mlp", 1.0), ("batchnorm", 0.5), ("cnn", 1.0)])
def test_a_client_trains_the_gated_model_and_its_gating_layer_as_plain_steps_on_real_examples(
    model_name, sparse_factor, digits, mlp, small_cnn, digits_federation
):
    """Each step: the gate of the batch's real examples, the authors' selection, one loss, each
    part's gradient clipped (both clip here) and then its weight decay added, plain SGD each at its
    learning rate; the model's and the gating layer's statistics from the real examples."""
    model = _model(model_name, digits, mlp, small_cnn)
    clip = 0.002
    options = dict(lr=0.1, momentum=0.0, weight_decay=0.01, clip_norm=clip, gate_lr_scale=2.0, local_epochs=1,
                   batch_size=32, sparse_factor=sparse_factor)  # fmt: skip
    alg = pfedgate(model, **options)
    server, client = alg.init(jax.random.key(0))
    data, rng = one_client(digits_federation, 3), jax.random.key(5)
    count = int(data.count)
    assert count % 32  # a partial last batch: its padding rows must count for nothing
    new_client, upload, metrics = jax.jit(alg.client_update)(server.params, client, data, rng, round_info(0))

    ids, sizes, dense_flags, first = _reference_blocks(model, server.params, 5)
    gating, floor = GatingLayer(int(sizes.size)), selection_floor(5, sparse_factor)
    padded = -(-data.indices.shape[0] // 32) * 32
    order = np.asarray(shuffled_positions(jax.random.split(rng, 1)[0], data.count, data.indices.shape[0], padded))
    params, gate, stats, model_state = server.params, client.gate, client.gate_state, client.model_state

    @jax.jit
    def batch_gates(g, stats, x):
        return jnp.mean(jax.nn.sigmoid(gating.apply({"params": g, **stats}, x, True, mutable=["batch_stats"])[0]), 0)

    @jax.jit
    def step_grads(params, gate, stats, model_state, x, y, keep):
        def loss(p, g):
            lg, new_stats = gating.apply({"params": g, **stats}, x, True, mutable=["batch_stats"])
            weights = _weights(jnp.mean(jax.nn.sigmoid(lg), 0), None if sparse_factor == 1 else keep, floor)
            value, new_model_state = _ce(model, _gated_reference(p, ids, weights), model_state, x, y)
            return value, (new_stats, new_model_state)

        return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, gate)

    clipped_model = clipped_gate = False
    for start in range(0, count, 32):
        positions = order[start : start + 32]
        rows = np.asarray(data.indices)[positions[positions < count]]
        x, y = data.x[rows], data.y[rows]
        gates = np.asarray(batch_gates(gate, stats, x))
        keep = None if sparse_factor == 1 else _authors_selection(gates, sizes, dense_flags, first, sparse_factor, 5)
        (_, (new_stats, new_model_state)), (g_params, g_gate) = step_grads(
            params, gate, stats, model_state, x, y, np.ones(sizes.size) if keep is None else keep
        )
        g_params, was = _clipped(g_params, clip)
        clipped_model |= was
        g_gate, was = _clipped(g_gate, clip)
        clipped_gate |= was
        params = jax.tree.map(lambda p, g: p - 0.1 * (g + 0.01 * p), params, g_params)
        gate = jax.tree.map(lambda p, g: p - 0.2 * (g + 0.01 * p), gate, g_gate)
        stats, model_state = dict(new_stats), dict(new_model_state)

    assert clipped_model and clipped_gate  # the test reaches each part's clipping
    close = dict(rtol=2e-4, atol=2e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **close), upload, params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **close), new_client.params, params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **close), new_client.gate, gate)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **close), new_client.gate_state, stats)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **close), new_client.model_state, model_state)
    assert bool(new_client.trained) and not bool(client.trained)
    assert int(metrics["steps"]) == -(-count // 32)


def test_the_gating_layer_is_switchnorm_dense_and_a_batchnorm_of_the_real_examples():
    """Dense (torch's init bound) then BatchNorm on the real rows (biased variance, eps 1e-5), its
    running statistics moving 0.1 of the way; inference mode normalizes by them."""
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.normal(size=(7, 4, 4, 2)), jnp.float32)
    mask = jnp.arange(7) < 5
    layer = GatingLayer(6)
    variables = layer.init(jax.random.key(1), x, False)
    bound = 1 / np.sqrt(32)
    dense = variables["params"]["Dense_0"]
    assert np.abs(dense["kernel"]).max() <= bound and np.abs(dense["bias"]).max() <= bound
    assert np.abs(dense["kernel"]).max() > 0.8 * bound  # uniform over the whole bound
    params = jax.tree.map(lambda p: p + jnp.asarray(rng.normal(0, 0.1, p.shape), p.dtype), variables["params"])
    stats = jax.tree.map(lambda s: s + jnp.asarray(rng.uniform(0.5, 1.0, s.shape), s.dtype), variables["batch_stats"])
    logits, new = layer.apply({"params": params, "batch_stats": stats}, x, True, mask, mutable=["batch_stats"])

    normed, _, _ = _switchnorm(np.asarray(x)[:5].reshape(5, 16, 2), params["SwitchNorm_0"])
    h = normed.reshape(5, -1) @ np.asarray(params["Dense_0"]["kernel"], np.float64) + np.asarray(
        params["Dense_0"]["bias"]
    )
    mean, var = h.mean(0), h.var(0)
    bn = params["BatchNorm_0"]
    want = (h - mean) / np.sqrt(var + 1e-5) * np.asarray(bn["scale"]) + np.asarray(bn["bias"])
    np.testing.assert_allclose(logits[:5], want, rtol=1e-4, atol=1e-4)
    running = new["batch_stats"]["BatchNorm_0"]
    np.testing.assert_allclose(running["mean"], 0.9 * stats["BatchNorm_0"]["mean"] + 0.1 * mean, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(running["var"], 0.9 * stats["BatchNorm_0"]["var"] + 0.1 * var, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("model_name, sparse_factor", [("mlp", 1.0), ("mlp", 0.3), ("batchnorm", 1.0)])
def test_the_personalized_model_is_its_trained_model_gated_by_the_mean_gate_over_every_training_example(
    model_name, sparse_factor, digits, mlp, small_cnn, digits_federation
):
    model = _model(model_name, digits, mlp, small_cnn)
    alg = pfedgate(model, sparse_factor=sparse_factor, batch_size=16)
    server, client = alg.init(jax.random.key(0))
    data = one_client(digits_federation, 4)
    trained, _, _ = alg.client_update(server.params, client, one_client(digits_federation, 2), jax.random.key(1),
                                      round_info(0))  # fmt: skip
    # some gates far below the selection's floor: at sparse_factor 1 they scale their blocks as they are
    bn_bias = trained.gate["BatchNorm_0"]["bias"]
    trained = trained._replace(gate={**trained.gate, "BatchNorm_0": {**trained.gate["BatchNorm_0"],
                                                                     "bias": bn_bias.at[::3].set(-4.0)}})  # fmt: skip
    later = jax.tree.map(lambda p: p + 0.01, server.params)  # the global model moved on: not what it evaluates
    got = jax.jit(alg.personalize)(server._replace(params=later), trained, data, jax.random.key(2), round_info(1))

    ids, sizes, dense_flags, first = _reference_blocks(model, server.params, 5)
    rows = np.asarray(data.indices)[: int(data.count)]
    logits = GatingLayer(int(sizes.size)).apply({"params": trained.gate, **trained.gate_state}, data.x[rows], False)
    gates = np.asarray(jnp.mean(jax.nn.sigmoid(logits), 0))
    assert gates.min() < 0.1
    if sparse_factor < 1:
        keep = _authors_selection(gates, sizes, dense_flags, first, sparse_factor, 5)
        gates = gates * keep
        assert sizes[keep].sum() / sizes.sum() < 0.5
    want = _gated_reference(trained.params, ids, jnp.asarray(gates))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), got["params"], want)
    jax.tree.map(np.testing.assert_array_equal, got["batch_stats"] if "batch_stats" in got else {},
                 trained.model_state.get("batch_stats", {}))  # fmt: skip


def test_a_client_that_never_trained_gates_the_global_model(mlp, digits_federation):
    alg = pfedgate(mlp)
    server, client = alg.init(jax.random.key(0))
    later = server._replace(params=jax.tree.map(lambda p: p + 0.5, server.params))
    data = one_client(digits_federation, 4)
    got = jax.jit(alg.personalize)(later, client, data, jax.random.key(2), round_info(3))
    ids, sizes, _, _ = _reference_blocks(mlp, server.params, 5)
    rows = np.asarray(data.indices)[: int(data.count)]
    logits = GatingLayer(int(sizes.size)).apply({"params": client.gate, **client.gate_state}, data.x[rows], False)
    want = _gated_reference(later.params, ids, jnp.mean(jax.nn.sigmoid(logits), 0))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), got["params"], want)


def test_the_server_takes_the_sample_weighted_mean_of_the_uploaded_models(mlp):
    alg = pfedgate(mlp)
    server, _ = alg.init(jax.random.key(0))
    rng = np.random.default_rng(3)
    models = [jax.tree.map(lambda x: x + rng.normal(), server.params) for _ in range(3)]
    weights = np.array([30.0, 0.0, 10.0])  # the second is a weight-0 row: it counts for nothing
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *models)
    new = server_step(alg, server, stacked, jnp.asarray(weights, jnp.float32))
    want = jax.tree.map(lambda *xs: sum(w * np.asarray(x, np.float64) for w, x in zip(weights, xs)) / 40.0, *models)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), new.params, want)


def test_dense_layers_are_the_dense_calls(mlp, small_cnn):
    assert set(dense_layers(mlp)) == set(mlp.init(jax.random.key(0))["params"])
    assert dense_layers(small_cnn) == ["head"]  # its convs are not Dense


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
        (
            ["--set", "block_split=1", "--set", "sparse_factor=0.5"],
            "block_split: sparse_factor < 1 needs block_split >= 2",
        ),
    ],
)
def test_bad_pfedgate_settings_are_one_line_errors(args, expected, tmp_path, capsys):
    from jaxfed.cli import main

    assert main(["run", "pfedgate", *args, "--out", str(tmp_path / "r"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and expected in err, err
