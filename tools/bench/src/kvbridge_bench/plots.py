"""PNG plots of a ``kvbridge bench transfer`` result (matplotlib, Agg backend; the optional extra
``kvbridge-bench[plots]``).

* ``<prefix>throughput-vs-page.png``: GB/s per page size (one request size, the first equal-TP pair):
  kvbridge per page layout and placement, raw NIXL writing the same bytes as one descriptor, a plain copy;
* ``<prefix>throughput-vs-tp.png``: the same per prefill -> decode TP pair (scattered pages, first page size);
* ``<prefix>throughput-vs-size.png`` (when the sweep has several request sizes): GB/s against request size, one
  line per TP pair and placement, with raw NIXL (one descriptor) and the per-page-descriptor method of the same
  run;
* ``<prefix>layerwise-timeline.png``: prefill rank 0's per-layer compute and posts, and when the decode side
  had everything, for "send at the end" and layer-wise streaming.

    written, problem = write_plots(result, "docs/results", "gpu-")   # problem: None, or why nothing was drawn
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

MISSING = ("matplotlib is not installed: no plots (pip install 'kvbridge-bench[plots]' or matplotlib>=3.8); "
           "the JSON is written anyway")


def _size(n: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


def _title(result: dict[str, Any]) -> str:
    m = result["machine"]
    if m["device"] == "cuda":
        gpus = m.get("gpus") or []
        name = gpus[0].split(",")[1].strip() if gpus and "," in gpus[0] else "GPU"
        where = f"{len(gpus)}x {name}, {m['devices'][0]} -> {m['devices'][1]}, link {m.get('link')}"
    else:
        where = f"host: {m.get('cpu')} x {m.get('cpus')}"
    return f"{where}; backend {result['settings']['backend']}; {m['date'][:10]}"


def _ok(cases: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    return [c for c in cases if not c.get("error") and c.get("gbps")]


def _bars(ax: Any, categories: list[str], series: dict[str, list[float | None]]) -> None:
    """Grouped bars, one group per category, value labels on top; missing values leave a gap."""
    n = max(1, len(series))
    width = 0.8 / n
    for i, (label, values) in enumerate(series.items()):
        xs = [k + (i - (n - 1) / 2) * width for k, v in enumerate(values) if v is not None]
        ys = [v for v in values if v is not None]
        bars = ax.bar(xs, ys, width * 0.95, label=label)
        ax.bar_label(bars, labels=[f"{y:.3g}" for y in ys], fontsize=7, padding=1)
    ax.set_xticks(range(len(categories)), categories)
    ax.set_ylabel("GB/s (median)")
    every = [v for values in series.values() for v in values if v]
    if every and max(every) / min(every) > 30:
        ax.set_yscale("log")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    ax.grid(axis="y", alpha=0.3)


def _series(rows: list[dict[str, Any]], key: Callable[[dict[str, Any]], Any], keys: list[Any]
            ) -> dict[str, list[float | None]]:
    """kvbridge per (layout, placement), then raw NIXL and copy, each as one value per key."""
    out: dict[str, list[float | None]] = {}
    seen = list(dict.fromkeys((c["layout"], c["placement"]) for c in rows))      # the run's order
    combos = sorted(seen, key=lambda lp: (lp[1] != "scattered", seen.index(lp)))
    for layout, placement in combos:
        pick = {key(c): c["gbps"] for c in rows if (c["layout"], c["placement"]) == (layout, placement)}
        out[f"kvbridge {layout}, {placement}"] = [pick.get(k) for k in keys]
    for name, field in (("raw NIXL, 1 descriptor", "raw_nixl_gbps"), ("copy (same bytes)", "copy_gbps")):
        pick = {key(c): c[field] for c in rows if c.get(field)}
        if pick:
            out[name] = [pick.get(k) for k in keys]
    return out


def write_plots(result: dict[str, Any], out_dir: str | Path, prefix: str = "") -> tuple[list[str], str | None]:
    """Draw what the result holds; returns (paths written, None) or ([], why nothing was drawn)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return [], MISSING
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: list[str] = []
    rows = [c for c in _ok(result["cases"]) if c.get("group") == "sweep"]
    title = _title(result)
    if rows:
        size = rows[0]["bytes"]
        same = [c for c in rows if c["bytes"] == size]
        pairs = list(dict.fromkeys((c["prefill_tp"], c["decode_tp"]) for c in same))
        pair = (1, 1) if (1, 1) in pairs else pairs[0]

        at_pair = [c for c in same if (c["prefill_tp"], c["decode_tp"]) == pair]
        pages = sorted({c["page_tokens"] for c in at_pair})
        fig, ax = plt.subplots(figsize=(10, 4.5))
        _bars(ax, [f"{p}-token pages" for p in pages], _series(at_pair, lambda c: c["page_tokens"], pages))
        ax.set_title(f"Throughput vs page size: {_size(size)} requests, TP {pair[0]}->{pair[1]}\n{title}",
                     fontsize=9)
        written.append(_save(fig, out / f"{prefix}throughput-vs-page.png", plt))

        page = pages[0] if pages else rows[0]["page_tokens"]
        at_page = [c for c in same if c["page_tokens"] == page]
        keys = list(dict.fromkeys((c["prefill_tp"], c["decode_tp"]) for c in at_page))
        fig, ax = plt.subplots(figsize=(10, 4.5))
        _bars(ax, [f"TP {p}->{d}" for p, d in keys],
              _series(at_page, lambda c: (c["prefill_tp"], c["decode_tp"]), keys))
        shared = sorted({c["shared_gpu"] for c in at_page if c.get("shared_gpu")})
        note = "\n(" + "; ".join(shared) + ")" if shared else ""
        ax.set_title(f"Throughput vs TP pair: {_size(size)} requests, {page}-token pages\n{title}{note}",
                     fontsize=9)
        written.append(_save(fig, out / f"{prefix}throughput-vs-tp.png", plt))

    if len({c["bytes"] for c in rows}) > 1:
        written.append(_by_size(rows, title, out / f"{prefix}throughput-vs-size.png", plt))

    lw = result.get("layerwise")
    if lw and not lw.get("error") and lw.get("modes"):
        written.append(_timeline(lw, title, out / f"{prefix}layerwise-timeline.png", plt))
    return written, None


