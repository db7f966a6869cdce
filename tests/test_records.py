"""Records with more than four fields are keyword-only (issue 11, item 4).

Reordering the fields of a record built positionally silently changes what each argument means; with
keyword-only records a reorder is harmless and a rename fails loudly. This walks every module of core and
of the plugins in this repository and checks each dataclass and msgspec Struct defined there.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pkgutil
from collections.abc import Iterator
from types import ModuleType

import msgspec
import pytest

PACKAGES = ["kvbridge", "kvbridge_ascend", "kvbridge_mamba", "kvbridge_mooncake", "kvbridge_mori",
            "kvbridge_nixl", "kvbridge_nsa", "kvbridge_swa"]
MAX_POSITIONAL_FIELDS = 4
#: "module.Class" -> why it cannot be keyword-only. Empty: every record can be.
ALLOWED: dict[str, str] = {}


def _modules(package: str) -> Iterator[ModuleType]:
    root = importlib.import_module(package)
    yield root
    for info in pkgutil.walk_packages(root.__path__, f"{package}."):
        yield importlib.import_module(info.name)


def _classes(owner: ModuleType | type, module: str) -> Iterator[type]:
    for obj in vars(owner).values():
        if inspect.isclass(obj) and obj.__module__ == module and obj is not owner:
            yield obj
            yield from _classes(obj, module)


def _init_fields(cls: type) -> list[inspect.Parameter] | None:
    """The constructor's fields of a record type, None for anything else."""
    if dataclasses.is_dataclass(cls):
        names = {f.name for f in dataclasses.fields(cls) if f.init}
    elif issubclass(cls, msgspec.Struct):
        names = set(cls.__struct_fields__)
    else:
        return None
    return [p for p in inspect.signature(cls).parameters.values() if p.name in names]


def _records() -> dict[str, list[inspect.Parameter]]:
    found: dict[str, list[inspect.Parameter]] = {}
    for package in PACKAGES:
        for module in _modules(package):
            for cls in _classes(module, module.__name__):
                fields = _init_fields(cls)
                if fields is not None:
                    found[f"{module.__name__}.{cls.__qualname__}"] = fields
    return found


RECORDS = _records()


def test_the_walk_finds_the_records_it_should() -> None:
    for name in ("kvbridge.backends.base.ComponentTransfer", "kvbridge.planner.BufferPair",
                 "kvbridge.geometry.PoolLayout", "kvbridge.protocol.wire.Hello", "kvbridge_mori.backend.MoriOptions"):
        assert name in RECORDS, name
    assert sum(len(f) > MAX_POSITIONAL_FIELDS for f in RECORDS.values()) >= 40


@pytest.mark.parametrize("name", sorted(n for n, f in RECORDS.items() if len(f) > MAX_POSITIONAL_FIELDS))
def test_records_with_more_than_four_fields_are_keyword_only(name: str) -> None:
    if name in ALLOWED:
        pytest.skip(ALLOWED[name])
    positional = [p.name for p in RECORDS[name] if p.kind is not inspect.Parameter.KEYWORD_ONLY]
    assert not positional, (f"{name} has {len(RECORDS[name])} fields and takes {positional} positionally: make it "
                            "keyword-only (@dataclass(kw_only=True) / msgspec.Struct, kw_only=True) and build it "
                            "with keywords")


def test_the_allow_list_names_only_existing_records() -> None:
    assert set(ALLOWED) <= set(RECORDS)
