"""Low-rank primitives against numpy float64 and against the plain computations they replace."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxfed.core import lowrank
from jaxfed.errors import ConfigError
from jaxfed.nn import get_model
from jaxfed.nn.conv import conv2d
from jaxfed.nn.factorized import factorized_conv, factorized_dense, factorized_execution

CONV_SHAPES = [(3, 3, 4, 6), (5, 5, 1, 8), (1, 1, 7, 3), (3, 2, 2, 5)]


def _random(shape, seed=0):
    return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


@pytest.mark.parametrize("shape", CONV_SHAPES)
def test_fold_inverts_matricize_in_the_specified_layout(shape):
    kernel = _random(shape)
    matrix = np.asarray(lowrank.matricize(jnp.asarray(kernel)))
    kh, kw, cin, cout = shape
    assert matrix.shape == lowrank.matrix_shape(shape) == (kh * cin, kw * cout)
    for i, j, c, o in [(0, 0, 0, 0), (kh - 1, kw - 1, cin - 1, cout - 1), (kh // 2, kw - 1, 0, cout // 2)]:
        assert matrix[i * cin + c, j * cout + o] == kernel[i, j, c, o]  # row (i, c), column (j, o)
    np.testing.assert_array_equal(lowrank.fold(jnp.asarray(matrix), shape), kernel)
    dense = _random((6, 4))
    np.testing.assert_array_equal(lowrank.fold(lowrank.matricize(jnp.asarray(dense)), dense.shape), dense)


@pytest.mark.parametrize("rows, cols", [(12, 7), (5, 9), (6, 6)])
def test_full_rank_factorization_reconstructs(rows, cols):
    matrix = _random((rows, cols), seed=1)
    factors = lowrank.factorize(jnp.asarray(matrix), min(rows, cols))
    assert factors.u.shape == (rows, min(rows, cols)) and factors.v.shape == (cols, min(rows, cols))
    np.testing.assert_allclose(lowrank.reconstruct(factors), matrix, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("rank", [1, 2, 4])
def test_rank_r_error_is_the_tail_singular_values(rank):
    matrix = _random((10, 8), seed=2)
    singular = np.linalg.svd(matrix.astype(np.float64), compute_uv=False)
    approx = np.asarray(lowrank.reconstruct(lowrank.factorize(jnp.asarray(matrix), rank)), np.float64)
    error = np.linalg.norm(matrix.astype(np.float64) - approx)
    np.testing.assert_allclose(error, np.sqrt(np.sum(singular[rank:] ** 2)), rtol=1e-4)
    assert np.linalg.matrix_rank(approx, tol=1e-4) == rank
    # the factors split the singular values evenly: u^T u == v^T v == diag(S_r)
    factors = lowrank.factorize(jnp.asarray(matrix), rank)
    np.testing.assert_allclose(factors.u.T @ factors.u, np.diag(singular[:rank]), atol=1e-4)
    np.testing.assert_allclose(factors.v.T @ factors.v, np.diag(singular[:rank]), atol=1e-4)


def test_factorize_is_jittable_and_vmappable():
    stack = jnp.asarray(_random((3, 9, 6), seed=3))
    factors = jax.jit(jax.vmap(lambda m: lowrank.factorize(m, 2)))(stack)
    assert factors.u.shape == (3, 9, 2)
    for k in range(3):
        single = lowrank.reconstruct(lowrank.factorize(stack[k], 2))
        np.testing.assert_allclose(lowrank.reconstruct(lowrank.Factors(factors.u[k], factors.v[k])), single, atol=1e-5)


def _with_singular_values(rows, cols, singular, seed):
    """A float32 ``rows x cols`` matrix of these singular values, random singular vectors."""
    rng = np.random.default_rng(seed)
    k = min(rows, cols)
    left, _ = np.linalg.qr(rng.normal(size=(rows, k)))
    right, _ = np.linalg.qr(rng.normal(size=(cols, k)))
    return ((left * singular) @ right.T).astype(np.float32)


@pytest.mark.parametrize("rows, cols", [(40, 20), (20, 40)])
@pytest.mark.parametrize("rank", [20, 7, 1])
def test_the_gram_route_is_the_truncated_svd_of_a_well_conditioned_matrix(rows, cols, rank):
    singular = np.linspace(3.0, 0.5, 20)  # condition number 6, a trained kernel's (W1's fc1 and conv2)
    matrix = _with_singular_values(rows, cols, singular, seed=4)
    left, exact, right_t = np.linalg.svd(matrix.astype(np.float64), full_matrices=False)
    best = (left[:, :rank] * exact[:rank]) @ right_t[:rank]
    factorize = jax.jit(lowrank.factorize, static_argnums=(1, 2))
    factors = factorize(jnp.asarray(matrix), rank, "gram")
    u, v = np.asarray(factors.u, np.float64), np.asarray(factors.v, np.float64)
    np.testing.assert_allclose(u @ v.T, best, atol=1e-5)
    np.testing.assert_allclose(u.T @ u, np.diag(exact[:rank]), atol=1e-5)  # S split evenly, as the SVD's
    np.testing.assert_allclose(v.T @ v, np.diag(exact[:rank]), atol=1e-5)
    parts = lowrank.decompose(jnp.asarray(matrix), "gram")
    np.testing.assert_allclose(parts.singular, exact, rtol=1e-5)
    assert not np.array_equal(
        factors.u, factorize(jnp.asarray(matrix), rank, "svd").u
    )  # computed by the eigendecomposition, not the fallback


def test_the_gram_route_gives_an_ill_conditioned_matrix_to_the_svd():
    matrix = jnp.asarray(_with_singular_values(30, 12, np.logspace(0, -4, 12), seed=5))  # condition 1e4
    route = jax.jit(lowrank.decompose, static_argnums=1)
    chex.assert_trees_all_equal(route(matrix, "gram"), route(matrix, "svd"))
    # vmapped (a sweep's server step), the cond is a select: each matrix still gets its own route
    well = jnp.asarray(_with_singular_values(30, 12, np.linspace(2.0, 1.0, 12), seed=6))
    stacked = jax.jit(jax.vmap(lambda m: lowrank.decompose(m, "gram")))(jnp.stack([matrix, well]))
    for k, single in enumerate([route(matrix, "gram"), route(well, "gram")]):
        chex.assert_trees_all_close(jax.tree.map(lambda x: x[k], stacked), single, atol=1e-6)


def test_the_gram_route_gives_a_zero_matrix_to_the_svd():
    """Its condition number is undefined: the SVD's orthonormal ``U`` and ``V``, not zero columns."""
    route = jax.jit(lowrank.decompose, static_argnums=1)
    zero = jnp.zeros((6, 4))
    chex.assert_trees_all_equal(route(zero, "gram"), route(zero, "svd"))
    np.testing.assert_allclose(route(zero, "gram").left.T @ route(zero, "gram").left, np.eye(4), atol=1e-6)


