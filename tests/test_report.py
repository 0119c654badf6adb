"""jaxfed report: mean ± std over seeds (numpy's), verdicts against the seeds' spread, the files."""

import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from jaxfed.cli import main
from jaxfed.cli.report import Claim, collect, markdown, paired_standard_error, parse_claim, verdict, write_report
from jaxfed.errors import ConfigError


def _fake_run(directory, seed, final, task="classification", upload=2e6, cached=None, **config):
    """A finished run directory: config (``config`` over fedavg, 10 rounds, lr 0.05), two metrics
    rows, a summary ending at ``final`` (total traffic with clients caching: ``cached``, or all of it)."""
    directory.mkdir(parents=True)
    kind = "mse" if task == "regression" else "acc"
    run_config = {"algorithm": "fedavg", "seed": seed, "rounds": 10, "options": {"lr": 0.05}, **config}
    (directory / "config.json").write_text(json.dumps(run_config))
    rows = [
        {"round": 5, f"personalized_{kind}_mean": final / 2, "bytes_up_total": 1e6},
        {"round": 10, f"personalized_{kind}_mean": final, "bytes_up_total": 2e6},
    ]
    (directory / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = {
        "task": task,
        f"personalized_{kind}_mean": final,
        f"global_{kind}": final - 0.01,
        "bytes_up_total": upload,
        "bytes_total": 3 * upload,
        "bytes_total_cached": 3 * upload if cached is None else cached,
    }
    (directory / "summary.json").write_text(json.dumps(summary))


def _variant(root, name, finals, task="classification", upload=2e6, cached=None):
    for seed, final in enumerate(finals):
        _fake_run(root / name / f"seed{seed}_lr0.05", seed, final, task, upload, cached)
    return root / name


def test_table_is_the_mean_and_sample_std_over_seeds(tmp_path):
    finals = [0.81, 0.84, 0.80]
    variants = collect({"a": _variant(tmp_path, "a", finals)})
    table = markdown(variants)
    mean, std = np.mean(finals), np.std(finals, ddof=1)
    assert f"| a | 3 | {mean:.4f} ± {std:.4f} |" in table
    assert "0.8100, 0.8400, 0.8000" in table and "2.0 MB" in table
    one = markdown(collect({"b": _variant(tmp_path, "b", [0.8])}))
    assert "| b | 1 | 0.8000 | 0.7900 |" in one  # one seed has no spread to show


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


@pytest.mark.parametrize(
    "text, claim",
    [
        ("a>b", Claim("a", "b")),
        (" fedloru > fedavg-0.03 ", Claim("fedloru", "fedavg", 0.03)),
        ("floral>floral_oracle-.02", Claim("floral", "floral_oracle", 0.02)),
        ("x-1>y", Claim("x-1", "y")),
    ],
)
def test_claims_parse_with_an_optional_margin(text, claim):
    assert parse_claim(text) == claim


def test_a_margin_claim_is_judged_on_the_difference_plus_the_margin():
    a, b = [0.95, 0.96, 0.955], [0.97, 0.975, 0.972]  # A about 0.017 below B, spread about 0.003
    se = np.sqrt(np.var(a, ddof=1) / 3 + np.var(b, ddof=1) / 3)
    assert verdict(a, b).outcome == "not reproduced"
    within = verdict(a, b, margin=0.03)
    assert within.difference == pytest.approx(np.mean(a) - np.mean(b) + 0.03) and within.outcome == "reproduced"
    assert within.standard_error == pytest.approx(se)
    assert verdict(a, b, margin=0.017).outcome == "inconclusive"


def test_paper_numbers_and_traffic_relative_to_a_variant(tmp_path):
    variants = collect(
        {"fedcspack": _variant(tmp_path, "s", [0.9, 0.91], upload=1e6), "fedavg": _variant(tmp_path, "f", [0.88, 0.87])}
    )
    table = markdown(variants, [parse_claim("fedcspack>fedavg")], {"fedavg": "84.39"}, relative_to="fedavg")
    lines = table.splitlines()
    assert lines[0] == "personalized_acc_mean after each run's last round (summary.json); rounds 10"
    assert lines[2].startswith("| variant | seeds | personalized acc (mean ± std) | paper | global acc | uploaded |")
    assert "| fedavg | 2 | 0.8750 ± 0.0071 | 84.39 | 0.8650 ± 0.0071 | 2.0 MB (1.000) | 6.0 MB (1.000) |" in table
    assert "| fedcspack | 2 | 0.9050 ± 0.0071 |  | 0.8950 ± 0.0071 | 1.0 MB (0.500) | 3.0 MB (0.500) |" in table
    assert "| fedcspack > fedavg | +0.0300 |" in table


def test_per_seed_values_are_in_seed_order_and_nan_is_null(tmp_path):
    """The per-seed cell runs in seed order (not the directories' names: seed10 before seed2); a
    NaN a summary.json holds (JSON readers take it) is a null: its claims are not judged."""
    for seed, final in ((2, 0.5), (10, 0.9), (3, 0.7)):
        _fake_run(tmp_path / "a" / f"seed{seed}_lr0.05", seed, final)
    table = markdown(collect({"a": tmp_path / "a"}))
    assert "| 0.5000, 0.7000, 0.9000 |" in table
    nan = _variant(tmp_path, "nan", [0.8, 0.7])
    summary = nan / "seed1_lr0.05" / "summary.json"
    summary.write_text(summary.read_text().replace('"personalized_acc_mean": 0.7', '"personalized_acc_mean": NaN'))
    other = _variant(tmp_path, "b", [0.6, 0.5])
    table = markdown(collect({"nan": nan, "b": other}), [parse_claim("nan>b")])
    assert "| nan > b | n/a | n/a | not judged: a run's personalized_acc_mean is null (not finite) | n/a |" in table
    assert "0.8000, null" in table


def test_traffic_relative_to_a_variant_that_sent_nothing_says_so(tmp_path):
    variants = collect({"a": _variant(tmp_path, "a", [0.8, 0.7]), "z": _variant(tmp_path, "z", [0.6], upload=0.0)})
    table = markdown(variants, relative_to="z")
    assert "z sent nothing: no fractions of its traffic." in table and "the fraction of" not in table


def test_traffic_with_clients_caching_is_a_column_only_where_it_differs(tmp_path):
    plain = {"fedavg": _variant(tmp_path, "f", [0.88, 0.87])}
    assert "caching" not in markdown(collect(plain), relative_to="fedavg")
    cached = {**plain, "fedloru": _variant(tmp_path, "l", [0.86, 0.87], upload=1e6, cached=1.5e6)}
    table = markdown(collect(cached), relative_to="fedavg")
    assert "| uploaded | total traffic | total traffic, clients caching | per seed (in seed order) |" in table
    assert "| 2.0 MB (1.000) | 6.0 MB (1.000) | 6.0 MB (1.000) |" in table
    assert "| 1.0 MB (0.500) | 3.0 MB (0.500) | 1.5 MB (0.250) |" in table


def test_lower_is_better_for_regression(tmp_path):
    low = _variant(tmp_path, "low", [0.01, 0.012, 0.011], "regression")
    high = _variant(tmp_path, "high", [0.5, 0.52, 0.51], "regression")
    table = markdown(collect({"low": low, "high": high}), [Claim("low", "high")])
    assert "personalized mse" in table and "| low > high | +0." in table and "| reproduced |" in table


def test_write_report_writes_the_table_per_seed_files_and_the_plot(tmp_path):
    variants = {"a": _variant(tmp_path, "a", [0.8, 0.82, 0.81]), "b": _variant(tmp_path, "b", [0.7, 0.72, 0.71])}
    files = write_report(variants, tmp_path / "out", ["a>b"])
    assert "| a > b |" in files["md"].read_text()
    records = json.loads(files["json"].read_text())
    assert [(r["variant"], r["seed"]) for r in records] == [("a", 0), ("a", 1), ("a", 2), ("b", 0), ("b", 1), ("b", 2)]
    assert len(files["csv"].read_text().splitlines()) == 7 and files["png"].stat().st_size > 0


def test_a_report_names_its_setting_and_what_it_left_out(tmp_path):
    """report.md's first line: the setting's keys, each variant's value where they differ; the
    log: a sweep's member without summary.json (still running, or stopped) and different datasets."""
    _fake_run(tmp_path / "a" / "seed0", 0, 0.8, dataset="digits", alpha=0.1, model="")
    _fake_run(tmp_path / "a" / "seed1", 1, 0.82, dataset="digits", alpha=0.1, model="")
    (tmp_path / "a" / "seed2").mkdir()
    (tmp_path / "a" / "seed2" / "config.json").write_text("{}")  # started, no summary yet
    _fake_run(tmp_path / "b" / "seed0", 0, 0.7, dataset="mnist", alpha=0.1, model="")
    notes = []
    files = write_report({"a": tmp_path / "a", "b": tmp_path / "b"}, tmp_path / "out", log=notes.append)
    first = files["md"].read_text().splitlines()[0]
    setting = "dataset digits (a) / mnist (b); model default; alpha 0.1; rounds 10"
    assert first == f"personalized_acc_mean after each run's last round (summary.json); {setting}"
    assert notes == [
        "report: a: 1 unfinished run(s) left out (no summary.json): seed2",
        "report: the variants ran on different datasets (report.md's first line says which); verdicts compare them",
    ]


@pytest.mark.parametrize(
    "args, expected",
    [
        (["{empty}"], "holds no finished run"),
        (["{a}", "--claim", "a"], "--claim: expected 'VARIANT>VARIANT' or 'VARIANT>VARIANT-MARGIN', got 'a'"),
        (["{a}", "--claim", "a>zzz"], "--claim: unknown variant 'zzz'"),
        (["{a}", "--paper", "a"], "--paper: expected 'VARIANT=NUMBER', got 'a'"),
        (["{a}", "--paper", "b=0.9"], "--paper: unknown variant 'b'"),
        (["{a}", "--relative-to", "fedavg"], "--relative-to: unknown variant 'fedavg'"),
        (["{a}", "--claim", "a>a-3"], "--claim 'a > a − 3': the margin is in accuracy's units, a fraction (0.03 is 3"),
        (["{a}", "--claim", "a>=a"], "--claim: 'a>=a': write 'A>B'"),
    ],
)
def test_report_mistakes_are_one_line(args, expected, tmp_path, capsys):
    paths = {"{empty}": str(tmp_path / "empty"), "{a}": f"a={_variant(tmp_path, 'a', [0.8, 0.81])}"}
    (tmp_path / "empty").mkdir()
    assert main(["report", *[paths.get(x, x) for x in args], "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and expected in err


def test_experiment_scripts_report_finished_variants_and_drop_what_names_the_rest(tmp_path):
    """experiments/lib.sh report_variants: claims and options naming a variant that did not
    finish are left out with a note, the rest reach jaxfed report."""
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    if shutil.which("bash") is None:
        pytest.skip("bash is not installed")
    _variant(tmp_path, "fedavg", [0.80, 0.81, 0.82])
    _variant(tmp_path, "fedloru", [0.79, 0.80, 0.81], upload=5e5)
    (tmp_path / "fedlora").mkdir()  # started, never finished
    lib = Path(__file__).parents[1] / "experiments" / "lib.sh"
    script = (
        f"source {lib}; report_variants {tmp_path} 'fedloru>fedavg-0.05' 'fedloru>fedlora' "
        "--paper=fedavg=84.39 --paper=fedlora=80.0 --relative-to=fedavg"
    )
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    table = (tmp_path / "report" / "report.md").read_text()
    assert "| fedloru > fedavg − 0.05 | +0.0400 |" in table and "reproduced" in table
    assert "| fedavg | 3 | 0.8100 ± 0.0100 | 84.39 |" in table and "500.0 KB (0.250)" in table
    assert "fedlora" not in table.replace("fedloru", "")
    notes = done.stderr.splitlines()
    assert "run.sh: 'fedloru>fedlora' left out of the report: fedlora has no finished run there" in notes
    assert "run.sh: 'fedlora=80.0' left out of the report: fedlora has no finished run there" in notes


EXPERIMENTS_LIB = Path(__file__).parents[1] / "experiments" / "lib.sh"
FAKE_JAXFED = """#!/usr/bin/env bash
echo "$*" >> "$LOG"
command=$1
while [[ $# -gt 0 ]]; do [[ $1 == --out ]] && out=$2; shift; done
mkdir -p "$out"
case $(basename "$out") in bad) exit 1 ;; stop) exit 130 ;; crash) exit 139 ;; esac
[[ $command == report ]] && exit 0
[[ $(basename "$out") == nockpt ]] || mkdir -p "$out/checkpoints/1"
touch "$out/summary.json"
"""


@pytest.mark.parametrize(
    "variants, calls, code, message",
    [
        # a failed variant: the script goes on, writes the report and exits 1 at the end; a run with a
        # checkpoint is resumed, one that finished without checkpoints is skipped
        ("", "run_variant D/a x; run_variant D/bad x; run_variant D/a x; run_variant D/nockpt x; "
         "run_variant D/nockpt x; report_variants D", 1, "run.sh: 1 variant(s) failed: D/bad"),
        # Ctrl-C (jaxfed exits 130), or any signal, stops the script: no later variant, no report
        ("", "run_variant D/stop x; run_variant D/c x; report_variants D", 130,
         "run.sh: D/stop stopped (exit 130); the same command goes on from there"),
        ("", "run_variant D/crash x; run_variant D/c x", 139, "run.sh: D/crash stopped (exit 139)"),
        ("a,typo", "run_variant D/a x; run_variant D/b x; report_variants D", 2,
         "run.sh: VARIANTS: unknown typo; this script's variants: a,b"),
        # nothing ran in D: its report is not rewritten from older runs
        ("typo", "run_variant D/a x; report_variants D", 2, "run.sh: VARIANTS=typo ran nothing in D; its report"),
    ],
)  # fmt: skip
def test_experiment_scripts_stop_when_interrupted_resume_what_exists_and_exit_with_what_failed(
    variants, calls, code, message, tmp_path
):
    """experiments/lib.sh run_variant with a stand-in jaxfed that logs its arguments: a variant
    whose directory exists is resumed, and the script's exit status says what went wrong."""
    script = f"set -euo pipefail; source {EXPERIMENTS_LIB}; D={tmp_path / 'runs'}; {calls.replace('D', '$D')}"
    done, log = _run_with_fake_jaxfed(tmp_path, ["bash", "-c", script], variants)
    assert done.returncode == code, done.stderr
    assert message.replace("D", str(tmp_path / "runs")) in done.stderr
    runs = [line for line in log if line.startswith("run ")]
    assert "c" not in {line.split("--out ")[1].split()[0].rsplit("/", 1)[-1] for line in runs}
    if code == 1:  # a's second call resumes it; the first started it; nockpt's second is skipped
        assert ["--resume" in line for line in runs if "/runs/a " in line + " "] == [False, True]
        assert ["--resume" in line for line in runs if "/runs/nockpt " in line + " "] == [False]
        assert "runs/nockpt finished already, without a checkpoint to go on from: skipped" in done.stderr
        assert any(line.startswith("report ") for line in log)


def _run_with_fake_jaxfed(tmp_path, command, variants):
    """``command`` run with VARIANTS=``variants`` and FAKE_JAXFED as jaxfed: its completed process
    and the stand-in's log (a line per jaxfed call)."""
    if shutil.which("bash") is None:
        pytest.skip("bash is not installed")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "jaxfed").write_text(FAKE_JAXFED)
    (tmp_path / "bin" / "jaxfed").chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}",
        "LOG": str(tmp_path / "log"),
        "VARIANTS": variants,
        "TMPDIR": str(tmp_path / "tmp"),
    }
    (tmp_path / "tmp").mkdir()
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60)
    log = (tmp_path / "log").read_text().splitlines() if (tmp_path / "log").exists() else []
    return done, log


