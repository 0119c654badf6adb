"""Runs stopped at an edge: a member diverging in a sweep, a resume that stops at its checkpoint,
an extension interrupted (each test failed before its fix)."""

import dataclasses
import json

import pytest
from conftest import metrics_rows as rows

from jaxfed.errors import NonFiniteUpdateError
from jaxfed.runs.config import Config
from jaxfed.runs.rundir import TIMING_KEYS, RunDirectory
from jaxfed.runs.sweep import member_name, run_grid, sweep_configs

# one call of two rounds, evaluated and checkpointed at its end
SMALL = ["num_clients=8", "participation=0.5", "rounds=2", "eval_every=2", "rounds_per_call=2", "checkpoint_every=2"]
QUIET = dict(progress=False, log=lambda message: None)


def _untimed(path):
    return [{k: v for k, v in row.items() if k not in TIMING_KEYS} for row in rows(path)]


def _with(configs, **changes):
    return [dataclasses.replace(c, **changes).validate() for c in configs]


def test_a_sweep_stopped_by_one_member_resumes_with_the_other_members_evaluation(tmp_path):
    """The good member ran the whole call to an evaluation round when the other one diverged: it
    was checkpointed there without that round's row, so `--resume --set nonfinite=skip` (what the
    error says to do) crashed with IndexError in summary() (its rows were empty) and a longer run
    silently lost the row."""
    configs = sweep_configs(Config().with_overrides(SMALL), lrs=[0.05, 1e30])
    with pytest.raises(NonFiniteUpdateError):
        run_grid(configs, tmp_path / "s", **QUIET)
    skip = _with(configs, nonfinite="skip")
    outs, summaries = run_grid(skip, tmp_path / "s", resume=True, **QUIET)
    alone, _ = run_grid(skip, tmp_path / "alone", **QUIET)  # the sweep left alone, skipping from the start
    assert summaries[0]["rounds"] == 2
    assert _untimed(outs[0]) == _untimed(alone[0])


def test_a_second_diverging_member_records_only_the_rounds_its_state_has_done(tmp_path):
    """Only the first diverging member's record was cut at its failing round: another member that
    diverged in the same call kept every round of the call (pending metrics, byte totals, round
    times) in the record of a checkpoint whose state had not done them, so its resume counted
    them twice."""
    configs = sweep_configs(Config().with_overrides(SMALL), lrs=[1e30, 2e30])
    with pytest.raises(NonFiniteUpdateError):
        run_grid(configs, tmp_path / "s", **QUIET)
    for config in configs:
        directory = RunDirectory(tmp_path / "s" / member_name(config))
        round_, record = directory.newest_checkpoint_record()
        assert len(record["round_times"]) == round_ == 0
        assert record["totals"]["bytes_up"] == 0.0


class _Stop(Exception):
    pass


def _stop_at(round_):
    def stop(row):
        if row["round"] == round_:
            raise _Stop

    return stop


def test_a_resume_that_stops_at_an_unevaluated_checkpoint_evaluates_it(tmp_path):
    """A resume may "stop where it is" (rounds = the checkpoint's round), but a checkpoint round
    that is not an evaluation round was never evaluated: the resumed run ended without that row,
    so summary() raised IndexError (no row at all) or summed up an older round (its "rounds" too),
    where the run left alone with those rounds evaluates its last round."""
    from jaxfed.cli import main
    from jaxfed.runs.driver import run

    base = Config().with_overrides(["num_clients=8", "rounds=9", "eval_every=3", "rounds_per_call=1"])
    # checkpoints every 2, stopped at the evaluation of round 3: the newest is round 2, no row yet;
    # every 4, stopped at the evaluation of round 6: the newest is round 4, with the row of round 3
    for every, stop, newest in ((2, 3, 2), (4, 6, 4)):
        out, alone = tmp_path / f"every{every}", tmp_path / f"alone{every}"
        config = dataclasses.replace(base, checkpoint_every=every)
        with pytest.raises(_Stop):
            run(config, out, progress=False, log=lambda m: None, on_evaluation=_stop_at(stop))
        assert RunDirectory(out).checkpoints.rounds()[-1] == newest
        assert main(["run", "--quiet", "--out", str(out), "--resume", "--set", f"rounds={newest}"]) == 0
        run(dataclasses.replace(config, rounds=newest), alone, progress=False, log=lambda m: None)
        assert _untimed(out) == _untimed(alone)


def test_report_does_not_take_the_summary_of_a_finished_run_whose_extension_was_interrupted(tmp_path):
    """`--resume --set rounds=N` rewrites config.json at once but summary.json only when it ends:
    interrupted, the directory says rounds=N (and holds rows past the old end) beside the old
    run's summary, and `jaxfed report` took that summary as the finished run's result of N rounds,
    pooled with the seeds that did finish N rounds."""
    from jaxfed.cli.report import collect
    from jaxfed.runs.driver import run

    base = Config().with_overrides(["num_clients=8", "rounds=2", "eval_every=1", "rounds_per_call=1"])
    parent = tmp_path / "variant"
    run(base, parent / "seed0", progress=False, log=lambda m: None)
    with pytest.raises(_Stop):  # extended to 4 rounds, interrupted after round 3
        run(
            dataclasses.replace(base, rounds=4),
            parent / "seed0",
            resume=True,
            progress=False,
            log=lambda m: None,
            on_evaluation=_stop_at(3),
        )
    run(dataclasses.replace(base, rounds=4, seed=1), parent / "seed1", progress=False, log=lambda m: None)
    (variant,) = collect({"variant": parent})
    assert [run.name for run in variant.runs] == ["seed1"]  # seed0 has not finished its 4 rounds
    assert variant.summaries[0]["rounds"] == 4