@pytest.mark.parametrize("condition", [6.0, 1e8])
def test_the_gram_eigendecomposition_multiplies_back_to_the_matrix_at_any_condition(condition):
    """``U S V^T = A V V^T``: the matrix to float32 rounding even where ``U``'s small columns are
    not orthonormal (benchmarks/svd.py's ``gram_eigh``); well conditioned it is the gram route."""
    matrix = _with_singular_values(30, 12, np.logspace(0, -np.log10(condition), 12), seed=7)
    parts = jax.jit(lowrank.gram_eigendecomposition)(jnp.asarray(matrix))
    left, singular, right = (np.asarray(x, np.float64) for x in parts)
    np.testing.assert_allclose((left * singular) @ right.T, matrix, atol=2e-6)
    if condition < lowrank.GRAM_MAX_CONDITION:
        chex.assert_trees_all_equal(parts, jax.jit(lowrank.decompose, static_argnums=1)(jnp.asarray(matrix), "gram"))


def test_an_unknown_factorization_is_a_one_line_error():
    with pytest.raises(ValueError, match="factorization: unknown 'qr'; allowed: svd, gram"):
        lowrank.factorize(jnp.ones((3, 2)), 1, "qr")


@pytest.mark.parametrize(
    "shape, ratio, expected",
    [
        ((3, 3, 16, 32), 0.5, 24),  # matricized 48 x 96
        ((3, 3, 16, 32), 1.0, 48),
        ((3, 3, 16, 32), 1e-6, 1),  # never below 1
        ((784, 200), 0.25, 50),
        ((10, 3), 0.5, 2),  # 1.5 rounds up
        ((1, 1, 1, 9), 1.0, 1),
    ],
)
def test_rank_from_ratio(shape, ratio, expected):
    assert lowrank.rank_from_ratio(shape, ratio) == expected


def test_rank_from_budget():
    assert lowrank.rank_from_budget(100, 100, 0.1) == 5  # 0.1 * 10000 / 200
    assert lowrank.rank_from_budget(784, 10, 0.01) == 1  # floor(0.0987 ...) -> at least 1
    rows, cols, rho = 64, 288, 0.2
    rank = lowrank.rank_from_budget(rows, cols, rho)
    assert rank * (rows + cols) <= rho * rows * cols < (rank + 1) * (rows + cols)


@pytest.mark.parametrize("ratio", [0.0, -0.5, 1.5])
def test_ratio_outside_unit_interval_is_a_clear_error(ratio):
    with pytest.raises(ConfigError, match=r"tiers: a rank ratio must be in \(0, 1\]"):
        lowrank.rank_from_ratio((4, 4), ratio, field="tiers")
    with pytest.raises(ConfigError, match=r"rho: a rank ratio must be in \(0, 1\]"):
        lowrank.rank_from_budget(4, 4, ratio)


