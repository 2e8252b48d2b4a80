"""The proxy (`kvpush proxy`): one process in front of prefill (P) and decode (D) instances.

    proxy.py    the HTTP front door: one dispatch per request, pull (P, then D) or push (P and D at once)
    legs.py     the two legs of a dispatch and their kv_transfer_params
    batch.py    a completions request with several prompts: one dispatch per prompt, merged answers
    pool.py     the instances, probed for health, draining and restarts
    metrics.py  the proxy's Prometheus counters
    auto/       --kv-mode auto: the router that picks a route per request and its cost model

The proxy imports nothing of the instance or the engine (kvpush.protocol is what they share).
"""
