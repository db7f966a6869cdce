"""Options of the backend and creation of a Mooncake ``TransferEngine`` (imported lazily, here only).

Facts of mooncake-transfer-engine 0.3.13.post1 this module relies on (checked on this host):

* ``initialize(host, "P2PHANDSHAKE", protocol, device)`` does *not* pick the transport from ``protocol``:
  the engine installs RDMA whenever it finds an HCA, unless ``MC_FORCE_TCP`` is set when it initializes
  (it returned 0 for "rdma" and even "bogus" here, with no HCA, and used TCP). The Python API has no other
  way to choose (``initialize_ext`` only adds the metadata type). So ``protocol="tcp"`` sets
  ``MC_FORCE_TCP=1`` for the duration of ``initialize()`` only, when the user has not set it (their value is
  never overwritten), and removes it again; ``protocol="rdma"`` checks the topology for an HCA.
* ``MC_LOG_LEVEL`` is read once, when ``mooncake.engine`` loads (see ``availability.quiet_import``).
* The TCP transport acknowledges each write after it is applied at the destination (framing v2), so a
  finished batch means the bytes landed. ``MC_TCP_PROTO=1`` turns that off; this module refuses it.
* The TCP transport queues at most about 2048 transfers per peer (see ``DEFAULT_CHUNK``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Annotated, Any, Literal

import msgspec

from kvbridge.plugin import PluginUnavailableError, env_defaults, parse_options
from kvbridge_mooncake.availability import hint_for, load_engine_module

PROTOCOLS = ("tcp", "rdma")
# One engine batch holds at most DEFAULT_CHUNK descriptors, and at most DEFAULT_WINDOW batches per peer are
# in flight. Measured here (0.3.13.post1, TCP, 2 cores): a single batch of 2048 descriptors always passed;
# 2049-2100 passed or failed depending on how fast the lanes drained; 2200 and more always failed with
# rc -1 ("TCP lane queue-full rejection"). The limit counts descriptors, not bytes (2048 x 64 KiB and
# 2 x 128 MiB pass), and it is per peer, shared by every batch in flight to that peer, so two batches of
# 2048 fail together. 2 x 960 stays under it with room for notices; two batches in flight moved 64 KiB
# scattered descriptors 1.2-2x faster than one at a time here. MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER
# changes the engine's limit; the chunk follows it when set.
DEFAULT_QUEUE_LIMIT = 2048
DEFAULT_WINDOW = 2
_HEADROOM = 128
DEFAULT_CHUNK = (DEFAULT_QUEUE_LIMIT - _HEADROOM) // DEFAULT_WINDOW


def _doc(text: str, **constraints: Any) -> msgspec.Meta:
    return msgspec.Meta(description=text, **constraints)


class MooncakeOptionsSchema(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    """What ``options={...}`` (``backend_options``) may set; every value may arrive as a string."""

    protocol: Annotated[Literal["tcp", "rdma"], _doc(
        "`tcp`, or `rdma` (refused when the engine finds no RDMA device)")] = "tcp"
    device: Annotated[str, _doc("RDMA device filter, e.g. `mlx5_0,mlx5_1`; ignored by TCP")] = ""
    host: Annotated[str, _doc("the address peers reach this engine at")] = "127.0.0.1"
    chunk: Annotated[Annotated[int, msgspec.Meta(gt=0)] | None, _doc(
        "descriptors per engine batch; unset: fits the TCP transport's queue "
        "(`MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER`, 2048) with `window` batches in flight")] = None
    window: Annotated[int, _doc("engine batches in flight per peer", gt=0)] = DEFAULT_WINDOW
    workers: Annotated[int, _doc("transfer threads; a peer always uses the same one (keeps its order)",
                                 gt=0)] = 1


@dataclass(frozen=True, slots=True, kw_only=True)
class MooncakeOptions:
    """What ``options={...}`` may set (all values are strings on the way in)."""

    protocol: str = "tcp"
    device: str = ""          # RDMA device filter, e.g. "mlx5_0,mlx5_1"; ignored by TCP
    host: str = "127.0.0.1"   # the address peers reach this engine at
    chunk: int = DEFAULT_CHUNK
    window: int = DEFAULT_WINDOW
    workers: int = 1          # transfer threads; a peer always uses the same one (keeps its order)

    @classmethod
    def parse(cls, options: Mapping[str, object] | None,
              env: Mapping[str, str] | None = None) -> MooncakeOptions:
        """Checked against :class:`MooncakeOptionsSchema` (unknown keys refused with the closest known one,
        values of the wrong type with their key), then the chunk that fits the engine's queue."""
        opts = {k: (v.lower() if k == "protocol" and isinstance(v, str) else v) for k, v in (options or {}).items()}
        try:
            schema = parse_options(MooncakeOptionsSchema, opts, "mooncake option")
        except ValueError as exc:
            text = str(exc).replace("expected one of", "not one of").replace("expected int > 0", "must be positive")
            raise type(exc)(text) from None
        env = os.environ if env is None else env
        limit = int(env.get("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER") or DEFAULT_QUEUE_LIMIT)
        default_chunk = max(1, (limit - min(_HEADROOM, limit // 2)) // schema.window)
        chunk = schema.chunk or default_chunk
        if schema.protocol == "tcp" and chunk * schema.window > limit:
            raise ValueError(f"chunk {chunk} x window {schema.window} exceeds the TCP transport's {limit} queued "
                             "transfers per peer; lower one of them")
        return cls(protocol=schema.protocol, device=schema.device, host=schema.host or "127.0.0.1", chunk=chunk,
                   window=schema.window, workers=schema.workers)


def import_engine() -> ModuleType:
    """``mooncake.engine``, or PluginUnavailableError with the install command that fixes it."""
    try:
        engine: ModuleType = load_engine_module()
    except ImportError as exc:
        raise _unavailable(f"cannot import mooncake.engine: {exc}", hint_for(exc)) from exc
    return engine


def _unavailable(reason: str, hint: str = "") -> PluginUnavailableError:
    return PluginUnavailableError("mooncake", reason, hint)


def has_hca(topology_json: str) -> bool:
    """True when the engine's topology lists at least one RDMA device."""
    try:
        topology = json.loads(topology_json)
    except ValueError:
        return False
    return any(any(group) for groups in topology.values() for group in groups)


def create_engine(opts: MooncakeOptions) -> tuple[Any, str]:
    """A started engine and its session id ``host:rpc_port`` (what peers pass as target)."""
    mc = import_engine()
    if opts.protocol == "tcp":
        if os.environ.get("MC_TCP_PROTO") == "1":
            raise _unavailable("MC_TCP_PROTO=1 selects Mooncake's unacknowledged TCP framing, where a "
                               "finished write may still be on its way to the peer; kvbridge needs "
                               "acknowledged writes", "unset MC_TCP_PROTO")
    elif os.environ.get("MC_FORCE_TCP"):
        raise _unavailable("protocol 'rdma' was asked for, but MC_FORCE_TCP is set in this process's "
                           "environment", "unset MC_FORCE_TCP, or use protocol 'tcp'")
    engine = mc.TransferEngine()
    # read by initialize() only (see the module docstring): set for the call, never over the user's value
    with env_defaults({"MC_FORCE_TCP": "1"} if opts.protocol == "tcp" else {}):
        rc = engine.initialize(opts.host, "P2PHANDSHAKE", opts.protocol, opts.device)
    if rc != 0:
        raise _unavailable(f"TransferEngine.initialize({opts.host!r}, 'P2PHANDSHAKE', {opts.protocol!r}, "
                           f"{opts.device!r}) returned {rc}",
                           "check the host address and, for RDMA, the devices")
    if opts.protocol == "rdma" and not has_hca(engine.get_local_topology()):
        raise _unavailable(f"protocol 'rdma' was asked for, but the engine found no RDMA device (filter "
                           f"{opts.device or 'none'}) and would silently use TCP",
                           "check `ibv_devices` and the 'device' option, or use protocol 'tcp'")
    return engine, f"{opts.host}:{engine.get_rpc_port()}"
