"""jaxfed bench: the harness's bookkeeping against numbers written out, and a tiny end-to-end run."""

import json

import numpy as np
import pytest

from jaxfed.bench import examples_per_round, useful_step_fraction, workload_config
from jaxfed.cli import main
from jaxfed.experiment import build

TINY_W2 = ["num_clients=40", "participation=0.25", "client_train_size=40", "rounds_per_call=1"]


def test_examples_and_useful_steps_follow_the_sampled_clients():
    config = workload_config("w2", [*TINY_W2, "partition=dirichlet", "alpha=0.3", "min_examples=5"])
    sim = build(config).simulation
    counts = np.asarray(sim.data.train_count)
    examples, fractions = [], []
    for t in range(3):
        n = counts[sim.sampled_ids(t)]
        examples.append(((n // 32) * 32).sum())  # w2 drops the last partial batch
        steps = n // 32
        fractions.append(steps.sum() / (steps.max() * len(steps)))
    assert examples_per_round(sim, config, range(3)) == pytest.approx(np.mean(examples))
    assert useful_step_fraction(sim, config, range(3)) == pytest.approx(np.mean(fractions))


def test_bench_runs_a_small_workload_and_reports_every_measure(tmp_path, capsys):
    out = tmp_path / "bench.json"
    args = ["bench", "w2", "--rounds", "2", "--baseline", "none", "--json", str(out)]
    assert main([*args, *(x for pair in TINY_W2 for x in ("--set", pair))]) == 0
    result = json.loads(out.read_text())
    for key in ("compile_seconds", "round_seconds_median", "examples_per_second", "achieved_gflops",
                "matmul_peak_gflops", "eval_all_clients_seconds", "host_peak_rss_bytes"):  # fmt: skip
        assert result[key] > 0, key
    assert result["examples_per_round"] == 10 * 32  # 10 clients of 40 examples, one full batch each
    assert "s/round" in capsys.readouterr().out


def test_bench_refuses_the_torch_baseline_for_other_algorithms(capsys):
    assert main(["bench", "w2", "--set", "algorithm=fedprox", "--baseline", "torch", *("--set", TINY_W2[0])]) == 2
    assert "--baseline: torch runs fedavg only" in capsys.readouterr().err
