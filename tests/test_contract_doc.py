"""docs/contract.md against the code: the record's field order and defaults, every function's
signature (the Protocols of jaxfed/contract.py), the RoundInfo fields and TrainingOptions' fields,
so that the page cannot drift from the code; and the example in FederatedAlgorithm's docstring runs."""

from __future__ import annotations

import dataclasses
import inspect
import re
import textwrap
import typing
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import make_federation

from jaxfed.contract import Aggregation, FederatedAlgorithm, RoundInfo
from jaxfed.options import TrainingOptions

DOC = Path(__file__).resolve().parents[1] / "docs" / "contract.md"
SIGNATURE_ROW = re.compile(r"^\| `(\w+)` \| `(\w+)\(([^)]*)\) -> [^`]+` \|")
TABLE_ROW = re.compile(r"^\| `(\w+)` \| (.*?) \|")


def protocols(record=FederatedAlgorithm) -> dict[str, type]:
    """``{field: Protocol}`` of the record's function fields, from their annotations; a field that
    is itself a record of functions (``aggregation``) gives its own fields."""
    found = {}
    for name, hint in typing.get_type_hints(record).items():
        for kind in typing.get_args(hint) or (hint,):
            if getattr(kind, "_is_protocol", False):
                found[name] = kind
            elif isinstance(kind, type) and issubclass(kind, tuple) and hasattr(kind, "_fields"):
                found.update(protocols(kind))
    return found


def parameters(protocol: type) -> list[str]:
    return [p for p in inspect.signature(protocol.__call__).parameters if p != "self"]


def documented_args(protocol: type) -> list[str]:
    """The names of the ``Args:`` section of the Protocol's ``__call__`` docstring."""
    doc = inspect.getdoc(protocol.__call__) or ""
    section = doc.split("Args:", 1)[1].split("Returns:", 1)[0] if "Args:" in doc else ""
    return re.findall(r"^  (\w+):", section, flags=re.M)


def record_block(text: str) -> list[tuple[str, str | None]]:
    """``[(field, default or None)]`` of the ``FederatedAlgorithm(...)`` block, in order."""
    block = text.split("```python\nFederatedAlgorithm(", 1)[1].split("\n)\n", 1)[0]
    code = " ".join(line.split("#", 1)[0] for line in block.splitlines())
    fields = []
    for part in (p.strip() for p in code.split(",")):
        if part:
            name, _, default = part.partition("=")
            fields.append((name.strip(), default.strip() or None))
    return fields


def section(text: str, heading: str) -> list[str]:
    """The lines of the section under ``heading`` (up to the next heading of any level)."""
    lines = text.split(heading + "\n", 1)[1].splitlines()
    return [line for line in lines[: next((i for i, x in enumerate(lines) if x.startswith("#")), len(lines))]]


def table_after(lines: list[str], marker: str) -> dict[str, str]:
    """``{first cell: second cell}`` of the first table after the line containing ``marker``."""
    start = next(i for i, line in enumerate(lines) if marker in line)
    rows = {}
    for line in lines[start + 1 :]:
        if rows and not line.startswith("|"):
            break
        match = TABLE_ROW.match(line)
        if match:
            rows[match.group(1)] = match.group(2)
    return rows


def problems(text: str, record=FederatedAlgorithm, info=RoundInfo, training=TrainingOptions) -> list[str]:
    """Every way ``text`` (docs/contract.md) disagrees with the code; [] when they agree."""
    found = []
    fields = record_block(text)
    if [name for name, _ in fields] != list(record._fields):
        found.append(f"record fields: the page has {[n for n, _ in fields]}, the code {list(record._fields)}")
    for name, default in fields:
        if name in record._field_defaults and default != repr(record._field_defaults[name]):
            found.append(
                f"record field {name}: the page's default {default}, the code's {record._field_defaults[name]!r}"
            )
        if name not in record._field_defaults and default is not None and name in record._fields:
            found.append(f"record field {name}: required in the code, the page gives a default")

    functions = protocols(record)
    rows = {}
    for line in text.splitlines():
        match = SIGNATURE_ROW.match(line)
        if match:
            field, called, args = match.groups()
            if field != called:
                found.append(f"signature row {field}: names the function {called}")
            rows[field] = [a.strip() for a in args.split(",") if a.strip()]
    for name, protocol in functions.items():
        if name not in rows:
            found.append(f"{name}: no signature on the page")
        elif rows[name] != parameters(protocol):
            found.append(
                f"{name}: the page has ({', '.join(rows[name])}), the code ({', '.join(parameters(protocol))})"
            )
        if documented_args(protocol) != parameters(protocol):
            found.append(f"{protocol.__name__}: its Args {documented_args(protocol)} are not {parameters(protocol)}")
    for name in rows.keys() - functions.keys():
        found.append(f"{name}: a signature on the page but no function field of the record")

    info_rows = table_after(section(text, "## The round information"), "RoundInfo(")
    if list(info_rows) != [f.name for f in dataclasses.fields(info)]:
        found.append(
            f"RoundInfo: the page has {list(info_rows)}, the code {[f.name for f in dataclasses.fields(info)]}"
        )

    option_rows = table_after(section(text, "## Options and registration"), "`TrainingOptions`' fields")
    declared = {f.name: repr(f.default) for f in dataclasses.fields(training)}
    if list(option_rows) != list(declared):
        found.append(f"TrainingOptions: the page has {list(option_rows)}, the code {list(declared)}")
    for name, default in declared.items():
        if name in option_rows and option_rows[name] != f"`{default}`":
            found.append(f"TrainingOptions.{name}: the page's default {option_rows[name]}, the code's {default}")
    return found


