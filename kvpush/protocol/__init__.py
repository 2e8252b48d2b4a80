"""What crosses process boundaries over HTTP, shared by the instance, the proxy and the benchmarks:

    kv_params.py  kv_transfer_params (the legs' parameters, P's answer) and /v1/kv_info's body
    prompts.py    a completions request's prompt field, one or several
    http.py       OpenAI-style error bodies, JSON and SSE responses, the aiohttp server, signals

The KV channel between instances (side channel, NIXL) is kvpush.transfer's protocol.py.
"""
