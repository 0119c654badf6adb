"""Mixture adaptors: zero delta at init, C = 1 is LoRA, conv kinds as convs, preconditioning, errors."""

import os
import subprocess
import sys
import textwrap

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxfed.core import adaptors as ad
from jaxfed.core import lowrank
from jaxfed.core.routing import mixture_weights
from jaxfed.errors import ConfigError
from jaxfed.nn import Model, get_model, split_variables
from jaxfed.nn.layers import norm_layers


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
    plan = ad.adaptor_plan(params, 4, rho=0.1, norms=norm_layers(model))
    assert plan.norms and plan.biases  # GroupNorm scales/offsets and the head's bias are adapted
    adaptors = jax.jit(lambda k: ad.init_adaptors(k, params, plan))(jax.random.key(1))
    weights = mixture_weights(jnp.array([0.3, -1.0, 2.0, 0.1]))
    mixed = jax.jit(lambda p, a, w: ad.mix(p, a, w, plan))(params, adaptors, weights)
    for a, b in zip(jax.tree.leaves(mixed), jax.tree.leaves(params)):
        np.testing.assert_array_equal(a, b)
    assert all(float(jnp.abs(a["down"]).max()) > 0 for a in adaptors["kernels"].values())


def test_one_adaptor_with_a_fixed_router_is_plain_lora(mlp):
    params = split_variables(mlp.init(jax.random.key(0)))[0]
    plan = ad.adaptor_plan(params, 1, rank=4, bias=False, alpha=2.0)
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
    plan = ad.adaptor_plan(params, 3, rank=2, conv_adaptor=kind, bias=False, alpha=0.5)
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


def test_preconditioned_gradient_equals_its_closed_form_matricized(resnet):
    model, params = resnet
    plan = ad.adaptor_plan(params, 2, rho=0.1, norms=norm_layers(model))
    adaptors = _random_adaptors(ad.init_adaptors(jax.random.key(0), params, plan), seed=2)
    grads = _random_adaptors(adaptors, seed=3)
    eps = 1e-3
    out, _ = jax.jit(ad.lora_preconditioner(plan, eps, conv="matricized").update)(grads, optax.EmptyState(), adaptors)
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


def test_dense_preconditioner_at_large_ranks_equals_its_closed_form(mlp):
    """The ranks of rho = 1 on the digits MLP (48, 100 and 9), where the batched LAPACK solve hung,
    against the float64 closed form at the default eps."""
    params = split_variables(mlp.init(jax.random.key(0)))[0]
    plan = ad.adaptor_plan(params, 2, rho=1.0)
    assert sorted(s.rank for s in plan.kernels.values()) == [9, 48, 100]
    adaptors = _random_adaptors(ad.init_adaptors(jax.random.key(0), params, plan), seed=2)
    grads = _random_adaptors(adaptors, seed=3)
    eps = 1e-5
    out, _ = jax.jit(ad.lora_preconditioner(plan, eps).update)(grads, optax.EmptyState(), adaptors)
    for key in plan.kernels:
        for c in range(2):
            d, u, gd, gu = (
                np.asarray(tree["kernels"][key][name][c], np.float64)
                for tree, name in ((adaptors, "down"), (adaptors, "up"), (grads, "down"), (grads, "up"))
            )
            eye = eps * np.eye(u.shape[0])
            want_d, want_u = gd @ np.linalg.inv(u @ u.T + eye), np.linalg.inv(d.T @ d + eye) @ gu
            np.testing.assert_allclose(out["kernels"][key]["down"][c], want_d, rtol=2e-3, atol=1e-5)
            np.testing.assert_allclose(out["kernels"][key]["up"][c], want_u, rtol=2e-3, atol=1e-5)


def test_solve_spd_is_the_float64_solve():
    rng = np.random.default_rng(0)
    factor = rng.normal(size=(3, 4, 21, 40))
    a = factor @ np.swapaxes(factor, -1, -2) + 1e-5 * np.eye(21)
    b = rng.normal(size=(3, 4, 21, 7))
    got = jax.jit(ad.solve_spd)(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32))
    np.testing.assert_allclose(got, np.linalg.solve(a, b), rtol=1e-4, atol=1e-6)


# Several dense layers' preconditioning, vmapped over clients as the engine runs it, on an XLA
# thread pool of two threads: jnp.linalg.solve's batched LAPACK calls deadlocked it.
_CONCURRENT_SOLVES = """
import os
os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:2])
import jax, numpy as np, optax
from jaxfed.core import adaptors as ad
template = {f"fc{i}": {"kernel": jax.ShapeDtypeStruct((200, 200), np.float32)} for i in range(4)}
plan = ad.adaptor_plan(template, 4, rank=32, bias=False)
rng = np.random.default_rng(0)
factors = {"down": (10, 4, 200, 32), "up": (10, 4, 32, 200)}  # 10 clients, 4 adaptors
clients = {"kernels": {k: {n: rng.normal(size=s).astype(np.float32) for n, s in factors.items()} for k in plan.kernels}}
precondition = ad.lora_preconditioner(plan)
update = jax.jit(jax.vmap(lambda g, p: precondition.update(g, optax.EmptyState(), p)[0]))
for _ in range(5):
    jax.block_until_ready(update(clients, clients))
print("finished")
"""


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="pins the XLA thread pool with sched_setaffinity")
def test_concurrent_batched_preconditioning_finishes():
    try:
        done = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(_CONCURRENT_SOLVES)], capture_output=True, text=True, timeout=120
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the preconditioner deadlocked XLA's CPU thread pool")
    assert done.returncode == 0 and done.stdout.strip() == "finished", done.stderr[-2000:]


