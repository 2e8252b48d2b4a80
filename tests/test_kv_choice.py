"""--kv-mode auto's cost model as plain Python: the learned lines, prefix tracking of token-id, text
and chat prompts, the choice per route and what it learns from an answer's trace."""

from __future__ import annotations

import math

import pytest

from kvpush.protocol.trace import Trace
from kvpush.proxy.auto.choice import (
    AFTER_OFFSETS,
    AFTER_SLOPES,
    BUSY_MAX,
    EXPLORE_EVERY,
    EXPLORE_EVERY_LATER,
    STALE_AFTER,
    TIE_EVERY,
    CostModel,
    Decision,
    Line,
    Route,
)
from kvpush.proxy.auto.fit import BusyMeter, LocalBudget, RouteFit
from kvpush.proxy.auto.prefix import PrefixTracker, PromptKey
from kvpush.proxy.auto.records import Outcome, incumbent_key, outcome
from kvpush.proxy.auto.router import AutoRouter
from kvpush.proxy.request import ClientRequest

BS = 8
PAIR = ("http://p", "http://d")


def req(body: dict) -> ClientRequest:
    """A client's request as the proxy parsed it."""
    return ClientRequest.of("/v1/chat/completions" if "messages" in body else "/v1/completions", body)


def test_line_fits_a_straight_line_and_answers_its_prior_before_enough_samples():
    line = Line(0.5, 0.1, min_samples=4)
    assert line(10) == pytest.approx(1.5)
    for x in (0, 10, 20, 30, 40):
        line.add(x, 0.002 + 0.001 * x)
    a, b = line.coefficients()
    assert a == pytest.approx(0.002) and b == pytest.approx(0.001)
    assert line(-5) == pytest.approx(0.002)  # no negative work


def test_line_forgets_old_samples():
    line = Line(0.0, 0.0, half_life=5)
    for _ in range(50):
        line.add(100, 1.0)
    for _ in range(50):
        line.add(100, 3.0)
    assert line(100) == pytest.approx(3.0, rel=0.01)


def test_line_slope_never_negative_and_constant_x_keeps_prior_slope():
    line = Line(0.0, 0.25)
    for i in range(10):
        line.add(10, 5.0 + (i % 2))
    assert line.coefficients()[1] == 0.25
    falling = Line(0.0, 0.0)
    for x in range(10):
        falling.add(x, 10 - x)
    assert falling.coefficients()[1] == 0.0


def ids(n: int, seed: int = 0) -> list[int]:
    return [(seed * 7919 + i * 31) % 1000 for i in range(n)]


def test_token_id_prompts_match_by_whole_blocks():
    t = PrefixTracker()
    t.record(PromptKey.of(req({"prompt": ids(5 * BS)}), BS))
    assert t.matched(PromptKey.of(req({"prompt": ids(5 * BS) + [1, 2, 3]}), BS)) == 5
    assert t.matched(PromptKey.of(req({"prompt": ids(3 * BS + 4)}), BS)) == 3
    other = ids(5 * BS)
    other[BS + 1] += 1  # differs in block 1: only block 0 is shared
    assert t.matched(PromptKey.of(req({"prompt": other}), BS)) == 1
    assert t.matched(PromptKey.of(req({"prompt": ids(5 * BS, seed=1)}), BS)) == 0
    key = PromptKey.of(req({"prompt": ids(5 * BS + 3)}), BS)
    assert key.exact_tokens == 5 * BS + 3 and key.unit_tokens == BS
    odd = PromptKey.of(req({"prompt": ids(2 * BS) + [1.5]}), BS)  # not token ids: counted as text, never exact
    assert odd.exact_tokens is None and odd.unit_tokens is None


def test_chat_turns_share_the_conversation_prefix():
    t = PrefixTracker()
    turn1 = [{"role": "system", "content": "s" * 300}, {"role": "user", "content": "first question " * 10}]
    t.record(PromptKey.of(req({"messages": turn1}), BS))
    turn2 = turn1 + [{"role": "assistant", "content": "an answer " * 20}, {"role": "user", "content": "more"}]
    key2 = PromptKey.of(req({"messages": turn2}), BS)
    matched = t.matched(key2)
    assert matched == len(PromptKey.of(req({"messages": turn1}), BS).hashes) and 0 < matched < len(key2.hashes)
    assert t.matched(PromptKey.of(req({"messages": [{"role": "user", "content": "x" * 500}]}), BS)) == 0


def test_tracker_is_lru_bounded():
    t = PrefixTracker(capacity=10)
    t.record(PromptKey.of(req({"prompt": ids(8 * BS)}), BS))
    t.record(PromptKey.of(req({"prompt": ids(8 * BS, seed=3)}), BS))
    assert len(t.units) == 10
    assert t.matched(PromptKey.of(req({"prompt": ids(8 * BS)}), BS)) == 0  # its first blocks went first
    assert t.matched(PromptKey.of(req({"prompt": ids(8 * BS, seed=3)}), BS)) == 8


def decision(tokens=512.0, d_prefix=0.0, p_prefix=0.0, d_running=0, p_queue=0.0, d_queue=0.0) -> Decision:
    return Decision(Route.LOCAL, tokens, p_prefix, d_prefix, p_queue, d_queue, d_running, PAIR)


def p_gap(m: CostModel, d: Decision) -> float:
    """P's part of push-layerwise's estimate less push's (the same queue ahead of both)."""
    return m.p_time(Route.PUSH_LAYERWISE, d, d.p_queue) - m.p_time(Route.PUSH, d, d.p_queue)


def trained(local_s_per_token=0.0004, rest_push=0.010, rest_pull=0.025, local_max_s=10.0,
            stall_weight=1.0, near_tie=0.0, switch_margin=0.0) -> CostModel:
    """Push and push-layerwise 2 ms apart: a near tie, which these tests leave to the cheapest (near_tie 0,
    no switch margin: they test the fits' ranking)."""
    m = CostModel(stall_weight=stall_weight, local_max_s=local_max_s, near_tie=near_tie, switch_margin=switch_margin)
    for n in (128, 256, 512, 1024):
        d = decision(tokens=n)
        for route, rest in ((Route.PUSH, rest_push), (Route.PULL, rest_pull), (Route.PUSH_LAYERWISE, rest_push + 0.002)):
            d.route = route
            p_time = 0.004 + 0.0004 * n
            m.observe(d, Outcome(p_time + rest, p_time, None, n, 0))
        d.route = Route.LOCAL
        m.observe(d, Outcome(0.004 + local_s_per_token * n, None, 0.004 + local_s_per_token * n, n, 0))
    return m


def test_idle_decode_without_prefix_prefills_locally_busy_one_does_not():
    m = trained()
    assert m.choose(decision()).route is Route.LOCAL  # no handover to pay, nobody to stall
    busy = m.choose(decision(d_running=4))
    assert busy.route is Route.PUSH, busy.estimates_s  # 4 streams would each stall for the prefill
    assert busy.estimates_s["local"] < busy.estimates_s["push"]  # the estimate is TTFT; the cost adds the stall


def test_local_only_below_its_prefill_time_cap():
    m = trained(local_max_s=0.064)  # 0.4 ms per token: up to ~150 tokens
    idle_long = m.choose(decision(tokens=512))
    assert idle_long.route is Route.PUSH and "local" not in idle_long.estimates_s
    assert m.choose(decision(tokens=512, d_prefix=448)).route is Route.LOCAL  # 64 new tokens
    assert m.choose(Decision(Route.LOCAL, 512, 0, 0, 0, 0, 0, PAIR), (Route.LOCAL,)).route is Route.LOCAL  # all there is