def _by_size(rows: list[dict[str, Any]], title: str, path: Path, plt: Any) -> str:
    """GB/s against request size (log-log): kvbridge per (TP pair, layout, placement), then the baselines."""
    sizes = sorted({c["bytes"] for c in rows})
    fig, ax = plt.subplots(figsize=(10, 5))
    lines = dict.fromkeys((c["prefill_tp"], c["decode_tp"], c["layout"], c["placement"]) for c in rows)
    for pt, dt, layout, placement in lines:
        pick = {c["bytes"]: c["gbps"] for c in rows
                if (c["prefill_tp"], c["decode_tp"], c["layout"], c["placement"]) == (pt, dt, layout, placement)}
        xs = [n for n in sizes if n in pick]
        ax.plot(xs, [pick[n] for n in xs], marker="o", label=f"kvbridge TP {pt}->{dt}, {layout}, {placement}")
    for name, field, style in (("raw NIXL, 1 descriptor", "raw_nixl_gbps", "k--"),
                               ("per-page descriptors (vLLM/SGLang NIXL paths)", "per_page_gbps", "k:"),
                               ("copy (same bytes)", "copy_gbps", "k-.")):
        pick = {c["bytes"]: c[field] for c in rows if c.get(field)}
        xs = [n for n in sizes if n in pick]
        if xs:
            ax.plot(xs, [pick[n] for n in xs], style, marker="s", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(sizes, [_size(n) for n in sizes])
    ax.set_xlabel("request size (bytes one rank pair moves)")
    ax.set_ylabel("GB/s (median)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    ax.set_title(f"Throughput vs request size\n{title}", fontsize=9)
    return _save(fig, path, plt)


def _timeline(lw: dict[str, Any], title: str, path: Path, plt: Any) -> str:
    modes = [m for m in ("at_end", "layerwise") if m in lw["modes"]]
    fig, axes = plt.subplots(len(modes), 1, figsize=(9, 1.9 * len(modes) + 1.0), squeeze=False, sharex=True)
    names = {"at_end": "send everything after the last layer", "layerwise": f"layer-wise, groups of {lw['group']}"}
    for ax, mode in zip(axes[:, 0], modes):
        t = lw["modes"][mode]["timeline"]
        compute = [(g["compute"][0] * 1e3, (g["compute"][1] - g["compute"][0]) * 1e3) for g in t["groups"]]
        ax.broken_barh(compute, (1.1, 0.8), facecolors=["tab:blue", "tab:cyan"] * len(compute))
        spans = [g["post"] for g in t["groups"]] if mode == "layerwise" else [t["post_all"]]
        ax.broken_barh([(a * 1e3, (b - a) * 1e3) for a, b in spans], (1.1, 0.8), facecolors="dimgray")
        posts = [g["post"][0] * 1e3 for g in t["groups"]] if mode == "layerwise" else [t["post_all"][0] * 1e3]
        first = posts[0]
        ax.broken_barh([(first, t["done"] * 1e3 - first)], (0.1, 0.8), facecolors="tab:orange", alpha=0.6)
        ax.vlines(posts, 0.05, 0.95, colors="black", linewidth=0.6)
        end, done = t["compute_end"] * 1e3, t["done"] * 1e3
        ax.axvline(end, color="tab:red", linestyle="--", linewidth=0.8)
        ax.annotate(f"tail {done - end:.2f} ms", xy=(done, 0.5), xytext=(4, 0), textcoords="offset points",
                    fontsize=8, va="center")
        ax.set_yticks([0.5, 1.5], ["transfer\n(posts | until decode has all)", "compute | send() (grey)"],
                      fontsize=7)
        tail = lw["modes"][mode]["median_tail_s"] * 1e3
        ax.set_title(f"{names[mode]}: tail after the last layer's compute {tail:.2f} ms (median)", fontsize=8)
        ax.grid(axis="x", alpha=0.3)
    axes[-1, 0].set_xlabel("ms since the first layer's compute started (prefill rank 0)")
    group_ms = lw.get("one_group_transfer_s")
    extra = f"; one group's transfer ~{group_ms * 1e3:.2f} ms" if group_ms else ""
    fig.suptitle(f"Layer-wise streaming, {lw['case']}, {lw['layers']} layers{extra}\n{title}", fontsize=9)
    return _save(fig, path, plt)


def _save(fig: Any, path: Path, plt: Any) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)
