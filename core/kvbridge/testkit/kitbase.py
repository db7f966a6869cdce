"""What every kit class shares: capability skips, strict expected failures, the override meta-test, leak checks.

A kit class (``BackendTests``, ``StateTypeTests``) is subclassed by a plugin's ``test_conformance.py``.
The subclass may declare known gaps, which run as strict xfails (a gap that gets fixed fails loudly)::

    known_failures = {"test_byte_exact_delivery[pt4-dt1]": "engine drops the last descriptor, issue #12"}

or override a kit test, but only with ``@pytest.mark.xfail(strict=True, reason=...)`` on the override;
``test_no_overrides`` fails when a kit test is deleted (set to None) or overridden without one.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

import pytest

from kvbridge.testkit.checked import Tracker
from kvbridge.testkit.leaks import (
    Snapshot,
    pop_private_tempdir,
    prime_process_singletons,
    push_private_tempdir,
)
from kvbridge.testkit.plugin import MARK_HARDWARE, MARK_REQUIRES

__all__ = ["KitTests", "kit_tests", "override_problems"]


def _is_kit_class(cls: type) -> bool:
    return bool(cls.__dict__.get("_kvbridge_kit_class", False))


def kit_tests(cls: type) -> dict[str, tuple[type, Any]]:
    """Every test the kit defines for ``cls``: name -> (defining kit class, function)."""
    out: dict[str, tuple[type, Any]] = {}
    for klass in reversed(cls.__mro__):
        if _is_kit_class(klass):
            for name, value in klass.__dict__.items():
                if name.startswith("test_") and callable(value):
                    out[name] = (klass, value)
    return out


def _strict_xfail(func: Any) -> bool:
    for mark in getattr(func, "pytestmark", []):
        if mark.name == "xfail" and mark.kwargs.get("strict") is True and mark.kwargs.get("reason"):
            return True
    return False


def override_problems(cls: type) -> list[str]:
    """Kit tests that ``cls`` deleted or overrode without a strict xfail, and malformed known_failures."""
    problems = []
    tests = kit_tests(cls)
    for name, (kit_class, _func) in sorted(tests.items()):
        owner = next(k for k in cls.__mro__ if name in k.__dict__)
        if owner is kit_class or _is_kit_class(owner):
            continue
        value = owner.__dict__[name]
        where = f"{owner.__qualname__}.{name}"
        if value is None or not callable(value):
            problems.append(f"{where} deletes the kit test {kit_class.__name__}.{name}; declare the gap in "
                            "known_failures (a strict xfail) instead")
        elif not _strict_xfail(value):
            problems.append(f"{where} overrides the kit test {kit_class.__name__}.{name} without "
                            "@pytest.mark.xfail(strict=True, reason=...)")
    for key, reason in dict(getattr(cls, "known_failures", {})).items():
        base = key.split("[", 1)[0]
        if base not in tests:
            problems.append(f"known_failures names {key!r}, which is not a kit test "
                            f"(kit tests: {', '.join(sorted(tests))})")
        if not isinstance(reason, str) or not reason.strip():
            problems.append(f"known_failures[{key!r}] needs a reason (an issue link, what is wrong)")
    return problems


_RESOLVED: dict[type, Any] = {}   # kit class -> its spec, or why it has none


class KitTests:
    """Base of the kit's test classes (see the module docstring)."""

    _kvbridge_kit_class: ClassVar[bool] = True
    #: test name (``test_x`` or ``test_x[param-id]``) -> reason; those tests run as strict xfails
    known_failures: ClassVar[Mapping[str, str]] = {}
    #: run the leak checks after every test (file descriptors, threads, children, /dev/shm segments and files,
    #: temporary files, handles; see :mod:`kvbridge.testkit.leaks`)
    check_leaks: ClassVar[bool] = True
    leak_grace_s: ClassVar[float] = 3.0
    #: name prefixes of threads the plugin keeps for the life of the process (say why where you set it)
    leak_allowed_threads: ClassVar[tuple[str, ...]] = ()
    #: class-scoped fixtures whose agents outlive a test: tests using them are checked for threads and
    #: file descriptors when the class ends (engines may start per-backend threads on first use)
    shared_fixtures: ClassVar[tuple[str, ...]] = ("kv_world",)
    #: capability -> what a plugin that does not declare it loses (appended to the skip reason of its tests)
    _kvbridge_capability_notes: ClassVar[Mapping[str, str]] = {}

    # ---------------------------------------------------------------- subclass interface
    #: the class attribute that names the installed plugin under test (the alternative to ``spec``)
    _kvbridge_name_attr: ClassVar[str] = ""

    @classmethod
    def _kvbridge_lookup(cls, name: str) -> Any:
        """The installed spec called ``name``, or why there is none (a string)."""
        raise NotImplementedError

    @classmethod
    def _kvbridge_resolve(cls) -> Any:
        """The spec under test (``spec``, else the installed one named), or why it cannot be had (a string)."""
        cached = _RESOLVED.get(cls)
        if cached is None:
            attr = cls._kvbridge_name_attr
            if getattr(cls, "spec", None) is not None:
                cached = cls.spec  # type: ignore[attr-defined]
            elif not getattr(cls, attr, ""):
                cached = (f"{cls.__name__} names no {attr.replace('_', ' ')}: set `{attr} = \"<name>\"` "
                          "or `spec = ...`")
            else:
                cached = cls._kvbridge_lookup(getattr(cls, attr))
            _RESOLVED[cls] = cached
        return cached

    @classmethod
    def _kvbridge_spec_or_skip(cls) -> Any:
        """The spec under test; skips the calling test (or class-scoped fixture) when it cannot be had."""
        spec = cls._kvbridge_resolve()
        if isinstance(spec, str):
            pytest.skip(spec)
        return spec

    @classmethod
    def _kvbridge_subject(cls) -> str:
        spec = getattr(cls, "spec", None)
        return spec.name if spec is not None else str(getattr(cls, cls._kvbridge_name_attr, ""))

    @classmethod
    def _kvbridge_capabilities(cls) -> frozenset[str]:
        return frozenset()

    @classmethod
    def _kvbridge_unavailable(cls, config: pytest.Config) -> str:
        """Why this class cannot run here ("" when it can)."""
        return ""

    @classmethod
    def _kvbridge_tracker(cls) -> Tracker:
        tracker = cls.__dict__.get("_kvbridge_tracker_obj")
        if tracker is None:
            tracker = Tracker()
            cls._kvbridge_tracker_obj = tracker  # type: ignore[attr-defined]
        return tracker

    # ---------------------------------------------------------------- collection (called by plugin.py)
    @classmethod
    def _kvbridge_marks(cls, item: pytest.Item, config: pytest.Config) -> list[pytest.MarkDecorator]:
        marks = []
        why = cls._kvbridge_unavailable(config)
        if why:
            return [pytest.mark.skip(reason=why)]
        declared = cls._kvbridge_capabilities()
        name = getattr(item, "name", "")
        original = getattr(item, "originalname", name)
        needed = [getattr(c, "value", c) for mark in item.iter_markers(MARK_REQUIRES) for c in mark.args]
        defined_in = kit_tests(cls).get(original, (None, None))[0]
        needed += list(defined_in.__dict__.get("_kvbridge_tier_requires", ())) if defined_in is not None else []
        for value in dict.fromkeys(needed):
            if value not in declared:
                note = cls._kvbridge_capability_notes.get(value, "")
                marks.append(pytest.mark.skip(reason=f"'{cls._kvbridge_subject()}' does not declare {value}"
                                                     + (f": {note}" if note else "")))
        known = dict(cls.known_failures)
        reason = known.get(name) or known.get(original)
        if reason:
            marks.append(pytest.mark.xfail(strict=True, reason=reason))
        return marks

    # ---------------------------------------------------------------- the meta-test
    def test_no_overrides(self) -> None:
        """Every kit test still runs: none deleted, none overridden without a strict xfail.

        Troubleshooting: to declare a known gap, add it to ``known_failures`` (name -> reason, an issue
        link); to replace a kit test, decorate the override with ``@pytest.mark.xfail(strict=True,
        reason=...)``. Never set a kit test to None.
        """
        problems = override_problems(type(self))
        assert not problems, "the conformance kit was trimmed:\n  " + "\n  ".join(problems)

    # ---------------------------------------------------------------- leak checks
    @pytest.fixture(autouse=True)
    def _kvbridge_checks(self, request: pytest.FixtureRequest) -> Iterator[None]:
        if type(self).test_no_overrides is not KitTests.test_no_overrides:
            pytest.fail("test_no_overrides must not be overridden", pytrace=False)
        if not self.check_leaks:
            yield
            return
        prime_process_singletons(cuda=request.node.get_closest_marker(MARK_HARDWARE) is not None
                                 and self._kvbridge_uses_cuda(request.config))
        tracker = self._kvbridge_tracker()
        tracker.new_violations()                         # earlier ones were reported where they happened
        handles_before = {id(b): b.outstanding_handles() for b in tracker.backends}
        snapshot = Snapshot.take()
        yield
        problems = tracker.new_violations()
        for backend in list(tracker.backends):
            before = handles_before.get(id(backend))
            if before is None:                           # made by this test: closed, nothing left behind
                if not backend.closed:
                    problems.append(f"{backend.label} was created by this test and never closed")
                problems.extend(backend.leaks())
            elif backend.outstanding_handles() > before:  # a shared backend: no new unreleased handles
                problems.append(f"{backend.label}: {backend.outstanding_handles() - before} transfer handle(s) "
                                "of this test were never released")
        shared = any(name in request.fixturenames for name in self.shared_fixtures)
        leaked = snapshot.leaked(self.leak_grace_s, threads_and_fds=not shared,
                                 allowed_threads=self.leak_allowed_threads)
        if leaked:    # reported here, so the class's check at its end does not report the same things again
            self._kvbridge_absorb(Snapshot.take())
        problems += leaked
        tracker.forget_closed()
        if problems:
            pytest.fail(f"{self._kvbridge_subject()}: this test leaked:\n  " + "\n  ".join(problems), pytrace=False)

    @classmethod
    def _kvbridge_absorb(cls, now: Snapshot) -> None:
        baseline = cls.__dict__.get("_kvbridge_class_baseline")
        if baseline is not None:
            cls._kvbridge_class_baseline = baseline.merged(now)  # type: ignore[attr-defined]

    @classmethod
    def _kvbridge_uses_cuda(cls, config: pytest.Config) -> bool:
        """Will this class's hardware tier touch CUDA here (so its context must be primed)?"""
        return False

    @classmethod
    def _kvbridge_prime(cls, config: pytest.Config) -> None:
        """Make what lives until the process exits before the first baseline is taken: the ZMQ context,
        the CUDA context when the hardware tier runs, and the registry of every installed plugin (the kit
        builds it lazily - with ``spec = ...`` inside the first multi-process test - and building it runs
        the engines' probes, whose threads and descriptors belong to no plugin under test)."""
        prime_process_singletons(cuda=cls._kvbridge_uses_cuda(config))
        from kvbridge.testkit.checked import installed_registry

        try:
            installed_registry()
        except Exception:  # noqa: BLE001 - a broken installation is reported by the test that needs it
            pass

    @pytest.fixture(scope="class", autouse=True)
    @classmethod
    def _kvbridge_class_checks(cls, request: pytest.FixtureRequest) -> Iterator[None]:
        if not cls.check_leaks:
            yield
            return
        push_private_tempdir()
        try:
            cls._kvbridge_prime(request.config)
            cls._kvbridge_prime_subject(request)
            cls._kvbridge_class_baseline = Snapshot.take()  # type: ignore[attr-defined]
            try:
                yield
            finally:
                baseline = cls.__dict__["_kvbridge_class_baseline"]
                del cls._kvbridge_class_baseline  # type: ignore[attr-defined]
            problems = cls._kvbridge_tracker().problems() + baseline.leaked(cls.leak_grace_s,
                                                                           allowed_threads=cls.leak_allowed_threads)
        finally:
            pop_private_tempdir()
        if problems:
            _report_against_class(request, f"{cls._kvbridge_subject()}: the class {cls.__qualname__} leaked "
                                           "(found when its last test ended, after its shared fixtures closed; "
                                           "not caused by that test alone):\n  " + "\n  ".join(problems))

    @classmethod
    def _kvbridge_prime_subject(cls, request: pytest.FixtureRequest) -> None:
        """Build the plugin under test once before the class's baseline, so the engine runtime it starts for the
        life of the process (threads, descriptors, files) is the baseline's, not the first test's."""


def _report_against_class(request: pytest.FixtureRequest, text: str) -> None:
    """Report a failure of the class as a whole: an error whose node is the class, not its last test (a
    class-scoped fixture that raised in teardown would be reported as that test's teardown error)."""
    node = request.node
    path = node.nodeid.split("::", 1)[0]
    report = pytest.TestReport(nodeid=node.nodeid, location=(path, None, node.nodeid.split("::", 1)[-1]),
                        keywords={node.name: 1}, outcome="failed", longrepr=text, when="teardown")
    node.ihook.pytest_runtest_logreport(report=report)
