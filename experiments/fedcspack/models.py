"""The Fashion-MNIST model of FedCSPACK's authors' code (their ``CNNMNIST_BIG``), as a user's Flax
module: ``model=experiments/fedcspack/models.py:AuthorsFMNISTCNN``.

Two 5x5 VALID convolutions (10 and 20 filters), each max-pooled 2x2 then ReLU, the second after a
channel dropout (torch's ``Dropout2d``, p 0.5); Dense 320 -> 256, ReLU, dropout 0.5; Dense 256 ->
50 with no activation; the head 50 -> classes. 100,816 parameters (99 packs of 1024), against the
582,026 of jaxfed's ``cnn``. Flax's initializers, not torch's; the flattened features are read
height, width, channel (torch: channel first), a fixed permutation of ``fc1``'s rows."""

from __future__ import annotations

import flax.linen as nn

from jaxfed.nn.conv import Conv, max_pool_2x2


class AuthorsFMNISTCNN(nn.Module):
    num_classes: int = 10

    @nn.compact
    def __call__(self, x, train: bool = False, features: bool = False):
        h = nn.relu(max_pool_2x2(Conv(10, (5, 5), padding="VALID", name="conv1")(x)))
        h = Conv(20, (5, 5), padding="VALID", name="conv2")(h)
        h = nn.Dropout(0.5, broadcast_dims=(1, 2), deterministic=not train)(h)  # whole channels
        h = nn.relu(max_pool_2x2(h))
        h = nn.relu(nn.Dense(256, name="fc1")(h.reshape(h.shape[0], -1)))
        h = nn.Dropout(0.5, deterministic=not train)(h)
        h = nn.Dense(50, name="fc2")(h)
        return h if features else nn.Dense(self.num_classes, name="head")(h)
