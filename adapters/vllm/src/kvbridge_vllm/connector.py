"""``KVBridgeConnector``: vLLM's ``KVConnectorBase_V1`` on kvbridge's transfer agent.

Flow (the proxy in ``examples/vllm-disagg`` drives it):

1. The prefill instance (``kv_role: kv_producer``) gets the request with ``max_tokens=1`` and
   ``kv_transfer_params={"do_remote_decode": true}`` (optionally ``"room": <63-bit id>``). In the step that
   computes the prompt's last token, the scheduler side puts the request's blocks in the step's metadata;
   each worker opens a kvbridge ``Sender`` for the room at that step's first ``save_kv_layer``; if the
   decode's request is already there, ``save_kv_layer`` posts each layer as the forward pass writes it,
   else the whole request goes once the decode asks (after ``wait_for_save``). ``request_finished`` keeps
   the blocks (``True``) and returns
   ``{"do_remote_prefill": true, "room": ..., "instance": ..., "bootstrap": ..., "prompt_digest": ...}``.
   A client's ``room`` that is not a valid id, or is in use by another request here, is replaced by a fresh one.
2. The decode instance (``kv_consumer``) gets the request with those params. ``get_num_new_matched_tokens``
   computes the prompt itself when ``prompt_digest`` names another prompt (params of another request would
   load that request's KV), else claims every prompt token beyond its local prefix cache hit, loaded
   asynchronously; once vLLM allocated
   blocks, the worker opens a ``Receiver`` for the room with the blocks after the prefix (``prefix_len`` =
   the local hit, so the prefill sends only what decode lacks).
3. Each prefill worker sends when the decode's request arrives and reports the request in
   ``get_finished`` once ``safe_to_reuse``; each decode worker reports it on Success, or on Failure
   reports the request and its blocks through ``get_block_ids_with_load_errors`` (vLLM then recomputes or
   fails the request, per ``kv_load_failure_policy``).

The bootstrap server runs in the prefill instance's TP rank 0 worker (``serve_bootstrap``); every instance
names it in ``bootstrap``.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import secrets
import socket
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

import numpy as np
import torch
import zmq
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvbridge.errors import KVBridgeError
from kvbridge.zmq_link import BootstrapServer
from kvbridge_vllm.layout import pool_layout
from kvbridge_vllm.settings import Settings
from kvbridge_vllm.shm import remap_to_shm
from kvbridge_vllm.threads import unpinned
from kvbridge_vllm.worker import LoadSpec, SaveSpec, WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("kvbridge.vllm")

__all__ = ["KVBridgeConnector", "KVBridgeMetadata"]


MAX_ROOM = (1 << 63) - 1


@dataclass
class KVBridgeMetadata(KVConnectorMetadata):
    """One step's work for the workers: requests to send (prefill) and to receive (decode)."""

    saves: dict[str, SaveSpec] = field(default_factory=dict)
    loads: dict[str, LoadSpec] = field(default_factory=dict)


@dataclass
class _Producing:
    room: int
    prompt_len: int
    delay_s: float = 0.0
    blocks: list[int] = field(default_factory=list)
    computed: int = 0
    saved: bool = False


def _room(params: dict[str, Any]) -> int:
    room = params.get("room")
    if room is None:
        return secrets.randbits(63) or 1
    if isinstance(room, bool) or not (isinstance(room, int) or (isinstance(room, str) and room.isdigit())):
        raise KVBridgeError(f"kv_transfer_params room={room!r:.40} is not an integer")
    room = int(room)
    if not 0 < room <= MAX_ROOM:
        raise KVBridgeError(f"kv_transfer_params room={room} is not a 63-bit positive id")
    return room


def prompt_digest(token_ids: Any) -> str:
    """A fingerprint of a prompt's token ids: the prefill hands it out with the room, and a decode loads the
    room only into a request whose prompt has the same one (params of another prompt would load its KV)."""
    ids = np.asarray(token_ids if token_ids is not None else (), dtype=np.int64)
    return hashlib.blake2b(ids.tobytes(), digest_size=12).hexdigest()


def _wait_for_port(address: str, timeout_s: float) -> None:
    """Wait until something listens at a ``tcp://host:port`` address (the bootstrap server of rank 0)."""
    url = urlparse(address)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((url.hostname or "127.0.0.1", url.port or 0), timeout=1.0):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no kvbridge bootstrap server at {address} after {timeout_s} s") from None
            time.sleep(0.1)


