"""Prompt sets for `deltaserve bench serve`, with vLLM's `vllm bench serve` meanings.

- random: prompts of exactly N tokens (random text, see randtext.py), N uniform in
  [floor(len*(1-r)), ceil(len*(1+r))] for --random-range-ratio r (0 = fixed); the same for the output length
  (at least 1). --random-prefix-len tokens of one shared random prefix go before every prompt.
- prefix_repetition: --prefix-repetition-num-prefixes random prefixes, each followed by random suffixes; every
  prompt is prefix + suffix with exactly prefix_len + suffix_len tokens, the prefix's tokens identical in
  each, prompts shuffled (built in token space for any tokenizer: randtext.py).
- sharegpt: a local ShareGPT JSON file (first human turn = prompt, first reply = output length unless
  --sharegpt-output-len), filtered like vLLM (prompt >= 4 tokens, output >= 4, prompt <= 1024, sum <= 2048).
- custom: a JSONL file with a "prompt" field per line; output length --custom-output-len.
sharegpt and custom repeat random picks when the file has fewer usable prompts than --num-prompts (vLLM's
oversampling). The multi-turn set lives in multi_turn.py.
"""

import json
import math
import os
import random
from dataclasses import dataclass

import numpy as np

from deltaserve.bench.errors import BenchInputError
from deltaserve.bench.randtext import RandomTextGenerator

DATASET_NAMES = ("random", "prefix_repetition", "sharegpt", "custom", "multi_turn")


@dataclass
class SampleRequest:
    """One benchmark request: the prompt text, its token count and the max_tokens to ask for."""

    prompt: str
    prompt_len: int
    expected_output_len: int


def length_range(length: int, range_ratio: float, minimum: int = 0) -> tuple[int, int]:
    """vLLM's inclusive range [floor(len*(1-r)), ceil(len*(1+r))], each end at least `minimum`."""
    low = max(math.floor(length * (1 - range_ratio)), minimum)
    high = max(math.ceil(length * (1 + range_ratio)), minimum)
    return low, high


def sample_random(
    gen: RandomTextGenerator,
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    prefix_len: int,
) -> list[SampleRequest]:
    """The random dataset: shared prefix (prefix_len tokens) + a random body of a sampled length."""
    input_low, input_high = length_range(input_len, range_ratio)
    output_low, output_high = length_range(output_len, range_ratio, minimum=1)
    if prefix_len + input_low < 1:
        raise BenchInputError(
            f"--random-input-len {input_len} with --random-range-ratio {range_ratio} and --random-prefix-len "
            f"{prefix_len} allows prompts of 0 tokens; every prompt needs at least 1"
        )
    input_lens = gen.rng.integers(input_low, input_high + 1, size=num_prompts)
    output_lens = gen.rng.integers(output_low, output_high + 1, size=num_prompts)
    prefix = gen.prefix(prefix_len)
    requests = []
    for body_len, out_len in zip(input_lens.tolist(), output_lens.tolist()):
        requests.append(SampleRequest(gen.extend(prefix, body_len), prefix_len + body_len, out_len))
    return requests


def sample_prefix_repetition(
    gen: RandomTextGenerator,
    num_prompts: int,
    prefix_len: int,
    suffix_len: int,
    num_prefixes: int,
    output_len: int,
) -> list[SampleRequest]:
    """num_prompts prompts spread evenly over num_prefixes shared prefixes, then shuffled.

    vLLM makes num_prompts // num_prefixes prompts per prefix and drops the remainder; here the first
    (num_prompts % num_prefixes) prefixes get one prompt more, so exactly num_prompts requests are sent.
    """
    if num_prompts < num_prefixes:
        raise BenchInputError(
            f"--num-prompts {num_prompts} is smaller than --prefix-repetition-num-prefixes {num_prefixes}; "
            "every prefix needs at least one prompt"
        )
    if prefix_len + suffix_len < 1:
        raise BenchInputError("--prefix-repetition-prefix-len + --prefix-repetition-suffix-len must be >= 1")
    per_prefix, extra = divmod(num_prompts, num_prefixes)
    requests = []
    for prefix_index in range(num_prefixes):
        prefix = gen.prefix(prefix_len)
        for _ in range(per_prefix + (prefix_index < extra)):
            requests.append(SampleRequest(gen.extend(prefix, suffix_len), prefix_len + suffix_len, output_len))
    order = gen.rng.permutation(len(requests))
    return [requests[i] for i in order]


