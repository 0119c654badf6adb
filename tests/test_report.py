"""jaxfed report: mean ± std over seeds (numpy's), verdicts against the seeds' spread, the files."""

import json

import numpy as np
import pytest

from jaxfed.cli import main
from jaxfed.report import collect, markdown, verdict, write_report


def _fake_run(directory, seed, final, task="classification"):
    """A finished run directory: config, two metrics rows, a summary ending at ``final``."""
    directory.mkdir(parents=True)
    kind = "mse" if task == "regression" else "acc"
    (directory / "config.json").write_text(json.dumps({"algorithm": "fedavg", "seed": seed}))
    rows = [
        {"round": 5, f"personalized_{kind}_mean": final / 2, "bytes_up_total": 1e6},
        {"round": 10, f"personalized_{kind}_mean": final, "bytes_up_total": 2e6},
    ]
    (directory / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = {"task": task, f"personalized_{kind}_mean": final, f"global_{kind}": final - 0.01, "bytes_up_total": 2e6}
    (directory / "summary.json").write_text(json.dumps(summary))


def _variant(root, name, finals, task="classification"):
    for seed, final in enumerate(finals):
        _fake_run(root / name / f"seed{seed}_lr0.05", seed, final, task)
    return root / name


def test_table_is_the_mean_and_sample_std_over_seeds(tmp_path):
    finals = [0.81, 0.84, 0.80]
    variants = collect({"a": _variant(tmp_path, "a", finals)})
    table = markdown(variants)
    mean, std = np.mean(finals), np.std(finals, ddof=1)
    assert f"| a | 3 | {mean:.4f} ± {std:.4f} |" in table
    assert "0.8100, 0.8400, 0.8000" in table and "2.0 MB" in table


@pytest.mark.parametrize(
    "a, b, outcome",
    [
        ([0.90, 0.91, 0.92], [0.80, 0.81, 0.82], "reproduced"),
        ([0.80, 0.81, 0.82], [0.90, 0.91, 0.92], "not reproduced"),
        ([0.85, 0.80, 0.90], [0.84, 0.79, 0.88], "inconclusive"),
        ([0.95], [0.80, 0.81, 0.82], "inconclusive"),  # one seed: no spread to judge against
    ],
)
def test_verdict_against_two_standard_errors(a, b, outcome):
    result = verdict(a, b)
    spread = [np.var(x, ddof=1) / len(x) if len(x) > 1 else 0.0 for x in (a, b)]  # one seed: no spread
    se = np.sqrt(sum(spread))
    assert result.outcome == outcome
    assert result.difference == pytest.approx(np.mean(a) - np.mean(b))
    assert result.standard_error == pytest.approx(se)


def test_lower_is_better_for_regression(tmp_path):
    low = _variant(tmp_path, "low", [0.01, 0.012, 0.011], "regression")
    high = _variant(tmp_path, "high", [0.5, 0.52, 0.51], "regression")
    table = markdown(collect({"low": low, "high": high}), [("low", "high")])
    assert "personalized mse" in table and "| low > high | +0." in table and "| reproduced |" in table


def test_write_report_writes_the_table_per_seed_files_and_the_plot(tmp_path):
    variants = {"a": _variant(tmp_path, "a", [0.8, 0.82, 0.81]), "b": _variant(tmp_path, "b", [0.7, 0.72, 0.71])}
    files = write_report(variants, tmp_path / "out", ["a>b"])
    assert "| a > b |" in files["md"].read_text()
    records = json.loads(files["json"].read_text())
    assert [(r["variant"], r["seed"]) for r in records] == [("a", 0), ("a", 1), ("a", 2), ("b", 0), ("b", 1), ("b", 2)]
    assert len(files["csv"].read_text().splitlines()) == 7 and files["png"].stat().st_size > 0


@pytest.mark.parametrize(
    "args, expected",
    [
        (["{empty}"], "holds no finished run"),
        (["{a}", "--claim", "a"], "--claim: expected 'VARIANT>VARIANT', got 'a'"),
        (["{a}", "--claim", "a>zzz"], "--claim: unknown variant 'zzz'"),
    ],
)
def test_report_mistakes_are_one_line(args, expected, tmp_path, capsys):
    paths = {"{empty}": str(tmp_path / "empty"), "{a}": f"a={_variant(tmp_path, 'a', [0.8, 0.81])}"}
    (tmp_path / "empty").mkdir()
    assert main(["report", *[paths.get(x, x) for x in args], "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and expected in err