def test_burst_at_prefill_lifts_the_cap_on_local():
    """Past the cap, local is still a candidate when P's queue alone would hold the request longer
    than D's prefill takes; the stall on D's running requests is still charged."""
    m = trained(local_max_s=0.064)
    short_queue = m.choose(decision(tokens=512, p_queue=256))  # ~0.1 s of queue < ~0.2 s local prefill
    assert short_queue.route is Route.PUSH and "local" not in short_queue.estimates_s
    burst = m.choose(decision(tokens=512, p_queue=4096, d_running=2))  # ~1.6 s of queue on P
    assert burst.route is Route.LOCAL, burst.estimates_s
    assert m.p_queue_delay(burst) == pytest.approx(0.0004 * 4096, rel=0.05)
    crowded = m.choose(decision(tokens=512, p_queue=1024, d_running=8))  # allowed, but 8 streams stall
    assert "local" in crowded.estimates_s and crowded.route is Route.PUSH, crowded.estimates_s
    d_backlog = m.choose(decision(tokens=512, p_queue=4096, d_queue=4096))  # D's own queue is as long as P's
    assert d_backlog.route is Route.PUSH and "local" not in d_backlog.estimates_s


def test_prefix_on_decode_makes_local_cheap_even_when_busy():
    m = trained()
    d = m.choose(decision(tokens=1024, d_prefix=1000, d_running=4))
    assert d.route is Route.LOCAL, d.estimates_s
    assert d.estimates_s["local"] < d.estimates_s["push"] / 10


def test_queue_on_prefill_counts():
    m = trained()
    d = m.choose(decision(tokens=256, d_running=2, p_queue=4096))
    assert d.estimates_s["push"] > 0.0004 * 4096
    assert d.route is Route.LOCAL


def test_cheapest_remote_route_and_slow_pairs_are_learned():
    m = trained(rest_push=0.030, rest_pull=0.010)  # here pull's handover is the faster one, on an idle D
    assert m.choose(decision(d_running=2)).route is Route.PULL
    busy = m.choose(decision(d_running=12))  # unmeasured there: pull's prior load slope (+2 ms a request) counts
    assert busy.route is Route.PUSH, busy.estimates_s
    slow = ("http://p2", "http://d")  # a pair behind a slow link: every remote route takes 300 ms more
    for _ in range(6):
        for route, rest in ((Route.PUSH, 0.330), (Route.PULL, 0.310)):
            m.observe(Decision(route, 512, 0, 0, 0, 0, 0, slow), Outcome(0.21 + rest, 0.21, None, 512, 0))
    d = m.choose(Decision(Route.LOCAL, 512, 0, 0, 0, 0, 0, slow))
    assert d.route is Route.LOCAL, d.estimates_s  # cheaper to prefill on D than to cross that link
    assert d.estimates_s["pull"] == pytest.approx(0.21 + 0.31, abs=0.02)
    assert m.choose(decision(d_running=1)).route is Route.PULL  # the fast pair keeps its answer


def test_route_fit_moves_every_route_with_the_load():
    """Measured side by side at low load, pull costs 10 ms more than push; then the load rises and
    only push is measured: pull's estimate rises with it instead of staying at its old value."""
    r = RouteFit(("push", "push-layerwise", "pull"), {"pull": 0.004}, 0.004, 1e-5)
    pair = ("p", "d")
    for i in range(40):
        x = 256.0 + 256 * (i % 3)
        load = i % 2  # D idle or running one request
        r.add(x, load, 0.010 + 0.005 * load + 1e-5 * x, "push", pair)
        r.add(x, load, 0.020 + 0.005 * load + 1e-5 * x, "pull", pair)
    assert r(512, 0, "pull", pair) - r(512, 0, "push", pair) == pytest.approx(0.010, abs=2e-3)
    for i in range(60):  # D gets busy (8 running): only push is measured
        x = 256.0 + 256 * (i % 3)
        r.add(x, 8, 0.050 + 1e-5 * x, "push", pair)
    assert r(512, 8, "push", pair) == pytest.approx(0.050 + 0.00512, abs=3e-3)
    # pull stays ~10 ms above push at the new load (its old samples decay towards the prior 4 ms)
    assert r(512, 8, "pull", pair) - r(512, 8, "push", pair) == pytest.approx(0.010, abs=4e-3)
    assert r(512, 8, "push-layerwise", pair) == pytest.approx(r(512, 8, "push", pair), abs=3e-3)  # never measured


def test_route_fit_lets_pull_grow_faster_with_the_load_than_push():
    """regime_full12b's shape: pull's rest 5.6 ms over push's on an idle D, rising 2.3 ms more per request
    decoding there (it waits for D's steps to admit the request and post its READ). One load slope
    shared by both would put pull a fixed ~10 ms over push: dearer than it is on an idle D, and
    cheaper than it is on a busy one."""
    r = RouteFit(("push", "pull"), {"pull": 0.004}, 0.004, 1e-5, load_priors={"pull": 0.002})
    pair = ("p", "d")
    for i in range(60):
        load = i % 5
        r.add(256, load, 0.0030 + 0.0011 * load, "push", pair)
        r.add(256, load, 0.0086 + 0.0034 * load, "pull", pair)
    assert r(256, 0, "pull", pair) - r(256, 0, "push", pair) == pytest.approx(0.0056, abs=1e-3)
    assert r(256, 8, "pull", pair) - r(256, 8, "push", pair) == pytest.approx(0.0056 + 8 * 0.0023, abs=2e-3)


def test_cost_model_leaves_pull_when_d_gets_busy():
    """Pull measured cheaper than push on an idle D but growing faster with D's load: auto takes pull
    while D is idle and push once D decodes several requests."""
    m = CostModel(switch_margin=0.0)
    for i in range(80):
        load = i % 4
        for route, rest in ((Route.PUSH, 0.010 + 0.001 * load), (Route.PULL, 0.007 + 0.004 * load)):
            m.observe(Decision(route, 512, 0, 0, 0, 0, load, PAIR), Outcome(0.2 + rest, 0.2, None, 512, 0))
    remote = (Route.PUSH, Route.PULL)
    assert m.choose(Decision(Route.LOCAL, 512, 0, 0, 0, 0, 0, PAIR), remote).route is Route.PULL
    assert m.choose(Decision(Route.LOCAL, 512, 0, 0, 0, 0, 6, PAIR), remote).route is Route.PUSH


def test_route_fit_one_prompt_length_keeps_the_prior_slope():
    r = RouteFit(("push", "pull"), {}, 0.0, 1e-5)
    for _ in range(20):
        r.add(512, 0, 0.02, "push", ("p", "d"))
    assert r(512, 0, "push", ("p", "d")) == pytest.approx(0.02, abs=1e-4)
    assert r(1024, 0, "push", ("p", "d")) == pytest.approx(0.02 + 512e-5, abs=1e-3)


