"""kvoffload as SGLang's HiCache L3 storage (``HiCacheStorage``), loaded by SGLang with::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvoffload",
      "module_path": "kvoffload.integrations.sglang.storage",
      "class_name": "KvoffloadStorage", "interface_v1": 1, "tenant": "..."}'

:mod:`.storage` imports SGLang; :mod:`.identity` (settings, contract, keys) does
not. See ``docs/sglang.md``.
"""