def _authors_conv_weights(down, up, kernel_shape):
    """jaxfed's balanced factors of one adaptor as the authors' torch conv weights: ``layer_in``
    ``[r, cin, kh, 1]`` (a kh x 1 conv) and ``layer_out`` ``[cout, r, 1, kw]`` (a 1 x kw conv)."""
    kh, kw, cin, cout = kernel_shape
    w_in = down.reshape(kh, cin, -1).transpose(2, 1, 0)[..., None]
    w_out = up.reshape(-1, kw, cout).transpose(2, 0, 1)[:, :, None, :]
    return w_in, w_out


def test_conv_preconditioner_per_tap_is_the_authors_tensor_norm(resnet):
    """The authors' ``precond_tensor_lora_``: ``P_in = einsum("ma...,mb...->ab...", W_out, W_out)``,
    ``P_out = einsum("an...,bn...->ab...", W_in, W_in)``, gradients divided by ``||P|| + eps``,
    the norm over the whole tensor (every tap), written out in their layout in float64."""
    model, params = resnet
    plan = ad.adaptor_plan(params, 2, rho=0.1, norms=norm_layers(model))
    adaptors = _random_adaptors(ad.init_adaptors(jax.random.key(0), params, plan), seed=2)
    grads = _random_adaptors(adaptors, seed=3)
    eps = 1e-3
    out, _ = jax.jit(ad.lora_preconditioner(plan, eps).update)(grads, optax.EmptyState(), adaptors)
    conv = [k for k, s in plan.kernels.items() if s.kind != "dense"]
    assert conv and all(plan.kernels[k].layout == "balanced" for k in conv)
    ratios = []
    for key in conv:
        shape = plan.kernels[key].kernel_shape
        for c in range(2):
            down = np.asarray(adaptors["kernels"][key]["down"][c], np.float64)
            up = np.asarray(adaptors["kernels"][key]["up"][c], np.float64)
            w_in, w_out = _authors_conv_weights(down, up, shape)
            p_in = np.einsum("ma...,mb...->ab...", w_out, w_out)
            p_out = np.einsum("an...,bn...->ab...", w_in, w_in)
            want_down = np.asarray(grads["kernels"][key]["down"][c], np.float64) / (np.linalg.norm(p_in) + eps)
            want_up = np.asarray(grads["kernels"][key]["up"][c], np.float64) / (np.linalg.norm(p_out) + eps)
            np.testing.assert_allclose(out["kernels"][key]["down"][c], want_down, rtol=2e-5, atol=1e-7)
            np.testing.assert_allclose(out["kernels"][key]["up"][c], want_up, rtol=2e-5, atol=1e-7)
            if shape[:2] == (3, 3):  # 1 x 1 shortcuts have one tap: both forms agree
                ratios.append(np.linalg.norm(up @ up.T) / np.linalg.norm(p_in))
    # the matricized Gram sums the taps first: a larger divisor, at most sqrt(3) on 3-tap factors
    assert ratios and 1.05 < min(ratios) and max(ratios) <= np.sqrt(3) + 1e-9