def test_every_nth_decision_explores_the_least_measured_then_the_least_recently_taken_route():
    m = trained()
    m.samples[Route.PUSH_LAYERWISE] = 0
    routes = [m.choose(decision(d_running=4)).route for _ in range(EXPLORE_EVERY * 3)]
    assert routes.count(Route.PUSH_LAYERWISE) == 3 and routes.count(Route.PUSH) == EXPLORE_EVERY * 3 - 3
    m.samples = dict.fromkeys(Route, 50)  # all measured, all taken lately: explore far less often
    m.decisions = 0
    m.taken_at = {Route.PUSH: 0, Route.PULL: -40, Route.PUSH_LAYERWISE: -10, Route.LOCAL: -20}
    routes = [m.choose(decision(d_running=4)).route for _ in range(EXPLORE_EVERY_LATER)]
    assert routes.count(Route.PULL) == 1 and routes.count(Route.PUSH) == EXPLORE_EVERY_LATER - 1  # taken longest ago
    # local and push-layerwise go stale (STALE_AFTER decisions untaken): explored every EXPLORE_EVERY-th
    # decision until each was taken again, then pull at the next EXPLORE_EVERY_LATER-th
    assert STALE_AFTER == 150
    routes = [m.choose(decision(d_running=4)).route for _ in range(EXPLORE_EVERY_LATER)]
    explored = [(i + EXPLORE_EVERY_LATER + 1, r) for i, r in enumerate(routes) if r is not Route.PUSH]
    assert explored == [(140, Route.LOCAL), (160, Route.PUSH_LAYERWISE), (200, Route.PULL)]


def test_forced_and_local_only_choices():
    r = AutoRouter()
    body = req({"prompt": ids(40)})
    assert r.decide(body, "http://p", "http://d", 0, BS, forced=Route.PULL).route is Route.PULL
    assert r.decide(body, None, "http://d", 5, BS).route is Route.LOCAL  # no usable prefill instance


def test_router_tracks_queues_and_prefixes_and_learns_the_text_token_ratio():
    r = AutoRouter()
    text = "word " * 400  # 2000 characters
    d = r.decide(req({"prompt": text}), "http://p", "http://d", 9, BS, forced=Route.PUSH)
    assert d.tokens == pytest.approx(500)  # the prior 0.25 tokens per character
    r.dispatched(d)
    assert r.queued["http://p"] == pytest.approx(500)
    again = r.decide(req({"prompt": text + " more"}), "http://p", "http://d", 9, BS, forced=Route.PUSH)
    assert again.d_prefix > 0.9 * again.tokens and again.p_prefix > 0.9 * again.tokens
    r.prefilled(d)
    assert r.queued["http://p"] == 0
    trace = {"proxy_received": 100.0, "d_leg_sent": 100.001, "api_received": 50.0, "first_token": 50.2,
             "p_api_received": 70.0, "p_prefill_done": 70.15}
    ratio = r.finished(d, Trace.from_json(trace), {"tokens": 400, "cached_tokens": 0})
    assert ratio == pytest.approx(0.201 / d.estimates_s["push"])
    assert r.model.tokens_per_char < 0.25  # 400 tokens for 2000 characters pulls the ratio towards 0.2
    r.forget("http://d")
    assert r.decide(req({"prompt": text}), "http://p", "http://d", 0, BS).d_prefix == 0


def test_outcome_reads_one_clock_per_span_and_ignores_garbage():
    o = outcome(Trace.from_json({"proxy_received": 10.0, "d_leg_sent": 10.5, "api_received": 900.0, "first_token": 900.25,
                                 "p_api_received": 1.0, "p_prefill_done": 1.125}), {"tokens": 7, "cached_tokens": 3})
    assert (o.ttft_s, o.p_time_s, o.d_time_s, o.prompt_tokens, o.d_cached_tokens) == (0.75, 0.125, 0.25, 7, 3)
    bad = outcome(Trace.from_json({"proxy_received": "x", "first_token": 1.0, "api_received": 2.0}), {"tokens": "7"})
    assert (bad.ttft_s, bad.d_time_s, bad.prompt_tokens) == (None, None, None)
    assert outcome(Trace.from_json(None), None).ttft_s is None


def test_one_prompt_in_a_list_counts_like_the_prompt():
    text_key = PromptKey.of(req({"prompt": ["word " * 100]}), BS)
    assert text_key.chars == 500 and text_key.hashes == PromptKey.of(req({"prompt": "word " * 100}), BS).hashes
    ids_key = PromptKey.of(req({"prompt": [ids(3 * BS)]}), BS)
    assert ids_key.exact_tokens == 3 * BS and len(ids_key.hashes) == 3


def test_queue_release_is_idempotent_and_reroutes_move_the_pair():
    r = AutoRouter()
    d = r.decide(req({"prompt": ids(40)}), "http://p", "http://d", 0, BS, forced=Route.PULL)
    r.dispatched(d)
    r.prefilled(d)
    r.prefilled(d)  # a timer and the answer may both say so
    assert r.queued["http://p"] == 0
    other = r.decide(req({"prompt": ids(40, seed=2)}), "http://p", "http://d", 0, BS, forced=Route.PULL)
    r.dispatched(other)
    r.prefilled(d)
    assert r.queued["http://p"] == 40  # the other request's tokens are still queued
    r.rerouted(other, "http://d2")
    assert other.pair == ("http://p", "http://d2")
    assert r.decide(req({"prompt": ids(40, seed=2)}), "http://p", "http://d2", 0, BS).d_prefix == 40


def test_requests_waiting_for_their_prefill_do_not_count_as_decoding_on_d():
    """d_running counts D's requests past their prefill: those whose KV P still computes (or whose local
    prefill is queued) are not stalled by a local prefill, and move to decoding once prefilled."""
    r = AutoRouter()
    waiting = [r.decide(req({"prompt": ids(40, seed=s)}), "http://p", "http://d", s, BS, forced=Route.PUSH) for s in range(3)]
    for d in waiting:
        r.dispatched(d)
    assert r.decide(req({"prompt": ids(40, seed=9)}), "http://p", "http://d", 3, BS).d_running == 0
    assert r.decide(req({"prompt": ids(40, seed=9)}), "http://p", "http://d", 5, BS).d_running == 2  # 2 others decode
    r.prefilled(waiting[0])
    r.prefilled(waiting[0])  # idempotent
    assert r.decide(req({"prompt": ids(40, seed=9)}), "http://p", "http://d", 3, BS).d_running == 1
    r.rerouted(waiting[1], "http://d2")  # still pending: it now waits on d2
    assert r.decide(req({"prompt": ids(40, seed=9)}), "http://p", "http://d2", 1, BS).d_running == 0
    assert r.decide(req({"prompt": ids(40, seed=9)}), "http://p", "http://d", 2, BS).d_running == 1


def test_an_answer_recomputed_after_a_failed_transfer_teaches_nothing():
    r = AutoRouter()
    d = r.decide(req({"prompt": ids(40)}), "http://p", "http://d", 0, BS, forced=Route.PUSH)
    trace = {"proxy_received": 1.0, "d_leg_sent": 1.001, "api_received": 5.0, "first_token": 9.0,
             "p_api_received": 2.0, "p_prefill_done": 2.1, "kv_fallback_local": 8.0}
    assert r.finished(d, Trace.from_json(trace), {"tokens": 40, "cached_tokens": 0}) is None
    assert r.model.samples[Route.PUSH] == 0 and r.model.rest.n == 0


