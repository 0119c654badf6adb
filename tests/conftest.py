"""Shared fixtures: the embedded digits data and small federations built from it."""

from __future__ import annotations

import atexit
import functools
import json
import os
import shutil
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from small_models import BatchNormNet  # noqa: F401  (re-exported to the tests)

from jaxfed.contract import RoundInfo
from jaxfed.core import lowrank
from jaxfed.data import ClientData, federate, load_dataset, partition
from jaxfed.nn import get_model
from jaxfed.nn.models import CNN4, Model
from jaxfed.simulation import sampling

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
# The FedLoRU family's mechanism tests were written without gradient clipping and weight decay,
# before the authors' (clip_norm 0.1, weight_decay 1e-4) became its defaults; tests/test_defaults.py
# checks that those defaults learn.
UNCLIPPED = {"clip_norm": 0.0, "weight_decay": 0.0}
# What an algorithm needs of the model that the digits default (mlp) lacks, as config settings:
# FedBN keeps the normalization layers local, so it needs a model that has them.
# (A model file named in a config, as a user's would be: small_models.py's BatchNormNet.)
MODEL_NEEDS = {"fedbn": [f"model={Path(__file__).with_name('small_models.py')}:BatchNormNet"]}
# The default run (CI's) checks each property on each code path; a check that trains every algorithm
# (tests/test_defaults.py) trains the papers' methods and FedAvg there, and its other algorithms in
# the `slow` run (`python -m pytest -m slow`: README "Run the tests"), with the multi-process campaigns.
PAPER_METHODS = frozenset(
    {"fedavg", "fedloru", "pfedloru", "mfedloru", "fedhm", "feddecomp", "fedcspack", "fedara", "floral"}
)


def paper_methods_by_default(names):
    """``names`` as pytest params: the papers' methods and FedAvg as they are, every other one
    marked ``slow`` (left out of the default run)."""
    return [name if name in PAPER_METHODS else pytest.param(name, marks=pytest.mark.slow) for name in names]


# Many tests compile the same small simulations (and subprocesses inherit the environment):
# a persistent compilation cache for the session cuts the suite's time without changing results.
# Tests check semantics, not speed: XLA's backend optimizations off cut compile time about in half.
# With one pytest worker per core, each worker's own Eigen thread pool oversubscribes the cores:
# one thread each measured 2-5% faster (tests/test_defaults.py and test_engine.py, 2 workers).
# XLA's CPU fusion emitters (MLIR, its default) compile slower than its classic LLVM emitters: off,
# six algorithms' defaults checks spent 8.4 s in XLA's backend compile instead of 17.3 s, and the
# suite took 6:29 instead of 10:10 on 2 cores (the same tests pass; numbers may differ in the last bits).
TEST_XLA_FLAGS = (
    "--xla_backend_optimization_level=0",
    "--xla_cpu_multi_thread_eigen=false",
    "--xla_cpu_use_fusion_emitters=false",
)
for flag in TEST_XLA_FLAGS:
    if flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()
