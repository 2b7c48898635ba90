"""The workload kinds' registry (cachekeeper/builder/kinds/): a kind is one module behind one
protocol, registered by its table name.

The proof that adding a kind is its module and its tests: a toy kind, defined here and
registered from this test module, is read by the workload parser (with the file's own error
messages), listed in ``Workload.code`` so the agent's allowlist refuses or admits it, and
makes the server's admin rule ask for the admin scope (a real app, in this process, so it
sees this process's registry), with no edit anywhere else. Unregistered, its table is an
unknown key again.
"""

from __future__ import annotations

import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from cachekeeper.builder import kinds
from cachekeeper.builder.allowlist import Allowlist
from cachekeeper.builder.confine import Confinement
from cachekeeper.builder.kinds import CodeRef, ProcessKind, Validator
from cachekeeper.builder.kinds.base import is_import_path
from cachekeeper.builder.verdicts import CommandRun, Progress
from cachekeeper.builder.workload import parse_workload
from cachekeeper.errors import WorkloadInvalid
from cachekeeper.server.settings import Settings
from cachekeeper.workload import LIMITS
from tests.helpers.in_process import in_process


@dataclass(frozen=True)
class Toy:
    factory: str
    size: int


class ToyKind(ProcessKind):
    """``[[toy]]``: a factory called with a size, in a process of its own."""

    table = "toy"
    limits = {"toy": 2}

    def parse(self, v: Validator, raw: dict[str, Any], *, where: str) -> Toy:
        v.unknown_keys(raw, frozenset({"factory", "size"}), where)
        factory = v.required(raw, "factory", str, where)
        if not is_import_path(factory):
            v.fail(f"{where}.factory", f"{factory!r} is not an import path")
        return Toy(factory=factory, size=v.positive(raw, "size", where))

    def code(self, spec: Toy, *, where: str) -> tuple[CodeRef, ...]:
        return (CodeRef("import", spec.factory, f"{where}.factory"),)

    def describe(self, spec: Toy) -> str:
        return f"{spec.factory} x{spec.size}"

    def run(
        self,
        spec: Toy,
        *,
        index: int,
        mode: str,
        cache_dir: Path,
        work: Path,
        progress: Progress | None,
        timeout_s: float | None,
        confinement: Confinement | None,
    ) -> CommandRun:
        argv = ["python", "-c", f"import {spec.factory.split(':')[0]}"]
        return CommandRun(
            index=index,
            mode=mode,
            command=shlex.join(argv),
            status="invalid",
            seconds=0.0,
            table=self.table,
        )


TOY = ToyKind()
TEXT = 'name = "w"\n[[toy]]\nfactory = "pkg.toys:make"\nsize = 3\n'


@pytest.fixture
def toy() -> Iterator[ToyKind]:
    kinds.register(TOY)
    try:
        yield TOY
    finally:
        kinds.unregister("toy")


def _error(text: str) -> str:
    with pytest.raises(WorkloadInvalid) as caught:
        parse_workload(text, source="t.toml")
    return caught.value.detail


def test_the_built_in_kinds_are_registered_by_table_name() -> None:
    assert [k.table for k in kinds.kinds()] == ["attention", "entrypoint", "command"]
    (command,) = parse_workload('name = "w"\n[[command]]\nargv = ["a b"]\n', source="t").tables
    assert kinds.kind_named("command") is command.kind
    assert command.kind.describe(command.spec) == "'a b'"
    # the public name keeps every limit docs/workloads.md lists, the kinds' included
    assert LIMITS == {
        "bytes": 1 << 20,
        "attention": 64,
        "seq_lens": 64,
        "calls": 256,
        "entrypoint": 64,
        "command": 16,
        "argv": 1024,
        "env": 256,
    }


