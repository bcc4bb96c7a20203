"""The OpenAI completions protocol as `moesys serve` speaks it: a request body checked field by field into a
`CompletionRequest`, and the response, stream chunk and error bodies in OpenAI's shapes."""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass
from typing import Any, Optional

FIELDS = ("model", "prompt", "max_tokens", "temperature", "top_k", "seed", "stream", "n", "stop", "logprobs")
SAMPLING = ("max_tokens", "temperature", "top_k", "seed", "stream", "n", "stop")
"""The fields /v1/completions and /v1/chat/completions share."""
MAX_SEED = 2**63 - 1
MAX_N = 16
"""Choices per request (`n`)."""
MAX_STOPS, MAX_STOP_CHARS = 4, 256
"""At most this many stop strings (as OpenAI), each at most this long."""
MAX_LOGPROBS = 20
"""Alternatives per token (`logprobs` of /v1/completions, `top_logprobs` of chat)."""


class RequestError(ValueError):
    """A request the server refuses: HTTP status, a one-line message and the offending field (OpenAI's `param`)."""

    def __init__(self, message: str, param: Optional[str] = None, status: int = 400,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.param, self.status, self.kind = param, status, kind


@dataclass(frozen=True)
class Defaults:
    """What a request that leaves a field out gets: the checkpoint's infer.* settings, as `moesys infer` uses."""

    max_tokens: int
    temperature: float
    top_k: int
    seed: int


@dataclass(frozen=True)
class CompletionRequest:
    """One checked request, its prompt as token ids."""

    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    top_k: int
    seed: int
    stream: bool
    n: int = 1
    stop: tuple[str, ...] = ()
    logprobs: Optional[int] = None
    """None: no log-probabilities; N: the chosen token's and the N most likely alternatives' per token."""


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _shown(value: Any) -> str:
    """A field's value as JSON, cut to 40 characters: an error message stays one short line."""
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _int(body: dict, key: str, default: int, low: int, high: int) -> int:
    value = body.get(key, default)
    if not _is_int(value):
        raise RequestError(f"{key} must be an integer (got {_shown(value)})", key)
    if not low <= value <= high:
        raise RequestError(f"{key}={_shown(value)} is out of range {low}..{high}", key)
    return value


def parse_json(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object, or a RequestError saying why it is not one."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # also a number past Python's digit limit, or nesting too deep
        raise RequestError(f"the request body is not valid JSON ({str(exc).splitlines()[0][:200]})") from None
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object (got {type(body).__name__})")
    return body


def parse_completion(body: dict[str, Any], defaults: Defaults, tokenizer: Any, vocab_size: int,
                     context: int) -> CompletionRequest:
    """Check every field of a /v1/completions body; the prompt must leave room for max_tokens in the context."""
    check_fields(body, FIELDS)
    if "prompt" not in body:
        raise RequestError("prompt is required: text, or a list of token ids", "prompt")
    prompt = body["prompt"]
    if isinstance(prompt, str):
        ids = encode_text(prompt, tokenizer, "prompt")
    elif isinstance(prompt, list) and all(_is_int(t) for t in prompt):
        ids = list(prompt)
    else:
        raise RequestError("prompt must be text or a list of token ids (one prompt per request)", "prompt")
    logprobs = body.get("logprobs")
    if logprobs is not None:
        logprobs = _int(body, "logprobs", 0, 0, MAX_LOGPROBS)
    return sampling(body, ids, defaults, tokenizer, vocab_size, context, logprobs)


def check_fields(body: dict[str, Any], fields: tuple[str, ...]) -> None:
    unknown = sorted(set(body) - set(fields))
    if unknown:
        raise RequestError(f"unknown field {unknown[0]!r}; this route takes {', '.join(fields)}", unknown[0])
    if "model" in body and not isinstance(body["model"], str):
        raise RequestError("model must be a string", "model")


def encode_text(text: str, tokenizer: Any, param: str) -> list[int]:
    """Token ids of request text; a RequestError without a tokenizer or for text that is no valid Unicode."""
    if tokenizer is None:
        raise RequestError(f"this model has no tokenizer: {param} must be token ids", param)
    try:
        text.encode("utf-8")  # JSON allows a lone surrogate such as "\ud800", which is no character
    except UnicodeEncodeError as exc:
        raise RequestError(f"{param} is not valid Unicode text: a lone surrogate at character {exc.start}",
                           param) from None
    return tokenizer.encode(text)


def sampling(body: dict[str, Any], ids: list[int], defaults: Defaults, tokenizer: Any, vocab_size: int,
             context: int, logprobs: Optional[int]) -> CompletionRequest:
    """The prompt ids checked against the vocabulary and context, and the sampling fields both routes share."""
    if not ids:
        raise RequestError("prompt is empty: give at least one token", "prompt")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise RequestError(f"prompt token id {_shown(bad[0])} is outside the vocabulary 0..{vocab_size - 1}", "prompt")
    if len(ids) >= context:
        raise RequestError(f"prompt of {len(ids)} tokens does not fit the model's context of {context} tokens "
                           "with a token to generate", "prompt")
    room = context - len(ids)
    max_tokens = body.get("max_tokens", min(defaults.max_tokens, room))
    if _is_int(max_tokens) and max_tokens > room:
        raise RequestError(f"max_tokens={_shown(max_tokens)} with a prompt of {len(ids)} tokens exceeds the model's "
                           f"context of {context} tokens (at most {room})", "max_tokens")
    max_tokens = _int(body, "max_tokens", max_tokens, 1, room)
    temperature = _temperature(body.get("temperature", defaults.temperature))
    top_k = _int(body, "top_k", defaults.top_k, 0, vocab_size)
    seed = _int(body, "seed", defaults.seed, 0, MAX_SEED)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError(f"stream must be true or false (got {_shown(stream)})", "stream")
    n = _int(body, "n", 1, 1, MAX_N)
    if n > 1 and seed > MAX_SEED - n:
        raise RequestError(f"seed={seed} leaves no room for n={n} seeds (choice i samples with seed + i)", "seed")
    return CompletionRequest(ids, max_tokens, temperature, top_k, seed, stream, n, _stops(body, tokenizer), logprobs)


def _stops(body: dict[str, Any], tokenizer: Any) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise RequestError(f"stop must be a non-empty string or a list of them (got {_shown(stop)})", "stop")
    if len(stops) > MAX_STOPS or any(len(s) > MAX_STOP_CHARS for s in stops):
        raise RequestError(f"stop takes at most {MAX_STOPS} strings of at most {MAX_STOP_CHARS} characters", "stop")
    if tokenizer is None:
        raise RequestError("stop needs text: this model has no tokenizer", "stop")
    for s in stops:
        encode_text(s, tokenizer, "stop")
    return tuple(stops)


def _temperature(value: Any) -> float:
    """A finite number >= 0 as a float (an integer too large for a float is refused, not an OverflowError)."""
    try:
        number = float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan
    except OverflowError:
        number = math.inf
    if not math.isfinite(number) or number < 0:
        raise RequestError(f"temperature must be a number >= 0 (got {_shown(value)}); 0 is greedy", "temperature")
    return number


# ---- response bodies ----

def error_body(message: str, kind: str = "invalid_request_error", param: Optional[str] = None) -> dict[str, Any]:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


def token_text(tokenizer: Any, token: int) -> str:
    """A token's own text (its id in angle brackets without a tokenizer)."""
    return tokenizer.decode([token]) if tokenizer is not None else f"<{token}>"


def completion_logprobs(choice: Any, tokenizer: Any) -> Optional[dict[str, Any]]:
    """OpenAI's completions `logprobs` object of a choice (None when not asked)."""
    if not choice.logprobs:
        return None
    texts = [token_text(tokenizer, out.token) for out in choice.logprobs]
    offsets = [sum(len(t) for t in texts[:i]) for i in range(len(texts))]
    return {"tokens": texts, "token_logprobs": [out.logprob for out in choice.logprobs],
            "top_logprobs": [{token_text(tokenizer, t): lp for t, lp in out.top} for out in choice.logprobs],
            "text_offset": offsets}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_body(request_id: str, model: str, choices: list[Any], prompt_tokens: int,
                    tokenizer: Any) -> dict[str, Any]:
    """The whole answer: each choice's text (None without a tokenizer), token ids, logprobs and finish reason."""
    out = [{"index": c.index, "text": c.text, "token_ids": c.tokens, "logprobs": completion_logprobs(c, tokenizer),
            "finish_reason": c.finish_reason} for c in choices]
    return {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": out, "usage": usage(prompt_tokens, sum(len(c.tokens) for c in choices))}


def chunk_body(request_id: str, model: str, tokens: list[int], text: Optional[str],
               finish_reason: Optional[str] = None, index: int = 0,
               logprobs: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """One server-sent event's completion chunk: the new tokens of choice `index` since its last chunk."""
    choice = {"index": index, "text": text, "token_ids": tokens, "logprobs": logprobs, "finish_reason": finish_reason}
    return {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [choice]}


def sse(data: dict[str, Any] | str) -> bytes:
    """One server-sent event line pair: `data: JSON` (or `data: [DONE]`)."""
    payload = data if isinstance(data, str) else json.dumps(data)
    return f"data: {payload}\n\n".encode()


class TextStream:
    """Text of a growing list of ids, given out in pieces whose concatenation is the text of all the ids. Until the
    last piece, a trailing U+FFFD (maybe a UTF-8 character whose bytes have not all arrived) is held back, and so is
    everything while the text does not start with what was sent (a tokenizer that decodes a prefix differently
    from the whole); the last piece is the text past what it has in common with what was sent, so nothing is lost,
    though then the pieces also hold the prefix's differing end.
    """

    def __init__(self, tokenizer: Any):
        self.tokenizer, self.ids, self.sent = tokenizer, [], ""

    def push(self, ids: list[int], final: bool = False) -> str:
        self.ids.extend(ids)
        text = self.tokenizer.decode(self.ids)
        if final:
            piece, self.sent = text[len(os.path.commonprefix([text, self.sent])):], text
            return piece
        text = text.rstrip("\ufffd")
        if not text.startswith(self.sent):  # may start with it again once more ids arrive
            return ""
        piece, self.sent = text[len(self.sent):], text
        return piece
