"""What each instance probably holds in its prefix cache, as --kv-mode auto's proxy sees it: plain
Python, no I/O (choice.py's d_prefix and p_prefix signals).

A prompt becomes a PromptKey: chained hashes of block-sized chunks of its token ids (exact), or of
CHARS_PER_UNIT-character chunks of its text or chat messages (the token count then estimated by
the cost model). A PrefixTracker per instance remembers the chunks it was sent, least recently used
out; a prompt's match is how many of its leading chunks are remembered.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol

CHARS_PER_UNIT = 64  # prefix tracking granularity of text prompts
TRACKER_UNITS = 65536  # prefix chunks remembered per instance


class PromptSource(Protocol):
    """What a prompt key reads of a request (the proxy's ClientRequest): completions' prompt or chat's
    messages, as the client sent them (the other one None)."""

    @property
    def prompt(self) -> object: ...

    @property
    def messages(self) -> object: ...


@dataclass(frozen=True)
class PromptKey:
    """A prompt as prefix chunks: `units` chained hashes (one per chunk), `unit_tokens` tokens per
    chunk (exact for token ids; None for text: chars_per_unit characters each)."""

    hashes: tuple[int, ...]
    unit_tokens: int | None
    chars: int
    exact_tokens: int | None

    @classmethod
    def of(cls, req: PromptSource, block_size: int) -> PromptKey:
        prompt = req.prompt
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # one prompt in a list (several are split by the proxy before this)
        if isinstance(prompt, list) and prompt and set(map(type, prompt)) <= _INT_TYPES:  # (map: no Python loop)
            chunks = [tuple(prompt[i : i + block_size]) for i in range(0, len(prompt) - block_size + 1, block_size)]
            return cls(_chain(chunks), block_size, 0, len(prompt))
        text = prompt if isinstance(prompt, str) else _messages_text(req.messages)
        units = [text[i : i + CHARS_PER_UNIT] for i in range(0, len(text) - CHARS_PER_UNIT + 1, CHARS_PER_UNIT)]
        return cls(_chain(units), None, len(text), None)


_INT_TYPES = {int, bool}  # what isinstance(t, int) accepts (bool is an int)


def _chain(units: list[str] | list[tuple[int, ...]]) -> tuple[int, ...]:
    """Chained hashes: the i-th names the whole prefix up to chunk i (this process only)."""
    out, h = [], 0
    for u in units:
        h = hash((h, u))
        out.append(h)
    return tuple(out)


def _messages_text(messages: object) -> str:
    """Chat messages as one string whose prefixes are shared by the turns of one conversation."""
    if not isinstance(messages, list):
        return ""
    parts = []
    for m in messages:
        if isinstance(m, dict):
            content = m.get("content")
            parts.append(f"<{m.get('role')}>{content if isinstance(content, str) else repr(content)}")
    return "".join(parts)


class PrefixTracker:
    """The prompt prefixes an instance was sent, as chained chunk hashes, least recently used out."""

    def __init__(self, capacity: int = TRACKER_UNITS) -> None:
        self.capacity = capacity
        self.units: OrderedDict[int, None] = OrderedDict()

    def matched(self, key: PromptKey) -> int:
        """How many leading chunks of the prompt the instance was sent before."""
        n = 0
        for h in key.hashes:
            if h not in self.units:
                break
            n += 1
        return n

    def record(self, key: PromptKey) -> None:
        for h in key.hashes:
            self.units[h] = None
            self.units.move_to_end(h)
        while len(self.units) > self.capacity:
            self.units.popitem(last=False)
