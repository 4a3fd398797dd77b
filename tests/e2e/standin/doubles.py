"""Stand-ins for the vLLM objects a connector receives, and the recording connector.

A test double (see the package docstring).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    pass

# --------------------------------------------------------------------------
# Stand-ins for the vLLM objects a connector receives
# --------------------------------------------------------------------------


@dataclass
class StandInAttentionLayer:
    """Stand-in for vLLM's ``Attention`` module in ``no_compile_layers``: connectors
    (vLLM's ExampleConnector among them) read ``layer.kv_cache`` from it."""

    layer_name: str
    kv_cache: torch.Tensor


@dataclass(frozen=True)
class StandInAttentionMetadata:
    """Stand-in for vLLM 0.33's ``FlashAttentionMetadata``: the fields a connector
    reads, for the requests of one step laid end to end."""

    num_actual_tokens: int
    max_query_len: int
    query_start_loc: torch.Tensor  # int32 [num_reqs + 1]
    max_seq_len: int
    seq_lens: torch.Tensor  # int32 [num_reqs]
    block_table: torch.Tensor  # int32 [num_reqs, max_blocks], zero-padded
    slot_mapping: torch.Tensor  # int64 [num_actual_tokens]
    causal: bool = True


@dataclass
class StandInForwardContext:
    """Stand-in for vLLM's ``ForwardContext``. ``attn_metadata`` is None in a step
    with nothing to compute (as in ``kv_connector_no_forward``).
    ``virtual_engine`` is gone from vLLM 0.33 and kept (always 0) for connectors
    written against earlier versions."""

    no_compile_layers: dict[str, StandInAttentionLayer]
    attn_metadata: dict[str, StandInAttentionMetadata] | None
    slot_mapping: dict[str, torch.Tensor]
    virtual_engine: int = 0
    additional_kwargs: dict[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------------------
# What plugs in: the connector's worker side and its scheduler side
# --------------------------------------------------------------------------


class WorkerConnector(Protocol):
    """The worker methods of vLLM's ``KVConnectorBase_V1`` the stand-in calls.

    Duck-typed extras, used when present: ``register_kv_caches(kv_caches)`` (once,
    at construction), ``handle_preemptions(metadata)``,
    ``get_transfer_results(finished_req_ids)`` (preferred over ``get_finished``,
    as vLLM 0.33 does), ``get_block_ids_with_load_errors()``,
    ``build_connector_worker_meta()``.
    """

    def bind_connector_metadata(self, connector_metadata: Any) -> None: ...

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None: ...

    def wait_for_layer_load(self, layer_name: str) -> None: ...

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None: ...

    def wait_for_save(self) -> None: ...

    def get_finished(
        self, finished_req_ids: set[str]
    ) -> tuple[set[str] | None, set[str] | None]: ...

    def clear_connector_metadata(self) -> None: ...


@dataclass(frozen=True)
class RequestView:
    """What the mini-scheduler tells the connector's scheduler side about a request."""

    req_id: str
    prompt_token_ids: tuple[int, ...]
    all_token_ids: tuple[int, ...]
    num_computed_tokens: int
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of a step.

    The KV of ``token_ids[:num_computed_tokens]`` must be in ``block_ids`` when
    the forward runs: already there (a local hit), or written by the connector
    in ``start_load_kv`` (the last ``num_external_tokens`` of them).
    """

    req_id: str
    token_ids: tuple[int, ...]
    block_ids: tuple[int, ...]
    num_computed_tokens: int
    num_scheduled_tokens: int
    num_external_tokens: int = 0


@dataclass(frozen=True)
class StepPlan:
    """One step, in the terms of vLLM's ``SchedulerOutput``."""

    step: int
    requests: tuple[ScheduledRequest, ...] = ()
    #: Requests that finished before this step (vLLM passes them to ``get_finished``).
    finished_req_ids: frozenset[str] = frozenset()


class SchedulerHooks(Protocol):
    """The connector's scheduler side, consulted by :meth:`StandInModelRunner.generate`
    in vLLM's order. An adapter maps these onto a real connector's
    ``get_num_new_matched_tokens`` / ``update_state_after_alloc`` /
    ``build_connector_meta`` / ``request_finished``."""

    def get_num_new_matched_tokens(
        self, request: RequestView, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """(tokens loadable beyond ``num_computed_tokens``, whether the load is async)."""
        ...

    def update_state_after_alloc(
        self, request: RequestView, block_ids: Sequence[int], num_external_tokens: int
    ) -> None: ...

    def build_connector_meta(self, plan: StepPlan) -> Any: ...

    def request_finished(self, request: RequestView, block_ids: Sequence[int]) -> bool:
        """True when the connector still reads the blocks: they are held until
        ``get_finished`` reports the request in ``finished_sending``."""
        ...


@dataclass
class StepOutput:
    """What one step produced: logits of every scheduled position, and the
    connector's report (vLLM's ``KVConnectorOutput``)."""

    plan: StepPlan
    logits: dict[str, torch.Tensor]  # req_id -> float32 [num_scheduled_tokens, vocab]
    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)
    invalid_block_ids: set[int] = field(default_factory=set)
    #: ``build_connector_worker_meta()``, for connectors that report to their scheduler side.
    worker_meta: Any = None


@dataclass
class Generation:
    """One request run to completion by :meth:`StandInModelRunner.generate`."""

    req_id: str
    prompt: tuple[int, ...]
    #: Greedily sampled tokens.
    tokens: list[int]
    #: float32 ``[max_new_tokens, vocab]``: the logits each token was chosen from.
    sampled_logits: torch.Tensor
    #: float32 ``[n, vocab]``: logits of the prompt positions this run computed
    #: (the last ``n`` positions of the prompt).
    prefill_logits: torch.Tensor
    num_local_computed_tokens: int
    #: Prompt tokens whose KV the connector supplied (after any load-error recompute).
    num_external_tokens: int
    #: Times a reported load error made the run recompute from the first bad block.
    load_error_recomputes: int
    block_ids: tuple[int, ...]
    #: layer name -> (K, V), each ``[T, H, D]``: the request's KV read back from the
    #: paged blocks at the end (T = prompt + sampled tokens - 1).
    kv: dict[str, tuple[torch.Tensor, torch.Tensor]]
    steps: list[StepOutput]


@dataclass
class TransferResults:
    """vLLM 0.33's ``KVConnectorTransferResults``, without importing vLLM."""

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)


class RecordingConnector:
    """Wraps a worker connector (or nothing) and records each call, in order.

    ``calls`` holds ``(method, detail)``; ``detail`` is the layer name for the
    per-layer methods and ``""`` otherwise. ``on_save`` sees each
    ``save_kv_layer`` call before it is forwarded (to check what the blocks hold
    at that moment).
    """

    def __init__(
        self,
        inner: WorkerConnector | None = None,
        on_save: Callable[[str, torch.Tensor, Any], None] | None = None,
    ) -> None:
        self.inner = inner
        self.on_save = on_save
        self.calls: list[tuple[str, str]] = []
        self.registered: dict[str, torch.Tensor] | None = None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.calls.append(("register_kv_caches", ""))
        self.registered = kv_caches
        register = getattr(self.inner, "register_kv_caches", None)
        if register is not None:
            register(kv_caches)

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        self.calls.append(("bind_connector_metadata", ""))
        if self.inner is not None:
            self.inner.bind_connector_metadata(connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self.calls.append(("start_load_kv", ""))
        if self.inner is not None:
            self.inner.start_load_kv(forward_context, **kwargs)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.calls.append(("wait_for_layer_load", layer_name))
        if self.inner is not None:
            self.inner.wait_for_layer_load(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        self.calls.append(("save_kv_layer", layer_name))
        if self.on_save is not None:
            self.on_save(layer_name, kv_layer, attn_metadata)
        if self.inner is not None:
            self.inner.save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)

    def wait_for_save(self) -> None:
        self.calls.append(("wait_for_save", ""))
        if self.inner is not None:
            self.inner.wait_for_save()

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        self.calls.append(("handle_preemptions", ""))
        preemptions = getattr(self.inner, "handle_preemptions", None)
        if preemptions is not None:
            preemptions(kv_connector_metadata)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        self.calls.append(("get_finished", ""))
        if self.inner is None:
            return None, None
        return self.inner.get_finished(finished_req_ids)

    def get_transfer_results(self, finished_req_ids: set[str]) -> TransferResults:
        self.calls.append(("get_transfer_results", ""))
        results = getattr(self.inner, "get_transfer_results", None)
        if results is not None:
            r = results(finished_req_ids)
            return TransferResults(
                set(r.finished_sending or ()),
                set(r.finished_recving or ()),
                set(getattr(r, "failed_recving", None) or ()),
            )
        if self.inner is None:
            return TransferResults()
        sending, recving = self.inner.get_finished(finished_req_ids)
        return TransferResults(set(sending or ()), set(recving or ()))

    def get_block_ids_with_load_errors(self) -> set[int]:
        self.calls.append(("get_block_ids_with_load_errors", ""))
        errors = getattr(self.inner, "get_block_ids_with_load_errors", None)
        return set(errors()) if errors is not None else set()

    def build_connector_worker_meta(self) -> Any:
        self.calls.append(("build_connector_worker_meta", ""))
        meta = getattr(self.inner, "build_connector_worker_meta", None)
        return meta() if meta is not None else None

    def clear_connector_metadata(self) -> None:
        self.calls.append(("clear_connector_metadata", ""))
        if self.inner is not None:
            self.inner.clear_connector_metadata()
