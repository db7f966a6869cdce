"""Per request of a trace directory (``sitecustomize.py`` here): ms from the benchmark's ``go_whole`` to the
first write, to ``send()``'s return and to the decode's end of the request (medians; the warm-up dropped).

    python3 scripts/trace/analyze.py DIR LABEL
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path


def main() -> None:
    events: list[tuple[float, str]] = []
    for path in Path(sys.argv[1]).glob("trace-*.txt"):
        for line in path.read_text().splitlines():
            stamp, name, *_ = line.split(" ", 2)
            events.append((float(stamp), name))
    events.sort()
    rows: list[tuple[float, float, float]] = []
    for i, (t0, name) in enumerate(events):
        if name != "go_whole>":
            continue
        later = events[i:]
        first = next((t for t, n in later if n == "_send>"), None)
        returned = next((t for t, n in later if n == "send<"), None)
        done = next((t for t, n in later if n == "op_recv<"), None)
        if first is not None and returned is not None and done is not None:
            rows.append(((first - t0) * 1e3, (returned - t0) * 1e3, (done - t0) * 1e3))
    rows = rows[1:]
    if not rows:
        raise SystemExit(f"{sys.argv[1]}: no traced request")
    med = [statistics.median(r[k] for r in rows) for k in range(3)]
    print(f"{sys.argv[2] if len(sys.argv) > 2 else sys.argv[1]}: n={len(rows)} first write {med[0]:.3f} ms, "
          f"send() returns {med[1]:.3f} ms, request done {med[2]:.3f} ms (medians)")


if __name__ == "__main__":
    main()
