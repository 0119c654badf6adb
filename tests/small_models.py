"""Small Flax models the tests share, in a file of their own so that a config can name one
(``model=.../small_models.py:BatchNormNet``) as a user names theirs."""

from __future__ import annotations

import flax.linen as nn

from jaxfed.nn.conv import max_pool_2x2
from jaxfed.nn.models import HtCNN, Norm


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


class TinyHtCNN(HtCNN):
    """Yi et al.'s heterogeneous CNN shrunk for 8x8 digits (3x3 SAME convs of 4 and 8 filters,
    Dense 24 and 12): the largest of a family of tier models that nest in it."""

    channels: tuple = (4, 8)
    hidden: tuple = (24, 12)
    kernel: int = 3
    padding: str = "SAME"


class TinyHtCNNNarrowConv(TinyHtCNN):
    """conv2 with half the filters (the flattened conv output feeding fc1 narrows: htcnn2's change)."""

    channels: tuple = (4, 4)


class TinyHtCNNNarrowDense(TinyHtCNN):
    """fc1 a third as wide (htcnn3..htcnn5's change)."""

    hidden: tuple = (8, 12)


class TinyHtCNNFewerFeatures(TinyHtCNN):
    """fc2 narrower: the head gets 6 features instead of 12."""

    hidden: tuple = (24, 6)


class SigmoidNet(nn.Module):
    """A Dense of ``width`` sigmoid units then the head: a padded unit outputs 0.5, not 0."""

    num_classes: int
    width: int = 16

    @nn.compact
    def __call__(self, x, train=False, mask=None, features=False):
        h = nn.sigmoid(nn.Dense(self.width, name="hidden")(x.reshape(x.shape[0], -1)))
        return h if features else nn.Dense(self.num_classes, name="head")(h)


class NarrowSigmoidNet(SigmoidNet):
    width: int = 8


class TinyNormCNN(nn.Module):
    """Two 3x3 convs (``channels``), each followed by jaxfed's ``Norm`` (``norm``: batch or group)
    and ReLU and 2x2 max-pool, then a ReLU Dense ``fc1`` and the head: tier models with norm layers."""

    num_classes: int
    channels: tuple = (4, 8)
    norm: str = "batch"

    @nn.compact
    def __call__(self, x, train=False, mask=None, features=False):
        h = x
        for i, width in enumerate(self.channels):
            h = nn.Conv(width, (3, 3), name=f"conv{i + 1}")(h)
            h = max_pool_2x2(nn.relu(Norm(self.norm, name=f"norm{i + 1}")(h, train, mask)))
        h = nn.relu(nn.Dense(12, name="fc1")(h.reshape(h.shape[0], -1)))
        return h if features else nn.Dense(self.num_classes, name="head")(h)


class TinyNormCNNNarrow(TinyNormCNN):
    channels: tuple = (4, 4)


class TinyGroupNormCNN(TinyNormCNN):
    norm: str = "group"


class TinyGroupNormCNNNarrow(TinyGroupNormCNN):
    channels: tuple = (4, 4)
