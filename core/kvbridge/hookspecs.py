"""The kvbridge hook specifications.

Three discovery hooks run once when the registry is built (transfer backends, state types, discovery
services). Four operation hooks carry the mission's
contract and run once per component per peer per request (never per page or token):

* ``kvbridge_register_buffers`` - register a component's memory with a backend;
* ``kvbridge_slice_state``      - turn a component and a TP pair into a slice plan (pure);
* ``kvbridge_send_component``   - post the write of one component to one peer;
* ``kvbridge_notify_completion`` - tell the peer that a component has landed.

Exactly one implementation answers an operation: the core's dispatcher, which calls the backend or
state type the caller selected *by name* (the ``backend`` / ``state_type`` argument). Plugins never
answer operations themselves (the registry refuses a non-wrapper implementation); they provide the
objects through the discovery hooks and may wrap any operation with ``wrapper=True`` to observe it
(tracing, validation). A wrapper sees every backend alike. To see or change *every* call an agent makes to
its backend (metrics, fault injection), use the call seam instead (``kvbridge.backends.calls``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from kvbridge._markers import hookspec
from kvbridge.backends.base import ComponentTransfer, RegisteredBuffers, TransferBackend
from kvbridge.geometry import Component, MemoryRegion, Rank
from kvbridge.slicing import ComponentSlice
from kvbridge.specs import BackendSpec, DiscoverySpec, StateTypeSpec
from kvbridge.state.base import StateType

OPERATION_HOOKS = ("kvbridge_register_buffers", "kvbridge_slice_state", "kvbridge_send_component",
                   "kvbridge_notify_completion")


class KVBridgeSpecs:
    """Hook specifications of the ``kvbridge`` project."""

    @hookspec
    def kvbridge_transfer_backends(self) -> Iterable[BackendSpec]:
        """Declare transfer backends. Cheap: import no native engine here (do it in the factory).

        Example::

            @hookimpl
            def kvbridge_transfer_backends():
                return [BackendSpec(name="nixl", factory="kvbridge_nixl.backend:NixlBackend",
                                    capabilities=frozenset({Capability.HOST_MEMORY, Capability.NOTIFICATIONS}),
                                    probe=lambda: probe_import("nixl._api", "pip install nixl"))]
        """
        raise NotImplementedError

    @hookspec
    def kvbridge_state_types(self) -> Iterable[StateTypeSpec]:
        """Declare state types (see ``kvbridge.state.base.StateType``).

        Example::

            @hookimpl
            def kvbridge_state_types():
                return [StateTypeSpec(name="ring", factory=RingState)]
        """
        raise NotImplementedError

    @hookspec
    def kvbridge_discovery_services(self) -> Iterable[DiscoverySpec]:
        """Declare discovery services (see ``kvbridge.discovery.Discovery``), each with the URL schemes it
        opens. Cheap: import no client library here (do it in the factory).

        Example::

            @hookimpl
            def kvbridge_discovery_services():
                return [DiscoverySpec(name="etcd", schemes=("etcd",), factory="kvbridge_etcd.client:EtcdDiscovery",
                                      probe=lambda: probe_import("etcd3gw", "pip install etcd3gw"))]
        """
        raise NotImplementedError

    @hookspec(firstresult=True)
    def kvbridge_register_buffers(self, backend: TransferBackend, component: str,
                                  regions: Sequence[MemoryRegion]) -> RegisteredBuffers:
        """Register one component's regions with ``backend``; return the peer-visible descriptor.

        Answered by the dispatcher (``backend.register_buffers``). A wrapper example::

            @hookimpl(wrapper=True)
            def kvbridge_register_buffers(backend, component, regions):
                registered = yield
                log.info("%s registered %d regions of %s", backend.name, len(regions), component)
                return registered
        """
        raise NotImplementedError

    @hookspec(firstresult=True)
    def kvbridge_slice_state(self, state_type: StateType, src: Component, dst: Component, src_rank: Rank,
                             dst_rank: Rank) -> ComponentSlice:
        """Slice ``src`` (held by ``src_rank``) for ``dst`` (held by ``dst_rank``). Pure, no I/O.

        Answered by the dispatcher (``state_type.slice``). A wrapper that checks every plan::

            @hookimpl(wrapper=True)
            def kvbridge_slice_state(state_type, src, dst, src_rank, dst_rank):
                plan = yield
                assert all(len(s.nbytes) < 1_000_000 for s in plan.buffers)
                return plan
        """
        raise NotImplementedError

    @hookspec(firstresult=True)
    def kvbridge_send_component(self, backend: TransferBackend, transfer: ComponentTransfer) -> Any:
        """Post the write of one component of one request to one peer; return a pollable handle.

        Answered by the dispatcher (``backend.send_component``). A wrapper that counts sends::

            @hookimpl(wrapper=True)
            def kvbridge_send_component(backend, transfer):
                SENDS[backend.name] += 1
                return (yield)
        """
        raise NotImplementedError

    @hookspec(firstresult=True)
    def kvbridge_notify_completion(self, backend: TransferBackend, peer: str, notice: bytes) -> bool:
        """Tell ``peer`` that a component landed. True when the backend delivered the notice itself;
        False lets the core's control plane carry it (for engines without notifications).

        Answered by the dispatcher (``backend.notify_completion``). A wrapper that traces notices::

            @hookimpl(wrapper=True)
            def kvbridge_notify_completion(backend, peer, notice):
                delivered = yield
                TRACE.append((backend.name, peer, notice, delivered))
                return delivered
        """
        raise NotImplementedError