@pytest.mark.parametrize(
    "variants, code, ran",
    [("a,typo", 2, []), ("b", 0, ["b"]), ("", 0, ["a", "b"])],
)
def test_a_run_script_refuses_an_unknown_variant_before_it_runs_any(variants, code, ran, tmp_path):
    """A run.sh (a file, as experiments/*/run.sh) with VARIANTS naming no variant of it stops with
    exit 2 before its first run; VARIANTS naming one runs that one alone, and its report."""
    script = tmp_path / "run.sh"
    script.write_text(
        f"set -euo pipefail\nsource {EXPERIMENTS_LIB}\nD={tmp_path / 'runs'}\n"
        'for v in a b; do run_variant "$D/$v" fedavg; done\nreport_variants "$D"\n'
    )
    (tmp_path / "runs" / "earlier").mkdir(parents=True)  # a variant finished before: in the report
    (tmp_path / "runs" / "earlier" / "summary.json").touch()
    done, log = _run_with_fake_jaxfed(tmp_path, ["bash", str(script), "DATA"], variants)
    assert done.returncode == code, done.stderr
    assert [line.split("--out ")[1].split()[0].rsplit("/", 1)[-1] for line in log if line.startswith("run ")] == ran
    if code == 2:
        assert done.stderr.strip() == "run.sh: VARIANTS: unknown typo; this script's variants: a,b"
    else:
        assert sum(line.startswith("report ") for line in log) == 1
    assert not list((tmp_path / "tmp").iterdir())  # the listing's file is removed


