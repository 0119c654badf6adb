"""FedHM (Yao et al.): clients of different capacity train low-rank factorizations of one global model.

Clients sit in static tiers, each with a rank ratio. Every round the server truncated-SVD
factorizes each factorized kernel of the global model to the tier's rank
(``rank = round(ratio * min dim)`` of the matricized kernel) and sends each tier its factors;
clients train the factors (and the unfactorized parameters) with cross-entropy, running each
factorized Conv as a ``kh x 1`` then ``1 x kw`` conv and each Dense as two thin matmuls, so a
client's compute and upload scale with its rank. The server reconstructs every upload to full
kernels (``receive``) and averages them with sample weights over all tiers.
Where clients run vmapped together, every tier's clients run as one program (``pad_tier``): each
gets its tier's factors zero-padded to the largest tier's rank, and a whole kernel switched off
where its tier factorizes the layer (:func:`jaxfed.core.lowrank.pad_to_union`); zero factor
columns stay zero, so the numbers are the per-tier programs' up to float rounding.

``rank_rule=cout`` takes the authors' code's rank instead, ``round(ratio * cout)`` (their
``planes / rank_factor``, with ``rank_factor = 1 / ratio``). 1x1 convs (ResNet shortcuts) stay
full, as in the authors' low-rank ResNets, unless ``pointwise=true`` or ``layers`` names them.
"""

from __future__ import annotations

import dataclasses

from jaxfed.algorithms.aggregation import model_averaging
from jaxfed.algorithms.records import ClientStats, GlobalParams
from jaxfed.algorithms.registry import builtin
from jaxfed.algorithms.training import train_classifier
from jaxfed.contract import FederatedAlgorithm
from jaxfed.core import lowrank
from jaxfed.nn import model_template, split_variables
from jaxfed.nn.factorized import factorized_execution
from jaxfed.nn.layers import choose_layers
from jaxfed.options import CLIENT_OPTIMIZER_HELP, TrainingOptions, each, one_of, option, rank_ratio, resolve, split_keys

DEFAULT_TIERS = (1.0, 0.5, 0.25, 0.125, 0.0625)
RANK_RULES = ("min_dim", "cout")
FEDHM_AUTHORS = "the FedHM authors' code (low-rank ResNets)"
FEDARA_SETUP = "FedARA paper §5 (FedHM is its baseline, run in its setup: E=5, B=16, lr 5e-3)"


@dataclasses.dataclass(frozen=True)
class TieredOptions(TrainingOptions):
    """Client tiers of rank ratios, trained in FedARA's setup (FedHM is its baseline)."""

    local_epochs: int = option(5, "local epochs per round", source=FEDARA_SETUP)
    batch_size: int = option(16, "local batch size", source=FEDARA_SETUP)
    lr: float = option(5e-3, "client learning rate", source=FEDARA_SETUP)
    client_optimizer: str = option(
        "sgd", CLIENT_OPTIMIZER_HELP, source="ALGORITHMS.md (FedARA: SGD; the paper gives the lr only)"
    )
    tiers: tuple[float, ...] = option(
        DEFAULT_TIERS,
        "one rank ratio in (0, 1] per client tier; clients split into equal contiguous id blocks",
        source="FedARA paper §5 (five heterogeneous tiers of decreasing rank)",
        check=each(rank_ratio),
    )
    factorization: str = option(
        "svd",
        "how the server computes each round's truncated SVD: svd (jnp.linalg.svd: LAPACK on CPU, cuSOLVER on GPU) "
        "or gram (the eigendecomposition of the smaller Gram matrix, 2-3x faster on CPU; a kernel whose condition "
        "number exceeds 30 then also goes to jnp.linalg.svd, as every kernel does in a vmapped sweep, and trained "
        "kernels soon do: there gram costs more than svd); the two give the same products to float32 rounding "
        "(factors up to the sign of each pair)",
        check=one_of(*lowrank.FACTORIZATIONS),
    )


@dataclasses.dataclass(frozen=True)
class FedHMOptions(TieredOptions):
    """FedHM's options: client tiers of rank ratios over the factorized layers."""

    layers: tuple[str, ...] = option(
        (),
        "layers to factorize (comma-separated); empty = every Dense/Conv but the first called, the last "
        "and (unless pointwise) the 1x1 convs",
    )
    rank_rule: str = option(
        "min_dim",
        "tier rank: min_dim = round(ratio * min dim of the matricized kernel); cout = round(ratio * output "
        "channels), the authors' planes / rank_factor",
        source="ALGORITHMS.md (min_dim); " + FEDHM_AUTHORS + " (cout)",
        check=one_of(*RANK_RULES),
    )
    pointwise: bool = option(False, "factorize 1x1 convs (ResNet shortcuts) too", source=FEDHM_AUTHORS)


