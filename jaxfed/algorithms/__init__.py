"""Federated algorithms, one module each, every one a :class:`FederatedAlgorithm` built from its
own options (a frozen dataclass with the paper's defaults) and registered by name.

``registry.get(name)`` gives ``(options class, builder)``; ``jaxfed.register`` adds one from
research code. Every constructor has the form ``name(model, options=None, **overrides)``.
"""

from jaxfed.algorithms import ensemble, fedara, fedavg, fedcspack, feddecomp, fedhm, fedloru, fedprox, floral, local
from jaxfed.algorithms.base import FederatedAlgorithm
from jaxfed.algorithms.registry import get, names, register

# Built-ins: (name, options class, builder(model, options, config))
register("fedavg", fedavg.FedAvgOptions, lambda model, options, config: fedavg.fedavg(model, options))
register("fedprox", fedprox.FedProxOptions, lambda model, options, config: fedprox.fedprox(model, options))
register("local", local.LocalOptions, lambda model, options, config: local.local(model, options))
register("fedlora", fedloru.FedLoRAOptions, lambda model, options, config: fedloru.fedlora(model, options))
register("fedloru", fedloru.FedLoRUOptions, lambda model, options, config: fedloru.fedloru(model, options))
register("pfedloru", fedloru.PFedLoRUOptions, lambda model, options, config: fedloru.pfedloru(model, options))
register("mfedloru", fedloru.MFedLoRUOptions, lambda model, options, config: fedloru.mfedloru(model, options))
register("fedhm", fedhm.FedHMOptions, lambda model, options, config: fedhm.fedhm(model, options))
register("feddecomp", feddecomp.FedDecompOptions, lambda model, options, config: feddecomp.feddecomp(model, options))
register("fedcspack", fedcspack.FedCSPACKOptions, lambda model, options, config: fedcspack.fedcspack(model, options))
register("fedara", fedara.FedARAOptions, lambda model, options, config: fedara.fedara(model, options))
register(
    "floral",
    floral.FLoRALOptions,
    lambda model, options, config: floral.floral(model, options, num_clusters=floral.oracle_clusters(config)),
)
register(
    "local_adaptor", floral.LocalAdaptorOptions, lambda model, options, config: floral.local_adaptor(model, options)
)
register(
    "ensemble",
    ensemble.EnsembleOptions,
    lambda model, options, config: ensemble.ensemble(model, options, num_clusters=floral.oracle_clusters(config)),
)

__all__ = ["FederatedAlgorithm", "get", "names", "register"]