# The process that makes the cache (pytest, or its xdist controller) removes it at exit; xdist's
# workers and the subprocesses tests start inherit it through the environment.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxfed-test-xla-cache-")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
_CACHE = os.environ["JAX_COMPILATION_CACHE_DIR"]
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
jax.config.update("jax_compilation_cache_dir", _CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


def client_accuracy(model: Model, variables, fed, client: int) -> float:
    """The share of client ``client``'s test examples that ``model`` with ``variables`` classifies
    right: a per-client reference for the engine's evaluation. The model runs on every test example
    (one shape: compiled once, where each client's own slice would compile the model per client)."""
    idx = np.asarray(fed.test_idx[client][: int(fed.test_count[client])])
    logits = np.asarray(_jitted_apply(model)(variables, jnp.asarray(fed.x_test))[0])
    return float(np.mean(np.argmax(logits[idx], -1) == np.asarray(fed.y_test)[idx]))


@pytest.fixture(autouse=True)
def _run_directories_without_plots(request, monkeypatch):
    """A finished run directory skips its PNGs (accuracy.png, global_accuracy.png: about 0.3 s a
    run, with matplotlib's import the first time) except in tests marked ``plots``, which check
    them (tests/test_plots.py draws every figure). Subprocesses a test starts still draw them."""
    if request.node.get_closest_marker("plots") is None:
        from jaxfed.runs import rundir

        monkeypatch.setattr(rundir, "write_plots", lambda out, rows, log: None)


@functools.cache
def _jitted_apply(model: Model):
    return jax.jit(model.apply)


def fedopt_reference(rule, x, averages, lr, b1, b2, tau):
    """Reddi et al. 2021, Algorithm 2 in float64: the change Delta_t = mean_k x_k - x_t,
    m_t = b1 m + (1 - b1) Delta_t, v_t by the rule (v_{-1} = tau^2), x_{t+1} = x_t + lr m_t / (sqrt(v_t) + tau)."""
    x = np.asarray(x, np.float64)
    m, v = np.zeros_like(x), np.full_like(x, tau**2)
    for average in averages:
        delta = np.asarray(average, np.float64) - x
        m = b1 * m + (1 - b1) * delta
        v = {
            "adagrad": v + delta**2,
            "adam": b2 * v + (1 - b2) * delta**2,
            "yogi": v - (1 - b2) * delta**2 * np.sign(v - delta**2),
        }[rule]
        x = x + lr * m / (np.sqrt(v) + tau)
    return x


def round_info(round_: int = 0, tier: int | None = 0) -> RoundInfo:
    """The :class:`RoundInfo` the engine passes in round ``round_`` (0-based) to a client of ``tier``
    (``tier=None``: server_update's)."""
    return RoundInfo(round=jnp.int32(round_), tier=tier)


@pytest.fixture(scope="session")
def digits():
    return load_dataset("digits")


@pytest.fixture(scope="session")
def mlp(digits):
    return get_model("mlp", digits.input_shape, digits.num_classes)


@pytest.fixture(scope="session")
def small_cnn(digits):
    """A three-conv CNN (8, 16, 16 channels) on digits: conv layers that compile and train fast."""
    return Model("cnn4", CNN4(digits.num_classes, widths=(8, 16, 16)), digits.input_shape)


def make_federation(dataset, num_clients=10, name="dirichlet", seed=0, **options):
    train, test = partition(name, dataset.y_train, dataset.y_test, num_clients, np.random.default_rng(seed), **options)
    return federate(dataset, train, test)


def module_features(model, params, x):
    """A model's features (its head's input), read from its module itself (``features=True``)."""
    return model.module.apply({"params": params}, x, features=True)


def one_client(fed, client: int):
    """Client ``client``'s training view (``ClientData``, unstacked): what ``client_update`` gets."""
    data = fed.train_data(jnp.array([client]))
    return ClientData(x=data.x, y=data.y, indices=data.indices[0], count=data.count[0])


def log_softmax(logits):
    """``log softmax`` over the last axis of ``[batch, classes]``, written out (max-shifted)."""
    top = jnp.max(logits, axis=1, keepdims=True)
    return logits - top - jnp.log(jnp.sum(jnp.exp(logits - top), axis=1, keepdims=True))


def cross_entropy(logits, y):
    """The mean cross-entropy of integer labels ``y``, written out."""
    return -jnp.mean(log_softmax(logits)[jnp.arange(len(y)), y])


def torch_sgd(lr, momentum, weight_decay, clip_norm):
    """torch's ``clip_grad_norm_`` then ``SGD(lr, momentum, weight_decay)`` as ``(params, grad,
    velocity) -> (params, velocity, the gradient's norm before clipping)``."""

    def step(params, grad, velocity):
        norm = jnp.sqrt(sum(jnp.sum(g**2) for g in jax.tree.leaves(grad)))
        grad = jax.tree.map(lambda g, p: g * jnp.minimum(1.0, clip_norm / norm) + weight_decay * p, grad, params)
        velocity = jax.tree.map(lambda v, g: momentum * v + g, velocity, grad)
        return jax.tree.map(lambda p, v: p - lr * v, params, velocity), velocity, norm

    return step


def clients_one_by_one(sim, state, fed):
    """Round ``state.round``'s sampled clients (in id order) each updated by itself, as the engine's
    reference: ``(ids, [(new client state, upload), ...])`` from the server's broadcast, each
    client's data and the engine's key for it."""
    round_ = int(state.round)
    ids = np.sort(np.asarray(sim.sampled_ids(round_)))
    message = sim.algorithm.broadcast(state.server, round_info(round_))
    update = jax.jit(sim.algorithm.client_update)
    results = []
    for i in ids:
        client = jax.tree.map(lambda x: x[i], state.clients)  # noqa: B023
        key = sampling.client_keys(sampling.round_key(sim.root, round_), jnp.array([i]))[0]
        new, upload, _ = update(message, client, one_client(fed, int(i)), key, round_info(round_))
        results.append((new, upload))
    return ids, results


@pytest.fixture(scope="session")
def digits_federation(digits):
    return make_federation(digits, num_clients=10, alpha=0.5)


def shared_data_dir():
    """``../shared/data`` beside the repository when present (offline MNIST etc.)."""
    return SHARED_DATA if (SHARED_DATA / "mnist.npz").exists() else None


def with_random_lora_updates(server, seed):
    """A FedLoRU-family server state whose global LoRA factors are not at their init."""
    keys = iter(jax.random.split(jax.random.key(seed), 16))
    loras = {k: lowrank.LoRA(f.down, 0.3 * jax.random.normal(next(keys), f.up.shape)) for k, f in server.loras.items()}
    return server._replace(loras=loras)


def metrics_rows(run_dir) -> list[dict]:
    """A run directory's metrics.jsonl rows without their timing fields (the only ones that differ
    between runs of one config)."""
    from jaxfed.runs.rundir import TIMING_KEYS

    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING_KEYS} for line in lines]


def flip_state_byte(step: Path) -> None:
    """Flip one bit in the largest state file of checkpoint directory ``step``."""
    data_file = max((p for p in (step / "state").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    data = bytearray(data_file.read_bytes())
    data[len(data) // 2] ^= 0x01
    data_file.write_bytes(bytes(data))