def tier_rank(kernel_shape, ratio: float, rank_rule: str = "min_dim") -> int:
    """A kernel's rank in a tier of rank ratio ``ratio`` (at most the matricized kernel's rank)."""
    if rank_rule == "cout":
        lowrank.check_ratio("tiers", ratio)
        return min(lowrank.max_rank(kernel_shape), max(1, round(ratio * kernel_shape[-1])))
    return lowrank.rank_from_ratio(kernel_shape, ratio, "tiers")


def is_pointwise(template, key: str) -> bool:
    return lowrank.get_layer(template, key)["kernel"].shape[:-2] in ((1, 1), (1,))


def fedhm_layers(model, template, options: FedHMOptions) -> list[str]:
    """The layers FedHM factorizes: ``options.layers``, or the interior layers without 1x1 convs."""
    layers = choose_layers(model, options.layers, "fedhm")
    if options.pointwise or split_keys(options.layers):
        return layers
    return [key for key in layers if not is_pointwise(template, key)]


def tier_ranks(template, layers_per_tier, tiers, rank_rule: str = "min_dim") -> list[dict[str, int]]:
    """``{layer: rank}`` of the layers each tier's rank ratio factorizes (static; a ratio outside
    (0, 1] is a ConfigError), from one list of layers per tier. A layer whose tier rank is its
    full rank is left out: it travels and trains as its kernel, which takes fewer bytes and less
    compute than full-rank factors."""
    ranks = []
    for ratio, tier_layers in zip(tiers, layers_per_tier, strict=True):
        tier = {}
        for key in tier_layers:
            shape = lowrank.get_layer(template, key)["kernel"].shape
            rank = tier_rank(shape, ratio, rank_rule)
            if rank < lowrank.max_rank(shape):
                tier[key] = rank
        ranks.append(tier)
    return ranks


def reconstruct_upload(server_state, message, info):
    """``receive`` of FedHM and FedARA: a tier's factorized upload as full kernels."""
    return lowrank.reconstruct_layers(message)


def fedhm(model, options: FedHMOptions | None = None, *, name: str = "fedhm", **overrides) -> FederatedAlgorithm:
    """FedHM over ``len(options.tiers)`` client tiers."""
    options = resolve(FedHMOptions, options, overrides)
    template, private_stats = model_template(model)
    layers = fedhm_layers(model, template, options)
    ranks = tier_ranks(template, [layers] * len(options.tiers), options.tiers, options.rank_rule)

    def init(rng):
        params, model_state = split_variables(model.init(rng))
        return GlobalParams(params), ClientStats(model_state)

    def broadcast(server_state, info):
        return lowrank.factorize_layers(server_state.params, ranks[info.tier], options.factorization)

    union = lowrank.union_ranks(ranks)

    def pad_tier(factorized, info):
        return lowrank.pad_to_union(factorized, union)

    def client_update(message, client_state, data, rng, info):
        optimizer = options.optimizer(info.round)  # this round's learning rate
        factorized, kernel_on = message if isinstance(message, lowrank.Padded) else (message, None)
        with factorized_execution(kernel_on):
            variables, metrics = train_classifier(
                model,
                optimizer,
                {"params": factorized, **client_state.model_state},
                data,
                rng,
                **options.batching(),
            )
        trained, model_state = split_variables(variables)
        return ClientStats(model_state), trained, metrics

    def eval_params(server_state, client_state):
        return {"params": server_state.params, **client_state.model_state}

    def global_params(server_state):
        return {"params": server_state.params}

    return FederatedAlgorithm(
        name=name,
        options=options,
        init=init,
        broadcast=broadcast,
        client_update=client_update,
        aggregation=model_averaging(),  # full kernels
        eval_params=eval_params,
        global_params=None if private_stats else global_params,
        num_tiers=len(ranks),
        receive=reconstruct_upload,
        pad_tier=pad_tier,
    )


builtin("fedhm", FedHMOptions, lambda model, options, config: fedhm(model, options))
