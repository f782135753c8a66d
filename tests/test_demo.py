"""The demo tokenizer, its chat template, and the tiny random checkpoints (deltaserve/demo.py).

The shipped trained demo checkpoint is tested in test_demo_model.py."""

import json

import jinja2
import pytest
import torch
import transformers
from safetensors import safe_open

from deltaserve.demo import (
    ADDED_TOKENS,
    EOS_TOKEN_ID,
    PAD_TOKEN_ID,
    TINY_CONFIGS,
    VOCAB_SIZE,
    build_checkpoint,
    build_tokenizer,
)

EXPECTED_CLASS = {
    "qwen3_5": "Qwen3_5ForCausalLM",
    "qwen3_5_tied": "Qwen3_5ForCausalLM",
    "qwen3_5_moe": "Qwen3_5MoeForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
}


# ---------------------------------------------------------------- tokenizer


@pytest.mark.parametrize(
    "text",
    [
        "Le café est très bon à Paris.",
        "東京は日本の首都です。我们今天学习。",
        "Emoji 🙂🚀✅ and ❤️ — symbols € ≤ ∞",
        "def f(x):\n\treturn x * 2  # two spaces\n\n\n   trailing   ",
        "never seen: Ꙩ ᚠᛇᚻ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    ],
)
def test_tokenizer_round_trips_multibyte_text(tokenizer, text):
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert max(ids) < VOCAB_SIZE - len(ADDED_TOKENS)  # plain text never turns into an added token


def test_tokenizer_merges_common_words(tokenizer):
    # A trained BPE, not a bare byte alphabet: frequent corpus words are single tokens.
    assert tokenizer.tokenize("The scheduler") == ["The", "Ġscheduler"]


def test_tokenizer_vocab_and_special_tokens(tokenizer):
    assert len(tokenizer) == VOCAB_SIZE
    for arch, kwargs in TINY_CONFIGS.items():
        assert kwargs["vocab_size"] == len(tokenizer), arch
        assert kwargs["eos_token_id"] == EOS_TOKEN_ID, arch
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == EOS_TOKEN_ID
    assert tokenizer.pad_token == "<|endoftext|>" and tokenizer.pad_token_id == PAD_TOKEN_ID
    for content, _ in ADDED_TOKENS:
        assert len(tokenizer.encode(content)) == 1, content
    text = "<|im_start|>assistant\n<think>\nhm\n</think>\n\n<tool_call>\nx\n</tool_call><|im_end|>"
    ids = tokenizer.encode(text)
    # Only the ChatML markers are special; think/tool markers stay in the text for the parsers.
    assert tokenizer.decode(ids, skip_special_tokens=True) == (
        "assistant\n<think>\nhm\n</think>\n\n<tool_call>\nx\n</tool_call>"
    )


def test_tokenizer_is_deterministic(tokenizer):
    assert build_tokenizer().backend_tokenizer.to_str() == tokenizer.backend_tokenizer.to_str()


# ------------------------------------------------------------ chat template


def render(tokenizer, messages, **kwargs):
    return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)


def test_chat_template_roles_and_generation_prompt(tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "<think>greet back</think>\n\nHello!"},
        {"role": "user", "content": [{"type": "text", "text": "Again"}]},
    ]
    history = (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"  # reasoning of an earlier turn is dropped
        "<|im_start|>user\nAgain<|im_end|>\n"
    )
    assert render(tokenizer, messages) == history
    assert render(tokenizer, messages, add_generation_prompt=True) == history + "<|im_start|>assistant\n<think>\n"
    assert (
        render(tokenizer, messages, add_generation_prompt=True, enable_thinking=False)
        == history + "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )


def test_chat_template_tools_and_tool_calls(tokenizer):
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather for a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and Oslo?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "reasoning_content": "Two cities.",
            "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                {"function": {"name": "get_weather", "arguments": {"city": "Oslo", "days": [1, 2]}}},
            ],
        },
        {"role": "tool", "content": "sunny"},
        {"role": "tool", "content": "rain"},
    ]
    text = render(tokenizer, messages, tools=tools, add_generation_prompt=True)
    system, rest = text.split("<|im_end|>\n", 1)
    assert system.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert json.dumps(tools[0]["function"]) in system
    call_format = "<tool_call>\n<function=NAME>\n<parameter=PARAMETER_NAME>\nVALUE\n</parameter>\n</function>\n</tool_call>"
    assert call_format in system
    assert rest == (
        "<|im_start|>user\nWeather in Paris and Oslo?<|im_end|>\n"
        # after the last user message (the current tool round) the reasoning is kept
        "<|im_start|>assistant\n<think>\nTwo cities.\n</think>\n\nChecking.\n\n"
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>\n"
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
        "<parameter=days>\n[1, 2]\n</parameter>\n</function>\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n"
        "<tool_response>\nrain\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\n"
    )


