"""The client optimizer (``client_optimizer``: sgd, momentum, adam, adamw): one constructor for
every parameter group of every algorithm's local training.

The constructor's kinds against their update rules written in numpy; the default SGD against the
optax construction every earlier release made (bit for bit); an Adam client update of FedAvg and
of Ditto (two models, a fresh optimizer each) against a Python loop over the same batches with Adam
written by hand; FLoRAL's router on the same kind at its own rate without weight decay; the
one-line errors; every built-in tracing an Adam update without making any SGD; sweeps grouping by
the key; ``jaxfed list`` showing it.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import BatchNormNet, make_federation, round_info

from jaxfed.algorithms import registry
from jaxfed.algorithms.ditto import ClientState as DittoClient
from jaxfed.algorithms.ditto import ditto
from jaxfed.algorithms.fedavg import ServerState, fedavg
from jaxfed.algorithms.fedloru import FedLoRUOptions
from jaxfed.algorithms.floral import FLoRALOptions, _local_optimizer, _plan
from jaxfed.algorithms.records import ClientStats, GlobalParams
from jaxfed.algorithms.training import STEP_KEY_STREAM, classification_loss, shuffled_positions, train_classifier
from jaxfed.cli.commands import main
from jaxfed.data import ClientData
from jaxfed.errors import ConfigError
from jaxfed.nn import Model
from jaxfed.options import CLIENT_OPTIMIZERS, client_optimizer
from jaxfed.runs.config import Config
from jaxfed.runs.sweep import member_name, shape_groups, sweep_configs, traceable_keys

B1, B2, EPS = 0.9, 0.999, 1e-8  # optax's Adam defaults, which the help promises
LR, BATCH = 0.01, 32  # the Adam client updates' learning rate and batch size


def _steps(opt, params, grads_seq):
    """``params`` after ``opt``'s steps on each gradient of ``grads_seq`` (one fresh state)."""
    state = opt.init(params)
    for grads in grads_seq:
        updates, state = opt.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    return params


def _numpy_steps(kind, lr, params, grads_seq, momentum=0.0, weight_decay=0.0, clip_norm=0.0):
    """The update rules the help states, in float64 numpy on one array."""
    p = np.asarray(params, np.float64)
    m, v, trace = np.zeros_like(p), np.zeros_like(p), np.zeros_like(p)
    for t, g in enumerate(grads_seq, start=1):
        g = np.asarray(g, np.float64)
        if clip_norm:
            g = g * min(1.0, clip_norm / np.linalg.norm(g))
        if weight_decay and kind != "adamw":
            g = g + weight_decay * p  # added to the gradient
        if kind in ("sgd", "momentum"):
            trace = g + momentum * trace  # heavy ball, as torch's SGD
            p = p - lr * trace
        else:
            m = B1 * m + (1 - B1) * g
            v = B2 * v + (1 - B2) * g * g
            step = (m / (1 - B1**t)) / (np.sqrt(v / (1 - B2**t)) + EPS)
            p = p - lr * (step + (weight_decay * p if kind == "adamw" else 0.0))  # adamw: decoupled
    return p


@pytest.mark.parametrize(
    "kind, settings",
    [
        ("sgd", {}),
        ("sgd", {"momentum": 0.5, "weight_decay": 0.1}),
        ("momentum", {"momentum": 0.9, "clip_norm": 0.5}),
        ("adam", {}),
        ("adam", {"weight_decay": 0.1, "clip_norm": 0.5}),
        ("adamw", {"weight_decay": 0.1}),
    ],
)
def test_each_kind_follows_its_update_rule(kind, settings):
    rng = np.random.default_rng(0)
    params = rng.normal(size=(6,)).astype(np.float32)
    grads = [rng.normal(size=(6,)).astype(np.float32) for _ in range(4)]
    got = _steps(client_optimizer(kind, 0.05, **settings), jnp.asarray(params), [jnp.asarray(g) for g in grads])
    np.testing.assert_allclose(got, _numpy_steps(kind, 0.05, params, grads, **settings), rtol=1e-5, atol=1e-6)


