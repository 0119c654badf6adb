"""Models and the patches convolution against XLA's convolution."""

import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxfed.nn import MODELS, conv2d, get_model
from jaxfed.nn.conv import Conv


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


@pytest.mark.parametrize(
    "inits",
    [{}, {"kernel_init": nn.initializers.uniform(0.3), "bias_init": nn.initializers.normal(0.5)}],
    ids=["default", "given"],
)
def test_conv_initializes_as_flax_conv(inits):
    """Defaults and given ``kernel_init`` / ``bias_init``: Flax ``nn.Conv``'s parameters for the same key."""
    x = jax.random.normal(jax.random.key(3), (2, 8, 8, 3))
    ours = Conv(5, (3, 3), **inits).init(jax.random.key(4), x)
    flax_conv = nn.Conv(5, (3, 3), **inits).init(jax.random.key(4), x)
    chex.assert_trees_all_equal(ours, flax_conv)


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


def test_authors_fmnist_cnn_torch_init_draws_torch_default_bounds(monkeypatch):
    """experiments/fedcspack/models.py: with torch's initialization every kernel and bias is
    uniform in ±1/sqrt(fan_in) (``nn.Conv2d`` / ``nn.Linear``'s defaults); without it, Flax's."""
    path = Path(__file__).parents[1] / "experiments" / "fedcspack" / "models.py"
    spec = importlib.util.spec_from_file_location("fedcspack_models", path)
    models = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, models)  # its dataclasses look their module up
    spec.loader.exec_module(models)
    x = jnp.zeros((1, 28, 28, 1))
    torch_params = models.AuthorsFMNISTCNNTorchInit().init(jax.random.key(0), x)["params"]
    flax_params = models.AuthorsFMNISTCNN().init(jax.random.key(0), x)["params"]
    fan_in = {"conv1": 5 * 5 * 1, "conv2": 5 * 5 * 10, "fc1": 4 * 4 * 20, "fc2": 256, "head": 50}
    for layer, n in fan_in.items():
        bound = 1 / np.sqrt(n)
        kernel, bias = np.asarray(torch_params[layer]["kernel"]), np.asarray(torch_params[layer]["bias"])
        assert np.abs(kernel).max() <= bound and np.abs(bias).max() <= bound, layer
        assert np.abs(kernel).max() > 0.9 * bound and np.abs(bias).min() < np.abs(bias).max(), layer
        np.testing.assert_allclose(kernel.std(), bound / np.sqrt(3), rtol=0.15, err_msg=layer)  # uniform's std
        assert not np.any(flax_params[layer]["bias"]), layer


def test_a_models_shapes_and_layers_are_traced_once_and_each_caller_gets_its_own_copy():
    """``once_per_model`` answers a model's questions from one trace per model (equal modules are
    one model); an unhashable module is traced every time; the variables handed out are copies."""
    from jaxfed.nn.layers import head_layer, layers_in_call_order, parameter_layers
    from jaxfed.nn.models import Model, model_template
    from jaxfed.nn.traced import abstract_variables, once_per_model

    traces = []

    class Counted(nn.Module):
        widths: Sequence[int] = (5, 3)

        @nn.compact
        def __call__(self, x):
            traces.append(self.widths)
            for i, w in enumerate(self.widths):
                x = nn.Dense(w, name=f"d{i}")(x)
            return x

    model, same = (Model("counted", Counted(), (4,)) for _ in range(2))
    first = abstract_variables(model)
    assert jax.tree.map(lambda s: s.shape, first["params"]["d1"]) == {"kernel": (5, 3), "bias": (3,)}
    first["params"].pop("d0")  # the caller's copy only
    assert set(abstract_variables(same)["params"]) == {"d0", "d1"}
    assert layers_in_call_order(same) == layers_in_call_order(model) == parameter_layers(model) == ["d0", "d1"]
    assert head_layer(same) == "d1" and set(model_template(same)[0]) == {"d0", "d1"}
    assert len(traces) == 2  # the variables once, the watched forward pass once

    unhashable = Model("counted", Counted(widths=[5, 3]), (4,))
    shapes = [jax.tree.map(lambda s: s.shape, abstract_variables(unhashable)) for _ in range(2)]
    assert shapes[0] == shapes[1] == jax.tree.map(lambda s: s.shape, abstract_variables(same))
    assert len(traces) == 4  # each time

    calls = []
    answer = once_per_model(lambda m: calls.append(m) or len(calls))
    assert answer(model) == answer(same) == 1
    with jax.enable_x64(True):
        assert answer(model) == 2  # x64 mode changes a model's dtypes
