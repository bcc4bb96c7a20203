"""Chat and instruction data, read without torch: a .jsonl file whose records are OpenAI-style conversations
(`{"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]}`) or prompt/completion
pairs (`{"prompt": "...", "completion": "..."}`, read as a user message and the assistant's answer). A record that is
neither is refused in one line naming its file and line and what is wrong with it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime.data.text import JSONL_SUFFIXES, DataError

ROLES = ("system", "user", "assistant")
Message = dict[str, Any]


@dataclass(frozen=True)
class ChatRecord:
    """One conversation and the line of the file it came from."""

    line: int
    messages: list[Message]


def first_record(path: str | Path | None) -> dict | None:
    """The first record of a .jsonl file as a dict, None for any other source or one that does not parse."""
    if path is None or Path(path).suffix.lower() not in JSONL_SUFFIXES or not Path(path).is_file():
        return None
    with open(path, "rb") as f:
        for raw in f:
            if raw.strip():
                try:
                    record = json.loads(raw)
                except ValueError:
                    return None
                return record if isinstance(record, dict) else None
    return None


def is_chat(path: str | Path | None, data_format: str) -> bool:
    """Whether a source is chat data: train.data_format=chat, or auto and a .jsonl whose first record has messages
    or a prompt and a completion."""
    if data_format != "auto":
        return data_format == "chat"
    record = first_record(path)
    return record is not None and ("messages" in record or {"prompt", "completion"} <= set(record))


def _messages(record: Any, where: str) -> list[Message]:
    """The conversation of one parsed record; DataError naming `where` (file:line) and the problem."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: not a JSON object (a chat record is {{\"messages\": [...]}} or "
                        "{\"prompt\": ..., \"completion\": ...})")
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            raise DataError(f"{where}: 'messages' is not a non-empty list of {{role, content}} objects")
        for i, m in enumerate(messages):
            if not isinstance(m, dict):
                raise DataError(f"{where}: messages[{i}] is not an object with a role and a content")
            if m.get("role") not in ROLES:
                raise DataError(f"{where}: messages[{i}].role={m.get('role')!r} is not one of {', '.join(ROLES)}")
            if not isinstance(m.get("content"), str):
                raise DataError(f"{where}: messages[{i}].content is not a string")
        if not any(m["role"] == "assistant" for m in messages):
            raise DataError(f"{where}: no assistant message (the loss counts the assistant's tokens only)")
        return [{"role": m["role"], "content": m["content"]} for m in messages]
    prompt, completion = record.get("prompt"), record.get("completion")
    if prompt is None and completion is None:
        raise DataError(f"{where}: neither 'messages' nor 'prompt' and 'completion' (its keys: "
                        f"{', '.join(sorted(record)[:8]) or 'none'})")
    for name, value in (("prompt", prompt), ("completion", completion)):
        if not isinstance(value, str):
            raise DataError(f"{where}: '{name}' is {'missing' if value is None else 'not a string'}")
    if not completion:
        raise DataError(f"{where}: 'completion' is empty (the loss counts the completion's tokens only)")
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]


def read_chat(path: str | Path, key: str = "train.data") -> Iterator[ChatRecord]:
    """The conversations of a .jsonl file in order; DataError naming the first malformed line."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise DataError(f"{key}={path} does not exist" if not path.exists() else f"{key}={path} is not a file")
    found = False
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            where = f"{key}={path}:{number}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DataError(f"{where}: not UTF-8 text (byte {exc.start} of the line)") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as exc:
                raise DataError(f"{where}: not valid JSON ({exc})") from None
            found = True
            yield ChatRecord(number, _messages(record, where))
    if not found:
        raise DataError(f"{key}={path} holds no records")