def test_chat_template_without_tools_has_no_tool_prompt(tokenizer):
    text = render(tokenizer, [{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"


@pytest.mark.parametrize(
    "messages, error",
    [
        ([{"role": "user", "content": "a"}, {"role": "system", "content": "late"}], "only allowed first"),
        ([{"role": "robot", "content": "a"}], "robot"),
        (
            [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": '{"a": 1}'}}]}],
            "must be a mapping",
        ),
    ],
)
def test_chat_template_rejects_bad_messages(tokenizer, messages, error):
    with pytest.raises(jinja2.exceptions.TemplateError, match=error):
        render(tokenizer, messages)


# -------------------------------------------------------------- checkpoints


@pytest.mark.parametrize("arch", sorted(TINY_CONFIGS))
def test_checkpoint_loads_and_is_not_degenerate(arch, make_checkpoint, tokenizer):
    tiny_checkpoint = make_checkpoint(arch)
    config = json.loads((tiny_checkpoint / "config.json").read_text())
    assert config["architectures"] == [EXPECTED_CLASS[arch]]
    assert config["vocab_size"] == len(tokenizer) and config["eos_token_id"] == EOS_TOKEN_ID
    assert {"linear_attention", "full_attention"} == set(config["layer_types"])
    generation = json.loads((tiny_checkpoint / "generation_config.json").read_text())
    assert EOS_TOKEN_ID in generation["eos_token_id"]

    loaded_tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_checkpoint)
    assert loaded_tokenizer.eos_token_id == EOS_TOKEN_ID
    assert loaded_tokenizer.chat_template == tokenizer.chat_template
    prompt = "The scheduler decides which requests run."
    assert loaded_tokenizer.encode(prompt) == tokenizer.encode(prompt)

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_checkpoint)
    assert type(model).__name__ == EXPECTED_CLASS[arch]
    input_ids = torch.tensor([tokenizer.encode(prompt)])
    with torch.no_grad():
        logits = model(input_ids).logits  # [1, T, V]
        output = model.generate(input_ids, max_new_tokens=12, do_sample=False, eos_token_id=None)
    assert torch.isfinite(logits).all()
    assert logits[0, -1].std() > 0.5  # spread, not the near-uniform logits of transformers' default init
    new_tokens = output[0, input_ids.shape[1] :].tolist()
    assert len(set(new_tokens)) >= 4, new_tokens


def test_tied_variant_has_no_lm_head_tensor(make_checkpoint):
    with safe_open(make_checkpoint("qwen3_5_tied") / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names


def test_same_seed_same_weights_other_seed_differs(make_checkpoint, tmp_path):
    again = build_checkpoint(tmp_path / "again", "qwen3_5", seed=0)
    other = build_checkpoint(tmp_path / "other", "qwen3_5", seed=1)
    name = "model.layers.0.linear_attn.in_proj_qkv.weight"
    tensors = []
    for path in (make_checkpoint("qwen3_5"), again, other):
        with safe_open(path / "model.safetensors", "pt") as f:
            tensors.append(f.get_tensor(name))
    assert torch.equal(tensors[0], tensors[1])
    assert not torch.equal(tensors[0], tensors[2])


def test_sharded_bf16_checkpoint(make_checkpoint, tmp_path):
    path = build_checkpoint(tmp_path, "qwen3_5", dtype=torch.bfloat16, max_shard_size="20KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and not (path / "model.safetensors").exists()
    dtypes = {}
    for shard in shards:
        with safe_open(path / shard, "pt") as f:
            dtypes.update({name: f.get_slice(name).get_dtype() for name in f.keys()})
    assert set(dtypes) == set(index["weight_map"])
    assert {d for n, d in dtypes.items() if n.endswith("A_log")} == {"F32"}  # as in the releases
    assert {d for n, d in dtypes.items() if not n.endswith("A_log")} == {"BF16"}
    # Same seed: the sharded bf16 weights are the float32 ones rounded.
    name = "model.layers.3.self_attn.q_proj.weight"
    with safe_open(path / index["weight_map"][name], "pt") as f:
        sharded = f.get_tensor(name)
    with safe_open(make_checkpoint("qwen3_5") / "model.safetensors", "pt") as f:
        assert torch.equal(sharded, f.get_tensor(name).to(torch.bfloat16))


def test_build_checkpoint_rejects_unknown_arch(tmp_path):
    with pytest.raises(ValueError, match="arch='llama'"):
        build_checkpoint(tmp_path, "llama")
