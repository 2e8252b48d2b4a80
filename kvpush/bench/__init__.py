"""Measuring: the library behind `kvpush bench`, `kvpush demo` and the scripts in benchmarks/.

    cli.py, loadgen.py, datasets.py, metrics.py   `kvpush bench`: prompts, arrivals, TTFT/TPOT/ITL
    trace.py            each request's critical path from the servers' kvpush_trace
    stats.py            bootstrap intervals and "cannot tell" verdicts; report.py: tables; compare.py:
                        `kvpush bench compare` (tables and plots)
    suite.py, modes.py  deployments side by side (Fleet), mode names; demo.py: `kvpush demo`
    interleave.py       one request at a time, modes taking turns on each prompt
    regime*.py, calibrate.py  the regime map; soak.py, stale.py: long runs and forced-late transfers
"""
