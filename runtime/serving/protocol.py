"""The OpenAI completions protocol as `moesys serve` reads it: a request body checked field by field into a
`CompletionRequest` (runtime/serving/responses.py writes the answers)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from runtime.inference.sampling import MAX_LOGIT_BIAS, MAX_PENALTY, Sampling

SAMPLING = ("max_tokens", "temperature", "top_k", "top_p", "presence_penalty", "frequency_penalty", "logit_bias",
            "seed", "stream", "stream_options", "n", "stop", "user")
"""The fields /v1/completions and /v1/chat/completions share."""
FIELDS = ("model", "prompt", "echo", "best_of", "logprobs") + SAMPLING
NOT_SERVED = ("tools", "tool_choice", "functions", "function_call", "parallel_tool_calls", "response_format")
"""Chat fields the server knows and refuses with a 400 saying so (tool calls, structured output), unless they ask
for nothing: no tools, tool_choice "none", response_format text."""
MAX_SEED = 2**63 - 1
MAX_N = 16
"""Choices per prompt (`n`), and candidates per prompt (`best_of`)."""
MAX_STOPS, MAX_STOP_CHARS = 4, 256
"""At most this many stop strings (as OpenAI), each at most this long."""
MAX_LOGPROBS = 20
"""Alternatives per token (`logprobs` of /v1/completions, `top_logprobs` of chat)."""


class RequestError(ValueError):
    """A request the server refuses: HTTP status, a one-line message and the offending field (OpenAI's `param`)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.param, self.status, self.kind = param, status, kind


@dataclass(frozen=True)
class Defaults:
    """What a request that leaves a field out gets (the checkpoint's infer.* settings, as `moesys infer` uses them),
    and the most sequences one request may ask for (serve.max_sequences_per_request)."""

    max_tokens: int
    sampling: Sampling
    seed: int
    max_sequences: int = 256


@dataclass(frozen=True)
class CompletionRequest:
    """One checked request: its prompts as token ids, and how to answer each."""

    prompts: list[list[int]]
    max_tokens: int
    sampling: Sampling
    seed: int
    stream: bool = False
    n: int = 1
    """Choices per prompt; choice i of a prompt samples with seed + i."""
    stop: tuple[str, ...] = ()
    logprobs: int | None = None
    """None: no log-probabilities; N: the chosen token's and the N most likely alternatives' per token."""
    best_of: int = 0
    """Candidates per prompt (0: n) of which the n of highest cumulative log-probability are answered."""
    echo: bool = False
    """Answer each prompt's tokens (and their log-probabilities) before the generated ones."""
    include_usage: bool = False
    """stream_options.include_usage: a last stream chunk with the usage."""
    user: str | None = None

    @property
    def candidates(self) -> int:
        """Sequences generated per prompt."""
        return max(self.n, self.best_of)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


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


def _bool(body: dict, key: str, default: bool = False) -> bool:
    value = body.get(key, default)
    if not isinstance(value, bool):
        raise RequestError(f"{key} must be true or false (got {_shown(value)})", key)
    return value


def _number(value: Any, key: str, low: float, high: float, what: str) -> float:
    """A finite number in low..high as a float (an integer too large for a float is refused, not an
    OverflowError); `what` says the range in the message."""
    try:
        number = float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan
    except OverflowError:
        number = math.inf
    if not (math.isfinite(number) and low <= number <= high):
        raise RequestError(f"{key} must be a number {what} (got {_shown(value)})", key)
    return number


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
    """Check every field of a /v1/completions body; each prompt must leave room for max_tokens in the context
    (with echo and max_tokens=0 it may fill the context: it is only scored)."""
    check_fields(body, FIELDS)
    if "prompt" not in body:
        raise RequestError("prompt is required: text, token ids, or a list of either", "prompt")
    logprobs = body.get("logprobs")
    if logprobs is not None:
        logprobs = _int(body, "logprobs", 0, 0, MAX_LOGPROBS)
    return request_fields(body, _prompts(body["prompt"], tokenizer), defaults, tokenizer, vocab_size, context,
                          logprobs, echo=_bool(body, "echo"))


def _prompts(prompt: Any, tokenizer: Any) -> list[list[int]]:
    """One prompt (text or token ids) or several (a list of texts or of token id lists), as token ids."""
    if isinstance(prompt, str):
        return [encode_text(prompt, tokenizer, "prompt")]
    if isinstance(prompt, list):
        if all(_is_int(t) for t in prompt):
            return [list(prompt)]
        if all(isinstance(p, str) for p in prompt):
            return [encode_text(p, tokenizer, f"prompt[{i}]") for i, p in enumerate(prompt)]
        if all(isinstance(p, list) and all(_is_int(t) for t in p) for p in prompt):
            return [list(p) for p in prompt]
    raise RequestError("prompt must be text, a list of token ids, or a list of texts or of token id lists "
                       "(one per prompt)", "prompt")


def check_fields(body: dict[str, Any], fields: tuple[str, ...]) -> None:
    unknown = sorted(set(body) - set(fields))
    if unknown:
        raise RequestError(f"unknown field {unknown[0]!r}; this route takes {', '.join(fields)}", unknown[0])
    if "model" in body and not isinstance(body["model"], str):
        raise RequestError("model must be a string", "model")


def refuse_not_served(body: dict[str, Any]) -> None:
    """A 400 for a tool call or structured output asked for (NOT_SERVED), which this server does not do."""
    for key in NOT_SERVED:
        value = body.get(key)
        if (value in (None, [], "none") or (key == "response_format" and value == {"type": "text"})
                or (key == "parallel_tool_calls" and isinstance(value, bool))):
            continue
        raise RequestError(f"{key} is not supported by moesys serve (no tool calls or structured output); leave it "
                           "out", key)


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


def _check_prompts(prompts: list[list[int]], vocab_size: int, context: int, scored_only: bool) -> None:
    for i, ids in enumerate(prompts):
        name = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
        if not ids:
            raise RequestError(f"{name} is empty: give at least one token", "prompt")
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise RequestError(f"{name} token id {_shown(bad[0])} is outside the vocabulary 0..{vocab_size - 1}",
                               "prompt")
        if len(ids) > context or (len(ids) == context and not scored_only):
            tail = "" if len(ids) > context else " with a token to generate (echo with max_tokens=0 scores it)"
            raise RequestError(f"{name} of {len(ids)} tokens does not fit the model's context of {context} "
                               f"tokens{tail}", "prompt")


def request_fields(body: dict[str, Any], prompts: list[list[int]], defaults: Defaults, tokenizer: Any,
                   vocab_size: int, context: int, logprobs: int | None, echo: bool = False) -> CompletionRequest:
    """The prompts checked against the vocabulary and context, and the fields both routes share."""
    room = context - max((len(p) for p in prompts), default=0)
    max_tokens = body.get("max_tokens", max(0, min(defaults.max_tokens, room)) if echo else
                          min(defaults.max_tokens, room))
    _check_prompts(prompts, vocab_size, context, scored_only=echo and max_tokens == 0)
    if _is_int(max_tokens) and max_tokens > room:
        raise RequestError(f"max_tokens={_shown(max_tokens)} with a prompt of {context - room} tokens exceeds the "
                           f"model's context of {context} tokens (at most {room})", "max_tokens")
    max_tokens = _int(body, "max_tokens", max_tokens, 0 if echo else 1, room)
    stream = _bool(body, "stream")
    n = _int(body, "n", 1, 1, MAX_N)
    best_of = _int(body, "best_of", n, 1, MAX_N)
    if best_of < n:
        raise RequestError(f"best_of={best_of} must be >= n={n}", "best_of")
    if stream and best_of > n:
        raise RequestError("best_of > n cannot be streamed (the best are known only at the end); leave out stream "
                           "or best_of", "best_of")
    if stream and echo:
        raise RequestError("echo cannot be streamed; leave out stream or echo", "echo")
    sequences = len(prompts) * best_of
    if sequences > defaults.max_sequences:
        raise RequestError(f"{len(prompts)} prompts x {best_of} choices = {sequences} sequences exceed "
                           f"serve.max_sequences_per_request={defaults.max_sequences}; split the request",
                           "prompt" if len(prompts) > 1 else "n")
    seed = _int(body, "seed", defaults.seed, 0, MAX_SEED)
    if best_of > 1 and seed > MAX_SEED - best_of:
        raise RequestError(f"seed={seed} leaves no room for {best_of} seeds (choice i samples with seed + i)", "seed")
    return CompletionRequest(prompts, max_tokens, _sampling(body, defaults.sampling, vocab_size), seed, stream, n,
                             _stops(body, tokenizer), logprobs, best_of if best_of > n else 0, echo,
                             _include_usage(body, stream), _user(body))


def _sampling(body: dict[str, Any], default: Sampling, vocab_size: int) -> Sampling:
    def number(key: str, low: float, high: float, what: str) -> float:
        return _number(body[key], key, low, high, what) if key in body else getattr(default, key)

    top_p = number("top_p", 0.0, 1.0, "in (0, 1]; 1 keeps every token")
    if top_p == 0:
        raise RequestError("top_p must be a number in (0, 1]; 1 keeps every token (got 0)", "top_p")
    penalty = f"between {-MAX_PENALTY:g} and {MAX_PENALTY:g}"
    return Sampling.of(number("temperature", 0.0, math.inf, ">= 0; 0 is greedy"),
                       _int(body, "top_k", default.top_k, 0, vocab_size), top_p,
                       number("presence_penalty", -MAX_PENALTY, MAX_PENALTY, penalty),
                       number("frequency_penalty", -MAX_PENALTY, MAX_PENALTY, penalty),
                       _logit_bias(body, vocab_size) if "logit_bias" in body else dict(default.logit_bias))


def _logit_bias(body: dict[str, Any], vocab_size: int) -> dict[int, float]:
    """{token id (a decimal string, as JSON keys are): bias in -100..100}."""
    bias = body["logit_bias"]
    if bias is None:
        return {}
    if not isinstance(bias, dict):
        raise RequestError(f"logit_bias must be an object of token id: bias (got {_shown(bias)})", "logit_bias")
    out = {}
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit() and int(key) < vocab_size):
            raise RequestError(f"logit_bias key {_shown(key)} is not a token id 0..{vocab_size - 1}", "logit_bias")
        out[int(key)] = _number(value, "logit_bias", -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS,
                                f"between {-MAX_LOGIT_BIAS:g} and {MAX_LOGIT_BIAS:g} for each token")
    return out


def _include_usage(body: dict[str, Any], stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise RequestError("stream_options needs stream=true", "stream_options")
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise RequestError(f"stream_options takes only include_usage (got {_shown(options)})", "stream_options")
    return _bool(options, "include_usage")


def _user(body: dict[str, Any]) -> str | None:
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise RequestError(f"user must be a string (got {_shown(user)})", "user")
    return user


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
