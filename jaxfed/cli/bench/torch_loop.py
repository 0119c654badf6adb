"""The baseline a researcher would write in PyTorch: a per-client loop, a model copy per client.

The way PFLlib, FL-bench and Flower clients train: each sampled client deep-copies the global
model, runs its local epochs of SGD over its own shuffled minibatches, and the server averages
the copies' weights by sample count. It trains on exactly the examples jaxfed's partition gives
each client, and the clients jaxfed's sampler draws each round. Torch is imported here only;
it is a benchmark extra, never a jaxfed dependency (``pip install torch``).
"""

from __future__ import annotations

import copy
import os
import statistics
import time

import jax
import numpy as np

from jaxfed.errors import ConfigError


def require_torch():
    """The ``torch`` module, or a one-line ConfigError saying how to get it."""
    try:
        import torch
    except ImportError:
        raise ConfigError(
            "--baseline: torch needs PyTorch (pip install -e '.[bench]', or pip install torch); or pass --baseline none"
        ) from None
    return torch


TWINS = ("cnn", "mlp", "resnet8")  # the jaxfed models torch_model builds


def torch_model(name: str, input_shape, num_classes: int, hidden=(200, 200), norm: str = "group"):
    """The jaxfed model ``name`` (``cnn``, ``mlp`` or ``resnet8`` with ``norm``) in PyTorch,
    channels first."""
    torch = require_torch()
    nn = torch.nn
    if name == "cnn":
        h, w, c = input_shape
        flat = 64 * ((((h - 4) // 2) - 4) // 2) * ((((w - 4) // 2) - 4) // 2)
        return nn.Sequential(
            nn.Conv2d(c, 32, 5), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 5), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(flat, 512), nn.ReLU(), nn.Linear(512, num_classes),
        )  # fmt: skip
    if name == "mlp":
        layers, width = [nn.Flatten()], int(np.prod(input_shape))
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        return nn.Sequential(*layers, nn.Linear(width, num_classes))
    if name == "resnet8":
        return _resnet8(torch, input_shape[-1], num_classes, norm)
    raise SystemExit(f"jaxfed bench: no PyTorch twin of model '{name}' ({', '.join(TWINS)})")


def _resnet8(torch, channels: int, num_classes: int, norm: str):
    """jaxfed's ``resnet8`` (:class:`jaxfed.nn.models.ResNet`, widths 16, 32, 64, one basic block
    a stage) with its submodules named as its parameters are (``stem``, ``layer2_0.shortcut``, ...)."""
    nn, functional = torch.nn, torch.nn.functional

    class SameConv(nn.Conv2d):
        def __init__(self, cin, cout, kernel, stride=1):
            super().__init__(cin, cout, kernel, stride, padding=0, bias=False)

        def forward(self, x):  # XLA's SAME: the odd pad goes high (torch's padding=1 pads both sides)
            (top, bottom), (left, right) = jax.lax.padtype_to_pads(x.shape[2:], self.kernel_size, self.stride, "SAME")
            return super().forward(functional.pad(x, (left, right, top, bottom)))

    def make_norm(width):  # flax's GroupNorm (epsilon 1e-6) / BatchNorm (momentum 0.9 = torch's 0.1)
        return nn.GroupNorm(min(2, width), width, eps=1e-6) if norm == "group" else nn.BatchNorm2d(width, eps=1e-5)

    class Block(nn.Module):
        def __init__(self, cin, width, stride):
            super().__init__()
            self.conv1, self.norm1 = SameConv(cin, width, 3, stride), make_norm(width)
            self.conv2, self.norm2 = SameConv(width, width, 3), make_norm(width)
            self.shortcut = self.shortcut_norm = None
            if stride != 1 or cin != width:
                self.shortcut, self.shortcut_norm = SameConv(cin, width, 1, stride), make_norm(width)

        def forward(self, x):
            h = functional.relu(self.norm1(self.conv1(x)))
            h = self.norm2(self.conv2(h))
            if self.shortcut is not None:
                x = self.shortcut_norm(self.shortcut(x))
            return functional.relu(h + x)

    class ResNet8(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem, self.stem_norm = SameConv(channels, 16, 3), make_norm(16)
            self.layer1_0, self.layer2_0, self.layer3_0 = Block(16, 16, 1), Block(16, 32, 2), Block(32, 64, 2)
            self.head = nn.Linear(64, num_classes)

        def forward(self, x):
            h = functional.relu(self.stem_norm(self.stem(x)))
            h = self.layer3_0(self.layer2_0(self.layer1_0(h)))
            return self.head(h.mean(dim=(2, 3)))

    return ResNet8()


def copy_jax_params(module, params) -> None:
    """Load a jaxfed model's parameter tree into its PyTorch twin, so both start from the same
    weights (kernels HWIO -> OIHW, Dense [in, out] -> [out, in]; ``cnn`` / ``mlp``: the first
    Dense after the convolutions re-ordered from NHWC to NCHW flattening; ``resnet8``: by name,
    norms' ``scale`` to ``weight``)."""
    torch = require_torch()
    if not isinstance(module, torch.nn.Sequential):
        _copy_by_name(torch, module, params)
        return
    weighted = [m for m in module if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear))]
    layers = [params[name] for name in sorted(params, key=_layer_order)]
    if len(layers) != len(weighted):
        raise SystemExit(f"jaxfed bench: {len(layers)} jaxfed layers for {len(weighted)} torch layers")
    conv_out = None
    for layer, (torch_layer, p) in enumerate(zip(weighted, layers)):
        kernel = np.asarray(p["kernel"], np.float32)
        if kernel.ndim == 4:
            weight = kernel.transpose(3, 2, 0, 1)
            conv_out = kernel.shape[3]
        elif conv_out is not None and layer > 0 and isinstance(weighted[layer - 1], torch.nn.Conv2d):
            side = int(round((kernel.shape[0] / conv_out) ** 0.5))  # [h*w*c, out] -> [c*h*w, out]
            weight = kernel.reshape(side, side, conv_out, -1).transpose(2, 0, 1, 3).reshape(kernel.shape[0], -1).T
        else:
            weight = kernel.T
        with torch.no_grad():
            torch_layer.weight.copy_(torch.from_numpy(np.ascontiguousarray(weight)))
            torch_layer.bias.copy_(torch.from_numpy(np.array(p["bias"], np.float32)))


def _copy_by_name(torch, module, params) -> None:
    """Each torch submodule with weights from the jaxfed layer of the same path."""
    for path, sub in module.named_modules():
        if not isinstance(sub, (torch.nn.Conv2d, torch.nn.Linear, torch.nn.GroupNorm, torch.nn.BatchNorm2d)):
            continue
        layer = params
        for part in path.split("."):
            layer = layer[part]
        if isinstance(sub, (torch.nn.GroupNorm, torch.nn.BatchNorm2d)):
            (layer,) = layer.values()  # jaxfed's Norm holds the flax GroupNorm / BatchNorm
            weight = np.asarray(layer["scale"], np.float32)
        else:
            kernel = np.asarray(layer["kernel"], np.float32)
            weight = kernel.transpose(3, 2, 0, 1) if kernel.ndim == 4 else kernel.T
        with torch.no_grad():
            sub.weight.copy_(torch.from_numpy(np.array(weight)))
            if sub.bias is not None:
                sub.bias.copy_(torch.from_numpy(np.array(layer["bias"], np.float32)))


def _layer_order(name: str):
    """conv1, conv2, fc1, fc2, ..., head: the order the layers run in."""
    kind = 0 if name.startswith("conv") else 2 if name == "head" else 1
    digits = "".join(ch for ch in name if ch.isdigit())
    return kind, int(digits or 0)


def _channels_first(x: np.ndarray):
    x = np.asarray(x)
    return require_torch().from_numpy(np.array(np.moveaxis(x, -1, 1) if x.ndim == 4 else x))  # a writable copy


def cpu_threads() -> int:
    """The CPU cores this process may run on (its affinity; a container's share, not the host's
    count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def torch_device(name: str = "auto"):
    """The device the loop runs on: ``auto`` is the accelerator JAX runs on where PyTorch sees one
    too (CUDA), else the CPU."""
    torch = require_torch()
    if name == "auto":
        import jax

        name = "cuda" if jax.devices()[0].platform == "gpu" and torch.cuda.is_available() else "cpu"
    return torch.device(name)


def fedavg_rounds(sim, config, rounds: int, hidden=(200, 200), initial_params=None, device: str = "auto") -> dict:
    """FedAvg for ``rounds`` rounds on ``sim``'s data and sampled clients (from jaxfed's initial
    weights ``initial_params`` when given), on ``device`` (:func:`torch_device`: the accelerator
    JAX uses when PyTorch has it); median round seconds, the global model's pooled test accuracy
    after the last round, and the seconds to evaluate it on every client's test split one client
    at a time."""
    torch = require_torch()
    torch.set_num_threads(cpu_threads())
    torch.manual_seed(config.seed)
    device = torch_device(device)
    data = sim.data
    x_train = _channels_first(data.x_train).to(device)
    y_train = torch.from_numpy(np.array(data.y_train)).long().to(device)
    x_test = _channels_first(data.x_test).to(device)
    y_test = torch.from_numpy(np.array(data.y_test)).long().to(device)
    train_idx, train_count = np.asarray(data.train_idx), np.asarray(data.train_count)
    test_idx, test_count = np.asarray(data.test_idx), np.asarray(data.test_count)
    global_model = torch_model(sim.model.name, data.x_train.shape[1:], data.num_classes, hidden, config.norm)
    if initial_params is not None:
        copy_jax_params(global_model, initial_params)
    global_model = global_model.to(device)

    def synchronized():
        if device.type == "cuda":
            torch.cuda.synchronize()

    loss_fn = torch.nn.CrossEntropyLoss()
    generator = torch.Generator().manual_seed(config.seed)

    def train_client(k):
        local = copy.deepcopy(global_model)
        optimizer = torch.optim.SGD(local.parameters(), lr=config.options.lr, momentum=config.options.momentum)
        own = torch.from_numpy(train_idx[k, : train_count[k]].astype(np.int64))
        for _ in range(config.options.local_epochs):
            order = own[torch.randperm(len(own), generator=generator)].to(device)
            for start in range(0, len(order), config.options.batch_size):
                batch = order[start : start + config.options.batch_size]
                if config.options.drop_last and len(batch) < config.options.batch_size:
                    break
                optimizer.zero_grad()
                loss_fn(local(x_train[batch]), y_train[batch]).backward()
                optimizer.step()
        return local.state_dict()

    times = []
    cohorts = [sim.sampled_ids(t) for t in range(rounds)]  # JAX's sampling, drawn before the clock runs
    for ids in cohorts:
        tick = time.perf_counter()
        weights = train_count[ids].astype(np.float64) / train_count[ids].sum()
        total = None
        with torch.enable_grad():
            for k, w in zip(ids, weights):
                state = train_client(int(k))
                scaled = {name: w * v.double() for name, v in state.items()}
                total = scaled if total is None else {name: total[name] + scaled[name] for name in total}
        global_model.load_state_dict({name: v.float() for name, v in total.items()})
        synchronized()
        times.append(time.perf_counter() - tick)

    global_model.eval()
    with torch.no_grad():
        accuracy = float((global_model(x_test).argmax(1) == y_test).float().mean())
        tick = time.perf_counter()
        for k in range(sim.num_clients):  # every client's own test split, one client at a time
            own = torch.from_numpy(test_idx[k, : test_count[k]].astype(np.int64)).to(device)
            if len(own):
                (global_model(x_test[own]).argmax(1) == y_test[own]).float().mean()
        synchronized()
        eval_seconds = time.perf_counter() - tick
    return {
        "device": str(device),
        "threads": torch.get_num_threads(),
        "round_seconds_median": statistics.median(times),
        "global_acc": accuracy,
        "eval_all_clients_seconds": eval_seconds,
    }
