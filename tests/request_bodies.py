"""Hypothesis strategies for OpenAI request bodies: standard fields with valid, boundary and wrong
values, for fuzzing a server or a proxy (the valid model name is a parameter)."""

from __future__ import annotations

from hypothesis import strategies as st

scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**12, 10**12), st.floats(allow_nan=False),
                    st.text(max_size=20))
json_values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                            st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                           max_leaves=12)
small_ints = st.integers(-5, 40)
token_ids = st.lists(st.integers(-5, 3000), max_size=20)


def completion_bodies(model: str, max_tokens: st.SearchStrategy = small_ints) -> st.SearchStrategy:
    """Single and batched prompts (strings, token ids, a list of either), sampling and stream fields."""
    return st.fixed_dictionaries({}, optional={
        "model": st.sampled_from([model, "other", None]),
        "prompt": st.one_of(st.text(max_size=40), token_ids,
                            st.lists(st.one_of(st.text(max_size=10), st.lists(st.integers(0, 1023), max_size=12)),
                                     max_size=4),
                            json_values),
        "max_tokens": st.one_of(max_tokens, json_values),
        "temperature": st.one_of(st.floats(-2, 3, allow_nan=False), json_values),
        "top_p": st.floats(-1, 2, allow_nan=False),
        "top_k": small_ints,
        "seed": st.one_of(st.integers(-3, 2**64), st.none()),
        "stop": st.one_of(st.text(max_size=5), st.lists(st.text(max_size=5), max_size=20)),
        "stop_token_ids": st.lists(st.integers(-2, 1100), max_size=3),
        "n": st.integers(0, 3),
        "stream": st.booleans(),
        "logprobs": st.one_of(st.integers(-1, 30), st.none()),
        "ignore_eos": st.booleans(),
        "min_tokens": st.integers(-1, 6),
        "echo": st.booleans(),
        "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": st.booleans()}), json_values),
    })


def chat_bodies(model: str, max_tokens: st.SearchStrategy = small_ints) -> st.SearchStrategy:
    message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "bot", "assistant"]),
                                     "content": st.one_of(st.text(max_size=30), json_values)})
    return st.fixed_dictionaries({"messages": st.one_of(st.lists(message, max_size=3), json_values)}, optional={
        "model": st.sampled_from([model, "other"]),
        "max_tokens": max_tokens, "max_completion_tokens": st.one_of(st.none(), max_tokens),
        "stream": st.booleans(), "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
        "logprobs": st.booleans(), "top_logprobs": st.integers(-1, 25),
        "temperature": st.floats(-1, 3, allow_nan=False), "seed": st.integers(0, 100)})