def test_rank_larger_than_the_layer_is_a_clear_error():
    assert lowrank.check_rank((3, 3, 4, 8), 12) == 12
    with pytest.raises(ConfigError, match=r"rank: 13 is not a valid rank for conv1 .* allowed 1..12"):
        lowrank.check_rank((3, 3, 4, 8), 13, name="conv1")
    with pytest.raises(ConfigError, match="allowed 1..3"):
        lowrank.check_rank((3, 10), 0)


@pytest.mark.parametrize("layout", ["balanced", "im2col"])
def test_lora_starts_at_zero_and_composes_in_kernel_layout(layout):
    shape = (3, 3, 4, 6)
    lora = lowrank.lora_init(jax.random.key(0), shape, 2, layout)
    rows, cols = lowrank.matrix_shape(shape, layout)
    assert (rows, cols) == ((12, 18) if layout == "balanced" else (36, 6))
    assert lora.down.shape == (rows, 2) and lora.up.shape == (2, cols)
    assert float(jnp.abs(lora.down).max()) <= 1 / np.sqrt(rows) and float(jnp.abs(lora.down).std()) > 0
    np.testing.assert_array_equal(lowrank.lora_delta(lora, shape, 3.0, layout), np.zeros(shape))
    up = jnp.asarray(_random((2, cols), seed=4))
    delta = np.asarray(lowrank.lora_delta(lowrank.LoRA(down=lora.down, up=up), shape, 0.5, layout), np.float64)
    expected = 0.5 * np.asarray(lora.down, np.float64) @ np.asarray(up, np.float64)
    np.testing.assert_allclose(lowrank.matricize(jnp.asarray(delta), layout), expected, rtol=1e-5, atol=1e-6)
    if layout == "im2col":  # rows are (kh, kw, cin): the kh x kw "down" conv's kernel
        np.testing.assert_allclose(delta.reshape(-1, cols), expected, rtol=1e-5, atol=1e-6)


def test_factorized_dense_equals_the_reconstructed_kernel():
    x, kernel = jnp.asarray(_random((5, 12), seed=5)), jnp.asarray(_random((12, 7), seed=6))
    factors = lowrank.factorize_kernel(kernel, 3)
    expected = np.asarray(x, np.float64) @ np.asarray(lowrank.reconstruct_kernel(factors, kernel.shape), np.float64)
    np.testing.assert_allclose(factorized_dense(x, factors), expected, rtol=1e-4, atol=1e-4)


CONV_CASES = [
    ((3, 3, 4, 6), "SAME", (1, 1), "patches"),
    ((3, 3, 4, 6), "SAME", (2, 2), "patches"),
    ((3, 3, 4, 6), "VALID", (2, 1), "patches"),
    ((5, 3, 2, 4), "SAME", (2, 1), "patches"),
    ((5, 3, 2, 4), "VALID", (1, 1), "patches"),
    ((5, 3, 2, 4), "VALID", (2, 2), "patches"),
    ((3, 3, 4, 6), "SAME", (2, 2), "xla"),
    ((5, 3, 2, 4), "VALID", (2, 1), "xla"),
]


@pytest.mark.parametrize("shape, padding, strides, impl", CONV_CASES)
def test_factorized_conv_equals_the_conv_with_the_reconstructed_kernel(shape, padding, strides, impl):
    x = jnp.asarray(_random((2, 9, 8, shape[2]), seed=7))
    factors = lowrank.factorize_kernel(jnp.asarray(_random(shape, seed=8)), 2)
    kernel = lowrank.reconstruct_kernel(factors, shape)
    expected = jax.lax.conv_general_dilated(x, kernel, strides, padding, dimension_numbers=("NHWC", "HWIO", "NHWC"))
    got = factorized_conv(x, factors, shape, strides, padding, impl)
    assert got.shape == expected.shape
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
    # and it is the same as our own full conv
    np.testing.assert_allclose(got, conv2d(x, kernel, strides, padding, impl), rtol=1e-4, atol=1e-4)


# ----- parameter trees and factorized execution -------------------------------------------------


@pytest.fixture(scope="module")
def resnet8():
    model = get_model("resnet8", (16, 16, 3), 10)
    return model, jax.jit(model.init)(jax.random.key(0))["params"]


def _forward(model, factorized=False):
    """The model's logits as a jitted function of params (factorized layers run factorized)."""

    def forward(params, x):
        if not factorized:
            return model.apply({"params": params}, x)[0]
        with factorized_execution():
            return model.apply({"params": params}, x)[0]

    return jax.jit(forward)