def test_local_is_tried_before_d_measured_it_when_the_uncached_part_is_short():
    """P's line has a large intercept (its queue): D's first local estimates use only its slope, so
    that a short uncached part can go local and D's own line starts to learn."""
    m = CostModel(local_max_s=0.064)
    for n in (128, 512, 1024, 2048):
        m.observe(Decision(Route.PUSH, n, 0, 0, 0, 0, 0, PAIR), Outcome(0.3 + 0.0004 * n, 0.29 + 0.0004 * n, None, n, 0))
    d = m.choose(decision(tokens=600, d_prefix=512))
    assert d.route is Route.LOCAL and d.estimates_s["local"] == pytest.approx(88 * 0.0004, rel=0.05)
    m = CostModel(local_max_s=0.064)  # P's fitted slope, not its prior (0.0004)
    for n in (128, 512, 1024, 2048) * 5:
        m.observe(Decision(Route.PUSH, n, 0, 0, 0, 0, 0, PAIR), Outcome(0.3 + 0.0002 * n, 0.29 + 0.0002 * n, None, n, 0))
    assert m.choose(decision(tokens=600, d_prefix=512)).estimates_s["local"] == pytest.approx(88 * 0.0002, rel=0.1)


def test_local_budget_fills_at_its_share_and_lets_a_full_bucket_through_once():
    b = LocalBudget(share=0.1, window_s=2.0)  # 0.2 s deep, 0.1 s of prefill per second
    assert b.allows("d", 0.15, now=0.0)
    b.charge("d", 0.15, now=0.0)
    assert not b.allows("d", 0.1, now=0.0) and b.allows("d", 0.05, now=0.0)
    assert b.allows("d", 0.1, now=0.5)  # 0.05 + 0.5 s x 0.1
    assert b.allows("other", 0.2, now=0.0)  # per D
    assert b.available("d", now=100.0) == pytest.approx(0.2)  # never above its depth
    assert b.allows("d", 5.0, now=100.0)  # longer than the bucket: through when it is full...
    b.charge("d", 5.0, now=100.0)
    assert not b.allows("d", 0.01, now=120.0)  # ...and the debt is paid before the next (4.8 - 2.0 s)
    assert b.allows("d", 0.01, now=148.2)


def test_local_budget_limits_zero_and_one():
    never, always = LocalBudget(0.0, 10.0), LocalBudget(1.0, 10.0)
    assert not never.allows("d", 0.0001, now=1e6)
    always.charge("d", 1e9, now=0.0)
    assert always.allows("d", 1e9, now=0.0)


def test_router_goes_remote_once_ds_local_budget_is_spent_and_local_again_when_it_refills():
    now = [0.0]
    r = AutoRouter(local_share=0.1, local_window_s=1.0, clock=lambda: now[0], near_tie=0.0)  # 0.1 s of D prefill
    # 40 new tokens: the priors put D's prefill at 16 ms, cheaper than any remote route
    def route(seed: int, p_url: str | None = "http://p") -> Route:
        d = r.decide(req({"prompt": ids(40, seed=seed)}), p_url, "http://d", 0, BS)
        r.dispatched(d)
        r.prefilled(d)
        return d.route

    assert [route(s) for s in range(7)] == [Route.LOCAL] * 6 + [Route.PUSH]
    assert route(7, p_url=None) is Route.LOCAL  # no usable P: local regardless (and charged)
    forced = r.decide(req({"prompt": ids(40, seed=99)}), "http://p", "http://d", 0, BS, forced=Route.LOCAL)
    r.dispatched(forced)  # a route the client named is charged too
    r.prefilled(forced)
    assert r.budget.available("http://d", 0.0) == pytest.approx(0.004 - 0.032)
    now[0] = 0.3  # 0.03 s back: not enough for another
    assert route(8) is Route.PUSH
    now[0] = 1.0
    assert route(9) is Route.LOCAL


def test_a_route_that_slows_ps_prefill_is_charged_for_it():
    """Push-layerwise's KV lands sooner after P's prefill (its rest is shorter), but its layer hooks make
    P's prefill slower: the P line alone, shared by every route, would hide that and favour it."""
    m = CostModel()
    m.samples = dict.fromkeys(Route, 50)  # no exploring in this test
    for i in range(60):
        n = (128, 512, 1024)[i % 3]
        for route, per_token, rest in ((Route.PUSH, 0.0004, 0.004), (Route.PUSH_LAYERWISE, 0.00048, 0.002)):
            p_time = 0.01 + per_token * n
            m.observe(Decision(route, n, 0, 0, 0, 0, 0, PAIR), Outcome(p_time + rest, p_time, None, n, 0))
    d = m.choose(decision(tokens=1024, d_running=2), (Route.PUSH, Route.PUSH_LAYERWISE))
    assert p_gap(m, d) == pytest.approx(1024 * 0.00008, rel=0.2)
    assert d.route is Route.PUSH
    assert d.estimates_s["push-layerwise"] - d.estimates_s["push"] == pytest.approx(1024 * 0.00008 - 0.002, rel=0.25)


def test_a_route_seldom_taken_keeps_its_difference_on_p_from_the_baseline():
    """Once push-layerwise is taken for nearly every request, the P fit is mostly its samples; push, measured
    only every 10th request (as exploring does), is the baseline the difference is fitted against: it
    follows the measured 12 ms (from the prior's 6.5 at 512 tokens) instead of shrinking towards 0."""
    m = CostModel()
    m.samples = dict.fromkeys(Route, 50)
    rest = {Route.PUSH: 0.004, Route.PUSH_LAYERWISE: 0.001}  # 3 ms shorter, 12 ms longer on P
    for i in range(300):
        n = (128, 512, 1024)[i % 3]
        route = Route.PUSH if i % 10 == 0 else Route.PUSH_LAYERWISE
        p_time = 0.01 + 0.0004 * n + (0.012 if route is Route.PUSH_LAYERWISE else 0.0)
        m.observe(Decision(route, n, 0, 0, 0, 0, 0, PAIR), Outcome(p_time + rest[route], p_time, None, n, 0))
    d = m.choose(decision(tokens=512, d_running=2), (Route.PUSH, Route.PUSH_LAYERWISE))
    assert 0.009 < p_gap(m, d) < 0.0125, p_gap(m, d)
    assert d.route is Route.PUSH


def test_a_route_never_measured_against_the_baseline_keeps_its_prior():
    """Nothing says how push-layerwise differs from push: its offset stays at its prior (3.3 ms); its
    per-token prior shares the measured slope with P's own, both pulled alike (half of 6.3 us each)."""
    m = CostModel()
    m.samples = dict.fromkeys(Route, 50)
    for i in range(200):  # push-layerwise only: nothing says how it differs from push
        n = (128, 512, 1024)[i % 3]
        p_time = 0.02 + 0.0004 * n
        m.observe(Decision(Route.PUSH_LAYERWISE, n, 0, 0, 0, 0, 0, PAIR), Outcome(p_time + 0.002, p_time, None, n, 0))
    d = m.choose(decision(tokens=512), (Route.PUSH, Route.PUSH_LAYERWISE))
    assert p_gap(m, d) == pytest.approx(0.0033 + 512 * 6.3e-6 / 2, rel=0.02)


