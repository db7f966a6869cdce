"""This rank's registered memory: one registration per component, byte views, the staging area."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from kvbridge.backends.base import RegisteredBuffers
from kvbridge.backends.calls import BackendCalls
from kvbridge.errors import GeometryError
from kvbridge.geometry import DeviceKind, MemoryRegion, PoolLayout, region_of
from kvbridge.protocol.records import RemoteBuffers
from kvbridge.spans import BufferSpan, RunIndex
from kvbridge.staging import STAGING, CudaStager, Rows, StagingArea, device_view, host_view, is_cuda

log = logging.getLogger("kvbridge.agent")


class LocalBuffers:
    """Registers the engine's buffers (and a staging area) with the backend and keeps them alive.

    ``views[component]`` holds one uint8 ``[items, item_nbytes]`` view per buffer (numpy or torch) when
    every buffer of the component can be viewed; the staging path needs them.
    """

    def __init__(self, *, layout: PoolLayout, calls: BackendCalls) -> None:
        self._layout, self._calls = layout, calls
        self.registered: dict[str, RegisteredBuffers] = {}
        self.views: dict[str, list[Any]] = {}
        self.staging: StagingArea | None = None
        self.staging_registration: RegisteredBuffers | None = None
        self._keepalive: list[Any] = []      # registered memory must outlive the registration
        self._stager: CudaStager | None = None     # on the device of the first CUDA component
        self._spans: dict[str, BufferSpan | None] = {}

    def span(self, component: str) -> BufferSpan | None:
        """Every buffer of a CUDA component as one tensor (batched gathers and scatters), else None."""
        if component not in self._spans:
            found = None
            if self.is_cuda(component):
                try:
                    found = BufferSpan(self.views[component])
                except Exception as exc:  # noqa: BLE001 - the per-buffer path still works
                    log.warning("component %s: no batched staging (%s); one kernel per buffer", component, exc)
            self._spans[component] = found
        return self._spans[component]

    def batched(self, component: str, buffers: Sequence[int], rows: Rows | None, side: str) -> RunIndex | None:
        """One index kernel over ``buffers`` of a CUDA component when they share the run pattern ``rows``
        (None: host memory, mixed patterns, or runs too small; the caller copies buffer by buffer)."""
        span = self.span(component) if rows is not None else None
        return None if span is None or rows is None else span.run_index(buffers=buffers, rows=rows, side=side)

    def stager(self) -> CudaStager | None:
        """This agent's CUDA stream for gathers, scatters and engine events (None for host memory)."""
        return self._stager

    def is_cuda(self, component: str) -> bool:
        views = self.views.get(component) or []
        return bool(views) and is_cuda(views[0])

    def register(self, buffers: Mapping[str, Sequence[Any]]) -> None:
        layout = self._layout
        missing = [c.name for c in layout.components if c.name not in buffers]
        extra = sorted(set(buffers) - set(layout.component_names))
        if missing or extra:
            raise GeometryError(f"buffers given for {sorted(buffers)}; the layout needs exactly "
                                f"{list(layout.component_names)} (missing {missing}, unknown {extra})")
        for comp in layout.components:
            given = buffers[comp.name]
            if len(given) != len(comp.buffers):
                raise GeometryError(f"component {comp.name!r}: {len(given)} buffers given, layout has "
                                    f"{len(comp.buffers)}")
            regions = []
            self._keepalive.extend(given)
            for geom, buf in zip(comp.buffers, given):
                region = buf if isinstance(buf, MemoryRegion) else region_of(buf)
                geom.check_region(region)
                regions.append(region)
            self.registered[comp.name] = self._calls.register_buffers(comp.name, regions)
            if all(r.device is DeviceKind.CPU for r in regions):
                self.views[comp.name] = [host_view(r).reshape(g.num_items, g.item_nbytes)
                                         for r, g in zip(regions, comp.buffers)]
            elif all(r.device is DeviceKind.CUDA for r in regions):
                views = [device_view(b, g.num_items, g.item_nbytes) for b, g in zip(given, comp.buffers)]
                if all(v is not None for v in views):
                    self.views[comp.name] = views
                    if self._stager is None:
                        self._stager = CudaStager(getattr(views[0], "device", None))

    def setup_staging(self, staging: Any | None, staging_bytes: int) -> None:
        """Register the staging area (given, e.g. in /dev/shm for loopback peers in other processes, or
        allocated here: host memory, or on the GPU of CUDA buffers) when every buffer has a view."""
        if len(self.views) != len(self._layout.components):
            return
        if staging is None:
            if staging_bytes <= 0:
                return
            first = next(iter(self.views.values()))[0]
            if isinstance(first, np.ndarray):
                staging = np.zeros(staging_bytes, np.uint8)   # zeros: pre-touched before registering
            else:
                import torch

                staging = torch.zeros(staging_bytes, dtype=torch.uint8, device=first.device)
        self._keepalive.append(staging)
        self.staging = StagingArea(staging.reshape(-1).view(np.uint8) if isinstance(staging, np.ndarray)
                                   else staging)
        self.staging_registration = self._calls.register_buffers(STAGING, [self.staging.region])

    def remote(self) -> tuple[RemoteBuffers, ...]:
        """What a peer needs to write into us: every registration, the staging area last."""
        regs = list(self.registered.values())
        if self.staging_registration is not None:
            regs.append(self.staging_registration)
        return tuple(reg.remote() for reg in regs)

    def deregister_all(self, agent_name: str) -> None:
        for reg in self.registered.values():
            try:
                self._calls.deregister_buffers(reg)
            except Exception:
                log.exception("%s: deregistering %s failed", agent_name, reg.component)
        self.registered.clear()
