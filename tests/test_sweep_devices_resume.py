"""A sweep on several devices, interrupted and resumed, goes on as the sweep left alone (restored
states were committed to one device and clashed with the mesh)."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

# A sweep interrupted and resumed on 4 host devices (host_devices=4 must be set before JAX starts:
# a subprocess) goes on bit for bit as the sweep left alone.
SWEEP_RESUME_ON_DEVICES = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    from jaxfed.runs.config import Config
    from jaxfed.runs.sweep import run_grid, sweep_configs

    out = Path(sys.argv[1])
    keys = ["host_devices=4", "num_clients=8", "local_epochs=1", "eval_every=1", "rounds_per_call=1",
            "checkpoint_every=1", "participation=0.5", "member_chunk=0", "client_chunk=1"]
    quiet = dict(progress=False, log=lambda m: None)
    configs = lambda rounds: sweep_configs(Config().with_overrides([*keys, f"rounds={rounds}"]), seeds=[0, 1])
    run_grid(configs(3), out / "whole", **quiet)
    run_grid(configs(1), out / "resumed", **quiet)  # stopped after its first round
    run_grid(configs(3), out / "resumed", resume=True, **quiet)
    rows = lambda d: [{k: v for k, v in json.loads(line).items() if not k.endswith("_seconds")}
                      for line in (d / "metrics.jsonl").read_text().splitlines()]
    for member in ("seed0_lr0.05", "seed1_lr0.05"):
        assert rows(out / "whole" / member) == rows(out / "resumed" / member), member
    print("same rows")
    """
)


@pytest.mark.slow  # a multi-process campaign (README: Run the tests)
def test_a_sweep_on_several_devices_resumes_as_it_runs_left_alone(tmp_path):
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    env = dict(os.environ, XLA_FLAGS=" ".join(flags), JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, "-c", SWEEP_RESUME_ON_DEVICES, str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "same rows"
    assert json.loads((tmp_path / "resumed" / "seed1_lr0.05" / "summary.json").read_text())["rounds"] == 3
