"""FLOPs from a computation's own arithmetic: the matrix products and convolutions of its jaxpr,
counted from their shapes (two per multiply-add; a convolution's multiply-adds on padding or on
a transposed convolution's dilation holes are not counted), so the count does not depend on how
XLA lowers a convolution (im2col patches, Winograd, ...) or on the backend; jaxfed's ``patches``
convolution (slices and one einsum) counts as the convolution it computes.

``local_step_flops`` counts one local training step of an algorithm (its ``client_update``'s
training loop body: the model's forward and backward pass plus whatever the algorithm adds, e.g.
adaptors, a proximal term, a composed kernel); ``model_step_flops`` the plain model's step."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.extend import core as jex_core

from jaxfed.core.losses import masked_loss
from jaxfed.nn.conv import traced_as_xla


def eqn_flops(eqn) -> float:
    """FLOPs of one ``dot_general`` or ``conv_general_dilated`` equation (0 for anything else)."""
    name = eqn.primitive.name
    out = eqn.outvars[0].aval
    if name == "dot_general":
        (lhs_contract, _), _ = eqn.params["dimension_numbers"]
        lhs = eqn.invars[0].aval
        return 2.0 * math.prod(out.shape) * math.prod(lhs.shape[d] for d in lhs_contract)
    if name == "conv_general_dilated":
        lhs, rhs = eqn.invars[0].aval, eqn.invars[1].aval
        numbers, params = eqn.params["dimension_numbers"], eqn.params
        lhs_spec, rhs_spec, out_spec = numbers.lhs_spec, numbers.rhs_spec, numbers.out_spec  # batch, feature, *spatial
        taps = math.prod(
            _taps_on_inputs(lhs.shape[ld], rhs.shape[rd], out.shape[od], stride, pad, lhs_dil, rhs_dil)
            for ld, rd, od, stride, pad, lhs_dil, rhs_dil in zip(
                lhs_spec[2:],
                rhs_spec[2:],
                out_spec[2:],
                params["window_strides"],
                params["padding"],
                params["lhs_dilation"],
                params["rhs_dilation"],
            )
        )
        return 2.0 * out.shape[out_spec[0]] * out.shape[out_spec[1]] * rhs.shape[rhs_spec[1]] * taps
    return 0.0


def _taps_on_inputs(size, window, out_size, stride, padding, lhs_dilation, rhs_dilation) -> int:
    """Along one spatial dimension of a convolution: the (output position, kernel tap) pairs that
    land on a real input element, not on padding or on a dilation hole (a transposed
    convolution's, in a backward pass): the multiply-adds that touch data."""
    low, _ = padding
    extent = (size - 1) * lhs_dilation
    count = 0
    for o in range(out_size):
        for k in range(window):
            at = o * stride + k * rhs_dilation - low
            count += 0 <= at <= extent and at % lhs_dilation == 0
    return count


def _sub_jaxprs(eqn):
    for value in eqn.params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, jex_core.ClosedJaxpr):
                yield item.jaxpr
            elif isinstance(item, jex_core.Jaxpr):
                yield item


def jaxpr_flops(jaxpr) -> float:
    """FLOPs of ``jaxpr`` with every loop body counted once (as XLA's cost analysis counts them),
    a scan's body once per iteration and a ``cond`` as its costliest branch."""
    total = 0.0
    for eqn in jaxpr.eqns:
        total += eqn_flops(eqn)
        inner = [jaxpr_flops(sub) for sub in _sub_jaxprs(eqn)]
        if not inner:
            continue
        if eqn.primitive.name == "cond":
            total += max(inner)
        elif eqn.primitive.name == "scan":
            total += sum(inner) * eqn.params["length"]
        else:
            total += sum(inner)
    return total


def loop_body_flops(jaxpr) -> list[float]:
    """FLOPs of each ``while`` loop body in ``jaxpr`` (nested ones included), outermost first."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "while":
            found.append(jaxpr_flops(eqn.params["body_jaxpr"].jaxpr))
        for sub in _sub_jaxprs(eqn):
            found.extend(loop_body_flops(sub))
    return found


def model_step_flops(model, input_shape, batch_size: int) -> float:
    """FLOPs of one SGD step's forward and backward pass of ``model`` on a batch."""
    variables = model.init(jax.random.key(0))
    x = jnp.zeros((batch_size, *input_shape), jnp.float32)
    y = jnp.zeros((batch_size,), jnp.int32)
    mask = jnp.ones((batch_size,), bool)

    def loss(params):
        out, _ = model.apply({**variables, "params": params}, x, train=True, mask=mask)
        return masked_loss(out, y, mask)

    with traced_as_xla():  # a patches conv's padding is no multiply-add of the convolution
        return jaxpr_flops(jax.make_jaxpr(jax.grad(loss))(variables["params"]).jaxpr)


def local_step_flops(sim, tier: int = 0) -> float:
    """FLOPs of one local training step of ``sim``'s algorithm for a client of ``tier``: the
    costliest ``while`` body of ``client_update`` (the training loop's; an algorithm's other
    loops, e.g. FedARA's anchor pass, are forward passes only)."""
    from jaxfed.contract import RoundInfo
    from jaxfed.core import gather_clients
    from jaxfed.data import ClientData

    alg = sim.algorithm
    state = sim.init()
    info = RoundInfo(round=state.round, tier=tier)
    message = alg.broadcast(state.server, info)
    ids = jnp.asarray([sim.tiers[tier][0] if sim.tiers else 0], jnp.int32)  # a client of the tier
    batch = sim.data.train_data(ids)
    client_state = jax.tree.map(lambda x: x[0], gather_clients(state.clients, ids))
    data = ClientData(batch.x, batch.y, batch.indices[0], batch.count[0])
    with traced_as_xla():  # a patches conv's padding is no multiply-add of the convolution
        jaxpr = jax.make_jaxpr(lambda m, c, d, r: alg.client_update(m, c, d, r, info))(
            message, client_state, data, jax.random.key(0)
        )
    bodies = loop_body_flops(jaxpr.jaxpr)
    return max(bodies) if bodies else jaxpr_flops(jaxpr.jaxpr)
