"""Privacy of every built-in: what a client keeps private (its ``client_state``'s private parts)
does not reach its upload, and it does make the client's personalized model.

For each algorithm the private parts of one client's state are perturbed (every leaf moved); the
client then runs ``client_update`` on the same message, data and key. Its upload must be exactly
what it was, and its ``eval_params`` must change. Where the private state shapes local training
(FedARA's head, FedDecomp's tau, pFedLoRU's personal pair, pFedLoRA's personal modules, FLoRAL's
router and adaptors, the ensemble's router, FedCSPACK's own packs) the shared part's gradients
legitimately depend on it, so those run with training frozen (``lr=0``): the upload must then be a function of what the
server sent alone. Where the private state is only BatchNorm statistics (train mode normalizes
with the batch's own statistics) the clients train at a real learning rate. This catches a
private leaf sent in any form (copied, scaled, mixed into a shared leaf), not only verbatim.

The default run checks the papers' methods and FedAvg (``tests/conftest.py``'s ``PAPER_METHODS``;
each compiles its own update, about 1.3 s); the other built-ins run in the slow run
(``python -m pytest -m slow``: README "Run the tests").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import BatchNormNet, paper_methods_by_default, round_info

from jaxfed.algorithms import registry
from jaxfed.core import packs as pk
from jaxfed.data import ClientData
from jaxfed.nn import Model
from jaxfed.runs.config import Config

# name -> (the client state's private fields, options); FROZEN ones train at lr 0 (see above).
PRIVATE = {
    "fedavg": ("model_state",),
    "fedprox": ("model_state",),
    "fedlora": ("model_state",),
    "fedloru": ("model_state",),
    "mfedloru": ("model_state",),
    "fedhm": ("model_state",),
    "local": ("variables",),
    "pfedloru": ("personal", "model_state"),
    "feddecomp": ("tau", "model_state"),
    "fedara": ("head", "model_state"),
    "floral": ("router", "model_state"),
    "local_adaptor": ("adaptors", "model_state"),
    "ensemble": ("router", "model_state"),
    "fedcspack": ("params", "model_state"),  # the packs it neither took from the server nor sends
    "fedper": ("personal", "model_state"),
    "fedrep": ("personal", "model_state"),
    "fedbn": ("personal", "model_state"),  # the normalization layers and their statistics
    "ditto": ("personal", "personal_state", "model_state"),
    "moon": ("previous", "model_state"),
    "fedntd": ("model_state",),
    "fedrod": ("personal", "model_state"),  # the personal loss does not reach the shared model: lr > 0
    "fedproto": ("params", "model_state"),
    "fedbabu": ("model_state",),
    "ifca": ("model_state",),  # the chosen cluster is sent (its one-hot): IFCA's upload, not private
    # FedALA's local model is the model it uploaded last, and its aggregation weights W make the model
    # it starts from and uploads (theta_hat, trained): by design neither is kept from the server, so
    # only its BatchNorm statistics are private (ALA's loss, like training, normalizes in train mode).
    "fedala": ("model_state",),
    "fedspu": ("params", "model_state"),  # its own model: the places outside this round's sub-model
    "pfedlora": ("tau", "model_state"),  # the personal LoRA modules
    # A FedAMP client uploads its own model; a FedCAC client its model and critical places: only their
    # BatchNorm statistics are private.
    "fedamp": ("model_state",),
    "pfedsd": ("model_state",),  # its previous local model is the model it uploaded
    "fedcac": ("model_state",),
    # A FedAS client's model: its head, and the body whose features are the prototypes the global body
    # aligns to (frozen below: lr and align_lr 0, so its upload is the body it received).
    "fedas": ("params", "model_state"),
    "pfedgate": ("gate", "gate_state", "model_state"),  # the gating layer, its statistics, the model's
    "fedtgp": ("params", "model_state"),  # its own model (its prototypes are disclosed, below)
    "fedkd": ("params", "model_state", "mentee_state", "projection"),  # the mentor, W_h, both models' statistics
    "fedgh": ("params", "model_state"),  # its own model (its prototypes are disclosed, below)
    # An LG-FedAvg client's extractor and statistics; its head it uploads (replaced next round).
    "lg_fedavg": ("params", "model_state"),
    "fml": ("params", "model_state", "meme_state"),  # the local model, both models' statistics
    # A pFedAFM client's local model, its mixing weights, both extractors' statistics.
    "pfedafm": ("params", "model_state", "mix", "extractor_state"),
    "pfedes": ("params", "model_state"),  # a pFedES client's local model and its statistics
}
FROZEN = {"pfedloru", "feddecomp", "pfedlora", "fedara", "floral", "local_adaptor", "ensemble", "fedcspack"}
# The private head / normalization layers shape the shared layers' gradients; MOON's previous model
# and FedNTD's teacher run with the client's BatchNorm statistics.
FROZEN |= {"fedper", "fedrep", "fedbn", "moon", "fedntd"}
# A FedSPU client's frozen places shape its sub-model's gradients.
FROZEN |= {"fedspu"}
# A FedAS client's prototypes (its own model's) pull the global body it trains with its own head.
FROZEN |= {"fedas"}
# A pFedGate client's gating layer scales the shared model it trains (frozen: lr 0 stops both).
FROZEN |= {"pfedgate"}
# A FedKD client's mentor and W_h distil into the mentee it trains (frozen: lr 0 stops all three).
FROZEN |= {"fedkd"}
# An LG-FedAvg client's extractor shapes the gradient of the head it uploads (frozen: lr 0 stops both).
FROZEN |= {"lg_fedavg"}
# An FML client's local model distils into the meme it uploads (frozen: lr 0 stops both).
FROZEN |= {"fml"}
# A pFedAFM client's local head trains the extractor G it uploads (frozen: lr 0 stops both).
FROZEN |= {"pfedafm"}
# A pFedES client's local model carries the gradient of the proxy extractor it uploads (frozen: lr 0 stops both).
FROZEN |= {"pfedes"}
FREEZE = {"lr": 0.0, "lr_schedule": "constant", "align_lr": 0.0}  # a cosine schedule would rise to its lr_min
# What the papers send on purpose: a FLoRAL / ensemble client sends its mixture weights (C numbers,
# the softmax of its router), by which the server weighs its adaptors / members.
# A FedProto / FedTGP client sends its class prototypes (the mean features of its private model).
# A FedAS client sends the trace of its Fisher information (one number), by which the server weighs its body.
DISCLOSED = {
    "floral": ("mixture_weights",),
    "ensemble": ("mixture_weights",),
    "fedproto": ("means",),
    "fedtgp": ("means",),  # FedProto's prototypes
    "fedgh": ("means",),  # FedProto's prototypes
    "fedas": ("fisher",),
}
SETTINGS = {
    "local_epochs": 1,
    "batch_size": 32,
    "lora_rank": 4,
    "personal_rank": 2,
    "tiers": "0.5",  # mFedLoRU: nested factors; FedHM / FedARA: a factorized tier
    "batch_stats": "private",  # FedDecomp
    "pack_size": 64,
}


def test_every_builtin_has_its_private_state_listed():
    assert set(PRIVATE) == set(registry.BUILTINS), "a new built-in: list its private client state here"


def _algorithm(name, model, frozen):
    options = Config(algorithm=name).options
    wanted = {**SETTINGS, **(FREEZE if frozen else {}), **({"local_epochs": 2} if name == "feddecomp" else {})}
    config = Config(algorithm=name).with_overrides([f"{k}={v}" for k, v in wanted.items() if options.field_for(k)])
    return registry.get(name).build(model, config.options, config)


def _perturbed(tree, seed):
    """Every float leaf moved: scaled (kept positive where it was, e.g. BatchNorm variances) and
    shifted (so a leaf at zero moves too)."""
    leaves, structure = jax.tree.flatten(tree)
    keys = jax.random.split(jax.random.key(seed), 2 * max(len(leaves), 1))
    moved = [
        x * jnp.exp(0.3 * jax.random.normal(keys[2 * i], x.shape))
        + 0.1 * jnp.abs(jax.random.normal(keys[2 * i + 1], x.shape))
        if jnp.issubdtype(x.dtype, jnp.inexact)
        else x
        for i, x in enumerate(leaves)
    ]
    return jax.tree.unflatten(structure, moved)


def _differs(a, b) -> bool:
    return any(not np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _fedcspack_client(alg, server, client, upload_of):
    """A FedCSPACK client that took part before (so it keeps packs of its own) and the same
    client with its private packs moved: those it neither takes from the server this round nor
    sends. They are scaled, which keeps each pack's cosine to the global pack, so the selection of
    the packs it sends stands (checked)."""
    view = pk.pack_view(server.params, SETTINGS["pack_size"])
    packs = np.arange(view.num_packs)
    server = server._replace(updated=jnp.asarray(np.where(packs % 2 == 0, 5, 0), jnp.int32))  # even: moved in round 4
    own = _perturbed(client.params, seed=7)
    client = client._replace(params=own, last_seen=jnp.int32(3))  # it took part in round 3: keeps the odd packs
    upload = upload_of(server, client)
    sent = np.asarray(upload.indices)[np.asarray(upload.sent)]
    private = (packs % 2 == 1) & ~np.isin(packs, sent)
    assert sent.size and private.any()
    scaled = jnp.where(jnp.asarray(private)[:, None], 1.5 * view.to_packs(own), view.to_packs(own))
    moved = client._replace(params=view.to_tree(scaled), model_state=_perturbed(client.model_state, seed=8))
    return server, client, moved


@pytest.mark.parametrize("name", paper_methods_by_default(sorted(PRIVATE)))
def test_a_private_state_changes_the_personalized_model_but_not_the_upload(name, digits, digits_federation):
    model = Model("bn_net", BatchNormNet(digits.num_classes), digits.input_shape)
    alg = _algorithm(name, model, name in FROZEN)
    server, client = alg.init(jax.random.key(0))  # op by op: the ops (one model's) compile once per process
    data = digits_federation.train_data(jnp.array([2]))
    view = ClientData(x=data.x, y=data.y, indices=data.indices[0], count=data.count[0])
    info = round_info(4, 0)
    update = jax.jit(alg.client_update)

    def upload_of(server_state, client_state):
        return update(alg.broadcast(server_state, info), client_state, view, jax.random.key(1), info)[1]

    if name == "fedcspack":
        server, client, moved = _fedcspack_client(alg, server, client, upload_of)
    else:
        fields = PRIVATE[name]
        parts = {f: _perturbed(getattr(client, f), seed=i) for i, f in enumerate(fields)}
        moved = client._replace(**parts)
        assert all(jax.tree.leaves(getattr(client, f)) for f in fields), "nothing private to perturb"

    before, after = upload_of(server, client), upload_of(server, moved)
    disclosed = DISCLOSED.get(name, ())
    assert jax.tree.leaves(before) or name == "local"  # local sends nothing at all
    shared = [f for f in getattr(before, "_fields", ()) if f not in disclosed] if disclosed else None
    pick = (lambda u: [getattr(u, f) for f in shared]) if shared is not None else (lambda u: u)
    for a, b in zip(jax.tree.leaves(pick(before)), jax.tree.leaves(pick(after)), strict=True):
        np.testing.assert_array_equal(a, b)

    server_view = server if alg.eval_server is None else alg.eval_server(server, info)
    personalized = jax.jit(alg.eval_params)
    assert _differs(personalized(server_view, client), personalized(server_view, moved))


def test_the_privacy_check_sees_a_leak(digits, digits_federation):
    """FedARA leaking a scaled copy of its private head into the uploaded extractor fails the check."""
    model = Model("bn_net", BatchNormNet(digits.num_classes), digits.input_shape)
    alg = _algorithm("fedara", model, frozen=True)

    def leaky_update(message, client_state, data, rng, info):
        new_state, upload, metrics = alg.client_update(message, client_state, data, rng, info)
        bias = upload["Dense_0"]["bias"]
        leaked = bias + 1e-3 * jnp.sum(client_state.head["kernel"])
        return new_state, {**upload, "Dense_0": {**upload["Dense_0"], "bias": leaked}}, metrics

    server, client = jax.jit(alg.init)(jax.random.key(0))
    data = digits_federation.train_data(jnp.array([2]))
    view = ClientData(x=data.x, y=data.y, indices=data.indices[0], count=data.count[0])
    info = round_info(4, 0)
    moved = client._replace(head=_perturbed(client.head, seed=0))
    uploads = [
        jax.jit(leaky_update)(alg.broadcast(server, info), c, view, jax.random.key(1), info)[1] for c in (client, moved)
    ]
    assert _differs(*uploads)