def test_the_paired_standard_error_is_that_of_the_per_seed_differences(tmp_path):
    a, b = [0.8415, 0.9255, 0.9020], [0.8330, 0.9265, 0.9035]
    variants = collect({"a": _variant(tmp_path, "a", a), "b": _variant(tmp_path, "b", b)})
    table = markdown(variants, [Claim("a", "b")])
    differences = np.subtract(a, b)
    paired = np.std(differences, ddof=1) / np.sqrt(len(a))
    unpaired = np.sqrt(np.var(a, ddof=1) / 3 + np.var(b, ddof=1) / 3)
    assert f"| a > b | {np.mean(differences):+.4f} | {unpaired:.4f} | inconclusive | {paired:.4f} |" in table


def test_no_paired_standard_error_unless_both_variants_ran_the_same_seeds(tmp_path):
    a = _variant(tmp_path, "a", [0.90, 0.91, 0.92])
    b = _variant(tmp_path, "b", [0.80, 0.81])  # seeds 0, 1 against 0, 1, 2
    c = _variant(tmp_path, "c", [0.80])  # one seed
    table = markdown(collect({"a": a, "b": b, "c": c}), [Claim("a", "b"), Claim("c", "a")])
    assert table.count("| n/a |") == 3
    assert "| c > a | -0.1100 | n/a | inconclusive | n/a |" in table  # one seed: no standard error
    assert paired_standard_error({0: 0.9, 1: 0.8}, {1: 0.6, 0: 0.7}) == pytest.approx(0.0)  # by seed, not order
    assert paired_standard_error({0: 0.9, 2: 0.8}, {0: 0.7, 1: 0.6}) is None


