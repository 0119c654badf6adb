"""The Fashion-MNIST model of FedCSPACK's authors' code (their ``CNNMNIST_BIG``), as a user's Flax
module: ``model=experiments/fedcspack/models.py:AuthorsFMNISTCNN``.

Two 5x5 VALID convolutions (10 and 20 filters), each max-pooled 2x2 then ReLU, the second after a
channel dropout (torch's ``Dropout2d``, p 0.5); Dense 320 -> 256, ReLU, dropout 0.5; Dense 256 ->
50 with no activation; the head 50 -> classes. 100,816 parameters (99 packs of 1024), against the
582,026 of jaxfed's ``cnn``. Flax's initializers (LeCun normal kernels, zero biases); the flattened
features are read height, width, channel (torch: channel first), a fixed permutation of ``fc1``'s
rows. ``AuthorsFMNISTCNNTorchInit`` is the same model with torch's default initialization:
every kernel and bias uniform in ``±1/sqrt(fan_in)`` (``kaiming_uniform_(a=sqrt(5))`` and the
bias rule of ``nn.Conv2d`` / ``nn.Linear``)."""

from __future__ import annotations

import math

import flax.linen as nn
import jax

from jaxfed.nn.conv import Conv, max_pool_2x2


def torch_uniform(fan_in: int):
    """torch's default initializer of a layer with ``fan_in`` inputs per output: uniform in ``±1/sqrt(fan_in)``."""
    bound = 1 / math.sqrt(fan_in)
    return lambda key, shape, dtype=jax.numpy.float32: jax.random.uniform(key, shape, dtype, -bound, bound)


class AuthorsFMNISTCNN(nn.Module):
    num_classes: int = 10
    torch_init: bool = False

    def inits(self, fan_in: int) -> dict:
        """The layer's ``kernel_init`` and ``bias_init``: torch's with ``torch_init``, else Flax's defaults."""
        return {"kernel_init": torch_uniform(fan_in), "bias_init": torch_uniform(fan_in)} if self.torch_init else {}

    @nn.compact
    def __call__(self, x, train: bool = False, features: bool = False):
        h = nn.relu(max_pool_2x2(Conv(10, (5, 5), padding="VALID", name="conv1", **self.inits(25 * x.shape[-1]))(x)))
        h = Conv(20, (5, 5), padding="VALID", name="conv2", **self.inits(25 * 10))(h)
        h = nn.Dropout(0.5, broadcast_dims=(1, 2), deterministic=not train)(h)  # whole channels
        h = nn.relu(max_pool_2x2(h))
        h = h.reshape(h.shape[0], -1)
        h = nn.relu(nn.Dense(256, name="fc1", **self.inits(h.shape[-1]))(h))
        h = nn.Dropout(0.5, deterministic=not train)(h)
        h = nn.Dense(50, name="fc2", **self.inits(256))(h)
        return h if features else nn.Dense(self.num_classes, name="head", **self.inits(50))(h)


class AuthorsFMNISTCNNTorchInit(AuthorsFMNISTCNN):
    torch_init: bool = True
