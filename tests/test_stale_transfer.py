"""A WRITE (push) or READ (pull) that starts after D's deadline or P's lease, while other requests
want the blocks, over the real nixl: every HTTP 200 equals a colocated run byte for byte, and nothing
is left behind. The scenario is kvpush.bench.stale; benchmarks/stale_transfer.py runs 200 per mode."""

from __future__ import annotations

import pytest

from kvpush.bench.stale import run_stale

pytestmark = pytest.mark.integration
COUNT = {"push": 3, "pull": 2}  # the full 200 per mode: benchmarks/stale_transfer.py


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_late_transfers_never_change_an_answer(tiny_model, reference, tmp_path, mode):
    result = run_stale(tiny_model, mode, COUNT[mode], tmp_path, lambda p, n: reference(p, n)[1])
    print(result.summary())
    assert result.forced_late >= COUNT[mode], result.summary()
    assert result.wrong == [], result.wrong
    assert result.errors == [], result.errors
    assert result.fallbacks >= result.forced_late  # each late transfer was recomputed locally on D
    assert result.leftovers == {}, result.summary()
