"""The OpenAI completions answers of `moesys serve`: the response, stream chunk, usage and error bodies, and the
`logprobs` object (with echo, each prompt token's entry before the generated ones', the first one null: nothing
predicts it)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from itertools import accumulate
from typing import Any

Entry = tuple[int, float | None, list[tuple[int, float]] | None]
"""One token of a `logprobs` object: (token id, its log-probability, the most likely alternatives)."""


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None) -> dict[str, Any]:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


def token_text(tokenizer: Any, token: int) -> str:
    """A token's own text (its id in angle brackets without a tokenizer)."""
    return tokenizer.decode([token]) if tokenizer is not None else f"<{token}>"


def logprobs_object(entries: Iterable[Entry], tokenizer: Any) -> dict[str, Any]:
    """OpenAI's completions `logprobs` object: tokens, token_logprobs, top_logprobs (keyed by token text) and each
    token's offset in the concatenated token texts."""
    entries = list(entries)
    texts = [token_text(tokenizer, token) for token, _, _ in entries]
    return {"tokens": texts, "token_logprobs": [lp for _, lp, _ in entries],
            "top_logprobs": [None if top is None else {token_text(tokenizer, t): v for t, v in top}
                             for _, _, top in entries],
            "text_offset": [0, *accumulate(len(t) for t in texts[:-1])] if texts else []}


def choice_entries(choice: Any, prompt_ids: list[int]) -> list[Entry]:
    """A choice's echoed prompt tokens (none unless echoed) then its generated ones."""
    prompt = [(prompt_ids[0], None, None)] if prompt_ids else []
    echoed = zip(prompt_ids[1:], choice.prompt_logprobs, strict=False)  # no prompt logprobs unless echoed
    prompt += [(token, out.logprob, out.top) for token, out in echoed]
    return prompt + [(out.token, out.logprob, out.top) for out in choice.logprobs]


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_body(request_id: str, model: str, choices: list[Any], request: Any, tokenizer: Any) -> dict[str, Any]:
    """The whole answer: each choice's text (None without a tokenizer; with echo, after its prompt's), token ids
    (the generated ones), logprobs and finish reason, in index order."""
    out = []
    for c in choices:
        prompt_ids = request.prompts[c.prompt] if request.echo else []
        text = c.text
        if text is not None and prompt_ids:
            text = tokenizer.decode(prompt_ids) + text
        lp = logprobs_object(choice_entries(c, prompt_ids), tokenizer) if request.logprobs is not None else None
        out.append({"index": c.index, "text": text, "token_ids": c.tokens, "logprobs": lp,
                    "finish_reason": c.finish_reason})
    return {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": out, "usage": usage(request.prompt_tokens, sum(len(c.tokens) for c in choices))}


def chunk_body(request_id: str, model: str, tokens: list[int], text: str | None,
               finish_reason: str | None = None, index: int = 0,
               logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    """One server-sent event's completion chunk: the new tokens of choice `index` since its last chunk."""
    choice = {"index": index, "text": text, "token_ids": tokens, "logprobs": logprobs, "finish_reason": finish_reason}
    return {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [choice]}


def usage_chunk(request_id: str, model: str, kind: str, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """stream_options.include_usage's last chunk: no choices, the request's usage (`kind`: the chunks' object)."""
    return {"id": request_id, "object": kind, "created": int(time.time()), "model": model, "choices": [],
            "usage": usage(prompt_tokens, completion_tokens)}


def sse(data: dict[str, Any] | str) -> bytes:
    """One server-sent event line pair: `data: JSON` (or `data: [DONE]`)."""
    payload = data if isinstance(data, str) else json.dumps(data)
    return f"data: {payload}\n\n".encode()

