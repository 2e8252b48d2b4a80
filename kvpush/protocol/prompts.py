"""A completions request's `prompt` field: one prompt or several, as text or token ids.

Shared by the instance (which validates it) and the proxy (which splits a batch into one dispatch per
prompt): plain Python, no engine types."""

from __future__ import annotations


def split_prompt(p: object) -> list[str | list[int]] | None:
    """A completions `prompt` as its list of prompts (a string, token ids, or a list of either);
    None when it is none of these shapes."""
    if isinstance(p, str):
        return [p]
    if isinstance(p, list) and p and all(_is_token(t) for t in p):
        return [p]
    if isinstance(p, list) and p and all(isinstance(x, str) or _is_token_list(x) for x in p):
        return list(p)
    return None


def _is_token(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_token_list(x: object) -> bool:
    return isinstance(x, list) and bool(x) and all(_is_token(t) for t in x)
