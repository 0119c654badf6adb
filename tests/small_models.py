"""Small Flax models the tests share, in a file of their own so that a config can name one
(``model=.../small_models.py:BatchNormNet``) as a user names theirs."""

from __future__ import annotations

import flax.linen as nn

from jaxfed.nn.models import Norm


class BatchNormNet(nn.Module):
    """Dense -> BatchNorm -> hidden Dense -> head: BatchNorm statistics are private client state in
    every algorithm that keeps them (FedBN's normalization layers), the hidden layer is one every
    low-rank algorithm adapts; small enough to run every built-in quickly."""

    num_classes: int
    width: int = 16

    @nn.compact
    def __call__(self, x, train=False, mask=None, features=False):
        h = nn.relu(Norm("batch")(nn.Dense(self.width)(x.reshape(x.shape[0], -1)), train, mask))
        h = nn.relu(nn.Dense(self.width, name="hidden")(h))
        return h if features else nn.Dense(self.num_classes, name="head")(h)