def test_a_run_interrupted_while_a_checkpoint_is_written_completes_it(tmp_path, capsys, monkeypatch):
    """Ctrl-C while a checkpoint was written in the background left only its temporary directory
    (orbax's write is asynchronous): a first checkpoint lost that way left nothing to resume from."""
    import threading
    import time

    from jaxfed.cli import main
    from jaxfed.runs.checkpoint import RunCheckpoints
    from jaxfed.simulation.engine import Simulation

    save, wait, run_rounds = RunCheckpoints.save, RunCheckpoints.wait, Simulation.run_rounds
    writes, calls = [], [0]

    def slow_save(self, *args):  # the write still under way when the interrupt comes
        writes.append(threading.Thread(target=lambda: (time.sleep(0.5), save(self, *args))))
        writes[-1].start()

    def interrupted(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] == 2:
            raise KeyboardInterrupt
        return run_rounds(self, *args, **kwargs)

    monkeypatch.setattr(RunCheckpoints, "save", slow_save)
    monkeypatch.setattr(RunCheckpoints, "wait", lambda self: ([w.join() for w in writes], wait(self)))
    monkeypatch.setattr(Simulation, "run_rounds", interrupted)
    out = tmp_path / "run"
    settings = ["num_clients=8", "rounds=3", "eval_every=1", "rounds_per_call=1", "checkpoint_every=1"]
    assert main(["run", "--quiet", "--out", str(out), "--set", *settings]) == 130
    assert RunDirectory(out).checkpoints.rounds() == [1]
    assert (
        capsys.readouterr()
        .err.strip()
        .endswith("interrupted; the checkpoint of round 1 is intact (--resume continues from it)")
    )


def test_an_interrupt_python_dropped_stops_the_run_before_its_next_call(tmp_path, capsys):
    """SIGINT's KeyboardInterrupt raised inside JAX's garbage-collection callback is dropped by
    Python (the run went on to its end, exit 0); the jaxfed command's handler remembers it and the
    loop stops before its next compiled call, checkpoints complete, exit 130."""
    from jaxfed.cli import main
    from jaxfed.runs import interrupts

    out = tmp_path / "run"
    settings = ["num_clients=8", "rounds=3", "eval_every=1", "rounds_per_call=1", "checkpoint_every=1"]
    interrupts._received.set()  # as install()'s handler does, its KeyboardInterrupt then dropped
    try:
        assert main(["run", "--quiet", "--out", str(out), "--set", *settings]) == 130
    finally:
        interrupts.clear()
    assert capsys.readouterr().err.strip().endswith("jaxfed: interrupted; no checkpoint was completed")
    assert RunDirectory(out).checkpoints.rounds() == [] and not (out / "summary.json").exists()


@pytest.mark.parametrize("code, received, exit_code", [(130, True, 130), (0, True, 130), (0, False, 0), (2, True, 2)])
def test_the_jaxfed_command_exits_130_when_interrupted_without_the_interpreters_teardown(
    code, received, exit_code, monkeypatch, capsys
):
    """entry(): an interrupted command leaves by os._exit (torn down with XLA's threads mid-compile
    it crashed, exit 139); one whose interrupt came too late to stop it still exits 130."""
    import os

    from jaxfed.cli import commands
    from jaxfed.runs import interrupts

    class Exited(Exception):
        pass

    def leave(how):
        def exit_(status):
            raise Exited(how, status)

        return exit_

    monkeypatch.setattr(commands, "main", lambda: code)
    monkeypatch.setattr(os, "_exit", leave("os._exit"))
    monkeypatch.setattr(commands.sys, "exit", leave("sys.exit"))
    monkeypatch.setattr(interrupts, "install", lambda: None)  # the test process keeps pytest's handler
    if received:
        interrupts._received.set()
    try:
        with pytest.raises(Exited) as exited:
            commands.entry()
    finally:
        interrupts.clear()
    assert exited.value.args == ("os._exit" if exit_code == 130 else "sys.exit", exit_code)
    late = "jaxfed: interrupted after the command had done its work (its results are complete)"
    assert (late in capsys.readouterr().err) == (code == 0 and received)


def test_a_finished_run_resumed_to_its_rounds_is_left_as_it_is(tmp_path):
    """`jaxfed run --resume` of a run that ended (the experiment scripts resume every variant they
    find) rebuilt it and rewrote summary.json (compile_seconds 0, wall_seconds grown): now the
    summary is returned and every file stays as it was."""
    from jaxfed.runs.driver import run

    config = Config().with_overrides(SMALL).validate()
    out = tmp_path / "run"
    first = run(config, out, **QUIET)
    files = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    lines = []
    assert run(config, out, resume=True, progress=False, log=lines.append) == json.loads(json.dumps(first))
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == files
    assert lines == [f"{out}: finished its 2 rounds already; left as it is"]