def sample_sharegpt(
    path: str, tokenizer, num_prompts: int, output_len: int | None, seed: int
) -> list[SampleRequest]:
    """First human turn of each ShareGPT conversation; output length from the reply unless fixed."""
    entries = _read_json(path, "--dataset-path")
    if not isinstance(entries, list):
        raise BenchInputError(f"--dataset-path {path}: a ShareGPT file holds a JSON list of conversations")
    conversations = [
        entry["conversations"] for entry in entries
        if isinstance(entry, dict) and len(entry.get("conversations", [])) >= 2
    ]
    random.Random(seed).shuffle(conversations)
    requests = []
    for turns in conversations:
        if len(requests) == num_prompts:
            break
        if not all(isinstance(turn, dict) and isinstance(turn.get("value"), str) for turn in turns[:2]):
            continue
        prompt, reply = turns[0]["value"], turns[1]["value"]
        prompt_len = len(tokenizer(prompt).input_ids)
        out_len = len(tokenizer(reply).input_ids) if output_len is None else output_len
        if _keep_sharegpt_pair(prompt_len, out_len, check_output=output_len is None):
            requests.append(SampleRequest(prompt, prompt_len, out_len))
    return _oversample(requests, num_prompts, seed, path)


def sample_custom(
    path: str, tokenizer, num_prompts: int, output_len: int, apply_chat_template: bool, seed: int
) -> list[SampleRequest]:
    """JSONL lines with a "prompt" field, shuffled; optionally wrapped in the tokenizer's chat template."""
    if not os.path.isfile(path):
        raise BenchInputError(f"--dataset-path {path}: no such file")
    prompts = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise BenchInputError(f"--dataset-path {path} line {line_no}: not JSON ({e})") from None
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                raise BenchInputError(f"--dataset-path {path} line {line_no}: needs a string \"prompt\" field")
            prompts.append(row["prompt"])
    random.Random(seed).shuffle(prompts)
    if apply_chat_template and prompts and not tokenizer.chat_template:
        raise BenchInputError(
            "the tokenizer has no chat template to wrap custom prompts in; pass --skip-chat-template"
        )
    requests = []
    for prompt in prompts[:num_prompts]:
        if apply_chat_template:
            prompt = tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
            )
        requests.append(SampleRequest(prompt, len(tokenizer(prompt).input_ids), output_len))
    return _oversample(requests, num_prompts, seed, path)


def _keep_sharegpt_pair(prompt_len: int, output_len: int, check_output: bool) -> bool:
    """vLLM's ShareGPT filter: min 4 tokens each, prompt <= 1024, prompt + output <= 2048."""
    too_short = prompt_len < 4 or (check_output and output_len < 4)
    return not too_short and prompt_len <= 1024 and prompt_len + output_len <= 2048


def _oversample(requests: list[SampleRequest], num_prompts: int, seed: int, path: str) -> list[SampleRequest]:
    """Pad to num_prompts with random repeats, as vLLM does when a file has too few usable prompts."""
    if not requests:
        raise BenchInputError(f"--dataset-path {path}: no usable prompt in the file")
    missing = num_prompts - len(requests)
    if missing > 0:
        picks = np.random.default_rng(seed).integers(0, len(requests), size=missing)
        requests = requests + [requests[i] for i in picks.tolist()]
    return requests


def _read_json(path: str, flag: str):
    if not os.path.isfile(path):
        raise BenchInputError(f"{flag} {path}: no such file")
    with open(path, encoding="utf-8") as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise BenchInputError(f"{flag} {path}: not valid JSON ({e})") from None
