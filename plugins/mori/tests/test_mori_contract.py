"""Pin the stand-in to the documented mori.io surface (amd-mori 1.2.x; engines.md §4 and the MoRI sources).

amd-mori cannot be installed here (no cp311 wheel, and it needs the ROCm runtime to import), so the
expected surface is written down below. On a ROCm host where ``mori.io`` imports, the same table is
also checked against the real module.
"""

from __future__ import annotations

import importlib
import inspect
from types import ModuleType
from typing import Any

import pytest

from kvbridge_mori import standin

ENUMS = {
    "BackendType": {"Unknown": 0, "XGMI": 1, "RDMA": 2, "TCP": 3, "FABRIC": 4},
    "MemoryLocationType": {"Unknown": 0, "CPU": 1, "GPU": 2},
    "StatusCode": {"SUCCESS": 0, "INIT": 1, "IN_PROGRESS": 2, "ERR_INVALID_ARGS": 11, "ERR_NOT_FOUND": 12,
                   "ERR_RDMA_OP": 13, "ERR_BAD_STATE": 14, "ERR_GPU_OP": 15},
    "PollCqMode": {"POLLING": 0, "EVENT": 1},
}
# method -> parameter names after self (None: the upstream wrapper takes *args; arity checked instead)
ENGINE_METHODS: dict[str, list[str] | int] = {
    "get_engine_desc": [], "create_backend": ["type", "config"], "remove_backend": ["type"],
    "register_remote_engine": ["engine_desc"], "deregister_remote_engine": ["engine_desc"],
    "register_memory": ["ptr", "size", "device_id", "mem_loc"], "register_torch_tensor": ["tensor"],
    "deregister_memory": ["mem_desc"], "allocate_transfer_uid": [],
    "read": 6, "write": 6, "batch_read": 6, "batch_write": 6,
    "create_session": ["local_mem", "remote_mem"], "pop_inbound_transfer_status": ["remote_key", "transfer_uid"],
    "wait_all": ["statuses", "timeout_ms"],
}
SESSION_METHODS = {"allocate_transfer_uid": [], "read": 4, "write": 4, "batch_read": 4, "batch_write": 4, "alive": []}
RDMA_CONFIG_DEFAULTS = {
    "qp_per_transfer": 1, "post_batch_size": -1, "num_worker_threads": -1, "poll_cq_mode": "POLLING",
    "enable_notification": True, "notif_per_qp": 1024, "enable_transfer_chunking": False, "chunk_bytes": 65536,
    "max_chunks_per_transfer": 64, "num_nics_per_transfer": 1,
}
STATUS_METHODS = ("Code", "Message", "Update", "Init", "InProgress", "Succeeded", "Failed", "SetCode", "SetMessage",
                  "Wait", "WaitFor")
ENGINE_DESC_FIELDS = ("key", "node_id", "hostname", "host", "port", "pid")
MEMORY_DESC_FIELDS = ("engine_key", "id", "device_id", "device_bus_id", "numa_node", "data", "size", "loc",
                      "ipc_handle")


def _real_mori() -> ModuleType | None:
    try:
        return importlib.import_module("mori.io")
    except Exception:  # noqa: BLE001 - absent, or present without ROCm
        return None


def _params(func: Any) -> list[inspect.Parameter]:
    return list(inspect.signature(func).parameters.values())[1:]


def _check_enums(api: Any) -> None:
    for name, members in ENUMS.items():
        enum_type = getattr(api, name)
        for member, value in members.items():
            assert int(getattr(enum_type, member)) == value, f"{name}.{member}"


def _check_names(api: Any) -> None:
    for cls in ("IOEngine", "IOEngineConfig", "RdmaBackendConfig", "EngineDesc", "MemoryDesc"):
        assert hasattr(api, cls), cls
    for method in ENGINE_METHODS:
        assert callable(getattr(api.IOEngine, method)), method
    for cls in ("EngineDesc", "MemoryDesc"):   # fields are checked on instances (round trip below)
        assert callable(getattr(api, cls).pack) and callable(getattr(api, cls).unpack), cls


def test_standin_enums_match_the_documented_values() -> None:
    _check_enums(standin)


def test_standin_engine_methods_match_the_documented_signatures() -> None:
    _check_names(standin)
    for method, expected in ENGINE_METHODS.items():
        params = _params(getattr(standin.IOEngine, method))
        if isinstance(expected, int):
            assert len(params) == expected, method
        else:
            assert [p.name for p in params] == expected, method
    assert [p.name for p in _params(standin.IOEngine.__init__)] == ["key", "config"]
    assert [p.default for p in _params(standin.IOEngine.wait_all)] == [inspect.Parameter.empty, -1]
    for method, expected in SESSION_METHODS.items():
        params = _params(getattr(standin.IOEngineSession, method))
        assert (len(params) if isinstance(expected, int) else [p.name for p in params]) == expected, method


def test_standin_configs_match_the_binding_defaults() -> None:
    params = {p.name: p.default for p in _params(standin.RdmaBackendConfig.__init__)}
    assert list(params) == list(RDMA_CONFIG_DEFAULTS)
    for name, default in RDMA_CONFIG_DEFAULTS.items():
        got = params[name]
        assert (got.name if name == "poll_cq_mode" else got) == default, name
    config = standin.IOEngineConfig()
    assert (config.host, config.port) == ("", 0)


def test_standin_status_and_descriptors_behave_as_documented() -> None:
    status = standin.TransferStatus()
    assert all(callable(getattr(status, m)) for m in STATUS_METHODS)
    assert status.Init() and status.Code() == standin.StatusCode.INIT
    status.SetCode(standin.StatusCode.IN_PROGRESS)
    assert status.InProgress() and status.WaitFor(0) == standin.StatusCode.IN_PROGRESS
    status.Update(standin.StatusCode.ERR_RDMA_OP, "boom")
    status.Update(standin.StatusCode.SUCCESS, "late")            # a failure is sticky
    assert status.Failed() and status.Message() == "boom"
    engine = standin.IOEngine("contract", standin.IOEngineConfig("10.0.0.1", 0))
    desc = engine.get_engine_desc()
    assert desc.port > 0 and desc.host == "10.0.0.1"          # port 0 binds a free port
    again = standin.EngineDesc.unpack(desc.pack())
    assert again == desc and all(getattr(again, f) == getattr(desc, f) for f in ENGINE_DESC_FIELDS)
    md = engine.register_memory(0x1000, 4096, -1, standin.MemoryLocationType.CPU)
    copy = standin.MemoryDesc.unpack(md.pack())
    assert copy == md and all(getattr(copy, f) == getattr(md, f) for f in MEMORY_DESC_FIELDS)
    assert engine.pop_inbound_transfer_status("nobody", 0) is None
    assert isinstance(engine.allocate_transfer_uid(), int)
    standin.reset()


def test_legacy_namespace_differs_only_in_the_batch_form() -> None:
    assert standin.legacy.IOEngine.pop_peer_failure is None
    params = _params(standin.legacy.IOEngine.batch_write)
    assert len(params) == 6 and params[0].annotation in ("MemoryDesc", standin.MemoryDesc)


@pytest.mark.skipif(_real_mori() is None, reason="mori.io does not import here (needs amd-mori on a ROCm host)")
def test_real_mori_matches_the_same_table() -> None:
    real = _real_mori()
    assert real is not None
    _check_enums(real)
    _check_names(real)
    for method in ENGINE_METHODS:
        assert hasattr(standin.IOEngine, method)
