"""What any instance checks of a prompt before it reaches an engine (no torch: the API process uses it)."""

from __future__ import annotations

from kvpush.errors import InvalidRequestError


def check_prompt(prompt_token_ids: list[int], max_model_len: int, vocab_size: int, num_blocks: int,
                 block_size: int) -> None:
    """Raise InvalidRequestError for an empty prompt, one that cannot fit, or an unknown token id."""
    n = len(prompt_token_ids)
    if n == 0:
        raise InvalidRequestError("prompt is empty", param="prompt")
    if n >= max_model_len:
        raise InvalidRequestError(
            f"prompt has {n} tokens; this model's maximum context length is {max_model_len} "
            f"tokens including at least 1 generated token", param="prompt")
    if -(-(n + 1) // block_size) > num_blocks:
        raise InvalidRequestError(
            f"prompt has {n} tokens but the KV cache holds only {num_blocks * block_size}", param="prompt")
    bad = next((t for t in prompt_token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequestError(f"token id {bad} is outside the vocabulary [0, {vocab_size})", param="prompt")
