"""The agent's timeouts and options."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from kvbridge.protocol.wire import MIN_PROTOCOL_VERSION, PROTOCOL_VERSION


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
    staging_bytes: int = 32 << 20          # staging area (host, or on the GPU of CUDA buffers; 0: off)
    staging: str = "auto"                  # "auto": cost model; "always": every regular slice; "never"
    staging_below_bytes: int | None = None  # auto stages when the average descriptor is smaller than this;
    #                                         None: the backend's descriptor cost x the staging throughput
    staging_piece_bytes: int = 256 << 20   # a staged write is cut into pieces of at most this much: the gather
    #                                        of piece k+1 overlaps the write of piece k, the scatter of k too.
    #                                        Each piece costs the engine thread ~0.3-0.5 ms (posting, notice,
    #                                        bounds checks): a piece must take longer than that on the wire
    prove_writer_death: bool = True        # decode: hold a TCP connection to each prefill rank; its kernel closes
    #                                        it when the process ends (kvbridge.agent.liveness): a killed writer's
    #                                        rooms become safe to reuse without declare_gone
    writer_exit_grace_s: float = 0.5       # after that EOF, how long writes the dead process posted may still land
    write_flight_bound_s: float | None = None   # decode: the longest a posted write can stay in flight on this
    #                                        fabric, retransmissions across a partition included (unset: no bound
    #                                        known). Set, a prefill silent past its write lease plus this bound is
    #                                        fenced without its acknowledgement (stopped, partitioned, dead host)
    engine_progress_s: float | None = None  # beside the progress thread, the engine's own calls (handle polls,
    #                                        events()) run a progress step at most this often; unset: never. Set
    #                                        (e.g. 0.002), completions are handled in the engine's thread as it
    #                                        calls, not when the progress thread next gets the GIL: lower latency,
    #                                        more of kvbridge's CPU in the engine's thread (docs/results)
    checksums: bool = False                # decode: ask every prefill rank for per-destination digests and
    #                                        verify each write against them (host memory; ``kvbridge.digests``)
    min_protocol_version: int = MIN_PROTOCOL_VERSION   # refuse peers below this protocol version (raise it to
    #                                        the current one once every instance is upgraded: no fallback then)
    backend_options: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        from kvbridge.staging import MODES

        if self.staging not in MODES:
            raise ValueError(f"AgentConfig.staging={self.staging!r}; one of {', '.join(MODES)}")
        for name in ("heartbeat_interval_s", "peer_timeout_s", "bootstrap_timeout_s", "waiting_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise ValueError(f"AgentConfig.{name}={value!r} must be a finite number of seconds > 0")
        if self.heartbeat_interval_s >= self.peer_timeout_s:
            raise ValueError(f"AgentConfig.heartbeat_interval_s={self.heartbeat_interval_s} must be below "
                             f"peer_timeout_s={self.peer_timeout_s} (a peer would be judged dead between beats)")
        if (isinstance(self.min_protocol_version, bool) or not isinstance(self.min_protocol_version, int)
                or not MIN_PROTOCOL_VERSION <= self.min_protocol_version <= PROTOCOL_VERSION):
            raise ValueError(f"AgentConfig.min_protocol_version={self.min_protocol_version!r} must be an integer "
                             f"from {MIN_PROTOCOL_VERSION} to {PROTOCOL_VERSION} (the versions this release speaks)")
        bound = self.write_flight_bound_s
        if bound is not None and (isinstance(bound, bool) or not isinstance(bound, (int, float))
                                  or not 0 <= bound < float("inf")):
            raise ValueError(f"AgentConfig.write_flight_bound_s={bound!r} must be unset or a finite number of "
                             "seconds >= 0")
        step = self.engine_progress_s
        if step is not None and (isinstance(step, bool) or not isinstance(step, (int, float))
                                 or not 0 <= step < float("inf")):
            raise ValueError(f"AgentConfig.engine_progress_s={step!r} must be unset or a finite number of seconds "
                             ">= 0")
        if not 0 <= self.writer_exit_grace_s < float("inf"):
            raise ValueError(f"AgentConfig.writer_exit_grace_s={self.writer_exit_grace_s} must be >= 0 and finite")
        if self.staging_piece_bytes <= 0:
            raise ValueError(f"AgentConfig.staging_piece_bytes={self.staging_piece_bytes} must be positive")
        if self.staging_below_bytes is not None and self.staging_below_bytes < 0:
            raise ValueError(f"AgentConfig.staging_below_bytes={self.staging_below_bytes} must be >= 0")


TOMBSTONES = 1 << 16        # rooms remembered after clear(), so late frames for them are ignored
GOODBYE_GRACE_S = 1.0       # after a peer's goodbye, its notices on the engine's own channel may still arrive
HELLO_RESEND_S = 1.0        # connect() repeats its Hello to targets that have not answered
TICK_S = 0.05               # timeouts are checked this often (not on every progress call)
EARLY_ROOMS = 4096          # decode requests kept for rooms whose sender() has not been created yet ...
EARLY_BYTES = 256 << 20     # ... and the bytes of their page ids (about 33 M page ids)
