"""The command line: ``jaxfed run``, ``sweep``, ``plot``, ``report``, ``list``, ``bench``.

User mistakes end with one line on stderr and exit code 2, never a traceback; a run stopped by
a non-finite client update ends with one line and exit code 1.
"""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
import time
from pathlib import Path

from jaxfed.errors import ConfigError, DeviceMemoryError, NonFiniteUpdateError, StorageFullError
from jaxfed.runs import distributed
from jaxfed.runs.config import Config, read_config_lines

EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 1, 2, 130  # 130: 128 + SIGINT, as a shell reports Ctrl-C


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse prints usage too by default)
        print(f"jaxfed: error: {message}", file=sys.stderr)
        sys.exit(EXIT_USAGE)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="jaxfed", description="Federated learning simulated at accelerator speed.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    run = commands.add_parser("run", help="run one simulation (default: fedavg on the embedded digits data)")
    add_config_arguments(run)
    run.add_argument("--out", help="run directory (default: runs/<algorithm>_<dataset>_<time>)")
    run.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in --out from its newest checkpoint (its saved config, with --set applied on top)",
    )
    run.add_argument("--quiet", action="store_true", help="no progress bar")
    processes = run.add_argument_group(
        "a run across processes (jax.distributed; each flag also from $JAXFED_COORDINATOR, "
        "$JAXFED_NUM_PROCESSES, $JAXFED_PROCESS_ID)"
    )
    processes.add_argument("--coordinator", metavar="HOST:PORT", help="process 0's address, the same in every process")
    processes.add_argument("--num-processes", type=int, metavar="N", help="processes in the run")
    processes.add_argument("--process-id", type=int, metavar="I", help="this process, 0..N-1 (0 writes the files)")
    sweep = commands.add_parser(
        "sweep", help="run seeds x lrs x --grid keys as compiled programs, one run directory per configuration"
    )
    add_config_arguments(sweep)
    sweep.add_argument("--seeds", default="", help="comma-separated seeds, e.g. 0,1,2 (default: the config's seed)")
    sweep.add_argument("--lrs", default="", help="comma-separated client learning rates (default: the config's lr)")
    sweep.add_argument(
        "--grid",
        action="append",
        default=[],
        metavar="KEY=V1,V2",
        help="sweep any run key or option too (repeatable; the grid is seeds x lrs x every --grid); options "
        "a round takes as numbers run in one compiled program, other keys in one per group",
    )
    sweep.add_argument(
        "--out",
        help="parent directory of the members' run directories seed<S>_lr<LR> "
        "(default: runs/sweep_<algorithm>_<dataset>_<time>)",
    )
    sweep.add_argument(
        "--resume",
        action="store_true",
        help="continue the interrupted sweep in --out (the same command plus --resume): finished members are "
        "skipped, the others go on from their newest checkpoints",
    )
    sweep.add_argument("--quiet", action="store_true", help="no progress lines")
    plot = commands.add_parser("plot", help="plot accuracy vs round and vs bytes uploaded for run directories")
    plot.add_argument(
        "runs", nargs="+", metavar="DIR", help="run directories (jaxfed run's), or sweeps' directories (each member)"
    )
    plot.add_argument(
        "--out",
        help="PNG file (default: DIR/accuracy.png for one run, ./accuracy.png for several; with --metric M, "
        "M.png there instead)",
    )
    plot.add_argument(
        "--metric",
        default=None,
        help="personalized_acc_mean (the default; personalized_mse_mean for a regression task), "
        "personalized_acc_weighted, global_acc, new_personalized_acc_mean, ..., or any other number in the runs' "
        "metrics.jsonl rows: train_loss, global_loss, personalized_loss, steps, bytes_up_round, round_seconds, ...",
    )
    plot.add_argument(
        "--clients",
        nargs="?",
        const="auto",
        metavar="NAME",
        help="draw the per-client values instead (clients/<round>.npz): acc or mse by default, or loss, new_acc, "
        "new_global_acc; their distribution at the last evaluation and their spread over rounds",
    )
    report = commands.add_parser(
        "report", help="a table (mean ± std over seeds), per-seed CSV/JSON and a spread plot of variants"
    )
    report.add_argument(
        "variants",
        nargs="+",
        metavar="[NAME=]DIR",
        help="a variant: a directory of run directories over seeds (a sweep's), or one run directory; a grid "
        "sweep's directory is one variant per configuration, NAME[key=value,...]",
    )
    report.add_argument("--out", required=True, help="directory for report.md, .json, .csv and .png")
    report.add_argument(
        "--claim",
        action="append",
        default=[],
        metavar="A>B[-MARGIN]",
        help="judge 'variant A beats B' (A>B) or 'A is at most MARGIN worse than B' (A>B-0.03); repeatable",
    )
    report.add_argument(
        "--paper",
        action="append",
        default=[],
        metavar="VARIANT=NUMBER",
        help="the paper's reported number for a variant, shown beside ours as written (repeatable)",
    )
    report.add_argument(
        "--relative-to", metavar="VARIANT", help="also show upload and total traffic as a fraction of this variant's"
    )
    listing = commands.add_parser(
        "list", help="list algorithms, datasets, models, partitioners and run keys; with ALGORITHM, its options"
    )
    listing.add_argument("algorithm", nargs="?", help="an algorithm: print its options, defaults and their sources")
    listing.add_argument(
        "--plugin",
        action="append",
        default=[],
        metavar="FILE_OR_MODULE",
        help="import a module that registers algorithms first (repeatable)",
    )
    bench = commands.add_parser("bench", help="throughput of a workload (w1-w4), against a PyTorch loop")
    bench.add_argument("workload", nargs="?", default="w1", help="w1 (default), w2, w3 or w4; see jaxfed.cli.bench")
    bench.add_argument("--data-dir", help="directory with mnist.npz (w1, w3) or cifar10.npz (w4)")
    bench.add_argument(
        "--set", action="extend", nargs="+", default=[], metavar="KEY=VALUE", help="override config keys"
    )
    bench.add_argument("--rounds", type=int, default=5, help="steady-state rounds timed after a warm-up call")
    bench.add_argument("--baseline", default="torch", help="torch (a PyTorch per-client loop; fedavg only) or none")
    bench.add_argument(
        "--baseline-rounds",
        type=int,
        default=0,
        help="rounds the PyTorch loop runs (its median round is timed); 0 = as many as jaxfed ran, so the "
        "global accuracies compare",
    )
    bench.add_argument(
        "--profile",
        metavar="DIR",
        default="",
        help="also trace as many calls as were timed into DIR and summarize the device's kernels: count, time, "
        "busy fraction, kernels per local step (accelerators; see jaxfed.cli.bench.profile)",
    )
    bench.add_argument("--strategies", default="", help="comma-separated client_chunk values to time too, e.g. 0,1,10")
    bench.add_argument("--json", metavar="FILE", help="also write the full result as JSON")
    return parser


