"""kvpush's transfer layer inside vLLM: the engine-agnostic halves of `KVPushConnector`.

vLLM loads ``kvpush.vllm_connector`` (the only module here that imports vLLM) by
``kv_connector_module_path``; it hands each method to one of these plain-Python halves, which test
without vLLM:

    config.py     the connector's options (``kv_connector_extra_config``) -> kvpush's TransferConfig
    legs.py       a request's ``kv_transfer_params`` (kvpush's legs or vLLM's NIXL shape) -> a leg
    meta.py       what the scheduler half tells the worker half each step, and what comes back
    scheduler.py  the scheduler half (vLLM's scheduler process): legs, block references, P's answer
    worker.py     the worker half (vLLM's worker): TransferRuntimes over vLLM's per-layer KV caches
"""
