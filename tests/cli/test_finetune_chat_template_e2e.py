"""A fine-tune keeps its source's chat template and stop tokens, through the real commands: a tiny random Qwen3-MoE
whose tokenizer (a BPE of its own, saved by transformers) renders chat with a Mixtral-style template (bos and eos as
template variables, not ChatML) and ends generation at eos `</s>` or `<|end|>` is fine-tuned with `moesys train
train.init_from=DIR` on chat data; the chat the run trained on, the prompt `moesys serve` renders and /tokenize gives,
and transformers' `apply_chat_template` on the source and on the run's hf export are one text and one list of ids;
/tokenizer_info names the source's tokens; the server's generation ends at the source's stop ids, which the export's
generation_config.json names. A text-data fine-tune keeps them too."""

from __future__ import annotations

import json
import urllib.request

import pytest
import torch

from runtime.data.chat_data import ChatSamples
from runtime.files.paths import CHAT_TEMPLATE_FILE, CHECKPOINTS, GENERATION_TOKENS_FILE
from runtime.inference.load import open_checkpoint
from runtime.serving.chat import chat_prompt
from tests.cli.conftest import FAST_TINY, run_moesys, serving
from tests.hf_families import OWN_STOPS, OWN_TEMPLATE, save_own_tokenizer, save_sharded, tiny_model

transformers = pytest.importorskip("transformers", reason="transformers is not installed")
pytestmark = pytest.mark.slow
CHATS = [
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the weather?"},
     {"role": "assistant", "content": "Sunny and warm."}],
    [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "Hi, how are you?"},
     {"role": "user", "content": "I am fine."}, {"role": "assistant", "content": "Good."}],
]
QUESTION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "How warm is it?"}]


def source_model(path):
    """The Qwen3-MoE of 300 rows with the tokenizer, template and stop ids of tests/hf_families.save_own_tokenizer."""
    save_sharded(tiny_model("qwen3_moe", vocab_size=300, bos_token_id=0, eos_token_id=1, pad_token_id=2), path,
                 tokenizer=False)
    return save_own_tokenizer(path, [m["content"] for chat in CHATS for m in chat] * 4)


def get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=120) as response:
        return json.loads(response.read())


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return source_model(tmp_path_factory.mktemp("source") / "qwen3-mixtral-template")


@pytest.fixture(scope="module")
def auto(source):
    """transformers' own tokenizer of the source: the reference every rendering is compared with."""
    return transformers.AutoTokenizer.from_pretrained(str(source))


def train(source, run_dir, data) -> None:
    done = run_moesys("train", *FAST_TINY, f"train.init_from={source}", f"train.data={data}", "train.max_steps=2",
                      f"train.run_dir={run_dir}")
    assert done.returncode == 0, done.stderr[-3000:]


def test_a_chat_fine_tune_renders_serves_and_exports_with_the_source_template_and_stops(source, auto, tmp_path):
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": chat}) + "\n" for chat in CHATS))
    run = tmp_path / "run"
    train(source, run, data)
    assert (run / CHAT_TEMPLATE_FILE).read_text() == OWN_TEMPLATE
    assert json.loads((run / GENERATION_TOKENS_FILE).read_text()) == {
        "special_tokens": {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}, "eos_token_id": OWN_STOPS}
    step = sorted((run / CHECKPOINTS).glob("step_*"))[-1]
    assert (step / CHAT_TEMPLATE_FILE).read_text() == OWN_TEMPLATE and (step / GENERATION_TOKENS_FILE).is_file()

    # what the run trained on: each conversation as transformers renders and encodes it with the source's tokenizer
    samples = ChatSamples.load(next((run / "tokens").glob("train.data-*.chat.npz")))
    for i, chat in enumerate(CHATS):
        want = list(auto.apply_chat_template(chat, return_dict=False))
        assert samples.ids[samples.offsets[i]:samples.offsets[i + 1]].tolist() == want

    loaded = open_checkpoint(run)
    prompt = auto.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
    ids = list(auto.apply_chat_template(QUESTION, add_generation_prompt=True, return_dict=False))
    assert prompt.startswith("<s><<SYS>>") and chat_prompt(loaded.tokenizer, QUESTION) == prompt
    assert loaded.stop_ids == tuple(OWN_STOPS) and loaded.tokenizer.eos_id == 1

    with serving([f"checkpoint={run}"], tmp_path / "serve.log") as (_, url):
        info = get(f"{url}/tokenizer_info")
        assert (info["eos_token"], info["bos_token"], info["pad_token"], info["chat_template"]) == (
            "</s>", "<s>", "<pad>", OWN_TEMPLATE)
        assert post(f"{url}/tokenize", {"messages": QUESTION})["tokens"] == ids
        for stop in OWN_STOPS:  # the model made to say a stop token first: the answer ends there
            body = {"messages": QUESTION, "max_tokens": 6, "temperature": 0, "logit_bias": {str(stop): 100}}
            choice = post(f"{url}/v1/chat/completions", body)
            assert choice["choices"][0]["finish_reason"] == "stop", choice
            assert (choice["usage"]["prompt_tokens"], choice["usage"]["completion_tokens"]) == (len(ids), 1)
        free = post(f"{url}/v1/chat/completions", {"messages": QUESTION, "max_tokens": 6, "temperature": 0,
                                                     "logit_bias": {"1": -100, "3": -100}})
        assert free["choices"][0]["finish_reason"] == "length"

    hf = tmp_path / "hf"
    done = run_moesys("export", f"checkpoint={run}", f"out={hf}", "export.format=hf")
    assert done.returncode == 0, done.stderr[-2000:]
    exported = transformers.AutoTokenizer.from_pretrained(str(hf))
    assert exported.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True) == prompt
    for chat in CHATS:
        assert exported.apply_chat_template(chat, tokenize=False) == auto.apply_chat_template(chat, tokenize=False)
    assert (exported.eos_token, exported.bos_token, exported.pad_token) == ("</s>", "<s>", "<pad>")
    assert transformers.GenerationConfig.from_pretrained(str(hf)).eos_token_id == OWN_STOPS
    config = json.loads((hf / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (0, 1, 2)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32).eval()
    with torch.no_grad():  # transformers' generate on the export ends at the source's stop ids too
        out = model.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False,
                             sequence_bias={(3,): 100.0})[0, len(ids):].tolist()
    assert out == [3]

    moesys_export = tmp_path / "moesys"
    done = run_moesys("export", f"checkpoint={run}", f"out={moesys_export}")
    assert done.returncode == 0, done.stderr[-2000:]
    again = open_checkpoint(moesys_export)
    assert chat_prompt(again.tokenizer, QUESTION) == prompt and again.stop_ids == tuple(OWN_STOPS)


@pytest.mark.extended
def test_a_text_fine_tune_keeps_the_template_and_stops_too(source, auto, tmp_path):
    data = tmp_path / "text.txt"
    data.write_text("Sunny and warm. Hello there, how are you? I am fine.\n" * 40)
    run = tmp_path / "run"
    train(source, run, data)
    loaded = open_checkpoint(run)
    prompt = auto.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
    assert chat_prompt(loaded.tokenizer, QUESTION) == prompt and loaded.stop_ids == tuple(OWN_STOPS)
    assert loaded.tokenizer.eos_token == "</s>"
