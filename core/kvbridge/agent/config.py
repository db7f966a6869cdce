"""The agent's timeouts and options."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True, kw_only=True)
class AgentConfig:
    """Timeouts (seconds) and options. Defaults suit one host; raise them across a cluster.

        AgentConfig(peer_timeout_s=10.0, secret=b"cluster-secret")
    """

    heartbeat_interval_s: float = 0.5      # how often we tell each peer we are alive
    peer_timeout_s: float = 3.0            # a peer silent this long is dead: its rooms fail
    bootstrap_timeout_s: float = 30.0      # connect() / a prefill room waiting for its requests
    waiting_timeout_s: float = 120.0       # a decode room waiting for data after send_metadata
    secret: bytes | None = None            # shared secret: HMAC on every control frame
    staging_bytes: int = 32 << 20          # host staging area for the gather/one-write/scatter path (0: off)
    backend_options: Mapping[str, str] = field(default_factory=dict)


TOMBSTONES = 1 << 16        # rooms remembered after clear(), so late frames for them are ignored
GOODBYE_GRACE_S = 1.0       # after a peer's goodbye, its notices on the engine's own channel may still arrive
HELLO_RESEND_S = 1.0        # connect() repeats its Hello to targets that have not answered
TICK_S = 0.05               # timeouts are checked this often (not on every progress call)
EARLY_ROOMS = 4096          # decode requests kept for rooms whose sender() has not been created yet
