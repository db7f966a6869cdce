"""kvbridge-bench: kvbridge's benchmarks, ``kvbridge bench [planner|control|transfer|flood]`` and
``kvbridge bench --backend NAME``; every figure is printed as a ratio against a baseline measured in the same run.

* :mod:`kvbridge_bench.micro`: the planner's cost per request, the control plane's latency, polling;
* :mod:`kvbridge_bench.transfer`: kvbridge end to end through the agent against raw NIXL and a plain copy;
* :mod:`kvbridge_bench.flood`: healthy requests' latency under a flood of forged frames;
* :mod:`kvbridge_bench.nixl_backend`: the NIXL backend's send against raw NIXL and memcpy;
* :mod:`kvbridge_bench.raw_nixl`: the one raw NIXL baseline (NIXL's own ``nixl_agent`` API);
* :mod:`kvbridge_bench.cli`: the ``bench`` subcommand (entry point group ``kvbridge.cli``).

It imports kvbridge's public modules, and the few internals :mod:`kvbridge_bench._internals` names.
"""

from __future__ import annotations

__all__: list[str] = []
