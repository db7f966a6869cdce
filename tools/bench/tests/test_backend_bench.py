"""``kvbridge bench --backend NAME`` finds a backend's benchmark through its spec (``BackendSpec.bench``), else
the one kvbridge-bench ships for it (nixl), never by importing a plugin by name; what cannot run says why."""

from __future__ import annotations

import pytest

from kvbridge.plugin import BackendSpec, hookimpl
from kvbridge_bench import micro
from kvbridge_bench._internals import Registry


class _Benched:
    ran: list[str] = []

    @staticmethod
    @hookimpl
    def kvbridge_transfer_backends() -> list[BackendSpec]:
        factory = "kvbridge.backends.loopback:LoopbackBackend"
        return [BackendSpec(name="benched", factory=factory, bench=lambda: _Benched.ran.append("x") or 7),
                BackendSpec(name="plain", factory=factory),
                BackendSpec(name="broken", factory=factory, bench="kvbridge_no_such_module:main"),
                BackendSpec(name="nixl", factory=factory)]          # a nixl spec without a bench of its own


def test_a_backend_benchmark_is_found_through_its_spec(capsys: pytest.CaptureFixture[str],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    registry = Registry.build(entry_points=False, plugins=[_Benched])
    assert micro.main_backend("benched", registry) == 7 and _Benched.ran == ["x"]
    assert micro.main_backend("plain", registry) == 2
    assert "ships no benchmark" in capsys.readouterr().out
    assert micro.main_backend("absent", registry) == 2
    assert "no backend named 'absent' is installed" in capsys.readouterr().out
    assert micro.main_backend("broken", registry) == 2
    assert "cannot load its benchmark (kvbridge_no_such_module:main)" in capsys.readouterr().out
    ran: list[str] = []
    monkeypatch.setitem(micro.BACKEND_BENCHMARKS, "nixl", lambda: ran.append("nixl") or 0)
    assert micro.main_backend("nixl", registry) == 0 and ran == ["nixl"]


def test_the_nixl_benchmark_is_this_packages_own() -> None:
    assert micro.BACKEND_BENCHMARKS["nixl"] == "kvbridge_bench.nixl_backend:main"
    from kvbridge_bench import nixl_backend

    assert callable(nixl_backend.main)
