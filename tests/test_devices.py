"""1 device vs 4 forced CPU devices: the same numbers to float tolerance (subprocesses)."""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import jax, numpy as np
    from jaxfed.config import Config
    from jaxfed.experiment import build

    devices, out = int(sys.argv[1]), sys.argv[2]
    assert len(jax.devices()) == 4, jax.devices()
    arrays, infos = {}, {}
    for algorithm in ("fedavg",):
        config = Config(algorithm=algorithm, num_clients=10, participation=0.5, local_epochs=1, devices=devices)
        sim = build(config).simulation
        state, metrics = sim.run_rounds(sim.init(), 3)
        leaves = jax.tree.leaves(state.server) + jax.tree.leaves(state.clients)
        arrays.update({f"{algorithm}_{i}": np.asarray(x) for i, x in enumerate(leaves)})
        arrays[f"{algorithm}_loss"] = np.asarray(metrics["train_loss"])
        infos[algorithm] = {"devices": sim.num_devices, "sharded": sim.mesh is not None, **sim.evaluate(state)}
    np.savez(out, **arrays)
    print(json.dumps(infos))
    """
)


def _run_together(tmp_path, device_counts):
    """The script with each device count, as concurrent subprocesses: ``[(info, arrays)]``."""
    flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    env = dict(os.environ, XLA_FLAGS=flags.strip(), JAX_PLATFORMS="cpu")
    outs = [tmp_path / f"devices_{n}.npz" for n in device_counts]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", SCRIPT, str(n), str(out)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for n, out in zip(device_counts, outs)
    ]
    results = []
    for proc, out in zip(procs, outs):
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr[-3000:]
        with np.load(out) as f:
            results.append((json.loads(stdout.strip().splitlines()[-1]), {k: f[k] for k in f.files}))
    return results


@pytest.mark.slow
def test_one_vs_four_devices(tmp_path):
    (one_info, one), (four_info, four) = _run_together(tmp_path, (1, 4))
    assert one.keys() == four.keys()
    for key in one:
        np.testing.assert_allclose(one[key], four[key], rtol=2e-4, atol=2e-5, err_msg=key)
    for algorithm in ("fedavg",):
        assert (one_info[algorithm]["devices"], one_info[algorithm]["sharded"]) == (1, False)
        # 5 sampled clients padded to 8 over 4 devices
        assert (four_info[algorithm]["devices"], four_info[algorithm]["sharded"]) == (4, True)
        acc_one, acc_four = one_info[algorithm]["personalized_acc_mean"], four_info[algorithm]["personalized_acc_mean"]
        assert acc_one == pytest.approx(acc_four, abs=0.01)