def test_the_default_sgd_is_the_optax_construction_of_earlier_releases_bit_for_bit():
    """FedLoRU's defaults use every part (clipping, weight decay, momentum, a cosine lr): its
    optimizer against the construction every algorithm made before ``client_optimizer``."""
    options = FedLoRUOptions()
    assert options.client_optimizer == "sgd"
    lr = options.learning_rate(jnp.int32(3))
    before = optax.chain(
        optax.clip_by_global_norm(0.1), optax.chain(optax.add_decayed_weights(1e-4), optax.sgd(lr, momentum=0.9))
    )
    rng = np.random.default_rng(1)
    params = {"w": jnp.asarray(rng.normal(size=(3, 4)), jnp.float32)}
    grads = [{"w": jnp.asarray(rng.normal(size=(3, 4)), jnp.float32)} for _ in range(3)]
    now = options.optimizer(jnp.int32(3))
    assert jax.tree.structure(now.init(params)) == jax.tree.structure(before.init(params))
    np.testing.assert_array_equal(_steps(now, params, grads)["w"], _steps(before, params, grads)["w"])


@pytest.fixture(scope="module")
def start(mlp):
    """The parameters both Adam client updates start from."""
    return jax.jit(mlp.init)(jax.random.key(0))["params"]


@pytest.fixture(scope="module")
def client_data(digits):
    data = make_federation(digits, num_clients=20, alpha=1.0).train_data(jnp.array([3]))
    return ClientData(x=data.x, y=data.y, indices=data.indices[0], count=data.count[0])


@functools.cache
def _adam_step(model):
    """One Adam step written out, on ``CE + lam/2 ||p - anchor||^2`` of one batch (compiled once
    per model: every reference loop below shares it)."""
    loss = classification_loss(model)

    @jax.jit
    def step(params, m, v, t, data, positions, key, anchor, lam):
        def objective(p):
            pull = sum(jnp.sum((a - b) ** 2) for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(anchor)))
            return loss(p, {}, data.batch(positions)._replace(key=key))[0] + lam / 2 * pull

        g = jax.grad(objective)(params)
        m = jax.tree.map(lambda m, g: B1 * m + (1 - B1) * g, m, g)
        v = jax.tree.map(lambda v, g: B2 * v + (1 - B2) * g * g, v, g)
        n = (t + 1).astype(jnp.float32)
        step = lambda m, v: (m / (1 - B1**n)) / (jnp.sqrt(v / (1 - B2**n)) + EPS)  # noqa: E731
        return jax.tree.map(lambda p, m, v: p - LR * step(m, v), params, m, v), m, v

    return step


