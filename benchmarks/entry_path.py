"""How a config travels from the command line to the engine: which jaxfed functions receive it,
and how often each once-only step runs, for one ``jaxfed run`` and its ``--resume``.

    python benchmarks/entry_path.py [--out DIR]

A function "receives" the config when one of its arguments is the run's ``Config`` (or the
algorithm's options object, for the ``lr`` path); each is counted once per call. The steps
counted: config validations (``Config.check``, the work of ``validate``), registry look-ups, host splits,
lock acquisitions, checkpoint record reads and state restores, builds. Works on any revision
(it matches functions by name and file), so the numbers compare before and after a change.
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
from pathlib import Path

STEPS = {  # (file name, function name) -> what it counts
    ("config.py", "check"): "config validated (Config.check: the work of validate)",
    ("registry.py", "get"): "registry look-up",
    ("build.py", "split_host"): "host split",
    ("distributed.py", "split_host"): "host split",
    ("rundir.py", "_acquire_lock"): "lock acquired",
    ("checkpoint.py", "read_record"): "checkpoint record read",
    ("checkpoint.py", "restore"): "checkpoint state restored",
    ("build.py", "build"): "build",
}


def trace(command: list[str]):
    """``(steps, config_receivers, options_receivers)`` while ``jaxfed`` runs ``command``."""
    from jaxfed.cli import main
    from jaxfed.options import Options

    steps, config_calls, option_calls = collections.Counter(), collections.Counter(), collections.Counter()
    package = str(Path(sys.modules["jaxfed"].__file__).parent)

    def profile(frame, event, arg):
        if event != "call" or not frame.f_code.co_filename.startswith(package):
            return
        code = frame.f_code
        where = (Path(code.co_filename).name, code.co_name)
        if where in STEPS:
            steps[STEPS[where]] += 1
        names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
        values = [frame.f_locals.get(name) for name in names]
        site = f"{Path(code.co_filename).relative_to(package)}:{code.co_name}"
        if any(type(v).__name__ == "Config" for v in values):
            config_calls[site] += 1
        elif any(isinstance(v, Options) and type(v).__name__ != "Config" for v in values):
            option_calls[site] += 1

    sys.setprofile(profile)
    try:
        code = main(command)
    finally:
        sys.setprofile(None)
    assert code == 0, command
    return steps, config_calls, option_calls


def report(title: str, traced) -> list[str]:
    steps, config_calls, option_calls = traced
    files = {site.split(":")[0] for site in config_calls}
    lines = [
        f"## {title}",
        f"- the Config reaches {len(config_calls)} functions in {len(files)} files "
        f"({sum(config_calls.values())} calls)",
        f"- the options object (lr's path) reaches {len(option_calls)} functions ({sum(option_calls.values())} calls)",
        *(f"- {what}: {count}" for what, count in sorted(steps.items())),
        "- Config receivers: " + ", ".join(sorted(config_calls)),
    ]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=tempfile.mkdtemp(prefix="jaxfed-entry-"))
    args = parser.parse_args()
    out = str(Path(args.out) / "run")
    small = ["num_clients=4", "rounds=2", "checkpoint_every=2", "eval_every=2", "lr=0.1"]
    lines = report("jaxfed run --set lr=0.1 ...", trace(["run", "--quiet", "--out", out, "--set", *small]))
    lines += report("jaxfed run --resume", trace(["run", "--quiet", "--out", out, "--resume", "--set", "rounds=4"]))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