def test_a_route_that_slows_p_is_charged_for_the_requests_waiting_behind_it():
    """Push-layerwise's rest is 8 ms shorter and its P time 3 ms longer: alone at P it wins; with 3
    requests queued at P, each waits 3 ms more behind every push-layerwise prefill, and push wins."""
    m = CostModel(switch_margin=0.0)
    m.samples = dict.fromkeys(Route, 50)
    for i in range(60):
        n = (128, 512, 1024)[i % 3]
        for route, extra, rest in ((Route.PUSH, 0.0, 0.010), (Route.PUSH_LAYERWISE, 0.003, 0.002)):
            p_time = 0.01 + 0.0004 * n + extra
            m.observe(Decision(route, n, 0, 0, 0, 0, 0, PAIR), Outcome(p_time + rest, p_time, None, n, 0, 0.001))
    both = (Route.PUSH, Route.PUSH_LAYERWISE)
    alone = m.choose(decision(tokens=512, d_running=0), both)
    assert alone.route is Route.PUSH_LAYERWISE
    assert alone.estimates_s["push"] - alone.estimates_s["push-layerwise"] == pytest.approx(0.005, abs=0.0015)
    busy = decision(tokens=512, d_running=0)
    busy.p_waiting, busy.p_queue = 3, 1536
    d = m.choose(busy, both)
    assert d.route is Route.PUSH, d.estimates_s
    assert d.estimates_s["push-layerwise"] < d.estimates_s["push"]  # its own TTFT is still the shorter
    assert (d.to_json()["p_queue_tokens"], d.to_json()["d_queue_tokens"], d.to_json()["p_waiting"]) == (1536, 0, 3)
    own_pl = m.p_time(Route.PUSH_LAYERWISE, d, 0.0) + m.after_s(Route.PUSH_LAYERWISE, d)  # its prefill, P's answer
    assert d.to_json()["costs_ms"]["push-layerwise"] == pytest.approx((d.estimates_s["push-layerwise"] + 3 * own_pl) * 1e3,
                                                                       abs=0.01)


def test_requests_waiting_at_p_tip_a_short_prompt_to_local():
    """Both sides carry their delay to others: local stalls D's 2 decoding requests (weight 3), a
    remote prefill delays each request queued at P behind it. With one waiting at P the stall weighs
    more; with three, staying off P spares more than the stall costs (the old rule, charging remote
    routes only their difference from each other, sent both to P)."""
    m = trained(stall_weight=3.0)
    one = decision(tokens=128, p_queue=512, d_running=2)
    one.p_waiting = 1
    assert m.choose(one).route is Route.PUSH, one.costs_s
    three = decision(tokens=128, p_queue=512, d_running=2)
    three.p_waiting = 3
    assert m.choose(three).route is Route.LOCAL, three.costs_s
    assert three.costs_s["push"] - three.estimates_s["push"] == pytest.approx(3 * m.p_busy_s(Route.PUSH, three))


def test_busy_meter_averages_the_busy_state_over_its_window():
    b = BusyMeter(window_s=10.0)
    assert b.fraction("p", 0.0) == 0.0
    b.set("p", True, 0.0)
    assert b.fraction("p", 10.0) == pytest.approx(1 - math.exp(-1))
    b.set("p", False, 10.0)
    assert b.fraction("p", 20.0) == pytest.approx((1 - math.exp(-1)) * math.exp(-1))
    for t in range(100):  # busy half the time, in 1-s turns: about 0.5
        b.set("q", t % 2 == 0, 100.0 + t)
    assert b.fraction("q", 200.0) == pytest.approx(0.5, abs=0.05)
    assert b.fraction("other", 5.0) == 0.0


def test_with_busy_period_the_delay_to_those_behind_at_p_grows_with_ps_busy_fraction():
    """The charge for the requests left behind at P is multiplied by 1 / (1 - P's busy fraction), capped at
    BUSY_MAX; off (the default) it is not; with nobody waiting there is nothing to multiply."""
    on, off = trained(stall_weight=3.0), trained(stall_weight=3.0)
    on.busy_period = True
    for busy, factor in ((0.0, 1.0), (0.5, 2.0), (0.75, 4.0), (0.99, 1 / (1 - BUSY_MAX))):
        d = decision(tokens=512, p_queue=512)
        d.p_waiting, d.p_busy = 2, busy
        charge = on.choose(d).costs_s["push"] - d.estimates_s["push"]
        assert charge == pytest.approx(2 * factor * on.p_busy_s(Route.PUSH, d)), busy
        assert off.choose(d).costs_s["push"] - d.estimates_s["push"] == pytest.approx(2 * off.p_busy_s(Route.PUSH, d))
    d = decision(tokens=512)
    d.p_busy = 0.7
    assert on.choose(d).costs_s["push"] == d.estimates_s["push"]
    short = decision(tokens=128, p_queue=512, d_running=2)  # one waiting at P: push (see the test above) ...
    short.p_waiting, short.p_busy = 1, 0.7
    assert off.choose(short).route is Route.PUSH and on.choose(short).route is Route.LOCAL  # ... unless P is busy
    assert short.to_json()["p_busy"] == 0.7


def test_the_router_measures_how_busy_each_p_is():
    now = [0.0]
    r = AutoRouter(clock=lambda: now[0], local_window_s=10.0)
    body = req({"prompt": ids(40, seed=1)})
    first = r.decide(body, "http://p", "http://d", 0, BS, forced=Route.PUSH)
    assert first.p_busy == 0.0
    r.dispatched(first)
    local = r.decide(body, "http://p", "http://d", 1, BS, forced=Route.LOCAL)
    r.dispatched(local)  # D's prefill does not make P busy
    now[0] = 10.0
    r.prefilled(local)
    assert r.decide(body, "http://p", "http://d", 1, BS).p_busy == pytest.approx(1 - math.exp(-1))
    r.prefilled(first)
    now[0] = 20.0
    assert r.decide(body, "http://p", "http://d", 0, BS).p_busy == pytest.approx((1 - math.exp(-1)) * math.exp(-1))
    assert r.decide(body, "http://p2", "http://d", 0, BS).p_busy == 0.0


def test_p_stays_busy_until_its_last_leg_is_answered_and_local_legs_leave_it_idle():
    now = [0.0]
    r = AutoRouter(clock=lambda: now[0], local_window_s=10.0, busy_period=True)
    assert r.model.busy_period and not AutoRouter().model.busy_period
    body = req({"prompt": ids(40, seed=2)})
    a, b = (r.decide(body, "http://p", "http://d", 0, BS, forced=Route.PUSH) for _ in range(2))
    r.dispatched(a)
    r.dispatched(b)
    now[0] = 5.0
    r.prefilled(a)  # b is still at P
    now[0] = 10.0
    assert r.decide(body, "http://p", "http://d", 0, BS).p_busy == pytest.approx(1 - math.exp(-1))
    local = r.decide(body, "http://q", "http://d", 0, BS, forced=Route.LOCAL)
    r.dispatched(local)
    now[0] = 20.0
    assert r.decide(body, "http://q", "http://d", 0, BS).p_busy == 0.0  # D's prefill: P q stays idle
    assert BusyMeter(0.0).fraction("p", 1.0) == 0.0  # no window: the state now (no division by zero)


def test_the_proxy_hands_the_busy_period_switch_to_its_router():
    from kvpush.config import KVMode, ProxyConfig
    from kvpush.proxy.proxy import Proxy

    on = Proxy(ProxyConfig(prefill_urls=("http://p",), decode_urls=("http://d",), kv_mode=KVMode.AUTO,
                           auto_busy_period=True))
    off = Proxy(ProxyConfig(prefill_urls=("http://p",), decode_urls=("http://d",), kv_mode=KVMode.AUTO))
    assert on.auto is not None and on.auto.model.busy_period
    assert off.auto is not None and not off.auto.model.busy_period


