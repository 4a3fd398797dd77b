"""SGLang's own code, imported on a CPU-only machine, and a real host pool built from it
(tests/sglang and scripts/bench_sglang.py; run in the SGLang venv, .venv-sglang).

Named stand-ins (each only for what cannot run here):

* ``torchvision``: SGLang's config package imports it for multimodal models;
  PyPI's torchvision wheel links CUDA's ``libc10_cuda.so``, absent under the
  CPU torch. When the real one cannot be imported, an empty module tree stands
  in for it (nothing on the HiCache path calls it).
* :class:`ControllerStandIn`: SGLang's ``HiCacheController`` needs a GPU device
  pool and torch.distributed groups. The stand-in is a bare object carrying
  the controller's *own* methods (``_page_backup``, ``_page_set_zero_copy``,
  ``_storage_hit_query``, ``_page_transfer``, ``_page_get_zero_copy``...), taken
  from the class, so the calls into the backend are SGLang's code, unchanged.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
import warnings
from queue import Queue
from typing import Any


def _stand_in_attr(attr: str) -> type:
    # Dunder names stay absent: tools that walk sys.modules (hypothesis, coverage)
    # read __file__ and friends and must not be handed a class.
    if attr.startswith("__") and attr.endswith("__"):
        raise AttributeError(attr)
    return type(attr, (), {})


class _EmptyTorchvision(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: Any) -> types.ModuleType:
        m = types.ModuleType(spec.name)
        m.__path__ = []
        m.__getattr__ = _stand_in_attr  # type: ignore[method-assign]
        return m

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def import_sglang() -> None:
    """Import the SGLang modules the backend and these tests use (raises ImportError)."""
    if importlib.util.find_spec("sglang") is None:
        # Where SGLang is absent, leave no stand-in behind in this interpreter.
        raise ImportError("No module named 'sglang'")
    with warnings.catch_warnings():
        # Import-time notices of SGLang and its dependencies ("only CUDA supports ...").
        warnings.simplefilter("ignore")
        try:
            import torchvision  # noqa: F401
        except Exception:
            for name in [m for m in sys.modules if m.split(".")[0] == "torchvision"]:
                del sys.modules[name]
            # transformers decides once whether torchvision exists: let it see none.
            import transformers.image_transforms
            import transformers.image_utils  # noqa: F401

            if not any(isinstance(f, _EmptyTorchvision) for f in sys.meta_path):
                sys.meta_path.insert(0, _EmptyTorchvision())
        import sglang.srt.managers.cache_controller
        import sglang.srt.mem_cache.hicache_storage
        import sglang.srt.mem_cache.pool_host.mha
        import sglang.srt.mem_cache.storage.backend_factory  # noqa: F401


def host_pool(
    layout: str = "page_first",
    *,
    layers: int = 2,
    heads: int = 2,
    head_dim: int = 16,
    page_size: int = 4,
    tokens: int = 64,
    allocator: str = "default",
) -> Any:
    """SGLang's real ``MHATokenToKVPoolHost`` (host size 2x the device's), over CPU
    tensors standing in for the device KV buffers it is built from. ``allocator``:
    SGLang's host allocator ("shm": its ``ShmHostTensorAllocator``, a memfd)."""
    import torch
    from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    k = tuple(torch.zeros(tokens, heads, head_dim, dtype=torch.bfloat16) for _ in range(layers))
    v = tuple(torch.zeros(tokens, heads, head_dim, dtype=torch.bfloat16) for _ in range(layers))

    def ptrs(ts: tuple[Any, ...]) -> Any:
        return torch.tensor([t.data_ptr() for t in ts], dtype=torch.uint64)

    info = MHABufferInfo(
        buffers=KVBuffers(
            k=k, v=v, k_data_ptrs=ptrs(k), v_data_ptrs=ptrs(v), layout=KVBufferLayout.NHD
        ),
        page_size=page_size,
        head_num=heads,
        head_dim=head_dim,
        v_head_dim=head_dim,
        dtype=torch.bfloat16,
        device=torch.device("cpu"),
    )
    return MHATokenToKVPoolHost(
        info,
        2.0,
        0,
        page_size,
        layout,
        pin_memory=False,
        device="cpu",
        allocator_type=allocator,
        device_capacity_tokens=tokens,
        start_layer=0,
        end_layer=layers,
    )


def storage_config(extra: dict[str, Any], *, tp_rank: int = 0, tp_size: int = 1, **kw: Any) -> Any:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    fields: dict[str, Any] = dict(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=True,
        model_name="Org/tiny-model",
        extra_config=extra,
    )
    fields.update(kw)
    return HiCacheStorageConfig(**fields)


def dynamic_extra(socket_path: str, tenant: str, **more: Any) -> dict[str, Any]:
    return {
        "backend_name": "kvoffload",
        "module_path": "kvoffload.integrations.sglang.storage",
        "class_name": "KvoffloadStorage",
        "interface_v1": 1,
        "socket_path": socket_path,
        "tenant": tenant,
        **more,
    }


def controller_stand_in(backend: Any, pool: Any, *, v1: bool = True) -> Any:
    """The named stand-in for ``HiCacheController`` (see the module docstring).
    ``v1``: a "dynamic" backend with ``interface_v1`` (else the generic calls)."""
    from sglang.srt.managers.cache_controller import HiCacheController as HC

    class ControllerStandIn:
        _page_backup = HC._page_backup
        _page_set_zero_copy = HC._page_set_zero_copy
        _generic_page_set = HC._generic_page_set
        _page_get_zero_copy = HC._page_get_zero_copy
        _generic_page_get = HC._generic_page_get
        _storage_hit_query = HC._storage_hit_query
        _page_transfer = HC._page_transfer
        _page_transfer_kv_batch = HC._page_transfer_kv_batch

        def __init__(self) -> None:
            self.storage_backend = backend
            self.storage_host_pool = pool
            self.mem_pool_host = pool
            self.page_size = pool.page_size
            self.prefetch_sync_queue: Queue[Any] = Queue()
            # attach_storage_backend's choice for "dynamic" with interface_v1.
            self.page_get_func = self._page_get_zero_copy if v1 else self._generic_page_get
            self.page_set_func = self._page_set_zero_copy if v1 else self._generic_page_set

    return ControllerStandIn()
