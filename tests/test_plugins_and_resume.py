"""Plugins and the sweep resume as research code uses them: two plugin files of one name, a plugin
fixed after failing midway, a sweep resumed with another command (each test failed before its fix)."""

import pytest

from jaxfed.algorithms import registry
from jaxfed.errors import ConfigError

PLUGIN = """import jaxfed
from jaxfed.algorithms.fedavg import FedAvgOptions, fedavg
jaxfed.register({name!r}, FedAvgOptions, lambda model, options, config: fedavg(model, options))
{tail}
"""


def test_two_plugin_files_with_one_file_name_both_register(tmp_path):
    # a/plug.py and b/plug.py: the second used to be skipped silently (its module name,
    # jaxfed_plugin_plug, was taken), so `--plugin a/plug.py --plugin b/plug.py` lost b's algorithms
    for folder, name in (("a", "audit_same_stem_a"), ("b", "audit_same_stem_b")):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "plug.py").write_text(PLUGIN.format(name=name, tail=""))
        registry.import_plugin(str(tmp_path / folder / "plug.py"))
    assert "audit_same_stem_a" in registry.names()
    assert "audit_same_stem_b" in registry.names()


def test_a_plugin_fixed_after_failing_midway_imports_again(tmp_path):
    # a plugin that registered, then raised: its registration stayed, so importing the fixed
    # file again (a notebook, a retried jaxfed.run) failed with "exists already" instead of working
    plugin = tmp_path / "midway.py"
    plugin.write_text(PLUGIN.format(name="audit_midway", tail="raise RuntimeError('typo')"))
    with pytest.raises(ConfigError, match="typo"):
        registry.import_plugin(str(plugin))
    assert "audit_midway" not in registry.names()
    plugin.write_text(PLUGIN.format(name="audit_midway", tail=""))
    registry.import_plugin(str(plugin))
    assert "audit_midway" in registry.names()


def test_sweep_resume_with_another_command_is_refused_not_run_beside_the_sweep(tmp_path, capsys):
    # `jaxfed sweep --out S --resume` with a command that names none of S's members (forgot the
    # algorithm or grid, as `jaxfed run --out R --resume` allows) used to start a new sweep
    # (fedavg at the default rounds) inside S, beside the members it was meant to continue
    from jaxfed.cli import main

    out = str(tmp_path / "sweep")
    tiny = ["--set", "num_clients=4", "rounds=1"]
    assert main(["sweep", "fedavg", "--quiet", "--grid", "local_epochs=1,2", "--out", out, *tiny]) == 0
    before = sorted(p.name for p in (tmp_path / "sweep").iterdir())
    capsys.readouterr()
    assert main(["sweep", "fedavg", "--quiet", "--out", out, "--resume", *tiny]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "none of this sweep's members" in err, err
    assert sorted(p.name for p in (tmp_path / "sweep").iterdir()) == before