def test_the_router_counts_the_requests_queued_at_each_p():
    r = AutoRouter()
    body = req({"prompt": ids(40, seed=1)})
    first = r.decide(body, "http://p", "http://d", 0, BS, forced=Route.PUSH)
    r.dispatched(first)
    second = r.decide(body, "http://p", "http://d", 1, BS, forced=Route.PULL)
    r.dispatched(second)
    local = r.decide(body, "http://p", "http://d", 2, BS, forced=Route.LOCAL)
    r.dispatched(local)  # D's prefill: not queued at P
    assert r.decide(body, "http://p", "http://d", 3, BS).p_waiting == 2
    assert r.decide(body, "http://p2", "http://d", 3, BS).p_waiting == 0
    r.prefilled(first)
    r.prefilled(first)  # once only
    r.rerouted(second, "http://d2")  # pull after P answered: still P's until it ends
    assert r.decide(body, "http://p", "http://d", 3, BS).p_waiting == 1
    r.prefilled(second)
    r.prefilled(local)
    assert r.decide(body, "http://p", "http://d", 0, BS).p_waiting == 0 and r.waiting["http://d"] == 0


def push_biased(near_tie: float) -> CostModel:
    """A model whose fits put push 10% above push-layerwise at 512 tokens (its old samples), while
    push is really the faster: 40 ms against push-layerwise's 45 (regime_full14's 128/256 80% cell)."""
    m = CostModel(near_tie=near_tie, switch_margin=0.0)
    m.samples = dict.fromkeys(Route, 50)  # no exploring in this test
    for _ in range(60):
        for route, ttft in ((Route.PUSH, 0.050), (Route.PUSH_LAYERWISE, 0.045)):
            m.observe(Decision(route, 512, 0, 0, 0, 0, 0, PAIR), Outcome(ttft, 0.030, None, 512, 0))
    m.decisions = TIE_EVERY  # as if after a few decisions, none of them taking push
    return m


def serve(m: CostModel, n: int, true_ttft: dict[Route, float]) -> list[Route]:
    """n requests: choose, then learn what the route really took."""
    routes = []
    for _ in range(n):
        d = m.choose(decision(tokens=512), (Route.PUSH, Route.PUSH_LAYERWISE))
        m.observe(d, Outcome(true_ttft[d.route], 0.030, None, 512, 0))
        routes.append(d.route)
    return routes


def test_a_near_tie_is_measured_and_a_wrong_ranking_corrects_itself():
    truth = {Route.PUSH: 0.040, Route.PUSH_LAYERWISE: 0.045}
    off = serve(push_biased(0.0), 40, truth)
    assert off.count(Route.PUSH) == 0  # the cheapest by the fits, every time: push's old samples stay
    m = push_biased(0.2)
    d = m.choose(decision(tokens=512), (Route.PUSH, Route.PUSH_LAYERWISE))
    assert d.route is Route.PUSH and d.reason == "near-tie" and d.to_json()["reason"] == "near-tie"
    assert d.costs_s["push"] > d.costs_s["push-layerwise"]
    on = serve(m, 80, truth)  # (the remote routes share one residual: push's own offset in the fits learns it)
    # measured, push turned out the faster and won; push-layerwise is now the one measured now and then
    assert on[-TIE_EVERY:].count(Route.PUSH) == TIE_EVERY - 1, on
    assert on.count(Route.PUSH) > 80 // TIE_EVERY + 4, on  # more than the near ties alone would take


def test_a_near_tie_costs_at_most_one_decision_in_tie_every_when_the_ranking_was_right():
    m = push_biased(0.2)
    truth = {Route.PUSH: 0.050, Route.PUSH_LAYERWISE: 0.045}  # the fits were right
    routes = serve(m, 80, truth)  # (no exploring before decision 100)
    assert routes.count(Route.PUSH) == 80 // TIE_EVERY
    assert all(r is Route.PUSH_LAYERWISE for i, r in enumerate(routes) if i % TIE_EVERY)


def test_no_near_tie_beyond_its_margin_nor_against_a_cheaper_local():
    m = push_biased(0.05)  # 10% apart: no tie at 5%
    assert serve(m, 30, {Route.PUSH: 0.050, Route.PUSH_LAYERWISE: 0.045}).count(Route.PUSH) == 0
    m = trained(stall_weight=1.0)
    m.near_tie, m.decisions = 10.0, TIE_EVERY  # every remote route "tied", none taken lately
    d = m.choose(decision(tokens=128))
    assert d.route is Route.LOCAL and d.reason == "cheapest"  # local is the cheapest, so none is taken
    d = m.choose(decision(tokens=128, d_running=8))
    assert d.route is not Route.PUSH and d.reason == "near-tie"  # push is the cheapest: a tied route is taken
    only = m.choose(decision(tokens=128), (Route.PULL,))
    assert only.reason == "only"
    r = AutoRouter()
    assert r.decide(req({"prompt": ids(40)}), "http://p", "http://d", 0, BS, forced=Route.PULL).reason == "forced"


def test_the_residual_correction_follows_the_remote_routes_recent_error_per_size_class():
    """Push taken alone while its fit lags: measured 20% over the fit at 512 tokens. The correction
    learns that within a few answers, for 512-token prompts only, for every remote route alike (one
    residual: per route, it opened gaps between routes the fixed modes never showed), not for local
    nor other sizes; alpha 0 turns it off."""
    m = push_biased(0.0)
    raw = m.choose(decision(tokens=512), (Route.PUSH,)).estimates_s["push"]
    for _ in range(12):
        d = m.choose(decision(tokens=512), (Route.PUSH,))
        m.observe(d, Outcome(raw * 1.2, 0.030, None, 512, 0))
    d = m.choose(decision(tokens=512), (Route.PUSH, Route.PUSH_LAYERWISE))
    assert d.estimates_s["push"] == pytest.approx(raw * 1.2, rel=0.03)
    fit = d.estimates_s["push"] / math.exp(d.residuals["push"])
    assert fit < raw * 1.12 and d.residuals["push"] > 0.07  # the fit alone is still well behind
    assert d.residuals["push-layerwise"] == d.residuals["push"]
    assert m.residual((False, 9, False)) == 0.0  # local's
    assert m.choose(decision(tokens=2048), (Route.PUSH,)).residuals["push"] == 0.0  # another size class
    turn = m.choose(decision(tokens=2048, p_prefix=1536, d_prefix=1536), (Route.PUSH,))  # D holds a prefix: apart
    assert turn.residuals["push"] == 0.0
    assert d.to_json()["residuals"]["push"] == pytest.approx(d.residuals["push"], abs=1e-4)
    off = push_biased(0.0)
    off.residual.alpha = 0.0
    for _ in range(5):
        d = off.choose(decision(tokens=512), (Route.PUSH,))
        off.observe(d, Outcome(0.5, 0.030, None, 512, 0))
    assert off.choose(decision(tokens=512), (Route.PUSH,)).residuals["push"] == 0.0


def test_the_residual_correction_is_bounded_and_scales_no_queue():
    m = push_biased(0.0)
    for _ in range(3):  # stalls: 10x and 1000x the fit, and garbage
        for ttft in (10.0, 1000.0, math.nan):
            d = m.choose(decision(tokens=512), (Route.PUSH,))
            m.observe(d, Outcome(ttft, 0.030, None, 512, 0))
    assert m.residual((True, 9, False)) <= math.log(2.0) and math.isfinite(m.residual((True, 9, False)))
    one = push_biased(0.0)
    d = one.choose(decision(tokens=512), (Route.PUSH,))
    one.observe(d, Outcome(1000.0, 0.030, None, 512, 0))  # one stalled answer moves it alpha x log 2 at most
    assert one.residual((True, 9, False)) == pytest.approx(one.residual.alpha * math.log(2.0))
    # a long queue at P: push and push-layerwise wait in it alike; the corrections scale their own parts only
    m = push_biased(0.0)
    m.residual.values[(True, 9, False)] = 0.15
    queued = decision(tokens=512, p_queue=20000)
    queued = m.choose(queued, (Route.PUSH, Route.PUSH_LAYERWISE))
    plain = decision(tokens=512)
    plain = m.choose(plain, (Route.PUSH, Route.PUSH_LAYERWISE))
    assert queued.queue_s["push"] > 1.0
    assert queued.queue_s["push"] == pytest.approx(queued.queue_s["push-layerwise"], rel=0.05)
    gap = queued.estimates_s["push"] - queued.estimates_s["push-layerwise"]
    assert gap == pytest.approx(plain.estimates_s["push"] - plain.estimates_s["push-layerwise"], abs=0.01)


