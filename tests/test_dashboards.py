"""The Grafana dashboard and the Prometheus alerting rules under ``deploy/`` name only what kvbridge exports.

Every ``kvbridge_*`` name in either file (PromQL, descriptions, annotations) must be a series prometheus_client
exposes for a metric that ``kvbridge.metrics`` declares, spelled as exposed: a counter's ``_total``, a
histogram's ``_bucket`` / ``_sum`` / ``_count``, a gauge's bare name. Every label that an expression's selector
matches, that it groups by (``by``, ``without``, ``on``, ``ignoring``) or that a legend (``{{label}}``) or an
annotation (``$labels.label``) prints must be a label of every series the expression names (``le``: ``_bucket``
only); a printed label must also survive the expression's ``by (...)``.

The exported series come from prometheus_client itself, not from the source text: the metrics are created lazily
(``metrics.enable``), so the module fixture builds them once more (``metrics._Metrics``, its ``_client`` pointed
at constructors bound to a registry of our own), makes one child of each and collects that registry. Nothing is
enabled or registered globally.

PyYAML is not installed in the project's environment: the rules file keeps a plain layout (one ``- alert:`` per
rule, its ``expr:`` on one line) that a few regular expressions read; where PyYAML is importable, a test checks
that it reads the same rules.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any, NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "deploy" / "grafana" / "kvbridge-dashboard.json"
ALERTS = ROOT / "deploy" / "prometheus" / "kvbridge-alerts.yml"

NAME = re.compile(r"\bkvbridge_[a-z0-9_]+")
STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
SELECTOR = re.compile(r"\b(kvbridge_[a-z0-9_]+)\s*\{([^}]*)\}")
MATCHER = re.compile(r"([A-Za-z_]\w*)\s*(?:=~|!~|!=|=)")
GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
LABEL_VALUES = re.compile(r"label_values\((.*),\s*(\w+)\s*\)")
LEGEND_LABEL = re.compile(r"\{\{\s*(\w+)\s*\}\}")
ANNOTATION_LABEL = re.compile(r"\$labels\.(\w+)")

DASHBOARD_NEEDS = {"kvbridge_bytes_total", "kvbridge_transfer_seconds_bucket", "kvbridge_room_failures_total",
                   "kvbridge_rooms_unsafe_overdue", "kvbridge_peer_deaths_total", "kvbridge_staged_bytes_total",
                   "kvbridge_rejected_frames_total", "kvbridge_link_dropped_frames_total",
                   "kvbridge_peer_protocol_version"}
ALERTS_NEED = {"kvbridge_rooms_unsafe_overdue", "kvbridge_room_failures_total", "kvbridge_peer_deaths_total",
               "kvbridge_rejected_frames_total", "kvbridge_staged_bytes_total", "kvbridge_transfer_seconds_bucket"}


class Expr(NamedTuple):
    where: str
    promql: str
    printed: frozenset[str]       # labels a legend or an annotation prints from its result


@pytest.fixture(scope="module")
def exported() -> dict[str, frozenset[str]]:
    """Every series name kvbridge.metrics exports -> its label names, as prometheus_client exposes them."""
    pc = pytest.importorskip("prometheus_client", reason="kvbridge[metrics] is not installed")
    from prometheus_client.metrics import MetricWrapperBase

    from kvbridge import metrics

    registry = pc.CollectorRegistry()
    made: list[tuple[Any, int]] = []

    def into_registry(kind: Callable[..., Any]) -> Callable[..., Any]:
        def build(name: str, documentation: str, labelnames: Sequence[str] = (), **kwargs: Any) -> Any:
            metric = kind(name, documentation, labelnames, registry=registry, **kwargs)
            made.append((metric, len(labelnames)))
            return metric
        return build

    client = SimpleNamespace(**{kind: into_registry(getattr(pc, kind))
                                for kind in ("Counter", "Gauge", "Histogram", "Summary", "Info", "Enum")})
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
        mp.setattr(metrics, "_client", lambda: client)
        built = metrics._Metrics()
    assert len(made) == sum(isinstance(v, MetricWrapperBase) for v in vars(built).values()) > 0
    for metric, nlabels in made:
        if nlabels:
            metric.labels(*["x"] * nlabels)       # a labelled metric exposes no series before its first child
    return {s.name: frozenset(s.labels) for family in registry.collect() for s in family.samples}


def _dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


def _panels(panels: Sequence[Mapping[str, Any]]) -> Iterator[Mapping[str, Any]]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", ()))      # a collapsed row keeps its panels


def _rules() -> list[dict[str, str]]:
    """Each rule of the alerts file: alert, expr, for, severity, summary, description (as written), text."""
    rules = []
    for chunk in re.split(r"^\s*- alert:", ALERTS.read_text(), flags=re.M)[1:]:
        fields = dict(re.findall(r"^\s+(expr|for|severity|summary|description):[ \t]*(.*)$", chunk, flags=re.M))
        expr = fields.get("expr", "").strip()
        if expr[:1] in ("'", '"') and expr[-1:] == expr[:1]:
            expr = expr[1:-1]
        rules.append({**fields, "alert": chunk.split("\n", 1)[0].strip(), "expr": expr, "text": chunk})
    return rules


def _exprs() -> list[Expr]:
    found = []
    dashboard = _dashboard()
    for var in dashboard["templating"]["list"]:
        query = var.get("query")
        query = query.get("query", "") if isinstance(query, dict) else query or ""
        if var.get("type") == "query" and (m := LABEL_VALUES.fullmatch(query.strip())):
            found.append(Expr(f"variable {var['name']}", m[1], frozenset([m[2]])))
        elif var.get("type") == "query":
            found.append(Expr(f"variable {var['name']}", query, frozenset()))
    for panel in _panels(dashboard["panels"]):
        for target in panel.get("targets", ()):
            found.append(Expr(f"panel {panel['title']!r} {target.get('refId')}", target.get("expr", ""),
                              frozenset(LEGEND_LABEL.findall(target.get("legendFormat", "")))))
    for rule in _rules():
        found.append(Expr(f"alert {rule['alert']}", rule["expr"], frozenset(ANNOTATION_LABEL.findall(rule["text"]))))
    return found


def _label_problems(expr: Expr, exported: Mapping[str, frozenset[str]]) -> list[str]:
    bare = STRING.sub('""', expr.promql)
    names = {name for name in NAME.findall(bare) if name in exported}      # unknown names: the other test
    problems = [f"{name} has no label {label!r} (it has {sorted(exported[name])})"
                for name, matchers in SELECTOR.findall(bare) if name in exported
                for label in MATCHER.findall(matchers) if label not in exported[name]]
    grouped = {label.strip() for _, labels in GROUPING.findall(bare) for label in labels.split(",") if label.strip()}
    by = {label.strip() for kind, labels in GROUPING.findall(bare) if kind == "by"
          for label in labels.split(",") if label.strip()}
    for name in sorted(names):
        problems += [f"{name} has no label {label!r} to group by or print (it has {sorted(exported[name])})"
                     for label in sorted((grouped | expr.printed) - exported[name])]
    if by:
        problems += [f"prints {label!r}, which its by ({', '.join(sorted(by))}) drops"
                     for label in sorted(expr.printed - by)]
    return problems


@pytest.mark.parametrize("path", [DASHBOARD, ALERTS], ids=lambda p: p.name)
def test_every_name_is_an_exported_series(path: Path, exported: dict[str, frozenset[str]]) -> None:
    named = set(NAME.findall(path.read_text()))
    assert named, f"{path} names no kvbridge metric"
    unknown = {}
    for name in sorted(named - exported.keys()):
        base = re.sub(r"_(total|bucket|sum|count|created)$", "", name)
        unknown[name] = sorted(s for s in exported if re.fullmatch(rf"{base}(_total|_bucket|_sum|_count)?", s))
    assert not unknown, f"{path.name} names series kvbridge does not export (name: exported look-alikes): {unknown}"


def test_every_label_exists(exported: dict[str, frozenset[str]]) -> None:
    exprs = _exprs()
    assert len(exprs) > 10
    problems = [f"{e.where}: {p}" for e in exprs for p in _label_problems(e, exported)]
    assert not problems, "\n".join(problems)


def test_dashboard_shape() -> None:
    dashboard = _dashboard()
    assert dashboard["schemaVersion"] == 39
    variables = {var["name"]: var for var in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    panels = list(_panels(dashboard["panels"]))
    assert len({p["id"] for p in panels}) == len(panels)
    for panel in panels:
        for source in [panel, *panel.get("targets", ())]:
            assert source.get("datasource", {}).get("uid") == "${datasource}", panel["title"]
    used = {name for e in _exprs() if e.where.startswith("panel") for name in NAME.findall(e.promql)}
    assert DASHBOARD_NEEDS <= used, f"no panel shows {sorted(DASHBOARD_NEEDS - used)}"


def test_rules_shape() -> None:
    rules = _rules()
    assert rules and len({r["alert"] for r in rules}) == len(rules)
    for rule in rules:
        assert NAME.search(rule["expr"]), rule["alert"]
        assert re.fullmatch(r"\d+[smh]", rule.get("for", "")), f"{rule['alert']}: no for: duration"
        assert rule.get("severity") in ("warning", "critical"), rule["alert"]
        assert rule.get("summary") and rule.get("description"), f"{rule['alert']}: no summary or description"
    used = {name for rule in rules for name in NAME.findall(rule["expr"])}
    assert ALERTS_NEED <= used, f"no rule watches {sorted(ALERTS_NEED - used)}"


def test_rules_read_the_same_with_pyyaml() -> None:
    yaml = pytest.importorskip("yaml", reason="PyYAML is not installed: the plain reader is all there is")
    loaded = yaml.safe_load(ALERTS.read_text())
    rules = [rule for group in loaded["groups"] for rule in group["rules"]]
    assert [(r["alert"], r["expr"], r["for"]) for r in rules] == [(r["alert"], r["expr"], r["for"]) for r in _rules()]
    assert all(r["labels"]["severity"] and r["annotations"]["description"] for r in rules)