def _adam_by_hand(model, params, data, rng, *, epochs, anchor=None, lam=0.0):
    """``run_epochs``' batches (the same shuffles and order) in a Python loop of Adam steps from
    fresh moments: what a client running Adam at ``LR`` computes on its loss (plus the pull
    ``lam/2 ||p - anchor||^2``)."""
    max_examples = data.indices.shape[0]
    length = -(-max_examples // BATCH) * BATCH
    per_epoch = -(-int(data.count) // BATCH)
    shuffle = jax.jit(shuffled_positions, static_argnums=(2, 3))
    orders = [shuffle(key, data.count, max_examples, length) for key in jax.random.split(rng, epochs)]
    step_keys = jax.random.fold_in(rng, STEP_KEY_STREAM)
    m = v = jax.tree.map(jnp.zeros_like, params)
    anchor = params if anchor is None else anchor
    for t in range(epochs * per_epoch):
        epoch, s = divmod(t, per_epoch)
        positions = orders[epoch][s * BATCH : (s + 1) * BATCH]
        key = jax.random.fold_in(step_keys, t)
        params, m, v = _adam_step(model)(params, m, v, jnp.int32(t), data, positions, key, anchor, jnp.float32(lam))
    return params


def _close(got, want, lr=LR):
    """Equal to float32 rounding, which Adam's normalization amplifies where a gradient is near 0:
    to a thousandth of a step of ``lr`` (a wrong moment, bias correction or eps moves every entry
    by a sizeable part of a step)."""
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-3 * lr)


def test_fedavg_with_adam_is_a_loop_of_adam_steps_and_its_sgd_is_unchanged(mlp, start, client_data):
    server, client = ServerState(start, ()), ClientStats({})
    rng, info = jax.random.key(5), round_info()
    alg = fedavg(mlp, client_optimizer="adam", lr=LR, local_epochs=2, batch_size=BATCH)
    _, upload, _ = jax.jit(alg.client_update)(server.params, client, client_data, rng, info)
    _close(upload, _adam_by_hand(mlp, server.params, client_data, rng, epochs=2))

    # The default (sgd) client update is the earlier releases' optax.sgd, bit for bit.
    def now_and_before(params):
        _, now, _ = fedavg(mlp, batch_size=BATCH).client_update(params, client, client_data, rng, info)
        before, _ = train_classifier(
            mlp, optax.sgd(0.05), {"params": params}, client_data, rng, epochs=2, batch_size=BATCH
        )
        return now, before["params"]

    now, before = jax.jit(now_and_before)(server.params)
    for a, b in zip(jax.tree.leaves(now), jax.tree.leaves(before), strict=True):
        np.testing.assert_array_equal(a, b)


def test_ditto_trains_both_models_with_a_fresh_adam_each(mlp, start, client_data):
    """Two parameter groups trained in turn: the global copy, then the personal model toward it,
    each from fresh Adam moments."""
    alg = ditto(mlp, client_optimizer="adam", lr=LR, lam=0.5, local_epochs=1, personal_epochs=2, batch_size=BATCH)
    server = GlobalParams(start)
    personal = jax.tree.map(lambda x: x + 0.05, start)  # a personal model away from the global
    client = DittoClient(personal, {}, {})
    rng = jax.random.key(5)
    new_client, upload, _ = jax.jit(alg.client_update)(server.params, client, client_data, rng, round_info())

    global_rng, personal_rng = jax.random.split(rng)
    _close(upload, _adam_by_hand(mlp, server.params, client_data, global_rng, epochs=1))
    want = _adam_by_hand(mlp, personal, client_data, personal_rng, epochs=2, anchor=server.params, lam=0.5)
    _close(new_client.personal, want)


def test_floral_routers_take_the_kind_at_router_lr_without_weight_decay(mlp):
    """FLoRAL's three parameter groups: the base and the adaptors with the client optimizer (and
    its weight decay) at lr, the router logits with the same kind at router_lr, undecayed."""
    options = FLoRALOptions(client_optimizer="adam", lr=0.01, router_lr=0.3, weight_decay=0.1, precondition=False)
    _, plan = _plan(mlp, options, options.num_adaptors)  # (unused without preconditioning)
    rng = np.random.default_rng(3)
    shapes = {"base": {"w": (3, 5), "b": (5,)}, "adaptors": {"down": (4, 3, 2), "up": (4, 2, 5)}, "router": (4,)}
    params, *grads = (jax.tree.map(lambda shape: rng.normal(size=shape).astype(np.float32), shapes,
                                   is_leaf=lambda x: isinstance(x, tuple)) for _ in range(3))  # fmt: skip

    def got_and_want(params, grads):
        split = lambda key: (params[key], [g[key] for g in grads])  # noqa: E731
        decayed_adam = optax.chain(optax.add_decayed_weights(0.1), optax.adam(0.01))
        want = {
            "base": _steps(decayed_adam, *split("base")),
            "adaptors": _steps(decayed_adam, *split("adaptors")),
            "router": _steps(optax.adam(0.3), *split("router")),
        }
        return _steps(_local_optimizer(plan, options, jnp.int32(0), router=True), params, grads), want

    _close(*jax.jit(got_and_want)(params, grads))


def test_a_bad_value_is_one_line_naming_the_key_and_the_allowed_values(mlp):
    allowed = ", ".join(CLIENT_OPTIMIZERS)
    with pytest.raises(
        ConfigError, match=rf"^client_optimizer: unknown 'adma' \(did you mean 'adam'\?\); allowed: {allowed}$"
    ):
        Config().with_overrides(["client_optimizer=adma"]).validate()
    with pytest.raises(ConfigError, match=rf"^client_optimizer: unknown 'lbfgs'; allowed: {allowed}$"):
        fedavg(mlp, client_optimizer="lbfgs")
    with pytest.raises(ConfigError, match=r"^client_optimizer: momentum needs momentum > 0 \(e\.g\. momentum=0\.9\)"):
        Config(algorithm="feddecomp").with_overrides(["client_optimizer=momentum"]).validate()
    assert Config(algorithm="fedara").with_overrides(["client_optimizer=momentum", "momentum=0.9"]).validate()


OFFERED = [name for name in registry.BUILTINS if registry.get(name).options.field_for("client_optimizer")]
SETTINGS = {"local_epochs": 1, "batch_size": 32, "lora_rank": 2, "personal_rank": 2, "tiers": "0.5", "pack_size": 64}


def test_every_builtin_offers_the_key_with_sgd_as_its_default():
    assert OFFERED == list(registry.BUILTINS)
    assert {registry.get(name).options().client_optimizer for name in OFFERED} == {"sgd"}


# Steps a paper fixes apart from the client optimizer: FedAS aligns the global body by plain SGD at
# align_lr (the authors' SGD(lr=0.01)), whatever trains the model.
OWN_SGD = {"fedas": ("sgd",)}


@pytest.mark.parametrize("name", OFFERED)
def test_every_builtin_traces_an_adam_update_and_makes_no_sgd(name, digits, client_data, monkeypatch):
    """Building the algorithm and tracing one client update with ``client_optimizer=adam``: every
    optimizer it makes (heads, LoRA factors, routers, phases) is Adam, none SGD."""
    made = []
    for kind in ("sgd", "adam", "adamw"):
        original = getattr(optax, kind)
        monkeypatch.setattr(optax, kind, lambda *a, _f=original, _k=kind, **k: made.append(_k) or _f(*a, **k))
    options = Config(algorithm=name).options
    wanted = {**SETTINGS, "client_optimizer": "adam", **({"local_epochs": 2} if name == "feddecomp" else {})}
    config = Config(algorithm=name).with_overrides([f"{k}={v}" for k, v in wanted.items() if options.field_for(k)])
    model = Model("small", BatchNormNet(digits.num_classes, width=8), digits.input_shape)
    alg = registry.get(name).build(model, config.options, config)
    info = round_info(1, 0)

    def update(key):
        server, client = alg.init(key)
        return alg.client_update(alg.broadcast(server, info), client, client_data, jax.random.fold_in(key, 1), info)

    _, upload, metrics = jax.eval_shape(update, jax.random.key(0))
    assert made and set(made) - set(OWN_SGD.get(name, ())) == {"adam"}, made
    assert made.count("sgd") == len(OWN_SGD.get(name, ())), made
    assert metrics["train_loss"].shape == ()


def test_a_sweep_over_the_key_runs_one_program_per_optimizer():
    base = Config().with_overrides(["rounds=1", "num_clients=4"])
    configs = sweep_configs(base, seeds=[0, 1], grid={"client_optimizer": ["sgd", "adam"]})
    assert traceable_keys(configs) == []  # a string: never traced, a shape key
    assert shape_groups(configs, ["lr"]) == [[0, 2], [1, 3]]
    assert member_name(configs[1], ["client_optimizer"]) == "seed0_lr0.05_client_optimizeradam"


def test_jaxfed_list_shows_the_key(capsys):
    assert main(["list", "ditto"]) == 0
    out = capsys.readouterr().out
    assert "client_optimizer = sgd" in out and "adamw" in out


@pytest.mark.parametrize("kind", ["momentum", "adamw"])
def test_a_masked_part_stays_put_and_the_rest_trains_as_it_would_alone(kind):
    """``masked`` with a traced 0 freezes its part (no weight decay, nothing in the clipped norm,
    an inf gradient kept out); the other part follows the optimizer run on it alone; a traced 1
    everywhere is the optimizer itself."""
    from jaxfed.algorithms.training import masked

    opt = client_optimizer(kind, 0.1, momentum=0.9, weight_decay=0.1, clip_norm=0.5)
    params = {"a": jnp.arange(3.0), "b": {"c": jnp.ones((2, 2))}}
    grads = [{"a": jnp.asarray([1.0, -2.0, 0.5]) * k, "b": {"c": jnp.full((2, 2), 3.0 * k)}} for k in (1, 2)]
    grads[1]["b"]["c"] = grads[1]["b"]["c"].at[0, 0].set(jnp.inf)  # frozen: must not reach the clipped norm
    update = jax.jit(lambda g, state, p, on: masked(opt, {"a": 1.0, "b": on}).update(g, state, p))
    alone, alone_state, both, both_state = params["a"], opt.init(params["a"]), params, opt.init(params)
    for g in grads:
        updates, alone_state = opt.update(g["a"], alone_state, alone)
        alone = optax.apply_updates(alone, updates)
        updates, both_state = update(g, both_state, both, 0.0)
        both = optax.apply_updates(both, updates)
    np.testing.assert_allclose(both["a"], alone, rtol=1e-6)
    np.testing.assert_array_equal(both["b"]["c"], params["b"]["c"])
    plain, _ = jax.jit(opt.update)(grads[0], opt.init(params), params)
    ones, _ = update(grads[0], opt.init(params), params, 1.0)
    chex.assert_trees_all_equal(ones, plain)