def test_local_is_corrected_by_its_own_error_and_its_stall_is_not():
    m = trained()
    d = m.choose(decision(tokens=128))
    assert d.route is Route.LOCAL and d.residuals["local"] == 0.0
    for _ in range(20):
        d = m.choose(decision(tokens=128), (Route.LOCAL,))
        m.observe(d, Outcome(1.5 * d.estimates_s["local"] / math.exp(d.residuals["local"]), None, 0.1, 128, 0))
    busy = m.choose(decision(tokens=128, d_running=2))
    assert busy.residuals["local"] == pytest.approx(math.log(1.5), rel=0.1)
    assert busy.costs_s["local"] - busy.estimates_s["local"] == pytest.approx(2 * m.local_s(busy))  # weight 1
    assert m.residual((Route.PUSH, 7, False)) == 0.0


def test_session_turns_and_fresh_prompts_have_rest_fits_of_their_own():
    """regime_full15's shape: a session turn's handover (D holds its prefix) grows 3 ms per request
    decoding on D, a fresh prompt's 0.5 ms. Turns measured at load do not price fresh prompts."""
    m = CostModel(residual_alpha=0.0)
    m.samples = dict.fromkeys(Route, 50)

    def p_time(own: int) -> float:
        return 0.005 + 0.0004 * own

    for i in range(60):  # fresh prompts, D lightly loaded
        load = i % 3
        d = Decision(Route.PUSH, 128, 0, 0, 0, 0, load, PAIR)
        m.observe(d, Outcome(p_time(128) + 0.004 + 0.0005 * load, p_time(128), None, 128, 0))
    for i in range(60):  # then session turns at load: 64 new tokens, P and D hold the rest
        load = 4 + i % 6
        d = Decision(Route.PUSH, 512, 448, 448, 0, 0, load, PAIR)
        m.observe(d, Outcome(p_time(64) + 0.010 + 0.003 * load, p_time(64), None, 512, 448))
    fresh = m.choose(Decision(Route.PUSH, 128, 0, 0, 0, 0, 10, PAIR), (Route.PUSH,))
    assert fresh.estimates_s["push"] == pytest.approx(p_time(128) + 0.004 + 0.0005 * 10, abs=0.003)
    turn = m.choose(Decision(Route.PUSH, 512, 448, 448, 0, 0, 10, PAIR), (Route.PUSH,))
    assert turn.estimates_s["push"] == pytest.approx(p_time(64) + 0.010 + 0.003 * 10, abs=0.003)


K512 = incumbent_key(decision(tokens=512))


def test_another_remote_route_takes_over_only_beyond_the_switch_margin():
    """The fits put push 10% above push-layerwise: with a 20% margin push (the priors' first, the
    incumbent) keeps the requests; with 5% push-layerwise takes over and is the incumbent then, so push
    comes back only when it is 5% cheaper. Local is never held back by the margin."""
    both = (Route.PUSH, Route.PUSH_LAYERWISE)
    m = push_biased(0.0)
    m.switch_margin = 0.2
    d = m.choose(decision(tokens=512), both)
    assert d.route is Route.PUSH and d.costs_s["push"] > d.costs_s["push-layerwise"] * 1.05, d.costs_s
    m.switch_margin = 0.05
    assert m.choose(decision(tokens=512), both).route is Route.PUSH_LAYERWISE
    assert m.incumbent(K512) is Route.PUSH_LAYERWISE
    assert m.cheapest(both, {"push": 0.097, "push-layerwise": 0.100}, K512) is Route.PUSH_LAYERWISE  # 3%: not enough
    assert m.cheapest(both, {"push": 0.094, "push-layerwise": 0.100}, K512) is Route.PUSH and m.incumbent(K512) is Route.PUSH
    m.switch_margin = 0.5
    three = (*both, Route.LOCAL)
    assert m.cheapest(three, {"push": 0.100, "push-layerwise": 0.070, "local": 0.060}, K512) is Route.LOCAL
    # local against the cheapest remote route at its own cost: push-layerwise is cheaper than local here,
    # so a remote route is taken - push, the incumbent, push-layerwise being within the margin
    assert m.cheapest(three, {"push": 0.100, "push-layerwise": 0.070, "local": 0.099}, K512) is Route.PUSH
    assert m.incumbent(K512) is Route.PUSH


def test_a_forced_route_an_exploration_or_a_lone_remote_route_leaves_the_incumbent():
    m = push_biased(0.0)
    m.switch_margin = 0.2
    forced = decision(tokens=512)
    forced.forced = True
    assert m.choose(forced, (Route.PULL,)).route is Route.PULL and m.incumbent(K512) is Route.PUSH
    assert m.choose(decision(tokens=512), (Route.PUSH_LAYERWISE, Route.LOCAL)).route is not Route.PUSH
    assert m.incumbent(K512) is Route.PUSH
    m.decisions = EXPLORE_EVERY_LATER - 1  # the next decision explores: the route taken least recently
    m.taken_at[Route.PUSH] = m.decisions
    d = m.choose(decision(tokens=512), (Route.PUSH, Route.PUSH_LAYERWISE))
    assert d.reason == "explore" and d.route is Route.PUSH_LAYERWISE and m.incumbent(K512) is Route.PUSH


def test_each_size_class_keeps_its_own_incumbent():
    """Short prompts settling on push-layerwise leave the long ones' incumbent alone: with a 20% margin
    the long ones go by pull, their cheapest, though push-layerwise is the short ones' incumbent."""
    m = CostModel(switch_margin=0.2)
    both = (Route.PUSH_LAYERWISE, Route.PULL)
    short, long = decision(tokens=128), decision(tokens=1024)
    assert incumbent_key(short) != incumbent_key(long)
    assert m.cheapest(both, {"push-layerwise": 0.050, "pull": 0.080}, incumbent_key(short)) is Route.PUSH_LAYERWISE
    assert m.incumbent(incumbent_key(short)) is Route.PUSH_LAYERWISE
    assert m.incumbent(incumbent_key(long)) is Route.PUSH  # nothing settled there yet: the priors' first
    assert m.cheapest(both, {"push-layerwise": 0.300, "pull": 0.290}, incumbent_key(long)) is Route.PULL
    assert m.incumbent(incumbent_key(long)) is Route.PULL
    # one class's incumbent holds within its margin: push-layerwise 10% cheaper stays behind pull
    assert m.cheapest(both, {"push-layerwise": 0.270, "pull": 0.300}, incumbent_key(long)) is Route.PULL
    # a session turn (D holds a prefix) is a class apart from a fresh prompt of its size
    assert incumbent_key(decision(tokens=1024, d_prefix=896)) != incumbent_key(long)


