"""Federated algorithms, one module each, every one a :class:`FederatedAlgorithm`.

``ALGORITHMS`` maps a config name to ``from_config(config, model) -> FederatedAlgorithm``.
"""

from jaxfed.algorithms import ensemble, fedara, fedavg, fedcspack, feddecomp, fedhm, fedloru, fedprox, floral, local
from jaxfed.algorithms.base import FederatedAlgorithm

ALGORITHMS = {
    "fedavg": fedavg.from_config,
    "fedprox": fedprox.from_config,
    "local": local.from_config,
    "fedlora": fedloru.fedlora_from_config,
    "fedloru": fedloru.from_config,
    "pfedloru": fedloru.pfedloru_from_config,
    "mfedloru": fedloru.mfedloru_from_config,
    "fedhm": fedhm.from_config,
    "feddecomp": feddecomp.from_config,
    "fedcspack": fedcspack.from_config,
    "fedara": fedara.from_config,
    "floral": floral.from_config,
    "local_adaptor": floral.local_adaptor_from_config,
    "ensemble": ensemble.from_config,
}

__all__ = ["ALGORITHMS", "FederatedAlgorithm"]
