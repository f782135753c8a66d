"""The shipped trained demo checkpoint (deltaserve/demo_model/) and the scripts that made it.

    - the shipped text, tokenizer and weights are the ones the scripts produce (text and tokenizer rebuilt
      here; the weights through the sha256 the training run recorded, and a short training run that must be
      bit-identical twice);
    - deltaserve serves it token for token as transformers runs it, its logits within the derived float32 bound;
    - a chat through the server with `--reasoning-parser qwen3` thinks, closes `</think>`, and answers in
      words of the training text.
"""

import hashlib
import importlib.util
import json
import re
from pathlib import Path

import pytest
import transformers

from deltaserve import LLM, SamplingParams, demo
from deltaserve.config import EngineConfig
from deltaserve.demo import CHAT_TEMPLATE, DEMO_MODEL_DIR, build_tokenizer, demo_model_path
from deltaserve.engine.llm_engine import LLMEngine
from deltaserve.server.api_server import make_state
from deltaserve.server.settings import ServerSettings
from tests.engine.test_engine import transformers_greedy
from tests.model.helpers import SequenceRunner, load_pair, model_bound
from tests.server.harness import ServerThread
from tests.tolerance import assert_within

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
# question -> a word its answer must contain (the shipped model answers these on topic)
TOPICAL = {"Tell me about the moon.": "moon", "What do you know about bees?": "bees", "Hello!": "hello",
           "Who are you?": "demo model"}
QUESTIONS = list(TOPICAL)
MAX_TOKENS = 160  # the longest learned turn is about 110 tokens


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def training_text() -> str:
    return (DEMO_MODEL_DIR / "training_text.txt").read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def training_words(training_text) -> set[str]:
    return set(re.findall(r"[A-Za-z]+", training_text))


@pytest.fixture(scope="module")
def llm():
    return LLM(max_num_seqs=4)  # no model: the demo checkpoint


def chat_prompt(tokenizer, question: str, thinking: bool = True) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                         add_generation_prompt=True, enable_thinking=thinking)


# ------------------------------------------------------------- what was shipped


def test_demo_model_path_is_the_shipped_checkpoint():
    path = demo_model_path()
    assert path == DEMO_MODEL_DIR
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5ForCausalLM"] and config["dtype"] == "bfloat16"
    assert {"linear_attention", "full_attention"} == set(config["layer_types"])
    assert 2e6 < (path / "model.safetensors").stat().st_size < 8e6


