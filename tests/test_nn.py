"""Models and the patches convolution against XLA's convolution."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxfed.nn import MODELS, conv2d, get_model


@pytest.mark.parametrize("kernel", [(1, 1), (3, 3), (5, 5), (3, 2)])
@pytest.mark.parametrize("stride", [1, 2])
@pytest.mark.parametrize("padding", ["SAME", "VALID"])
def test_patches_conv_equals_xla_conv(kernel, stride, padding):
    kx, kk = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (3, 11, 10, 4))
    k = jax.random.normal(kk, kernel + (4, 6))
    expected = jax.lax.conv_general_dilated(
        x, k, (stride, stride), padding, dimension_numbers=("NHWC", "HWIO", "NHWC"), precision="highest"
    )
    got = conv2d(x, k, (stride, stride), padding, impl="patches")
    assert got.shape == expected.shape
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


def test_patches_conv_gradients_equal_xla():
    x = jax.random.normal(jax.random.key(1), (2, 9, 9, 3))
    k = jax.random.normal(jax.random.key(2), (3, 3, 3, 5))

    def loss(impl):
        return jax.grad(lambda x, k: jnp.sum(jnp.sin(conv2d(x, k, (2, 2), "SAME", impl))), argnums=(0, 1))

    for a, b in zip(loss("patches")(x, k), loss("xla")(x, k)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_models_give_logits_and_features(name):
    model = get_model(name, (32, 32, 3), 7)
    variables = jax.eval_shape(model.init, jax.random.key(0))
    assert "head" in variables["params"]
    x = jnp.zeros((2, 32, 32, 3))
    logits, _ = jax.eval_shape(lambda v: model.apply(v, x), variables)
    features, _ = jax.eval_shape(lambda v: model.apply(v, x, features=True), variables)
    assert logits.shape == (2, 7)
    assert features.shape[0] == 2 and features.ndim == 2


def test_cnn_has_the_fedavg_paper_parameter_count():
    model = get_model("cnn", (28, 28, 1), 10)
    variables = jax.eval_shape(model.init, jax.random.key(0))
    assert sum(x.size for x in jax.tree.leaves(variables)) == 582_026  # PFLlib's FedAvgCNN on MNIST


def test_batchnorm_ignores_padded_examples():
    model = get_model("resnet8", (8, 8, 1), 10, norm="batch")
    variables = jax.jit(model.init)(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (4, 8, 8, 1))
    mask = jnp.array([True, True, False, False])
    apply = jax.jit(lambda v, x: model.apply(v, x, train=True, mask=mask))
    _, with_junk = apply(variables, x.at[2:].set(1e3))
    _, clean = apply(variables, x.at[2:].set(0.0))
    for a, b in zip(jax.tree.leaves(with_junk), jax.tree.leaves(clean)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shape, padding", [((2, 8, 6, 3), "VALID"), ((2, 7, 9, 3), "VALID"), ((2, 7, 5, 3), "SAME")])
def test_max_pool_2x2_equals_flax_max_pool_with_its_gradient(shape, padding):
    import flax.linen as nn

    from jaxfed.nn.conv import max_pool_2x2

    x = jax.random.normal(jax.random.key(0), shape)  # no ties, so the gradients are unique
    np.testing.assert_array_equal(max_pool_2x2(x, padding), nn.max_pool(x, (2, 2), (2, 2), padding=padding))
    grads = [jax.grad(lambda z, f=f: jnp.sum(jnp.sin(f(z))))(x) for f in (
        lambda z: max_pool_2x2(z, padding), lambda z: nn.max_pool(z, (2, 2), (2, 2), padding=padding))]  # fmt: skip
    np.testing.assert_allclose(grads[0], grads[1], rtol=1e-6)
