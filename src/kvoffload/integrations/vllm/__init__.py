"""kvoffload's vLLM KV connector (``KVConnectorBase_V1``), loaded by vLLM via
``kv_connector_module_path="kvoffload.integrations.vllm"``.

Importing this package imports vLLM; nothing in :mod:`kvoffload` imports it.
See ``README.md`` in this folder for set-up and settings.
"""

from .connector import KVOffloadConnector

__all__ = ["KVOffloadConnector"]
