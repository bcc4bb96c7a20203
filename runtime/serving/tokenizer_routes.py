"""vLLM's tokenizer routes, in vLLM's shapes, at the server root: GET /tokenizer_info (the tokenizer's settings as
tokenizer_config.json holds them, `eos_token` among them), POST /tokenize (text, or chat messages rendered as the
chat route renders them, to ids) and POST /detokenize (ids to text). A client such as lm-evaluation-harness then
tokenizes with the served model's own tokenizer, offline, from the server's address alone."""

from __future__ import annotations

from typing import Any

from runtime.serving.chat import _messages, chat_prompt, served_template
from runtime.serving.protocol import RequestError, _bool, _is_int, _shown, check_fields, encode_text
from runtime.serving.responses import token_text

TOKENIZE_FIELDS = ("model", "prompt", "messages", "add_special_tokens", "add_generation_prompt", "return_token_strs")
DETOKENIZE_FIELDS = ("model", "tokens")


def _tokenizer(service: Any) -> Any:
    if service.tokenizer is None:
        raise RequestError("this model has no tokenizer: prompts must be token ids", status=404)
    return service.tokenizer


def tokenizer_info(service: Any, body: dict[str, Any]) -> dict[str, Any]:
    """The tokenizer's class, special tokens (null where it has none), the chat template the chat route renders
    with and the context."""
    tok = _tokenizer(service)
    return {"tokenizer_class": getattr(tok, "tokenizer_class", type(tok).__name__),
            "eos_token": getattr(tok, "eos_token", None), "bos_token": getattr(tok, "bos_token", None),
            "pad_token": getattr(tok, "pad_token", None), "chat_template": served_template(tok),
            "model_max_length": service.config.model.max_seq_len}


def tokenize(service: Any, body: dict[str, Any]) -> dict[str, Any]:
    """{prompt} or {messages} -> {count, max_model_len, tokens, token_strs}. The ids are those the completions
    routes give the same text; add_special_tokens=false leaves out what a Hugging Face tokenizer adds (moesys's
    tokenizers add nothing)."""
    check_fields(body, TOKENIZE_FIELDS)
    tok = _tokenizer(service)
    if ("prompt" in body) == ("messages" in body):
        raise RequestError("give prompt (text) or messages (a chat), one of them", "prompt")
    if "messages" in body:
        if not _bool(body, "add_generation_prompt", True):
            raise RequestError("add_generation_prompt=false is not supported: a chat is rendered for its answer",
                               "add_generation_prompt")
        text, param = chat_prompt(tok, _messages(body)), "messages"
    else:
        text, param = body["prompt"], "prompt"
        if not isinstance(text, str):
            raise RequestError(f"prompt must be text (got {_shown(text)})", "prompt")
    if _bool(body, "add_special_tokens", True) or not getattr(tok, "adds_special_tokens", False):
        ids = encode_text(text, tok, param)
    else:
        encode_text(text, tok, param)  # the same checks
        ids = tok.encode(text, add_special_tokens=False)
    strs = [token_text(tok, t) for t in ids] if _bool(body, "return_token_strs") else None
    return {"count": len(ids), "max_model_len": service.config.model.max_seq_len, "tokens": ids, "token_strs": strs}


def detokenize(service: Any, body: dict[str, Any]) -> dict[str, Any]:
    """{tokens} -> {prompt}: their text."""
    check_fields(body, DETOKENIZE_FIELDS)
    tok = _tokenizer(service)
    ids = body.get("tokens")
    if not isinstance(ids, list) or not all(_is_int(t) for t in ids):
        raise RequestError(f"tokens must be a list of token ids (got {_shown(ids)})", "tokens")
    vocab = service.config.model.vocab_size
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise RequestError(f"token id {bad[0]} is outside the vocabulary 0..{vocab - 1}", "tokens")
    return {"prompt": tok.decode(ids)}


TOKENIZER_ROUTES = (("/tokenizer_info", "GET", tokenizer_info), ("/tokenize", "POST", tokenize),
                    ("/detokenize", "POST", detokenize))
"""(path, method, answer(service, body) -> the JSON answer)."""
