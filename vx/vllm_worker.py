"""vLLM worker extension: capture target-layer residual streams inside the model runner.

Passed to vLLM as `worker_extension_cls="vx.vllm_worker.VxWorkerExtension"`; vLLM mixes it into
its Worker class, and the driver calls the `vx_*` methods through `collective_rpc`.

How the capture works (vLLM 0.32):
- The model's EAGLE-3 aux-output interface (`set_aux_hidden_state_layers`) makes the decoder
  return `hidden_states + residual` (the residual stream) at the chosen indices. vLLM's index j
  is the stream *entering* layer j (0 = embeddings), so our layer id k is vLLM index k + 1.
- The model runner's `_model_forward` is wrapped: after each step it maps rows to requests with
  `input_batch.req_ids` and `query_start_loc`, checks each piece starts where the request's
  captured rows end (chunked prefill pieces arrive in position order), and appends it.
- Each request carries its sample id and loss mask in `SamplingParams.extra_args` (read from
  the runner's request state), so the driver makes no RPC per request.
- A request whose rows reach its prompt length is complete: its states go straight to a
  ShardWriter in this process. Hidden states never cross vLLM's RPC.
- Only tensor-parallel rank 0 captures. Anything the hook relies on that is missing raises.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

WARMUP_PREFIX = "vxwarm-"


def _external_id(req_id: str) -> str:
    """vLLM appends '-<8 hex>' to the driver's request id; strip it."""
    head, _, tail = req_id.rpartition("-")
    return head if head and len(tail) == 8 else req_id


