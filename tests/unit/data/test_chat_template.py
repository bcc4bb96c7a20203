"""The ChatML template: rendered as transformers renders it (text and ids of `apply_chat_template` on a tokenizer
carrying it, byte-level and a trained BPE), and each assistant message's tokens against two references: a plain
ChatML encoder written here, and transformers' assistant mask of the same template with `{% generation %}` marks."""

from __future__ import annotations

import json

import pytest

from runtime.data.chat_template import CHATML, ChatTemplateError, assistant_text_spans, encode_chat, render_chat
from runtime.data.text import CORPUS_DIR
from runtime.data.tokenizer import IM_END, IM_START, ByteTokenizer, hf_tokenizer_config, load_tokenizer
from runtime.data.tokenizer_train import train_bpe

CHATS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Wind?"},
     {"role": "assistant", "content": "Air that moves."}, {"role": "user", "content": "And rain, naïve 東京 🌧️?"},
     {"role": "assistant", "content": "Water that falls.\n\nOften."}],
    [{"role": "user", "content": "{{ not a tag }} {% raw %}"}, {"role": "assistant", "content": ""},
     {"role": "user", "content": " lead and trail  "}, {"role": "assistant", "content": "\nnew line first"}],
]
MARKED = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
          "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' + '\\n' }}"
          "{% endgeneration %}{% else %}{{ message['content'] + '<|im_end|>' + '\\n' }}{% endif %}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
"""CHATML with transformers' marks around what the assistant writes."""


@pytest.fixture(scope="module", params=["bytes", "bpe"])
def tokenizers(request, tmp_path_factory):
    """(ours, transformers' AutoTokenizer of the same tokenizer.json with CHATML in its tokenizer_config.json)."""
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    path = tmp_path_factory.mktemp(request.param)
    if request.param == "bytes":
        ours = ByteTokenizer()
        (path / "tokenizer.json").write_text(ours.to_str())
    else:
        train_bpe(CORPUS_DIR, 400, path / "tokenizer.json")
        ours = load_tokenizer(path / "tokenizer.json")
    (path / "tokenizer_config.json").write_text(json.dumps(hf_tokenizer_config(256, ours)))
    return ours, transformers.AutoTokenizer.from_pretrained(str(path))


def _ids(encoded) -> list[int]:
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


@pytest.mark.parametrize("chat", CHATS)
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_text_and_ids_are_transformers_apply_chat_template(tokenizers, chat, generation_prompt):
    ours, auto = tokenizers
    assert auto.chat_template == CHATML
    text = render_chat(chat, add_generation_prompt=generation_prompt)
    assert text == auto.apply_chat_template(chat, tokenize=False, add_generation_prompt=generation_prompt)
    expected = _ids(auto.apply_chat_template(chat, add_generation_prompt=generation_prompt))
    assert encode_chat(ours, chat, generation_prompt).ids == expected == ours.encode(text)
    if generation_prompt:
        assert text.endswith(f"{IM_START}assistant\n")


def _reference(tok, chat) -> tuple[list[int], list[bool]]:
    """ChatML built piece by piece: <|im_start|>, role and newline, then content, <|im_end|> and newline (the
    assistant's part), each piece encoded on its own."""
    ids, mask = [], []
    for m in chat:
        head = [tok.special_ids[IM_START]] + tok.encode(m["role"] + "\n")
        body = tok.encode(m["content"]) + [tok.special_ids[IM_END]] + tok.encode("\n")
        ids += head + body
        mask += [False] * len(head) + [m["role"] == "assistant"] * len(body)
    return ids, mask


@pytest.mark.parametrize("chat", CHATS)
def test_the_assistants_tokens_are_what_it_writes_after_its_generation_prompt(tokenizers, chat):
    ours, auto = tokenizers
    got = encode_chat(ours, chat)
    if isinstance(ours, ByteTokenizer):  # bytes encode piece by piece as they do whole
        assert (got.ids, got.assistant_mask()) == _reference(ours, chat)
    marked = auto.apply_chat_template(chat, chat_template=MARKED, return_assistant_tokens_mask=True,
                                      return_dict=True)
    assert marked["input_ids"] == got.ids
    assert [bool(m) for m in marked["assistant_masks"]] == got.assistant_mask()
    assert len(got.assistant) == sum(m["role"] == "assistant" for m in chat)


def test_a_template_that_rewrites_earlier_turns_or_refuses_is_a_one_line_error():
    last_only = ("{% for m in messages %}{% if loop.last or m['role'] != 'assistant' %}{{ m['content'] }}{% endif %}"
                 "{% endfor %}")
    with pytest.raises(ChatTemplateError, match=r"renders messages\[2\] \(an assistant's\)"):
        assistant_text_spans(CHATS[1], last_only)
    refusing = ("{% if messages[0]['role'] != 'system' %}{{ raise_exception('a system message comes first') }}"
                "{% endif %}")
    with pytest.raises(ChatTemplateError, match="refused the messages: a system message comes first") as err:
        render_chat(CHATS[0], template=refusing)
    assert "\n" not in str(err.value)
    with pytest.raises(ChatTemplateError, match="does not compile"):
        render_chat(CHATS[0], template="{% for %}")