def test_demo_model_path_names_what_is_missing(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setattr(demo, "DEMO_MODEL_DIR", tmp_path)
    with pytest.raises(FileNotFoundError, match=r"lacks \['model.safetensors', 'tokenizer.json'\]"):
        demo.demo_model_path()


def test_shipped_text_is_what_the_generator_writes(training_text):
    assert load_script("demo_dialogues").training_text() == training_text


def test_shipped_tokenizer_is_the_one_trained_on_the_shipped_text(training_text):
    shipped = transformers.AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
    assert shipped.backend_tokenizer.to_str() == build_tokenizer(training_text).backend_tokenizer.to_str()
    assert shipped.chat_template == CHAT_TEMPLATE


def test_shipped_weights_are_the_recorded_training_run(training_text):
    record = json.loads((DEMO_MODEL_DIR / "training.json").read_text())
    train_demo = load_script("train_demo")
    assert record["model_sha256"] == hashlib.sha256((DEMO_MODEL_DIR / "model.safetensors").read_bytes()).hexdigest()
    assert record["text_sha256"] == hashlib.sha256(training_text.encode()).hexdigest()
    assert (record["seed"], record["threads"], record["steps"]) == (train_demo.SEED, train_demo.THREADS,
                                                                    train_demo.STEPS)


def test_a_short_training_run_is_bit_identical_twice(training_text, tmp_path):
    train_demo = load_script("train_demo")
    runs = {}
    for name, steps in [("a", 2), ("b", 2), ("shorter", 1)]:
        runs[name] = train_demo.train(training_text, tmp_path / name, steps=steps, batch_size=4, log_every=0)
    assert runs["a"]["model_sha256"] == runs["b"]["model_sha256"]
    assert runs["a"]["model_sha256"] != runs["shorter"]["model_sha256"]  # the steps do change the weights


# ------------------------------------------------------------- how it is served


def test_engine_greedy_equals_transformers_on_the_demo_model(llm):
    tokenizer = llm.get_tokenizer()
    prompts = [tokenizer.encode(chat_prompt(tokenizer, q)) for q in QUESTIONS[:2]]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for prompt, output in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
        ours = output.outputs[0].token_ids
        ref, gaps, ties = transformers_greedy(DEMO_MODEL_DIR, prompt, params.max_tokens)
        if ours != ref:  # allowed only at a near tie of transformers' own logits (within float32 rounding)
            i = next(i for i, (a, b) in enumerate(zip(ours, ref)) if a != b)
            assert gaps[i] < ties[i], f"diverged from transformers at step {i} (top-2 gap {gaps[i]:.3g})"


def test_greedy_chat_closes_its_thinking_and_stops(llm):
    tokenizer = llm.get_tokenizer()
    end_think = tokenizer.convert_tokens_to_ids("</think>")
    prompts = [chat_prompt(tokenizer, q) for q in QUESTIONS]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    for question, output in zip(QUESTIONS, outputs):
        completion = output.outputs[0]
        assert completion.token_ids.count(end_think) == 1, (question, completion.text)
        assert completion.finish_reason == "stop", (question, completion.text)


@pytest.fixture(scope="module")
def demo_server():
    config = EngineConfig(max_num_seqs=4)  # no model: the demo checkpoint, as `deltaserve serve` alone
    settings = ServerSettings(served_model_names=("demo",), reasoning_parser="qwen3")
    with ServerThread(make_state(LLMEngine(config), config, settings)) as running:
        yield running


@pytest.mark.parametrize("question", QUESTIONS)
def test_chat_with_the_qwen3_reasoning_parser_answers_in_words(demo_server, training_words, question):
    reply = demo_server.openai().chat.completions.create(
        model="demo", messages=[{"role": "user", "content": question}], temperature=0, max_tokens=MAX_TOKENS)
    choice = reply.choices[0]
    reasoning = choice.message.model_extra["reasoning"]
    content = choice.message.content
    assert choice.finish_reason == "stop"
    assert reasoning and "</think>" not in reasoning  # the thinking ended: the parser split it off
    words = re.findall(r"[A-Za-z]+", content or "")
    assert len(words) >= 3, content
    assert set(words) <= training_words, sorted(set(words) - training_words)
    assert TOPICAL[question] in content.lower(), content


def test_chat_with_thinking_off_answers_without_reasoning(demo_server, training_words):
    reply = demo_server.openai().chat.completions.create(
        model="demo", messages=[{"role": "user", "content": "Tell me about trains."}], temperature=0,
        max_tokens=MAX_TOKENS, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    choice = reply.choices[0]
    assert choice.finish_reason == "stop" and not choice.message.model_extra.get("reasoning")
    words = re.findall(r"[A-Za-z]+", choice.message.content)
    assert len(words) >= 3 and set(words) <= training_words, choice.message.content
    assert "train" in choice.message.content.lower(), choice.message.content


def test_demo_model_logits_match_transformers():
    """Greedy agreement misses a wrong scale that keeps the argmax: the float32 logits of the shipped model on
    chat prompts, against transformers' in float64, within the derived bound (tests/model/helpers.model_bound)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
    ours, reference = load_pair(DEMO_MODEL_DIR)
    runner = SequenceRunner(ours)
    for slot, question in enumerate(QUESTIONS[:3], start=1):
        ids = tokenizer.encode(chat_prompt(tokenizer, question))
        runner.add(slot)
        truth = reference.logits(ids)
        bound = model_bound(ours.config, len(ids), truth.abs().max().item())
        assert_within(runner.step({slot: ids})[slot], truth, bound, f"demo logits for {question!r}")