def test_factorizable_layers_by_path_and_size(resnet8):
    _, params = resnet8
    every = lowrank.factorizable_layers(params)
    assert "stem" in every and "head" in every and any(k.startswith("layer2_0.") for k in every)
    assert all(lowrank.get_layer(params, k)["kernel"].ndim in (2, 4) for k in every)
    convs_of_layer3 = lowrank.factorizable_layers(params, include=["layer3"], exclude=["shortcut"])
    assert convs_of_layer3 and all("layer3" in k and "shortcut" not in k for k in convs_of_layer3)
    big = lowrank.factorizable_layers(params, min_size=10_000)
    assert big and all(lowrank.get_layer(params, k)["kernel"].size >= 10_000 for k in big)
    assert set(big) < set(every)


def test_full_rank_factorized_model_reproduces_the_model(resnet8):
    model, params = resnet8
    layers = lowrank.factorizable_layers(params, exclude=["head"])
    full = {k: lowrank.max_rank(lowrank.get_layer(params, k)["kernel"].shape) for k in layers}
    factored = lowrank.factorize_layers(params, full)
    for k in layers:
        layer = lowrank.get_layer(factored, k)
        assert "kernel" not in layer and {"u", "v"} <= layer.keys()
        assert lowrank.kernel_shape_of(layer) == lowrank.get_layer(params, k)["kernel"].shape
    x = jnp.asarray(_random((4, 16, 16, 3), seed=9))
    expected = _forward(model)(params, x)
    got = _forward(model, factorized=True)(factored, x)
    np.testing.assert_allclose(got, expected, rtol=1e-3, atol=1e-3)
    rebuilt = lowrank.reconstruct_layers(factored)
    for a, b in zip(jax.tree.leaves(rebuilt), jax.tree.leaves(params)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    assert jax.tree.structure(rebuilt) == jax.tree.structure(params)


def test_factorized_compute_falls_with_rank(resnet8):
    model, params = resnet8
    layers = lowrank.factorizable_layers(params, include=["layer"], exclude=["shortcut"])
    x = jnp.zeros((8, 16, 16, 3))

    def flops(ratio):
        ranks = {k: lowrank.rank_from_ratio(lowrank.get_layer(params, k)["kernel"].shape, ratio) for k in layers}
        factored = lowrank.factorize_layers(params, ranks)
        return _forward(model, factorized=True).lower(factored, x).compile().cost_analysis()["flops"]

    quarter, half, full = flops(0.25), flops(0.5), flops(1.0)
    assert quarter < half < full


def test_rank_too_large_for_a_layer_is_a_clear_error(resnet8):
    _, params = resnet8
    with pytest.raises(ConfigError, match=r"rank: 10000 is not a valid rank for stem"):
        lowrank.factorize_layers(params, {"stem": 10_000})


def test_loras_start_at_zero_and_add_their_delta(resnet8):
    model, params = resnet8
    layers = lowrank.factorizable_layers(params, include=["layer1"])
    loras = lowrank.init_loras(jax.random.key(1), params, {k: 2 for k in layers})
    x = jnp.asarray(_random((2, 16, 16, 3), seed=10))
    forward = _forward(model)
    base = forward(params, x)
    merged = forward(lowrank.add_loras(params, loras, scale=4.0), x)
    np.testing.assert_array_equal(merged, base)  # b = 0: no change at init
    key = layers[0]
    lora = loras[key]._replace(up=jnp.ones_like(loras[key].up))
    updated = lowrank.add_loras(params, {key: lora}, scale=0.5)
    kernel = lowrank.get_layer(params, key)["kernel"]
    expected = np.asarray(kernel) + 0.5 * np.asarray(lowrank.fold(lora.down @ lora.up, kernel.shape))
    np.testing.assert_allclose(lowrank.get_layer(updated, key)["kernel"], expected, rtol=1e-6)


def test_the_factored_frobenius_norm_and_its_gradient_are_those_of_the_product():
    """``product_norm_sq(u, v)`` against ``W = u v^T`` formed in float64: ``||W||^2``, and its
    gradient ``(2 W v, 2 W^T u)`` (the custom rule reuses the Gram matrices instead)."""
    rng = np.random.default_rng(3)
    u, v = rng.normal(size=(9, 4)), rng.normal(size=(6, 4))
    value, pullback = jax.vjp(lowrank.product_norm_sq, jnp.asarray(u, jnp.float32), jnp.asarray(v, jnp.float32))
    grad_u, grad_v = pullback(jnp.float32(3.0))  # a cotangent of 3: the rule scales by it
    w = u @ v.T
    np.testing.assert_allclose(value, np.sum(w**2), rtol=1e-5)
    np.testing.assert_allclose(grad_u, 3 * 2 * w @ v, rtol=1e-5)
    np.testing.assert_allclose(grad_v, 3 * 2 * w.T @ u, rtol=1e-5)