def test_the_contract_page_matches_the_code():
    assert problems(DOC.read_text()) == []


def test_every_function_field_has_a_protocol():
    functions = protocols()
    data_fields = {"name", "num_tiers", "evaluates_global", "eval_model", "aggregation", "options"}
    assert set(functions) == set(FederatedAlgorithm._fields) - data_fields | set(Aggregation._fields)


def _swap(text: str, a: str, b: str) -> str:
    return text.replace(a, "\0").replace(b, a).replace("\0", b)


@pytest.mark.parametrize(
    "change, expected",
    [
        (lambda t: _swap(t, "num_tiers=None", "receive=None"), "record fields"),
        (lambda t: t.replace("`contribute(server_state, message_up, weight, info)", "`contribute(m, w)"), "contribute"),
        (lambda t: t.replace("global_params=None,", "global_params=0,"), "record field global_params"),
        (lambda t: t.replace("`broadcast(server_state, info)", "`broadcast(server_state, tier)"), "broadcast"),
        (
            lambda t: t.replace("`client_update(message_down, client_state, data, rng, info)", "`client_update(m)"),
            "client_update",
        ),
        (
            lambda t: t.replace("| `eval_server` | `eval_server(", "| `eval_server` | eval_server("),
            "eval_server: no signature",
        ),
        (lambda t: t.replace("| `round` |", "| `index` |"), "RoundInfo"),
        (lambda t: t.replace("| `clip_norm` | `0.0` |", "| `clip_norm` | `1.0` |"), "TrainingOptions.clip_norm"),
        (lambda t: t.replace("| `local_epochs` | `2` | local epochs per round |\n", ""), "TrainingOptions"),
    ],
)
def test_the_check_sees_a_page_that_drifted(change, expected):
    text = DOC.read_text()
    changed = change(text)
    assert changed != text, "the change did not apply: update this test with the page"
    found = problems(changed)
    assert found and any(expected in p for p in found), found


class _ChangedServerUpdate(typing.Protocol):
    def __call__(self, server_state, messages_up, weights):
        """Args:
        server_state: s.
        messages_up: m.
        weights: w.
        """


def test_the_check_sees_code_that_drifted():
    text = DOC.read_text()
    reordered = typing.NamedTuple("Reordered", [(f, typing.Any) for f in reversed(FederatedAlgorithm._fields)])
    assert any("record fields" in p for p in problems(text, record=reordered))
    hints = typing.get_type_hints(FederatedAlgorithm)
    changed = typing.NamedTuple(
        "Changed", [(f, _ChangedServerUpdate if f == "server_update" else hints[f]) for f in FederatedAlgorithm._fields]
    )
    assert any(p.startswith("server_update: the page has") for p in problems(text, record=changed))

    @dataclasses.dataclass(frozen=True)
    class MoreOptions(TrainingOptions):
        warmup: int = 0

    assert any(p.startswith("TrainingOptions: the page has") for p in problems(text, training=MoreOptions))


def test_the_example_in_the_record_runs(mlp, digits):
    """FederatedAlgorithm's docstring example, run for two rounds by the engine: it learns."""
    from jaxfed.algorithms.training import train_classifier
    from jaxfed.core import mean_of, weighted_share
    from jaxfed.simulation import Simulation

    doc = FederatedAlgorithm.__doc__
    example = textwrap.dedent(doc.split("A minimal FedAvg::\n", 1)[1].split("\n    Attributes:", 1)[0])
    options = TrainingOptions(lr=0.1, local_epochs=1, batch_size=32)
    scope = {"model": mlp, "options": options, "train_classifier": train_classifier}
    scope |= {"FederatedAlgorithm": FederatedAlgorithm, "Aggregation": Aggregation}
    scope |= {"weighted_share": weighted_share, "mean_of": mean_of}
    exec(compile(example, "FederatedAlgorithm example", "exec"), scope)
    sim = Simulation(scope["fedavg"], mlp, make_federation(digits, num_clients=4, alpha=1.0), participation=1.0)
    state, metrics = sim.run_rounds(sim.init(), 2)
    assert int(state.round) == 2 and np.all(np.isfinite(np.asarray(metrics["train_loss"])))
    assert sim.evaluate(state)["global_acc"] > 0.5
    assert jax.tree.structure(state.server) == jax.tree.structure(sim.init().server)
