"""``python -m kvbridge_bench``: ``kvbridge bench`` (see :mod:`kvbridge_bench.cli`)."""

from kvbridge_bench.cli import main

raise SystemExit(main())
