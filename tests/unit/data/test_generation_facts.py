"""A model's generation facts: what a Hugging Face directory states read as transformers reads it (its named special
tokens, chat template, generation eos ids), recorded and found again beside a checkpoint (its step directory before its
run directory), and carried by the tokenizer: eos, pad, bos and stop ids become the model's, and chat renders and
encodes as transformers' `apply_chat_template` with the same template, assistant tokens as its generation marks; a
tokenizer without them keeps moesys's own tokens and ChatML."""

from __future__ import annotations

import json
import shutil

import pytest

from runtime.data.chat_template import CHATML, encode_chat, render_chat
from runtime.data.generation_facts import (GenerationFacts, checkpoint_facts, ending_ids, hf_facts, recorded_facts,
                                           write_facts)
from runtime.data.tokenizer import EOS, IM_END, byte_tokenizer, hf_tokenizer_config, load_tokenizer
from runtime.files.paths import CHAT_TEMPLATE_FILE, CHECKPOINTS, GENERATION_TOKENS_FILE
from tests.hf_families import OWN_STOPS, OWN_TEMPLATE, save_own_tokenizer

transformers = pytest.importorskip("transformers", reason="transformers is not installed")
CHATS = [
    [{"role": "user", "content": "Hello there"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the weather?"},
     {"role": "assistant", "content": "Sunny and warm."}, {"role": "user", "content": "And tomorrow?"},
     {"role": "assistant", "content": "Rain, naïve 東京."}],
]
MARKED = OWN_TEMPLATE.replace(" {{ m['content'] }}{{ eos_token }}",
                              " {% generation %}{{ m['content'] }}{{ eos_token }}{% endgeneration %}")
"""OWN_TEMPLATE with transformers' marks around what the assistant writes: after its generation prompt (a space),
its content and eos."""


@pytest.fixture(scope="module")
def own(tmp_path_factory):
    texts = [m["content"] for chat in CHATS for m in chat] * 4
    return save_own_tokenizer(tmp_path_factory.mktemp("own") / "model", texts)


def test_a_hugging_face_directory_states_what_transformers_reads(own):
    facts = hf_facts(own)
    auto = transformers.AutoTokenizer.from_pretrained(str(own))
    assert facts.special_tokens == auto.special_tokens_map == {"bos_token": "<s>", "eos_token": "</s>",
                                                               "pad_token": "<pad>"}
    assert facts.chat_template == auto.chat_template == OWN_TEMPLATE
    assert list(facts.eos_token_ids) == transformers.GenerationConfig.from_pretrained(str(own)).eos_token_id


@pytest.mark.parametrize("decoder,eos", [(False, "<pad>"), (True, "</s>")])
def test_older_files_tokens_as_objects_a_list_of_templates_and_config_json_eos(own, tmp_path, decoder, eos):
    """An older tokenizer_config.json (eos as an added token's object) under special_tokens_map.json's tokens, a
    newer one (listing its added tokens) on its own, as transformers 5 reads them; the default of a list of templates;
    config.json's eos where no generation_config.json names one."""
    shutil.copy(own / "tokenizer.json", tmp_path / "tokenizer.json")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": {"content": "</s>", "special": True},
              "chat_template": [{"name": "tool_use", "template": "{{ tools }}"}, {"name": "default", "template": CHATML}]}
    if decoder:
        config.update(eos_token="</s>", added_tokens_decoder={"1": {"content": "</s>", "special": True}})
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "<pad>",
                                                                   "unk_token": "<|end|>"}))
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 1}))
    facts = hf_facts(tmp_path)
    auto = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    want = {"eos_token": eos} if decoder else {"bos_token": "<s>", "eos_token": eos, "unk_token": "<|end|>"}
    assert facts.special_tokens == auto.special_tokens_map == want
    assert facts.chat_template == auto.get_chat_template() == CHATML and facts.eos_token_ids == (1,)
    assert hf_facts(tmp_path / "nothing") is None