def test_conv_preconditioner_taps_follow_each_layout():
    """in_layer (im2col) has kh*kw taps on down and one on up; out_layer (outcol) the reverse."""
    shape = (3, 3, 4, 5)
    rng = np.random.default_rng(0)
    for kind, taps_down, taps_up in (("in_layer", 9, 1), ("out_layer", 1, 9)):
        layout = ad.conv_layout(kind, shape)
        rows, cols = lowrank.matrix_shape(shape, layout)
        plan = ad.AdaptorPlan({"conv": ad.KernelAdaptor(kind, layout, 2, shape)}, (), (), 1, 1.0)
        p = {"down": rng.normal(size=(1, rows, 2)), "up": rng.normal(size=(1, 2, cols))}
        g = {"down": np.ones((1, rows, 2)), "up": np.ones((1, 2, cols))}
        tree = {"kernels": {"conv": jax.tree.map(jnp.asarray, p)}, "biases": {}, "norms": {}}
        grads = {"kernels": {"conv": jax.tree.map(jnp.asarray, g)}, "biases": {}, "norms": {}}
        out, _ = ad.lora_preconditioner(plan, 0.0).update(grads, optax.EmptyState(), tree)
        d = p["down"][0].reshape(taps_down, rows // taps_down, 2)
        u = p["up"][0].reshape(2, taps_up, cols // taps_up)
        norm_down = np.linalg.norm(np.einsum("tir,tis->trs", d, d))
        norm_up = np.linalg.norm(np.einsum("rtj,stj->trs", u, u))
        np.testing.assert_allclose(out["kernels"]["conv"]["down"][0], 1.0 / norm_up, rtol=1e-5)
        np.testing.assert_allclose(out["kernels"]["conv"]["up"][0], 1.0 / norm_down, rtol=1e-5)


def test_mixture_floor_clamps_without_renormalizing():
    logits = jnp.array([4.0, 0.0, -6.0])
    pi = np.asarray(jax.nn.softmax(logits), np.float64)
    assert pi[2] < 0.01
    np.testing.assert_allclose(mixture_weights(logits, floor=0.01), np.maximum(pi, 0.01), rtol=1e-6)
    np.testing.assert_array_equal(mixture_weights(logits, floor=0.0), jax.nn.softmax(logits))


def test_bad_settings_are_clear_errors(mlp):
    params = split_variables(mlp.init(jax.random.key(0)))[0]
    for rho in (0.0, 1.5):
        with pytest.raises(ConfigError, match=rf"rho: a rank ratio must be in \(0, 1\], got {rho}"):
            ad.adaptor_plan(params, 4, rho=rho)
    with pytest.raises(ConfigError, match="num_adaptors: must be >= 1, got 0"):
        ad.adaptor_plan(params, 0)
    with pytest.raises(ConfigError, match="conv_adaptor: unknown 'diagonal'; allowed: balanced_2d, channel"):
        ad.conv_layout("diagonal", (3, 3, 4, 4))
    with pytest.raises(ConfigError, match="conv_precondition: unknown 'taps'; allowed: per_tap, matricized"):
        ad.lora_preconditioner(ad.adaptor_plan(params, 2), conv="taps")


def test_a_rank_a_layer_cannot_hold_is_refused(mlp, small_cnn):
    params = split_variables(mlp.init(jax.random.key(0)))[0]
    assert ad.adaptor_plan(params, 2, rank=10).kernels["head"].rank == 10
    head = r"^adaptor_rank: 11 is not a valid rank for head \(kernel \(200, 10\), matricized \(200, 10\)\)"
    with pytest.raises(ConfigError, match=head + ": allowed 1..10$"):
        ad.adaptor_plan(params, 2, rank=11)
    # the limit is the conv adaptor layout's: out_layer matricizes conv1 [3, 3, 1, 8] as [cin, 72]
    template = jax.eval_shape(small_cnn.init, jax.random.key(0))["params"]
    assert ad.adaptor_plan(template, 2, rank=2).kernels["conv1"].rank == 2
    with pytest.raises(ConfigError, match=r"for conv1 \(kernel \(3, 3, 1, 8\), matricized \(1, 72\)\): allowed 1..1$"):
        ad.adaptor_plan(template, 2, rank=2, conv_adaptor="out_layer")


class _OneNormNet(nn.Module):
    """A Dense, one normalization layer, a Dense head."""

    norm: str

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.Dense(8)(x.reshape(x.shape[0], -1))
        layers = {
            "rms": nn.RMSNorm(),
            "offset_only": nn.LayerNorm(use_scale=False),
            "layer": nn.LayerNorm(),
            "bare": nn.LayerNorm(use_scale=False, use_bias=False),
        }
        x = layers[self.norm](x)
        return nn.Dense(3)(x)


@pytest.mark.parametrize(
    "norm, adapted", [("rms", {"scale"}), ("offset_only", {"bias"}), ("layer", {"scale", "bias"}), ("bare", set())]
)
def test_norm_adaptors_adapt_the_parameters_each_norm_layer_has(norm, adapted):
    """FLoRAL's norm adaptors (norm_adaptors=true) on the parameters a norm layer has: a scale-only
    RMSNorm (it raised KeyError: 'bias' in ``init_adaptors``), an offset-only LayerNorm (found by its
    module type: the plan looked for a 'scale' parameter and never adapted it), a full LayerNorm; one
    with neither is no layer to adapt (nor for FedBN to keep)."""
    model = Model("one_norm", _OneNormNet(norm), (4,))
    params = model.init(jax.random.key(0))["params"]
    if not adapted:
        assert norm_layers(model) == []
        return
    (key,) = norm_layers(model)
    plan = ad.adaptor_plan(params, 2, rank=1, norms=norm_layers(model))
    assert plan.norms == (key,)
    adaptors = ad.init_adaptors(jax.random.key(1), params, plan)
    assert set(adaptors["norms"][key]) == adapted
    weights = mixture_weights(jnp.array([0.3, -1.0]))
    mixed = ad.mix(params, adaptors, weights, plan)
    for a, b in zip(jax.tree.leaves(mixed), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(a, b)  # zero deltas at init
    moved = jax.tree.map(lambda x: x + 1.0, adaptors)
    mixed = ad.mix(params, moved, weights, plan)
    for name in adapted:  # each adapted parameter moves by the weights' sum (1), the rest stays
        np.testing.assert_allclose(mixed[key][name], params[key][name] + float(jnp.sum(weights)), rtol=1e-6)
