"""--kv-mode auto: the proxy picks a route (local, pull, push, push-layerwise) per request.

    router.py   AutoRouter: the proxy's entry; records decisions and their outcomes
    choice.py   CostModel: each route's estimated TTFT and the delay it causes others; the choice
    fit.py      the online fits behind the estimates (RouteFit, BusyMeter)
    prefix.py   what each D holds of a prompt (prefix estimate)
    records.py  Route, Decision, Outcome: what one decision saw and what came of it

Plain Python, no I/O: tests drive it with recorded timings. docs/protocol.md ("Auto") describes the model.
"""
