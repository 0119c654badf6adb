"""pFedLoRA (the FedLoRU paper's App. C.4, after Wu et al. 2024): a shared full-rank model plus
each client's personal low-rank modules.

Every client trains the full-rank global model ``sigma`` and its own personal modules ``tau_k``,
a LoRA pair per adapted kernel added to it (``sigma + s * fold(down @ up)``); ``sigma`` is
uploaded and averaged by sample count, ``tau_k`` never leaves the client. This is FedDecomp's
mechanism (:func:`jaxfed.algorithms.feddecomp.decomposed`) with the FedLoRU family's choices:
the layers (``layers``: every Dense/Conv but the first called and the last), the ``im2col``
layout, the scale ``s = lora_alpha / personal_rank`` (alpha 0: 1), ``down`` Kaiming and ``up``
0 (a zero start), the paper's App. D training (:class:`~jaxfed.algorithms.fedloru.FamilyOptions`),
and BatchNorm statistics kept by each client (no global model then).

- ``schedule=simultaneous``, pFedLoRA(2), the default: both parts train together for
  ``local_epochs``; the paper's better variant (its Table 3: 47.45 against 45.36).
- ``schedule=alternating``, pFedLoRA(1): ``personal_epochs`` on ``tau_k`` with ``sigma`` frozen,
  then ``local_epochs`` on ``sigma`` with ``tau_k`` frozen (pFedLoRU's convention).
"""

from __future__ import annotations

import dataclasses

from jaxfed.algorithms.aggregation import averaging
from jaxfed.algorithms.feddecomp import SCHEDULES, Alternating, Simultaneous, decomposed
from jaxfed.algorithms.fedloru import LAYOUT, FamilyOptions, PFedLoRUOptions, adapted_ranks, lora_scale
from jaxfed.algorithms.fedopt import ServerOptimizerOptions
from jaxfed.algorithms.registry import builtin
from jaxfed.contract import FederatedAlgorithm
from jaxfed.nn import model_template
from jaxfed.options import at_least, non_negative, one_of, option, resolve

PAPER = "FedLoRU paper App. C.4"


@dataclasses.dataclass(frozen=True)
class PFedLoRAOptions(FamilyOptions, ServerOptimizerOptions):
    """pFedLoRA's options: the FedLoRU family's training, layers and server optimizer, the personal
    modules, the schedule."""

    personal_rank: int = option(
        PFedLoRUOptions.personal_rank,
        "rank of the personal LoRA modules (at most each layer's matricized min dim)",
        source="pFedLoRU's personal_rank, so the two compare at equal personal rank",
        check=at_least(1),
    )
    personal_epochs: int = option(
        PFedLoRUOptions.personal_epochs,
        "alternating: epochs on the personal modules each round, before local_epochs on the global model",
        source="pFedLoRU's personal_epochs (the paper gives no split)",
        check=non_negative,
    )
    schedule: str = option(
        "simultaneous",
        "simultaneous (both parts together for local_epochs: pFedLoRA(2), the paper's better one) or "
        "alternating (personal modules, then the global model: pFedLoRA(1))",
        source=PAPER + ", Table 3 (47.45 against 45.36)",
        check=one_of(*SCHEDULES),
    )


def schedule_of(options: PFedLoRAOptions) -> Alternating | Simultaneous:
    """pFedLoRA(2): ``local_epochs`` on both; pFedLoRA(1): ``personal_epochs``, then ``local_epochs``."""
    if options.schedule == "simultaneous":
        return Simultaneous(options.local_epochs)
    return Alternating(options.personal_epochs, options.local_epochs)


def pfedlora(model, options: PFedLoRAOptions | None = None, **overrides) -> FederatedAlgorithm:
    """pFedLoRA: a shared full-rank model plus personal LoRA modules on the family's layers."""
    options = resolve(PFedLoRAOptions, options, overrides)
    template, _ = model_template(model)
    ranks = adapted_ranks(model, template, options.personal_rank, options.layers, field="personal_rank")
    scale = lora_scale(options.personal_rank, options.lora_alpha)
    return decomposed(
        model,
        options,
        ranks=ranks,
        scales=dict.fromkeys(ranks, scale),
        layout=LAYOUT,
        schedule=schedule_of(options),
        aggregation=averaging,
        shared_stats=False,
        name="pfedlora",
        server_optimizer=options.server(),
    )


builtin("pfedlora", PFedLoRAOptions, lambda model, options, config: pfedlora(model, options))