class VxWorkerExtension:
    """Methods run inside vLLM's worker process (prefix vx_ avoids clashes with Worker)."""

    def vx_install(self, layer_ids: list[int]) -> dict:
        """Turn on aux outputs for the target layers and wrap the model runner's forward."""
        from vllm.distributed import get_tensor_model_parallel_rank

        runner = self.model_runner
        model = runner.get_model() if hasattr(runner, "get_model") else runner.model
        for attr in ("set_aux_hidden_state_layers", ):
            if not hasattr(model, attr):
                raise RuntimeError(f"vx: {type(model).__name__} lacks {attr}(); this vLLM version or model "
                                   "cannot expose residual streams to vx")
        for attr in ("_model_forward", "input_batch", "query_start_loc", "use_aux_hidden_state_outputs"):
            if not hasattr(runner, attr):
                raise RuntimeError(f"vx: vLLM's model runner lacks {attr!r}; vx's capture hook does not "
                                   "support this vLLM version")
        self._vx_rank0 = get_tensor_model_parallel_rank() == 0
        self._vx_layer_ids = list(layer_ids)
        num_layers = model.config.get_text_config().num_hidden_layers \
            if hasattr(model.config, "get_text_config") else model.config.num_hidden_layers
        model.set_aux_hidden_state_layers(tuple(k + 1 for k in layer_ids))
        runner.use_aux_hidden_state_outputs = True
        self._vx_pending: dict[str, dict] = {}  # external id -> {sample_id, loss_mask, rows, n}
        self._vx_writer = None
        self._vx_stats = {"samples": 0, "tokens": 0, "capture_s": 0.0}
        if getattr(runner, "_vx_wrapped", False):
            return {"num_layers": num_layers}
        inner = runner._model_forward

        def forward_and_capture(*args, **kwargs):
            out = inner(*args, **kwargs)
            if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], list)):
                raise RuntimeError("vx: the model did not return aux hidden states; capture would be empty")
            if self._vx_rank0:
                self._vx_capture(out[1])
            return out

        runner._model_forward = forward_and_capture
        runner._vx_wrapped = True
        return {"num_layers": num_layers}

    def vx_begin(self, out_dir: str, shard_meta: dict, shard_bytes: int, next_shard: int, hidden_size: int,
                 store_dtype: str, max_local_bytes: int | None = None, compress: str | None = None) -> None:
        """Open a ShardWriter for one run (rank 0 only)."""
        from .shards import ShardWriter

        self._vx_pending.clear()
        self._vx_stats = {"samples": 0, "tokens": 0, "capture_s": 0.0}
        if self._vx_rank0:
            self._vx_writer = ShardWriter(Path(out_dir), shard_meta, shard_bytes, next_shard,
                                          len(self._vx_layer_ids), hidden_size, store_dtype,
                                          max_local_bytes=max_local_bytes, compress=compress)

    def vx_finish(self) -> dict:
        """Commit the last shard; return stats. Requests still pending are an error."""
        if not self._vx_rank0:
            return {}
        writer, self._vx_writer = self._vx_writer, None
        if writer is not None:
            writer.close()
        stats = dict(self._vx_stats)
        if writer is not None:
            stats.update(shards=writer.committed_shards, bytes=writer.committed_bytes, rejected=writer.rejected,
                         peak_local_bytes=writer.peak_local_bytes)
        stats["incomplete"] = sorted(v["sample_id"] for v in self._vx_pending.values() if v["n"])
        return stats

    def vx_param_count(self, substring: str) -> int:
        """Parameters of the loaded model whose name contains `substring` (tests: no vision tower)."""
        return sum(p.numel() for n, p in self.model_runner.get_model().named_parameters() if substring in n)

    # ---- hot path -------------------------------------------------------------------------
    def _vx_capture(self, aux: list[torch.Tensor]) -> None:
        t0 = time.perf_counter()
        runner = self.model_runner
        batch = runner.input_batch
        num_reqs = batch.num_reqs
        qsl = runner.query_start_loc.cpu[: num_reqs + 1].tolist()
        total = qsl[-1]
        stacked = torch.stack([h[:total] for h in aux], dim=1)  # [T, L, H], one gather on device
        reused = stacked.device.type == "cuda"
        if reused:  # one async copy into a pinned staging buffer, one sync per step
            buf = getattr(self, "_vx_pinned", None)
            if buf is None or buf.shape[0] < total or buf.dtype != stacked.dtype:
                buf = torch.empty((max(total, getattr(runner, "max_num_tokens", total)),) + tuple(stacked.shape[1:]),
                                  dtype=stacked.dtype, pin_memory=True)
                self._vx_pinned = buf
            host = buf[:total]
            host.copy_(stacked, non_blocking=True)
            torch.cuda.current_stream().synchronize()
        else:
            host = stacked
        for i, req_id in enumerate(batch.req_ids[:num_reqs]):
            key = _external_id(req_id)
            if key.startswith(WARMUP_PREFIX):
                continue
            p = self._vx_pending.get(key)
            if p is None:
                p = self._vx_pending[key] = self._vx_request(runner, req_id)
            start = int(batch.num_computed_tokens_cpu[i])
            if start != p["n"]:
                raise RuntimeError(f"vx: request {key} piece starts at {start}, captured {p['n']} rows so far")
            piece = host[qsl[i]: qsl[i + 1]]
            if piece.shape[0] == 0:
                continue
            p["rows"].append(piece.clone() if reused else piece)  # the staging buffer is reused
            p["n"] += piece.shape[0]
            prompt_len = int(batch.num_prompt_tokens[i])
            if p["n"] >= prompt_len:
                self._vx_complete(key, p, batch.token_ids_cpu[i, :prompt_len])
        self._vx_stats["capture_s"] += time.perf_counter() - t0

    @staticmethod
    def _vx_request(runner, req_id: str) -> dict:
        """A request's sample id, loss mask and rows to keep, carried in its SamplingParams.extra_args
        (so no RPC per request). A request without them is an error: its states would be dropped."""
        state = getattr(runner, "requests", {}).get(req_id)
        extra = (getattr(getattr(state, "sampling_params", None), "extra_args", None) or {}) if state else {}
        if "vx_id" not in extra:
            raise RuntimeError(f"vx: request {req_id!r} carries no vx sample id; refusing to drop its states")
        return {"sample_id": extra["vx_id"], "loss_mask": list(extra["vx_mask"]), "keep": extra["vx_keep"],
                "rows": [], "n": 0}

    def _vx_complete(self, key: str, p: dict, token_ids) -> None:
        hidden = p["rows"][0] if len(p["rows"]) == 1 else torch.cat(p["rows"], dim=0)  # [T, L, H]
        hidden = hidden[: p["keep"]]
        ids = [int(x) for x in token_ids[: p["keep"]]]
        self._vx_writer.add(p["sample_id"], ids, p["loss_mask"], hidden)
        self._vx_stats["samples"] += 1
        self._vx_stats["tokens"] += len(ids)
        del self._vx_pending[key]