class KVBridgeConnector(KVConnectorBase_V1):
    """kvbridge as a vLLM KV connector (both roles; ``kv_both`` sends and receives)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        config = vllm_config.kv_transfer_config
        assert config is not None
        # no secret configured and everything on loopback: this user's secret file on this host (secure by default)
        self.settings = Settings.from_extra(config.kv_connector_extra_config).with_local_secret()
        self.produce = bool(config.is_kv_producer)
        self.consume = bool(config.is_kv_consumer)
        self.instance = self.settings.instance or f"vllm-{config.engine_id}"
        self.block_size = int(vllm_config.cache_config.block_size)
        self._vllm_config = vllm_config
        # scheduler side
        self._producing: dict[str, _Producing] = {}
        self._local_hits: dict[str, int] = {}
        self._loads: dict[str, LoadSpec] = {}
        # worker side
        self.worker: WorkerSide | None = None
        self._layer_index: dict[str, int] = {}     # vLLM layer name -> its layer in the pool (wire order)
        self._bootstrap: BootstrapServer | None = None
        self._zmq: zmq.Context[zmq.Socket[bytes]] | None = None
        self._segment = ""          # the /dev/shm segment now backing the KV cache (loopback decode)

    # ================================================================== scheduler side
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        params = request.kv_transfer_params or {}
        if self.produce and params.get("do_remote_decode") and request.request_id not in self._producing:
            delay = float(params.get("kvbridge_delay_send_s", 0.0)) if self.settings.test_hooks else 0.0
            self._producing[request.request_id] = _Producing(room=self._new_room(request.request_id, params),
                                                              delay_s=delay,
                                                              prompt_len=len(request.prompt_token_ids or ()))
        if self.consume and params.get("do_remote_prefill"):
            want = params.get("prompt_digest")
            if want is not None and want != prompt_digest(request.prompt_token_ids):
                log.warning("kvbridge: request %s: kv_transfer_params (room %s) were made for another prompt; "
                            "computing it here instead of loading that KV", request.request_id, params.get("room"))
                params["do_remote_prefill"] = False
                return 0, False
            count = len(request.prompt_token_ids or ()) - num_computed_tokens
            if count > 0:
                self._local_hits[request.request_id] = num_computed_tokens
                return count, True
        return 0, False

    def _new_room(self, req_id: str, params: dict[str, Any]) -> int:
        """The room of a request this prefill produces: the client's ``room`` when it is a valid id not in use
        by another request here, else a fresh one (the room handed back in ``request_finished`` is the truth)."""
        try:
            room = _room(params)
        except KVBridgeError as exc:
            log.warning("kvbridge: request %s: %s; using a fresh room", req_id, exc)
            return secrets.randbits(63) or 1
        if any(p.room == room for p in self._producing.values()):
            log.warning("kvbridge: request %s: room %d is in use by another request here; using a fresh room",
                        req_id, room)
            return secrets.randbits(63) or 1
        return room

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        params = request.kv_transfer_params or {}
        if not (self.consume and params.get("do_remote_prefill")) or num_external_tokens <= 0:
            return
        params["do_remote_prefill"] = False          # load once: a second call (after the load) is a no-op
        local = self._local_hits.pop(request.request_id, 0)
        ids = list(blocks.get_block_ids()[0])
        first, end = local // self.block_size, math.ceil((local + num_external_tokens) / self.block_size)
        try:
            flip = int(params.get("kvbridge_flip_layer", -1)) if self.settings.test_hooks else -1
            spec = LoadSpec(room=_room(params), instance=str(params["instance"]), block_ids=tuple(ids[first:end]),
                            prefix_len=local, flip_layer=flip, tokens=local + num_external_tokens)
        except (KeyError, KVBridgeError, ValueError, TypeError) as exc:
            spec = LoadSpec(room=1, instance="", block_ids=tuple(ids[first:end]), prefix_len=local)
            log.warning("kvbridge: request %s has bad kv_transfer_params %s: %s", request.request_id, params, exc)
        if params.get("bootstrap") and params["bootstrap"] != self.settings.bootstrap:
            log.warning("kvbridge: request %s names bootstrap %s, this instance uses %s", request.request_id,
                        params["bootstrap"], self.settings.bootstrap)
        self._loads[request.request_id] = spec

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KVBridgeMetadata(loads=self._loads)
        self._loads = {}
        if self._producing:
            scheduled = scheduler_output.num_scheduled_tokens
            for new in scheduler_output.scheduled_new_reqs:
                state = self._producing.get(new.req_id)
                if state is not None:
                    state.blocks = list(new.block_ids[0])
                    state.computed = new.num_computed_tokens
            cached = scheduler_output.scheduled_cached_reqs
            for i, req_id in enumerate(cached.req_ids):
                state = self._producing.get(req_id)
                if state is None:
                    continue
                new_ids = cached.new_block_ids[i]
                if cached.resumed_req_ids and req_id in cached.resumed_req_ids:
                    state.blocks = list(new_ids[0]) if new_ids else []
                elif new_ids:
                    state.blocks.extend(new_ids[0])
                state.computed = cached.num_computed_tokens[i]
            for req_id, state in self._producing.items():
                if state.saved or req_id not in scheduled:
                    continue
                if state.computed + scheduled[req_id] >= state.prompt_len:
                    state.saved = True
                    need = math.ceil(state.prompt_len / self.block_size)
                    meta.saves[req_id] = SaveSpec(room=state.room, block_ids=tuple(state.blocks[:need]),
                                                  delay_s=state.delay_s)
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._local_hits.pop(request.request_id, None)
        self._loads.pop(request.request_id, None)
        state = self._producing.pop(request.request_id, None)
        if state is None or not state.saved:
            return False, None
        return True, {"do_remote_prefill": True, "do_remote_decode": False, "room": state.room,
                      "instance": self.instance, "bootstrap": self.settings.bootstrap,
                      "prompt_digest": prompt_digest(request.prompt_token_ids)}

    # ================================================================== worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        first = next(iter(kv_caches.values()))
        kind = "cpu" if first.device.type == "cpu" else (self.settings.kv_layout
                                                          or ("mla" if first.dim() == 3 else "nhd"))
        if self.settings.kv_layout and self.settings.kv_layout != kind and first.device.type == "cpu":
            raise KVBridgeError(f"kv_layout={self.settings.kv_layout!r} set, but vLLM's KV cache is on the CPU")
        parallel = self._vllm_config.parallel_config
        model = self._vllm_config.model_config
        tp_rank = get_tensor_model_parallel_rank()
        if self.consume and self.settings.remap_to_shm():
            if first.device.type != "cpu":
                raise KVBridgeError(f"backend {self.settings.backend!r} needs host memory; the KV cache is on "
                                    f"{first.device}")
            storage = first.untyped_storage()
            for name, tensor in kv_caches.items():
                if tensor.untyped_storage().data_ptr() != storage.data_ptr():
                    raise KVBridgeError(f"layer {name!r}: KV caches are not views into one allocation")
            self._segment = remap_to_shm(storage.data_ptr(), storage.nbytes(), f"rank{tp_rank}")
        pool = pool_layout(kv_caches, kind=kind, total_kv_heads=model.get_total_num_kv_heads(),
                           tp_size=parallel.tensor_parallel_size, tp_rank=tp_rank, block_size=self.block_size,
                           model=os.path.basename(str(model.model).rstrip("/")))
        serve = self.settings.serve_bootstrap or (self.produce and tp_rank == 0
                                                  and self.settings.serve_bootstrap is not False)
        if not serve and self.produce:   # our ranks publish themselves there at once; decode looks up per request
            _wait_for_port(self.settings.bootstrap, self.settings.bootstrap_timeout_s)
        with unpinned():      # kvbridge's threads (and its ZMQ I/O thread) off the core vLLM pinned this worker to
            self._zmq = zmq.Context()
            if serve:
                self._bootstrap = BootstrapServer(self.settings.bootstrap, secret=self.settings.secret_bytes,
                                                  context=self._zmq,
                                                  allow_insecure=self.settings.allow_insecure).start()
            self.worker = WorkerSide(settings=self.settings, pool=pool, produce=self.produce, consume=self.consume,
                                     instance=self.instance, zmq_context=self._zmq)
        self._layer_index = {name: i for i, name in enumerate(pool.layers)}
        log.info("kvbridge: %s rank %d/%d registered %d layers (%s, %d blocks), backend %s, instance %s",
                 "prefill" if self.produce else "decode", tp_rank, parallel.tensor_parallel_size, len(pool.layers),
                 kind, pool.num_blocks, self.settings.backend, self.instance)

    def _meta(self) -> KVBridgeMetadata | None:
        if not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        return meta if isinstance(meta, KVBridgeMetadata) else None

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._meta()
        if meta is None or self.worker is None:
            return
        if not meta.loads:
            return
        with unpinned():      # a first request to an instance starts its handshake's lookup thread
            for req_id, spec in meta.loads.items():
                self.worker.load(req_id, spec)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return      # loads are asynchronous: vLLM schedules the request once get_finished reports it

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """Layer-wise: post this layer of every prompt this step completes whose decode already asked (on
        CUDA the write follows the work queued on the current stream, the attention that wrote the layer)."""
        meta = self._meta()
        if meta is None or self.worker is None or not meta.saves:
            return
        layer = self._layer_index.get(layer_name)
        if layer is None:
            return
        for req_id, save in meta.saves.items():     # this step's forward pass completes these prompts
            self.worker.begin_save(req_id, save)    # (vLLM 0.32 calls start_load_kv after the forward pass)
            self.worker.save_layer(req_id, layer)

    def wait_for_save(self) -> None:
        meta = self._meta()
        if meta is None or self.worker is None:
            return
        for req_id, spec in meta.saves.items():
            self.worker.save(req_id, spec)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self.worker is None:
            return None, None
        sending, recving = self.worker.finished(finished_req_ids)
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.load_errors() if self.worker is not None else set()

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.close()
            self.worker = None
        if self._bootstrap is not None:
            self._bootstrap.close()
            self._bootstrap = None
        if self._zmq is not None:
            self._zmq.destroy(linger=0)
            self._zmq = None
        if self._segment:       # peers that mapped it keep their mapping; new ones cannot open it any more
            try:
                os.unlink(f"/dev/shm/{self._segment}")
            except FileNotFoundError:
                pass
            self._segment = ""
