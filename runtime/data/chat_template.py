"""Chat templates rendered as transformers renders a tokenizer's `chat_template` (the same sandboxed environment and
options, the tokenizer's named special tokens as variables): the tokenizer's own (a released model's, which a run
started from it keeps) or ChatML. `moesys serve`'s chat prompts, the chat data of training and transformers'
`apply_chat_template` on an export give the same text, so the same ids; and which tokens of a conversation are the
assistant's, the ones chat training puts its loss on.

An assistant message's tokens are what the model writes after the generation prompt of its turn: render the
messages before it with the generation prompt, then with it; the difference is its span (its content, <|im_end|>
and the newline after it, in ChatML). Any template whose rendering of a conversation begins with its rendering of
each earlier part does; one that rewrites earlier turns is refused.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from runtime.data.tokenizer import IM_END, IM_START
from runtime.errors import UserError

if TYPE_CHECKING:
    from runtime.data.tokenizer import Tokenizer

CHATML = ("{% for message in messages %}"
          f"{{{{ '{IM_START}' + message['role'] + '\\n' + message['content'] + '{IM_END}' + '\\n' }}}}"
          "{% endfor %}"
          f"{{% if add_generation_prompt %}}{{{{ '{IM_START}assistant\\n' }}}}{{% endif %}}")
"""ChatML: `<|im_start|>{role}\\n{content}<|im_end|>\\n` per message, and `<|im_start|>assistant\\n` to end a prompt
the model answers."""

Message = dict[str, Any]


def tokenizer_template(tokenizer: Any) -> tuple[str, dict[str, str]]:
    """The template chat is rendered with for this tokenizer (its model's own, else ChatML) and the special tokens
    the template sees (bos_token, eos_token, ... as transformers passes them)."""
    tokens = getattr(tokenizer, "template_tokens", None) or {}
    return getattr(tokenizer, "chat_template", None) or CHATML, dict(tokens)


class ChatTemplateError(UserError):
    """A template that cannot render these messages (the template's own error, or a rewrite of earlier turns)."""


@lru_cache(maxsize=4)
def _compiled(template: str) -> Any:
    """The template compiled as transformers compiles a chat template (trim_blocks, lstrip_blocks, loop controls,
    `raise_exception`, `tojson` without HTML escapes, `strftime_now`), in Jinja's immutable sandbox."""
    import json
    from datetime import datetime

    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"the chat template does not compile: {_reason(exc)}") from None


def _reason(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0][:200] if lines else type(exc).__name__


def render_chat(messages: Sequence[Message], add_generation_prompt: bool = False, template: str = CHATML,
                tokens: Mapping[str, str] | None = None) -> str:
    """The text of `messages` ({role, content} each), ending with the prompt of the assistant's answer when
    add_generation_prompt; `tokens`: the named special tokens the template sees (bos_token, eos_token, ...)."""
    import jinja2

    try:
        return _compiled(template).render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                          **dict(tokens or {}))
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"the chat template refused the messages: {_reason(exc)}") from None


def assistant_text_spans(messages: Sequence[Message], template: str = CHATML,
                         tokens: Mapping[str, str] | None = None) -> list[tuple[int, int]]:
    """[start, end) characters of each assistant message in `render_chat(messages)`: what the model writes after
    the generation prompt of its turn."""
    whole = render_chat(messages, template=template, tokens=tokens)
    spans = []
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        prompt = render_chat(messages[:i], add_generation_prompt=True, template=template, tokens=tokens)
        turn = render_chat(messages[:i + 1], template=template, tokens=tokens)
        if not (turn.startswith(prompt) and whole.startswith(turn)):
            raise ChatTemplateError(f"the chat template renders messages[{i}] (an assistant's) so that the "
                                    "conversation does not begin with its earlier turns; its tokens cannot be told "
                                    "apart")
        spans.append((len(prompt), len(turn)))
    return spans


@dataclass(frozen=True)
class ChatTokens:
    """A conversation's token ids and the [start, end) ids of each assistant message."""

    ids: list[int]
    assistant: list[tuple[int, int]]

    def assistant_mask(self) -> list[bool]:
        """Per id, whether an assistant wrote it (where chat training puts its loss)."""
        mask = [False] * len(self.ids)
        for start, end in self.assistant:
            mask[start:end] = [True] * (end - start)
        return mask


def encode_chat(tokenizer: Tokenizer, messages: Sequence[Message], add_generation_prompt: bool = False,
                template: str | None = None) -> ChatTokens:
    """`render_chat` with the tokenizer's template (`template` given: that one) encoded as the tokenizer encodes any
    text (special tokens' strings as their ids), with each assistant message's ids: those made from any of its
    characters."""
    own, tokens = tokenizer_template(tokenizer)
    template = template or own
    ids, offsets = tokenizer.encode_offsets(render_chat(messages, add_generation_prompt, template, tokens))
    spans = []
    for start, end in assistant_text_spans(messages, template, tokens):
        inside = [t for t, (a, b) in enumerate(offsets) if a < end and b > start]
        spans.append((inside[0], inside[-1] + 1) if inside else (0, 0))
    return ChatTokens(ids, spans)
