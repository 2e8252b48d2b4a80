"""The proxy (`kvpush proxy`): one process in front of prefill (P) and decode (D) instances.

    proxy.py    one dispatch per request: pull (P, then D) or push (P and D at once), retries elsewhere
    app.py      the HTTP routes and the middleware (API key, a leg's error as the client's answer)
    request.py  the client's request, parsed once and typed (ClientRequest)
    legs.py     the two legs of a dispatch and the ways they fail
    relay.py    D's answer back to the client, the trace merged
    batch.py    a completions request with several prompts: one dispatch per prompt, merged answers
    pool.py     the instances, probed for health, draining and restarts
    metrics.py  the proxy's Prometheus counters
    auto/       --kv-mode auto: the router that picks a route per request and its cost model

The proxy imports nothing of the instance or the engine (kvpush.protocol is what they share).
"""