def _run_of(root, name, seed=0, final=0.8, **config):
    _fake_run(root / name, seed, final, **config)
    return root / name


def _report_error(variants, tmp_path, capsys) -> str:
    """The one line of a ``jaxfed report`` refused with exit 2."""
    assert main(["report", *variants, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("jaxfed: error: "), err
    return err


def _grid(root, finals: dict[float, list[float]]):
    """A sweep's grid directory: fedara at each ``lambda`` (``finals[lambda]``: its seeds' results)."""
    for lam, values in finals.items():
        for seed, final in enumerate(values):
            _fake_run(
                root / f"seed{seed}_lr0.05_lambda{lam:g}",
                seed,
                final,
                algorithm="fedara",
                options={"lr": 0.05, "lambda": lam},
            )
    return root


def test_a_grid_directory_is_one_variant_per_value_its_seeds_pooled_within(tmp_path):
    finals = {0.1: [0.80, 0.82, 0.81], 2.0: [0.70, 0.74, 0.71], 10.0: [0.60, 0.61, 0.65]}
    grid = _grid(tmp_path / "lam", finals)
    variants = collect({"lam": grid})
    assert [(v.name, v.seeds) for v in variants] == [
        ("lam[lambda=0.1]", [0, 1, 2]), ("lam[lambda=2]", [0, 1, 2]), ("lam[lambda=10]", [0, 1, 2])
    ]  # fmt: skip
    table = markdown(variants)
    for lam, values in finals.items():
        mean, std = np.mean(values), np.std(values, ddof=1)
        assert f"| lam[lambda={lam:g}] | 3 | {mean:.4f} ± {std:.4f} |" in table
    # through the command: a directory given without NAME= is named by its last part; claims and
    # paper numbers name a grid's variants
    claims = ["--claim", "lam[lambda=0.1]>lam[lambda=10]", "--paper", "lam[lambda=2]=71.3"]
    assert main(["report", str(grid), *claims, "--out", str(tmp_path / "out")]) == 0
    table = (tmp_path / "out" / "report.md").read_text()
    assert "| lam[lambda=2] | 3 | 0.7167 ± 0.0208 | 71.3 |" in table
    assert "| lam[lambda=0.1] > lam[lambda=10] | +0.1900 |" in table and "| reproduced |" in table
    records = json.loads((tmp_path / "out" / "report.json").read_text())
    assert [r["variant"] for r in records] == [v.name for v in variants for _ in range(3)]


def test_a_grid_over_two_keys_is_named_by_both_and_a_seeds_only_sweep_stays_one_variant(tmp_path):
    for seed in (0, 1):
        for lr in (0.01, 0.1):
            for mu in (0.0, 0.5):
                options = {"lr": lr, "mu": mu}
                _fake_run(
                    tmp_path / "g" / f"seed{seed}_lr{lr}_mu{mu}", seed, lr + mu, algorithm="fedprox", options=options
                )
    variants = collect({"g": tmp_path / "g", "plain": _variant(tmp_path, "plain", [0.8, 0.81, 0.82])})
    names = ["g[lr=0.01,mu=0]", "g[lr=0.01,mu=0.5]", "g[lr=0.1,mu=0]", "g[lr=0.1,mu=0.5]", "plain"]
    assert [v.name for v in variants] == names
    assert [len(v.runs) for v in variants] == [2, 2, 2, 2, 3]
    assert [v.summaries[0]["personalized_acc_mean"] for v in variants[:4]] == [0.01, 0.51, 0.1, 0.6]


def test_a_grid_variant_named_as_another_variant_is_one_line(tmp_path):
    grid = _grid(tmp_path / "lam", {0.1: [0.8], 2.0: [0.7]})
    alone = _run_of(tmp_path, "alone", final=0.9)
    with pytest.raises(ConfigError) as err:
        collect({"lam[lambda=0.1]": alone, "lam": grid})
    assert f"two variants named 'lam[lambda=0.1]' (from {alone} and {grid}); give each directory its own" in str(
        err.value
    )


def test_runs_of_different_algorithms_are_variants_by_algorithm(tmp_path):
    for i, algorithm in enumerate(("fedara", "fedcspack", "floral")):  # all seed 0
        _run_of(tmp_path / "mix", algorithm, algorithm=algorithm, options={"lr": 0.05 * (i + 1)})
    variants = collect({"all": tmp_path / "mix"})
    # the options of different algorithms are not compared key by key: lr names none of them
    assert [v.name for v in variants] == ["all[algorithm=fedara]", "all[algorithm=fedcspack]", "all[algorithm=floral]"]


@pytest.mark.parametrize(
    "second, names",
    [
        ({"rounds": 50}, ["v[rounds=10]", "v[rounds=50]"]),
        ({"options": {"lr": 0.1}}, ["v[lr=0.05]", "v[lr=0.1]"]),
        (
            {"dataset": "mnist", "num_clients": 100},
            ["v[dataset=digits,num_clients=20]", "v[dataset=mnist,num_clients=100]"],
        ),
    ],
)
def test_runs_that_differ_in_a_key_that_changes_the_numbers_are_not_pooled(second, names, tmp_path, capsys):
    _run_of(tmp_path / "v", "seed0", seed=0, dataset="digits", num_clients=20)
    _run_of(tmp_path / "v", "seed1", seed=1, **{"dataset": "digits", "num_clients": 20, **second})
    assert [(v.name, v.seeds) for v in collect({"v": tmp_path / "v"})] == [(names[0], [0]), (names[1], [1])]
    err = _report_error([str(tmp_path / "v"), "--claim", "v>v[lr=0.05]"], tmp_path, capsys)
    assert f"--claim: unknown variant 'v'; variants: {', '.join(names)}" in err


def test_runs_may_differ_in_the_seed_and_in_keys_that_change_no_number(tmp_path):
    from jaxfed.runs.rundir import NEUTRAL_KEYS

    assert {"eval_every", "data_dir", "client_chunk", "member_chunk", "devices", "plugins"} <= NEUTRAL_KEYS
    assert not {"rounds", "seed", "algorithm", "lr", "matmul_precision"} & NEUTRAL_KEYS
    _run_of(tmp_path / "v", "a", seed=0, eval_every=5, data_dir="/data", client_chunk=0, plugins=[])
    _run_of(tmp_path / "v", "b", seed=1, eval_every=2, data_dir="", client_chunk=-1, plugins=["mine.py"])
    (variant,) = collect({"v": tmp_path / "v"})
    assert variant.seeds == [0, 1]


def test_the_same_seed_twice_in_one_variant_is_refused(tmp_path, capsys):
    _run_of(tmp_path / "v", "first", seed=3)
    _run_of(tmp_path / "v", "again", seed=3, eval_every=2)
    err = _report_error([f"v={tmp_path / 'v'}"], tmp_path, capsys)
    assert f"variant 'v' ({tmp_path / 'v'}) holds 2 runs of seed 3 (again, first)" in err and "NAME=DIR" in err


def test_a_run_directory_that_holds_run_directories_too_is_refused(tmp_path, capsys):
    sweep = _variant(tmp_path, "sweep", [0.8, 0.81])
    _fake_run(sweep / "stray", 0, 0.5)
    for name in ("config.json", "metrics.jsonl", "summary.json"):  # a run written into the sweep's parent
        (sweep / name).write_text((sweep / "stray" / name).read_text())
    err = _report_error([str(sweep)], tmp_path, capsys)
    assert f"{sweep} is a run directory (its own summary.json) and holds run directories too" in err
    assert "seed0_lr0.05, seed1_lr0.05, stray" in err


def test_a_regression_and_a_classification_variant_are_one_line(tmp_path, capsys):
    acc = _variant(tmp_path, "acc", [0.8, 0.81])
    mse = _variant(tmp_path, "mse", [0.1, 0.2], task="regression")
    err = _report_error([f"acc={acc}", f"mse={mse}"], tmp_path, capsys)
    assert "variant 'mse' is a regression task and 'acc' a classification task" in err
    assert "one jaxfed report per task" in err


@pytest.mark.parametrize("damage", ["", '{"task": ', "[1, 2]", "\udcff"])
def test_a_damaged_summary_is_one_line_naming_the_file(damage, tmp_path, capsys):
    variant = _variant(tmp_path, "a", [0.8, 0.81])
    summary = variant / "seed1_lr0.05" / "summary.json"
    summary.write_bytes(damage.encode("utf-8", "surrogateescape"))
    err = _report_error([str(variant)], tmp_path, capsys)
    assert f"{summary}: damaged" in err
    assert f"`jaxfed run --out {summary.parent} --resume` writes it again from the run's newest checkpoint" in err


def test_a_report_out_that_is_a_file_is_one_line(tmp_path, capsys):
    variant = _variant(tmp_path, "a", [0.8, 0.81])
    (tmp_path / "afile").write_text("mine")
    assert main(["report", str(variant), "--out", str(tmp_path / "afile")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--out " + str(tmp_path / "afile") + ": is a file, not a directory" in err
    assert (tmp_path / "afile").read_text() == "mine"
