"""kvbridge-example-ringbuffer: a per-request ring-buffer state type and a send-counting wrapper.

kvbridge loads this module through the ``kvbridge`` entry point and registers it with pluggy, so the
module-level hook implementations below are the plugin. Keep this module cheap to import: it runs
whenever any process builds a kvbridge registry.
"""

from __future__ import annotations

from kvbridge.plugin import StateTypeSpec, hookimpl
from kvbridge_example_ringbuffer.metrics import kvbridge_send_component, reset, sends_per_backend

__all__ = ["kvbridge_send_component", "kvbridge_state_types", "reset", "sends_per_backend"]


@hookimpl
def kvbridge_state_types() -> list[StateTypeSpec]:
    """Declare the ``ringbuffer`` state type (the factory is imported lazily, on first use)."""
    return [StateTypeSpec(name="ringbuffer", factory="kvbridge_example_ringbuffer.state:RingBufferState",
                          description="per-request ring buffer (example third-party plugin)")]
