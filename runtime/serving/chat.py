"""OpenAI chat completions as `moesys serve` speaks them: messages rendered to one prompt by the chat template the
tokenizer carries (a Hugging Face tokenizer's `chat_template`, or the one a run started from a released model keeps),
or else by moesys's ChatML template (runtime/data/chat_template.py); the template its chat training rendered with and
its exports carry; the chat response and stream chunk bodies."""

from __future__ import annotations

import time
from typing import Any

from runtime.data.chat_template import ChatTemplateError, render_chat, tokenizer_template
from runtime.serving.protocol import (
    MAX_LOGPROBS,
    NOT_SERVED,
    SAMPLING,
    CompletionRequest,
    Defaults,
    RequestError,
    _int,
    _shown,
    check_fields,
    encode_text,
    refuse_not_served,
    request_fields,
)
from runtime.serving.responses import token_text, usage

CHAT_FIELDS = ("model", "messages", "max_completion_tokens", "logprobs", "top_logprobs") + SAMPLING + NOT_SERVED
ROLES = ("system", "user", "assistant", "developer", "tool")


def served_template(tokenizer: Any) -> str:
    """The template `chat_prompt` renders with for this tokenizer: its model's own, or ChatML."""
    return tokenizer_template(tokenizer)[0]


def chat_prompt(tokenizer: Any, messages: list[dict[str, str]]) -> str:
    """The prompt text of `messages` with the generation prompt: the tokenizer's chat template (a Hugging Face
    tokenizer renders its own; moesys's render theirs, the model's own or ChatML, as transformers would)."""
    if hasattr(tokenizer, "apply_chat_template") and getattr(tokenizer, "chat_template", None):
        try:
            return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # a template that refuses these messages (e.g. roles out of order)
            reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise RequestError(f"the model's chat template refused the messages: {reason[:200]}",
                               "messages") from None
    template, tokens = tokenizer_template(tokenizer)
    try:
        return render_chat(messages, add_generation_prompt=True, template=template, tokens=tokens)
    except ChatTemplateError as exc:
        raise RequestError(str(exc), "messages") from None


def _messages(body: dict[str, Any]) -> list[dict[str, str]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages is required: a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise RequestError(f"messages[{i}] must be an object whose role is one of {', '.join(ROLES)}", "messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: only text ones
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise RequestError(f"messages[{i}].content: only text parts are served", "messages")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise RequestError(f"messages[{i}].content must be text (got {_shown(content)})", "messages")
        out.append({"role": m["role"], "content": content})
    return out


def parse_chat(body: dict[str, Any], defaults: Defaults, tokenizer: Any, vocab_size: int,
               context: int) -> CompletionRequest:
    """Check every field of a /v1/chat/completions body into a CompletionRequest of the rendered prompt."""
    check_fields(body, CHAT_FIELDS)
    refuse_not_served(body)
    if tokenizer is None:
        raise RequestError("this model has no tokenizer: chat needs one; use /v1/completions with token ids",
                           "messages")
    messages = _messages(body)
    if "max_completion_tokens" in body:
        if "max_tokens" in body:
            raise RequestError("give max_tokens or max_completion_tokens, not both", "max_completion_tokens")
        body = {**body, "max_tokens": body["max_completion_tokens"]}
    wanted = body.get("logprobs", False)
    if not isinstance(wanted, bool):
        raise RequestError(f"logprobs must be true or false (got {_shown(wanted)})", "logprobs")
    top = _int(body, "top_logprobs", 0, 0, MAX_LOGPROBS) if body.get("top_logprobs") is not None else 0
    if top and not wanted:
        raise RequestError("top_logprobs needs logprobs=true", "top_logprobs")
    ids = encode_text(chat_prompt(tokenizer, messages), tokenizer, "messages")
    return request_fields(body, [ids], defaults, tokenizer, vocab_size, context, top if wanted else None)


def chat_logprobs(outs: list[Any], tokenizer: Any) -> dict[str, Any] | None:
    """OpenAI's chat `logprobs` object for these TokenOuts (None when not asked)."""
    if not outs:
        return None

    def entry(token: int, logprob: float) -> dict[str, Any]:
        text = token_text(tokenizer, token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", "replace"))}

    return {"content": [{**entry(o.token, o.logprob), "top_logprobs": [entry(t, lp) for t, lp in o.top]}
                        for o in outs]}


def chat_body(request_id: str, model: str, choices: list[Any], request: CompletionRequest,
              tokenizer: Any) -> dict[str, Any]:
    out = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
            "logprobs": chat_logprobs(c.logprobs, tokenizer), "finish_reason": c.finish_reason} for c in choices]
    return {"id": request_id, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": out, "usage": usage(request.prompt_tokens, sum(len(c.tokens) for c in choices))}


def chat_chunk(request_id: str, model: str, index: int, delta: dict[str, Any], finish_reason: str | None = None,
               logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    return {"id": request_id, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [choice]}