def add_config_arguments(parser) -> None:
    """The arguments that make a config: algorithm, --dataset, --data-dir, --config, --set,
    --plugin (read by :func:`config_from_args`; experiment scripts use the pair too)."""
    parser.add_argument("algorithm", nargs="?", help="algorithm name (default: fedavg)")
    parser.add_argument("--dataset", help="dataset name (default: digits)")
    parser.add_argument("--data-dir", help="directory with <dataset>.npz files or TFDS data")
    parser.add_argument(
        "--config",
        action="append",
        default=[],
        metavar="FILE",
        help="config file of 'key = value' lines (# comments), applied before the options (repeatable)",
    )
    parser.add_argument(
        "--set",
        action="extend",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="override run or algorithm keys: --set a=1 b=2 (repeatable; jaxfed list ALGORITHM lists them)",
    )
    parser.add_argument(
        "--plugin",
        action="append",
        default=[],
        metavar="FILE_OR_MODULE",
        help="import a .py file or module whose jaxfed.register calls add algorithms (repeatable; recorded in "
        "the config as plugins, so --resume imports it again)",
    )


def _number_list(option: str, text: str, kind: type) -> list:
    try:
        return [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ConfigError(f"{option}: expected comma-separated {kind.__name__} values, got '{text}'") from None


def config_from_args(args, base: Config | None = None) -> Config:
    """The config of ``jaxfed run``: ``base`` (defaults, or a resumed run's), then the ``--config``
    files in order, then the algorithm, ``--dataset`` and ``--data-dir``, then ``--set`` (a
    sweep's ``--grid algorithm=...`` names the algorithm too)."""
    pairs, origins = given_pairs(args)
    config = (base or Config()).validated_with(pairs, origins)
    named = [pair.partition("=")[0].strip() for pair in [*pairs, *getattr(args, "grid", [])]]
    if base is None and "algorithm" not in named:
        refuse_unnamed_plugin_algorithm(getattr(args, "command", None) or "run", args.plugin)
    return config


def given_pairs(args) -> tuple[list[str], list]:
    """``(pairs, origins)``: the ``key=value`` settings the command line gives, in the order they
    apply (the ``--config`` files' lines, with their origins, then the algorithm, ``--dataset``,
    ``--data-dir`` and ``--set``, whose origins are None)."""
    lines = [line for path in args.config for line in read_config_lines(path)]
    pairs, origins = [pair for pair, _ in lines], [origin for _, origin in lines]
    if args.plugin:  # on --resume too: a plugin that moved is found where it is now
        pairs.append("plugins=" + ",".join(plugin_paths(args.plugin)))
    for key, value in (("algorithm", args.algorithm), ("dataset", args.dataset), ("data_dir", args.data_dir)):
        if value is not None:
            pairs.append(f"{key}={value}")
    pairs += args.set
    return pairs, origins + [None] * (len(pairs) - len(origins))


def given_host_devices(args) -> int | None:
    """The ``host_devices`` the command line sets (the last that reads as a count), else None."""
    values = [
        pair.partition("=")[2].strip()
        for pair in given_pairs(args)[0]
        if pair.partition("=")[0].strip() == "host_devices"
    ]
    counts = [int(v) for v in values if v.isdigit()]
    return counts[-1] if counts else None


def refuse_unnamed_plugin_algorithm(command: str, plugins: list[str]) -> None:
    """A ConfigError where ``--plugin`` registered algorithms but no algorithm was named (neither
    given nor in a ``--config`` file): the run would silently be the default algorithm's."""
    from jaxfed.algorithms import registry

    for plugin in plugins:
        registered = registry.registered_by(plugin)
        if registered and Config.algorithm not in registered:
            raise ConfigError(
                f"algorithm: not given; {plugin} registers {', '.join(registered)}: "
                f"jaxfed {command} {registered[0]} --plugin {plugin}"
            )


def plugin_paths(plugins: list[str]) -> list[str]:
    """``--plugin`` values as recorded: a .py file by its absolute path, so --resume finds it
    from anywhere; a module by its name."""
    return list(dict.fromkeys(str(Path(p).absolute()) if p.endswith(".py") else p for p in plugins))


def _silent(message: str) -> None:
    """The log of a process other than process 0 in a run across processes: it prints nothing."""


def _run(args) -> int:
    from jaxfed.core import human_bytes
    from jaxfed.runs.driver import resume_point, run
    from jaxfed.runs.rundir import new_run_dir

    if args.resume and not args.out:
        raise ConfigError("--resume: needs --out DIR, the run directory to continue")
    processes = distributed.settings_from(args.coordinator, args.num_processes, args.process_id)
    if processes is not None:
        if not args.out:
            raise ConfigError("--coordinator: needs --out DIR, the run directory every process shares")
        distributed.start(*processes)  # before anything below starts JAX's backend
    primary = distributed.is_primary()  # process 0 alone prints (docs/devices.md); errors still raise
    log = None if primary else _silent
    saved, point = (None, False)
    if args.resume:
        saved, point = resume_point(
            args.out, log=log, plugins=plugin_paths(args.plugin), host_devices=given_host_devices(args)
        )
    config = config_from_args(args, saved)
    out = args.out or new_run_dir(f"runs/{config.algorithm}_{config.dataset}")
    try:
        s = run(config, out, resume=point, progress=not args.quiet and primary, log=log)
    except NonFiniteUpdateError as err:
        saved = getattr(err, "checkpoint", None)
        where = f"; last good state saved in {saved}" if saved else ""
        print(
            f"jaxfed: error: {err}{where}; to drop such clients instead, continue with "
            f"`jaxfed run --out {out} --resume --set nonfinite=skip` (or lower lr)",
            file=sys.stderr,
        )
        return EXIT_FAILED
    if not distributed.is_primary():
        return 0
    from jaxfed.nn import user

    kind = "mse" if s["task"] == "regression" else "acc"
    global_part = f", global {kind} {s[f'global_{kind}']:.4f}" if s[f"global_{kind}"] is not None else ""
    print(
        f"{s['algorithm']} on {s['dataset']} ({user.label(s['model'])}, {s['num_clients']} clients, "
        f"{s['rounds']} round{'s' if s['rounds'] != 1 else ''}): "
        f"personalized {kind} {metric_text(s[f'personalized_{kind}_mean'])} "
        f"(weighted {metric_text(s[f'personalized_{kind}_weighted'])})"
        f"{global_part}; uploaded {human_bytes(s['bytes_up_total'])}; {s['wall_seconds']:.1f} s -> {out}"
        + skipped_note(s)
        + ("; null: not finite, or no client has test examples" if s[f"personalized_{kind}_mean"] is None else "")
    )
    return 0


def metric_text(value: float | None) -> str:
    """A summary's metric on the summary line: ``null`` there is a value that was not finite, or a
    mean over no client (none has test examples)."""
    return "null" if value is None else f"{value:.4f}"


def skipped_note(summary: dict) -> str:
    """What ``nonfinite=skip`` dropped, when it dropped anything."""
    skipped = int(summary.get("nonfinite_skipped_total") or 0)
    if not skipped:
        return ""
    return f"; {skipped} non-finite client update(s) skipped (see nonfinite_skipped in metrics.jsonl)"


def _sweep(args) -> int:
    from pathlib import Path

    from jaxfed.runs.rundir import new_run_dir
    from jaxfed.runs.sweep import run_grid, sweep_configs

    if args.resume and not args.out:
        raise ConfigError("--resume: needs --out DIR, the sweep's directory to continue")
    if args.resume and not Path(args.out).exists():
        raise ConfigError(f"--resume: {args.out} does not exist; start the sweep without --resume")
    base = config_from_args(args)
    grid = {}
    for key, values in map(_grid_axis, args.grid):
        if key in grid:  # a dict would keep the last: the first axis would vanish silently
            raise ConfigError(f"--grid: {key} given twice; give its values once, --grid {key}=V1,V2,...")
        grid[key] = values
    seeds, lrs = _number_list("--seeds", args.seeds, int), _number_list("--lrs", args.lrs, float)
    configs = sweep_configs(base, seeds, lrs, grid)
    root = Path(args.out) if args.out else new_run_dir(f"runs/sweep_{base.algorithm}_{base.dataset}")
    start = time.perf_counter()
    try:
        outs, summaries = run_grid(configs, root, list(grid), progress=not args.quiet, resume=args.resume)
    except NonFiniteUpdateError as err:
        print(
            f"jaxfed: error: {err}; last good states saved in {root}/*/checkpoints; to drop such clients instead, "
            "continue with the same command plus `--resume --set nonfinite=skip`",
            file=sys.stderr,
        )
        return EXIT_FAILED
    for out, s in zip(outs, summaries):
        kind = "mse" if s["task"] == "regression" else "acc"
        print(f"{out}: personalized {kind} {metric_text(s[f'personalized_{kind}_mean'])}" + skipped_note(s))
    print(f"{len(configs)} configurations in {time.perf_counter() - start:.1f} s -> {root}")
    return 0


def _grid_axis(text: str) -> tuple[str, list[str]]:
    """``KEY=V1,V2,...`` -> ``(KEY, [V1, V2, ...])``."""
    key, sep, values = text.partition("=")
    split = [v.strip() for v in values.split(",") if v.strip()]
    if not sep or not key.strip() or not split:
        raise ConfigError(f"--grid: expected KEY=V1,V2,..., got '{text}'")
    if key.strip() in ("seed", "lr"):
        raise ConfigError(f"--grid: sweep {key.strip()} with --{key.strip()}s")
    return key.strip(), split


def _plot(args) -> int:
    from pathlib import Path

    from jaxfed.runs.plots import plot_client_distribution, plot_runs

    name = "clients.png" if args.clients else f"{args.metric}.png" if args.metric else "accuracy.png"
    out = args.out or (Path(args.runs[0]) / name if len(args.runs) == 1 else name)
    if args.clients:
        print(plot_client_distribution(args.runs, out, "" if args.clients == "auto" else args.clients))
    else:
        print(plot_runs(args.runs, out, args.metric))
    return 0


def _report(args) -> int:
    from jaxfed.cli.report import write_report

    variants = {}
    for given in args.variants:
        name, sep, directory = given.partition("=")
        name, directory = (name, directory) if sep else (Path(given).name, given)
        if name in variants:
            raise ConfigError(f"report: variant name '{name}' given twice; write NAME=DIR")
        variants[name] = Path(directory)
    files = write_report(variants, Path(args.out), args.claim, args.paper, args.relative_to)
    print(files["md"].read_text(), end="")
    print(f"-> {', '.join(str(f) for f in files.values())}")
    return 0


def _list(args) -> int:
    from jaxfed.algorithms import registry
    from jaxfed.data import DATASETS, FILE_PARTITION, PARTITIONERS, SYNTHETIC_TASKS, default_model
    from jaxfed.nn import MODELS, user

    for plugin in args.plugin:
        registry.import_plugin(plugin)
    if args.algorithm:
        spec = registry.get(args.algorithm)
        print(f"{spec.name}: {spec.summary}")
        python_use = registry.python_use(spec.name)
        if python_use:
            print(f"python: {python_use}")
        print(f"options ({spec.options.__name__}; --set key=value):")
        _print_keys(spec.options.describe())
        return 0
    names = [*DATASETS, *SYNTHETIC_TASKS]
    _print_list("algorithms", [*registry.names(), "(jaxfed list ALGORITHM: its options)"])
    listed = {name for entries in registry.CATALOGUE.values() for name, _ in entries}
    own = [(name, registry.get(name).summary) for name in registry.names() if name not in listed]
    for group, entries in [*registry.CATALOGUE.items(), *([("registered by research code", own)] if own else [])]:
        print(f"  {group}:")
        for name, line in entries:  # a plugin's line is its docstring's: wrapped under its start
            print(textwrap.fill(line, width=100, initial_indent=f"    {name:<14}", subsequent_indent=" " * 18)
                  or f"    {name}")  # fmt: skip
    _print_list("datasets", [f"{name} (model {default_model(name)})" for name in names])
    _print_list("models", [*MODELS, f"or your own flax Module: model={user.FORMS}"])
    _print_list("partitioners", [*PARTITIONERS, f"{FILE_PARTITION} (partition_file=PATH: your own, an .npz)"])
    print("run keys (--set key=value):")
    _print_keys(Config.describe())
    return 0


def _print_list(title: str, items) -> None:
    """``title: a, b, c`` wrapped at 100 columns under the first item."""
    print(textwrap.fill(", ".join(items), width=100, initial_indent=f"{title + ':':<14}", subsequent_indent=" " * 14))


def _print_keys(rows) -> None:
    """``key = default`` then the help (and the default's source) wrapped under it, 100 columns."""
    import textwrap

    for key, default, help_, source in rows:
        shown = ",".join(map(str, default)) if isinstance(default, tuple) else str(default)
        print(f"  {key} = {shown}")
        text = help_ + (f" [default from: {source}]" if source else "")
        print(textwrap.fill(text, width=100, initial_indent="      ", subsequent_indent="      "))


def _bench(args) -> int:
    from jaxfed.cli.bench import run_benchmark, summary_lines
    from jaxfed.runs.rundir import json_text

    strategies = _number_list("--strategies", args.strategies, int)
    if args.json:  # before minutes of timing, not after
        check_writable_file("--json", args.json)
    overrides = ([f"data_dir={args.data_dir}"] if args.data_dir else []) + args.set
    result = run_benchmark(
        args.workload,
        overrides,
        rounds=args.rounds,
        baseline=args.baseline,
        strategies=strategies,
        baseline_rounds=args.baseline_rounds,
        profile=args.profile,
    )
    print("\n".join(summary_lines(result)))
    if args.json:
        Path(args.json).write_text(json_text(result, indent=2) + "\n")
    return 0


def check_writable_file(option: str, path: str) -> None:
    """A ConfigError, before any work, if the file ``path`` cannot be written."""
    target = Path(path)
    if target.is_dir():
        raise ConfigError(f"{option} {path}: is a directory, not a file")
    parent = target.parent
    if not parent.is_dir():
        raise ConfigError(f"{option} {path}: the directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise ConfigError(f"{option} {path}: is not writable")


def _attach_list_values(argv: list[str]) -> list[str]:
    """``--seeds -1,2`` as ``--seeds=-1,2``: argparse reads a value starting with '-' as an
    option, so a list of numbers would be refused with its usage message, not checked."""
    joined, i = [], 0
    while i < len(argv):
        if argv[i] in LIST_OPTIONS and i + 1 < len(argv) and argv[i + 1].startswith("-") and argv[i + 1] != "--":
            joined.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
        else:
            joined.append(argv[i])
            i += 1
    return joined


LIST_OPTIONS = ("--seeds", "--lrs")


def main(argv=None) -> int:
    argv = _attach_list_values(list(sys.argv[1:] if argv is None else argv))
    args = _parser().parse_args(argv)
    quiet_library_logs()
    try:
        commands = {"run": _run, "sweep": _sweep, "plot": _plot, "report": _report, "list": _list, "bench": _bench}
        return commands[args.command](args)
    except ConfigError as err:
        print(f"jaxfed: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except (StorageFullError, DeviceMemoryError) as err:
        print(f"jaxfed: error: {err}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt as err:
        kept = getattr(err, "intact", None)  # a run's loop says what it keeps
        print(f"jaxfed: interrupted; {kept}" if kept else "jaxfed: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # output piped into a reader that stopped (jaxfed list | head): not an error
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def entry() -> None:
    """The ``jaxfed`` command: :func:`main` with a SIGINT handler that loses no interrupt
    (:mod:`jaxfed.runs.interrupts`). An interrupted command ends without the interpreter's
    teardown, its output flushed and its checkpoints complete: torn down with XLA's threads
    mid-compile, it crashed there (exit 139 after its ``interrupted`` line)."""
    import os

    from jaxfed.runs import interrupts

    interrupts.install()
    code = main()
    if code == 0 and interrupts.received():  # dropped, and the command finished before the next check
        print("jaxfed: interrupted after the command had done its work (its results are complete)", file=sys.stderr)
        code = EXIT_INTERRUPTED
    if code == EXIT_INTERRUPTED:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def quiet_library_logs() -> None:
    """Orbax logs each failed background write as absl ERROR lines with tracebacks; the CLI
    reports failures itself, in one line."""
    import logging

    logging.getLogger("absl").setLevel(logging.CRITICAL)


if __name__ == "__main__":
    sys.exit(main())
