"""One kvpush instance (`kvpush serve`): two processes.

    API process         serve.py (start, drain, stop), api.py (OpenAI routes), generation.py and
                        responses.py (one request's stream and its bodies), openai_protocol.py (the
                        request bodies), vllm_compat.py (vLLM-shaped kv_transfer_params), metrics.py,
                        drain.py, engine_client.py (the pipe to the engine core)
    engine-core process core_entry.py -> engine_core.py: the engine (kvpush.engine) and its KV connector
                        (kvpush.transfer) in one step loop
    between the two     messages.py: typed msgspec messages over a pipe
"""
