"""Mixture adaptors: zero delta at init, C = 1 is LoRA, conv kinds as convs, preconditioning, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxfed.algorithms.training import split_variables
from jaxfed.core import adaptors as ad
from jaxfed.core import lowrank
from jaxfed.core.routing import mixture_weights
from jaxfed.errors import ConfigError
from jaxfed.nn import get_model


@pytest.fixture(scope="module")
def resnet():
    """A ResNet-8 (GroupNorm: norm scale / bias) on 8x8 inputs."""
    model = get_model("resnet8", (8, 8, 3), 10)
    return model, split_variables(jax.jit(model.init)(jax.random.key(0)))[0]


def _random_adaptors(tree, seed=1):
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda a: jnp.asarray(rng.normal(size=a.shape) * 0.1, jnp.float32), tree)


def test_at_init_the_adapted_model_is_the_base_model(resnet):
    model, params = resnet
    plan = ad.adaptor_plan(params, 4, rho=0.1)
    assert plan.norms and plan.biases  # GroupNorm scales/offsets and the head's bias are adapted
    adaptors = jax.jit(lambda k: ad.init_adaptors(k, params, plan))(jax.random.key(1))
    weights = mixture_weights(jnp.array([0.3, -1.0, 2.0, 0.1]))
    mixed = jax.jit(lambda p, a, w: ad.mix(p, a, w, plan))(params, adaptors, weights)
    for a, b in zip(jax.tree.leaves(mixed), jax.tree.leaves(params)):
        np.testing.assert_array_equal(a, b)
    assert all(float(jnp.abs(a["down"]).max()) > 0 for a in adaptors["kernels"].values())


def test_one_adaptor_with_a_fixed_router_is_plain_lora(mlp):
    params = split_variables(mlp.init(jax.random.key(0)))[0]
    plan = ad.adaptor_plan(params, 1, rank=4, bias=False, norm=False, alpha=2.0)
    adaptors = _random_adaptors(ad.init_adaptors(jax.random.key(1), params, plan))
    mixed = ad.mix(params, adaptors, jnp.ones(1), plan)
    loras = {k: lowrank.LoRA(a["down"][0], a["up"][0]) for k, a in adaptors["kernels"].items()}
    expected = lowrank.add_loras(params, loras, 2.0)
    for a, b in zip(jax.tree.leaves(mixed), jax.tree.leaves(expected)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", ["balanced_2d", "in_layer", "out_layer", "channel"])
def test_conv_adaptors_equal_their_two_convs(kind):
    """The mixed kernel's conv equals the base conv plus sum_c pi_c (conv_in_c then conv_out_c),
    each written as an explicit conv of the adaptor's own two kernels."""
    rng = np.random.default_rng(0)
    kh, kw, cin, cout = 3, 3, 4, 6
    params = {"conv": {"kernel": jnp.asarray(rng.normal(size=(kh, kw, cin, cout)), jnp.float32)}}
    plan = ad.adaptor_plan(params, 3, rank=2, conv_adaptor=kind, bias=False, norm=False, alpha=0.5)
    adaptors = _random_adaptors(ad.init_adaptors(jax.random.key(0), params, plan))
    weights = jnp.array([0.2, 0.5, 0.3])
    x = jnp.asarray(rng.normal(size=(2, 7, 7, cin)), jnp.float32)

    def conv(x, kernel, stride=(2, 2)):
        return jax.lax.conv_general_dilated(x, kernel, stride, "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))

    mixed = ad.mix(params, adaptors, weights, plan)["conv"]["kernel"]
    layout = plan.kernels["conv"].layout
    expected = conv(x, params["conv"]["kernel"])
    for c in range(3):
        d, u = adaptors["kernels"]["conv"]["down"][c], adaptors["kernels"]["conv"]["up"][c]
        if layout == "balanced":  # kh x 1 (cin -> r) then 1 x kw (r -> cout), stride split
            k_in, k_out = d.reshape(kh, cin, 2)[:, None], u.reshape(2, kw, cout).transpose(1, 0, 2)[None]
            path = conv(conv(x, k_in, (2, 1)), k_out, (1, 2))
        elif layout == "im2col":  # kh x kw (cin -> r) then 1 x 1
            path = conv(conv(x, d.reshape(kh, kw, cin, 2)), u[None, None], (1, 1))
        else:  # 1 x 1 (cin -> r) then kh x kw
            path = conv(conv(x, d[None, None], (1, 1)), u.reshape(2, kh, kw, cout).transpose(1, 2, 0, 3))
        expected = expected + 0.5 * weights[c] * path
    np.testing.assert_allclose(conv(x, mixed), expected, rtol=1e-4, atol=1e-4)


def test_channel_picks_the_cheaper_of_in_and_out_layer():
    assert ad.conv_layout("channel", (3, 3, 64, 16)) == "outcol"
    assert ad.conv_layout("channel", (3, 3, 16, 64)) == "im2col"


def test_ranks_follow_the_budget(resnet):
    _, params = resnet
    plan = ad.adaptor_plan(params, 4, rho=0.01)
    for spec in plan.kernels.values():
        rows, cols = lowrank.matrix_shape(spec.kernel_shape, spec.layout)
        assert spec.rank == max(1, int(np.floor(0.01 * rows * cols / (rows + cols))))


def test_mixture_weights_softmax_with_noise_and_temperature():
    logits = jnp.array([1.0, 0.0, -1.0])
    np.testing.assert_allclose(mixture_weights(logits), jax.nn.softmax(logits), rtol=1e-6)
    noisy = mixture_weights(logits, jax.random.key(0), noise_std=1.0, temperature=2.0)
    u = jax.random.uniform(jax.random.key(0), (3,))
    np.testing.assert_allclose(noisy, jax.nn.softmax((logits + u) / 2.0), rtol=1e-6)


def test_preconditioned_gradient_equals_its_closed_form(resnet):
    _, params = resnet
    plan = ad.adaptor_plan(params, 2, rho=0.1)
    adaptors = _random_adaptors(ad.init_adaptors(jax.random.key(0), params, plan), seed=2)
    grads = _random_adaptors(adaptors, seed=3)
    eps = 1e-3
    out, _ = jax.jit(ad.lora_preconditioner(plan, eps).update)(grads, optax.EmptyState(), adaptors)
    dense = [k for k, s in plan.kernels.items() if s.kind == "dense"]
    conv = [k for k, s in plan.kernels.items() if s.kind != "dense"]
    assert dense and conv
    for key in plan.kernels:
        for c in range(2):
            d = np.asarray(adaptors["kernels"][key]["down"][c], np.float64)
            u = np.asarray(adaptors["kernels"][key]["up"][c], np.float64)
            gd = np.asarray(grads["kernels"][key]["down"][c], np.float64)
            gu = np.asarray(grads["kernels"][key]["up"][c], np.float64)
            if key in dense:
                eye = eps * np.eye(u.shape[0])
                want_d, want_u = gd @ np.linalg.inv(u @ u.T + eye), np.linalg.inv(d.T @ d + eye) @ gu
            else:
                want_d = gd / (np.linalg.norm(u @ u.T) + eps)
                want_u = gu / (np.linalg.norm(d.T @ d) + eps)
            np.testing.assert_allclose(out["kernels"][key]["down"][c], want_d, rtol=2e-3, atol=1e-5)
            np.testing.assert_allclose(out["kernels"][key]["up"][c], want_u, rtol=2e-3, atol=1e-5)
    for a, b in zip(jax.tree.leaves(out["norms"]), jax.tree.leaves(grads["norms"])):
        np.testing.assert_array_equal(a, b)


def test_bad_settings_are_clear_errors(mlp):
    params = split_variables(mlp.init(jax.random.key(0)))[0]
    for rho in (0.0, 1.5):
        with pytest.raises(ConfigError, match=rf"rho: a rank ratio must be in \(0, 1\], got {rho}"):
            ad.adaptor_plan(params, 4, rho=rho)
    with pytest.raises(ConfigError, match="num_adaptors: must be >= 1, got 0"):
        ad.adaptor_plan(params, 0)
    with pytest.raises(ConfigError, match="conv_adaptor: unknown 'diagonal'; allowed: balanced_2d, channel"):
        ad.conv_layout("diagonal", (3, 3, 4, 4))