def test_a_registered_kind_is_read_with_the_files_own_errors(toy: ToyKind) -> None:
    assert kinds.kinds()[-1] is toy and kinds.kind_named("toy") is toy
    workload = parse_workload(TEXT, source="t.toml")
    (table,) = workload.tables
    assert (table.kind, table.name, table.spec) == (toy, "toy[0]", Toy("pkg.toys:make", 3))
    assert workload.specs("toy") == (Toy("pkg.toys:make", 3),)
    assert workload.process_tables == (table,) and workload.device_tables == ()
    assert toy.describe(table.spec) == "pkg.toys:make x3"
    run = toy.run(
        table.spec,
        index=0,
        mode="verify",
        cache_dir=Path("."),
        work=Path("."),
        progress=None,
        timeout_s=None,
        confinement=None,
    )
    assert run.to_dict()["name"] == "toy[0]"  # its verdict names its table
    assert _error(TEXT + "colour = 1\n") == (
        "t.toml: toy[0].colour: unknown key (allowed: factory, size)"
    )
    assert _error(TEXT.replace("size = 3", "size = 0")) == (
        "t.toml: toy[0].size: must be a positive integer, got 0"
    )
    three = TEXT + "[[toy]]\nfactory = 'a:b'\nsize = 1\n" * 2
    assert _error(three) == (
        "t.toml: toy: 3 [[toy]] tables; at most 2 in a workload (docs/workloads.md, 'Limits')"
    )
    assert _error('name = "w"\n') == (
        "t.toml: a workload needs at least one [[attention]], [[entrypoint]], [[command]]"
        " or [[toy]] table"
    )
    mixed = parse_workload(TEXT + '[[command]]\nargv = ["x"]\n', source="t.toml")
    assert [t.name for t in mixed.tables] == ["command[0]", "toy[0]"]  # registration order


def test_unregistered_its_table_is_an_unknown_key_again() -> None:
    assert _error(TEXT) == (
        "t.toml: toy: unknown key (allowed: attention, command, entrypoint, name, process)"
    )
    assert _error('name = "w"\n') == (
        "t.toml: a workload needs at least one [[attention]], [[entrypoint]] or [[command]] table"
    )


def test_register_refuses_a_taken_or_malformed_table_name(toy: ToyKind) -> None:
    class Named(ToyKind):
        pass

    for table, why in (
        ("toy", "a kind is registered for it already"),
        ("command", "a kind is registered for it already"),
        ("name", "is a key of the workload file itself"),
        ("process", "is a key of the workload file itself"),
        ("Toy", "must be a lower-case name"),
    ):
        Named.table = table
        Named.limits = {table: 1}
        with pytest.raises(ValueError, match=why):
            kinds.register(Named())
    Named.table, Named.limits = "other", {}
    with pytest.raises(ValueError, match=r"its limits must bound its tables \(limits\['other'\]\)"):
        kinds.register(Named())
    assert [k.table for k in kinds.kinds()] == ["attention", "entrypoint", "command", "toy"]


def test_the_allowlist_judges_a_new_kinds_code(toy: ToyKind) -> None:
    workload = parse_workload(TEXT, source="t.toml")
    assert [(r.form, r.value, r.where) for r in workload.code] == [
        ("import", "pkg.toys:make", "toy[0].factory")
    ]
    (refused,) = Allowlist().refused(workload)
    assert (refused.ref.where, refused.why) == ("toy[0].factory", "no import entry matches it")
    assert "agent --allow 'pkg.toys:make'" in Allowlist().explain([refused])
    assert Allowlist.load(["pkg.toys:make"]).refused(workload) == ()


def test_the_admin_rule_asks_for_the_admin_scope_for_a_new_kinds_code(
    toy: ToyKind, tmp_path: Path
) -> None:
    tokens = {"w-tok": "write", "a-tok": "admin"}
    with in_process(Settings(data_dir=tmp_path / "data", tokens=tokens)) as server:

        def put(token: str) -> Any:
            headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/toml"}
            return server.client.put("/v1/workloads/w", content=TEXT.encode(), headers=headers)

        refused = put("w-tok")
        assert refused.status_code == 403, refused.text
        assert refused.json()["detail"] == (
            "workload 'w' holds code a builder would run (toy[0].factory = 'pkg.toys:make'):"
            " registering it needs the 'admin' scope; the token has 'write'"
        )
        assert put("a-tok").status_code == 200