def test_ps_time_to_answer_is_learned_per_route_over_the_tokens_moved_and_charged_to_those_waiting_at_p():
    """Push's WRITE, copied by P's core here, slows P's answer after the prefill; pull's READ does not.
    Learned from P's prefill done -> answer per route against the tokens moved (the prompt less what D
    had cached), it is charged per request waiting at P, and only there: with nobody waiting the two
    routes' costs are their estimates. Push-layerwise, never measured, keeps its prior difference."""
    m = CostModel(switch_margin=0.0)
    m.samples = dict.fromkeys(Route, 50)  # no exploring
    for tokens, cached in ((256, 0), (768, 256), (1024, 0), (1536, 1024)) * 10:
        for route, per_token in ((Route.PUSH, 12e-6), (Route.PULL, 1e-6)):
            d = Decision(route, tokens, 128, cached, 0, 0, 0, PAIR)  # P held 128 tokens: not what moves
            p_time = 0.01 + 0.00024 * (tokens - 128)  # the same line for both routes
            m.observe(d, Outcome(0.3 + p_time, p_time, None, tokens, cached, 0.001 + per_token * (tokens - cached)))
    fresh, turn = decision(tokens=1024), decision(tokens=1536, d_prefix=512)  # both move 1,024 tokens
    assert m.after_s(Route.PUSH, fresh) == pytest.approx(m.after_s(Route.PUSH, turn))  # what moves counts
    # measured 13.3 and 2.0 ms at 1,024 tokens moved; the ridge towards the priors (push 5.4 ms, pull 1.6)
    # keeps the fit within ~15% of it
    assert m.after_s(Route.PUSH, fresh) == pytest.approx(0.001 + 12e-6 * 1024, rel=0.2)
    assert m.after_s(Route.PULL, fresh) == pytest.approx(0.001 + 1e-6 * 1024, rel=0.2)
    unmeasured = AFTER_OFFSETS["push-layerwise"] + AFTER_SLOPES["push-layerwise"] * 1024
    pl_gap = m.after_s(Route.PUSH_LAYERWISE, fresh) - m.after_s(Route.PUSH, fresh)
    assert pl_gap == pytest.approx(unmeasured, abs=0.001)  # its prior's difference from push
    idle = m.choose(decision(tokens=1024), (Route.PUSH, Route.PULL))
    assert idle.costs_s == idle.estimates_s
    busy = decision(tokens=1024, p_queue=2048)
    busy.p_waiting = 2
    m.choose(busy, (Route.PUSH, Route.PULL))
    charged = {r: busy.costs_s[r.value] - busy.estimates_s[r.value] for r in (Route.PUSH, Route.PULL)}
    # 2 waiting x (P's prefill of 1,024 tokens, measured 256 ms, + P's time to answer, measured 13.3 / 2.0 ms)
    assert charged[Route.PUSH] == pytest.approx(2 * (0.256 + 0.0133), rel=0.05)
    assert charged[Route.PULL] == pytest.approx(2 * (0.256 + 0.002), rel=0.05)
    # the routes' P prefills were measured alike: what tells their charges apart is push's WRITE on P
    assert charged[Route.PUSH] - charged[Route.PULL] == pytest.approx(2 * (0.0133 - 0.002), rel=0.25)


def test_outcome_reads_p_after_the_prefill_from_ps_own_stamps():
    trace = {"proxy_received": 10.0, "d_leg_sent": 10.001, "api_received": 50.0, "first_token": 50.3,
             "p_api_received": 80.0, "p_prefill_done": 80.25, "p_answered": 80.256}
    out = outcome(Trace.from_json(trace), {"tokens": 1024, "cached_tokens": 0})
    assert out.p_after_s == pytest.approx(0.006) and out.p_time_s == pytest.approx(0.25)
    assert outcome(Trace.from_json({**trace, "p_answered": 80.2}), None).p_after_s is None  # out of order: unmeasured
    assert outcome(Trace.from_json({k: v for k, v in trace.items() if k != "p_answered"}), None).p_after_s is None


def test_ps_own_stamps_reach_the_outcome_under_the_names_the_proxy_gives_them():
    """P's answer carries its engine's and API's stamps; the proxy renames them (Trace.as_prefill)
    and merges them with D's: the outcome's P spans come from P's stamps alone."""
    p_trace = {"api_received": 80.0, "arrived": 80.001, "prefill_done": 80.25, "api_answered": 80.256, "other": 1.0}
    merged = {"proxy_received": 10.0, "d_leg_sent": 10.001, "api_received": 50.0, "first_token": 50.3,
              **Trace.from_json(p_trace).as_prefill().stamps()}
    out = outcome(Trace.from_json(merged), None)
    assert out.p_time_s == pytest.approx(0.25) and out.p_after_s == pytest.approx(0.006)
    assert out.ttft_s == pytest.approx(0.301)


def test_ps_queue_and_the_requests_own_tokens_have_slopes_of_their_own():
    """A token queued at P when a request is dispatched is worth less than one of its own (the head of
    the queue is partly prefilled by then): here 0.1 ms against 0.24. One slope for both (the fit before)
    put every route's own part too low for long prompts, the more the more of its samples queued; two
    slopes learn both."""
    m = CostModel()
    for i in range(120):
        tokens, queue = (128, 1024, 512)[i % 3], (0, 1024, 2048, 512)[i % 4]
        d = Decision(Route.PUSH, tokens, 0, 0, queue, 0, 0, PAIR)
        m.observe(d, Outcome(0.5, 0.01 + 0.00024 * tokens + 0.0001 * queue, None, tokens, 0))
    d = decision(tokens=1024, p_queue=2048)
    assert m.p_time(Route.PUSH, d, 0.0) == pytest.approx(0.01 + 0.00024 * 1024, rel=0.05)
    assert m.p_queue_delay(d) == pytest.approx(0.0001 * 2048, rel=0.1)  # one slope for both: ~1.7x
    assert m.prefill.slope() == pytest.approx(0.00024, rel=0.05)


def test_before_any_answer_a_queued_token_costs_p_what_one_of_its_own_does():
    """P's prefill fit answers its priors until measured: a token queued ahead counts as one of the
    request's own (g0 = b0 x QUEUE_UNIT), whatever the route."""
    m = CostModel()
    d = decision(tokens=512, p_queue=1000)
    for r in (Route.PUSH, Route.PULL, Route.PUSH_LAYERWISE):
        assert m.p_time(r, d, 1000.0) - m.p_time(r, d, 0.0) == pytest.approx(m.prefill.slope() * 1000)
    assert m.p_queue_delay(d) == pytest.approx(m.prefill.slope() * 1000)


def test_ps_queue_delay_is_never_negative_whatever_the_fit_learned():
    """The queue slope is fitted unbounded (only the own tokens' slope is kept >= 0): samples where a
    longer queue came with a shorter prefill fit a negative one, and the burst rule, which compares P's
    queue delay with D's local prefill, must not read a negative delay."""
    m = CostModel()
    for i in range(60):
        tokens, queue = (128, 1024)[i % 2], (0, 2048)[(i // 2) % 2]
        d = Decision(Route.PUSH, tokens, 0, 0, queue, 0, 0, PAIR)
        m.observe(d, Outcome(0.5, 0.2 + 0.0002 * tokens - 0.00005 * queue, None, tokens, 0))
    d = decision(tokens=1024, p_queue=2048)
    assert m.p_time(Route.PUSH, d, 2048.0) < m.p_time(Route.PUSH, d, 0.0)  # the fit: a negative slope
    assert m.p_queue_delay(d) == 0.0