def test_a_tokenizer_carrying_the_facts_uses_the_models_tokens_and_template(own):
    tok = load_tokenizer(own / "tokenizer.json")
    assert (tok.eos_token, tok.eos_id, tok.stop_ids, tok.chat_template) == (None, None, (), None)  # not moesys's
    tok.facts = hf_facts(own)
    assert (tok.eos_token, tok.eos_id, tok.pad_token, tok.bos_token) == ("</s>", 1, "<pad>", "<s>")
    assert tok.stop_ids == tuple(OWN_STOPS) and tok.chat_template == OWN_TEMPLATE
    assert tok.template_tokens == {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
    auto = transformers.AutoTokenizer.from_pretrained(str(own))
    for chat in CHATS:
        for prompt in (True, False):
            text = auto.apply_chat_template(chat, tokenize=False, add_generation_prompt=prompt)
            assert render_chat(chat, prompt, tok.chat_template, tok.template_tokens) == text
            assert encode_chat(tok, chat, prompt).ids == list(auto.apply_chat_template(
                chat, add_generation_prompt=prompt, return_dict=False))
        marked = auto.apply_chat_template(chat, chat_template=MARKED, return_assistant_tokens_mask=True,
                                          return_dict=True)
        got = encode_chat(tok, chat)
        assert got.ids == marked["input_ids"]
        assert got.assistant_mask() == [bool(m) for m in marked["assistant_masks"]]
    config = hf_tokenizer_config(64, tok)  # what an hf export names: the model's own
    assert (config["bos_token"], config["eos_token"], config["pad_token"], config["chat_template"]) == (
        "<s>", "</s>", "<pad>", OWN_TEMPLATE)


def test_the_stop_ids_are_the_generation_configs_and_the_eos(own):
    assert ending_ids([3], 1) == (3, 1) and ending_ids([1, 3, 1], 1) == (1, 3) and ending_ids([], None) == ()
    tok = load_tokenizer(own / "tokenizer.json")
    tok.facts = GenerationFacts(None, {"eos_token": "</s>"}, (3,))
    assert tok.stop_ids == (3, 1) and tok.chat_template is None and tok.pad_token is None
    tok.facts = GenerationFacts(None, {"eos_token": "<not a token>"}, None)
    assert tok.eos_token is None and tok.stop_ids == ()


def test_without_facts_a_tokenizer_keeps_moesys_tokens_and_chatml():
    tok = byte_tokenizer()
    assert (tok.eos_token, tok.pad_token, tok.bos_token, tok.chat_template) == (EOS, EOS, None, None)
    assert tok.stop_ids == (256, 258) and tok.template_tokens == {"eos_token": EOS, "pad_token": EOS}
    tok.facts = GenerationFacts("{{ messages[0]['content'] }}")  # a template alone: moesys's tokens stay
    assert (tok.eos_token, tok.stop_ids, tok.chat_template) == (EOS, (256, 258), "{{ messages[0]['content'] }}")
    assert tok.special_ids[IM_END] in tok.stop_ids


def test_recorded_facts_round_trip_and_a_step_directory_wins_over_its_run(tmp_path):
    run, step = tmp_path / "run", tmp_path / "run" / CHECKPOINTS / "step_00000002"
    step.mkdir(parents=True)
    facts = GenerationFacts(OWN_TEMPLATE, {"eos_token": "</s>", "bos_token": "<s>"}, (1, 3))
    write_facts(run, facts)
    assert recorded_facts(run) == facts == checkpoint_facts(run, step)
    assert json.loads((run / GENERATION_TOKENS_FILE).read_text()) == {
        "special_tokens": {"eos_token": "</s>", "bos_token": "<s>"}, "eos_token_id": [1, 3]}
    mine = GenerationFacts(None, None, None)
    write_facts(step, mine)
    assert checkpoint_facts(run, step) == mine and not (step / CHAT_TEMPLATE_FILE).exists()
    write_facts(step, None)
    write_facts(run, None)
    assert checkpoint_facts(run, step) is None and not any(run.glob("*.json"))
    (run / CHAT_TEMPLATE_FILE).write_text(OWN_TEMPLATE)  # what runs recorded before the tokens were
    assert checkpoint_facts(run, step) == GenerationFacts(OWN_TEMPLATE)
