"""The demo models: the shipped trained demo checkpoint, and tiny random checkpoints made offline for the tests.

`deltaserve serve` with no MODEL argument (and `LLM()`) serves `demo_model_path()`: the checkpoint in
deltaserve/demo_model/, a 2 M-parameter Qwen3.5-shaped model (4 MB in bfloat16) trained on the CPU by
scripts/train_demo.py on the toy dialogues shipped beside it (training_text.txt, written by
scripts/demo_dialogues.py). It answers simple chat questions in words and closes its thinking, and it knows
nothing beyond those few dozen topics.

The tests use the builders here (`build_tokenizer`, `build_checkpoint`) to get random checkpoints of all three
architectures without a download:

    tokenizer   byte-level BPE (the scheme Qwen uses) trained in well under a second on `_CORPUS` (the
                demo model's on its dialogues), about 1,000 tokens, Qwen's special tokens appended after the
                learned vocabulary, and a ChatML chat template in the spirit of Qwen3.5's (thinking switch,
                tools in the qwen3_coder XML format).
    weights     transformers' own Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM / Qwen3NextForCausalLM with the
                shapes in `TINY_CONFIGS`, re-initialised so that logits have spread (see `_randomize_weights`),
                written with `save_pretrained` (safetensors, optionally sharded).

Random weights talk gibberish, but every code path (both layer types, GQA, partial RoPE, MoE routing, the chat
template) runs exactly as it would for the real models, which is what the parity tests need.
"""

import os
from pathlib import Path

import torch
import transformers
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

# The shipped trained demo checkpoint (scripts/train_demo.py writes it).
DEMO_MODEL_DIR = Path(__file__).with_name("demo_model")

# Target size of the whole vocabulary: learned BPE tokens plus the added tokens below.
VOCAB_SIZE = 1024

# (content, special). Special tokens are dropped by decode(skip_special_tokens=True); the think and tool
# markers are ordinary added tokens, as in Qwen's tokenizer, so they survive into the decoded text where
# the reasoning and tool-call parsers look for them.
ADDED_TOKENS = [
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<think>", False),
    ("</think>", False),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
]
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"

# Qwen2's pre-tokenization split: contractions, words with one leading non-letter, single digits,
# punctuation runs, newlines, and whitespace that does not swallow the space before the next word.
_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_CORPUS = '''\
The small model in this file has never read a book. Its weights are drawn at random, so it answers every
question with a confident stream of nonsense. That is exactly what a test needs: the numbers are real, the
shapes are real, and the code that moves them around is the same code that serves a model with billions
of parameters. When the outputs of two paths agree token for token on a random model, they agree because
the arithmetic is the same, not because the model happens to be predictable.

A serving engine spends most of its life waiting for memory. Each decoding step reads every weight once,
and for a hybrid model it also reads the recurrent state of every linear-attention layer. The state does
not grow with the length of the conversation, which is the whole point of linear attention, but it is
large, and it must be copied whenever a prefix is cached. The scheduler decides which requests run, the
block pool hands out pages of the key-value cache, and the state pool hands out slots for the recurrent
state. Nothing else is allowed to touch the device while a step is in flight.

Once upon a time, a traveller walked from the mountains to the sea. She carried bread, a notebook and a
small brass compass that always pointed a little to the east of north. In the evening she wrote down the
names of the villages she had passed, the rivers she had crossed and the people who had shared their
supper with her. "Where are you going?" asked an old man at the harbour. "Somewhere I have not been yet,"
she said, and he laughed, because that was the only answer he had ever heard from travellers.

def greedy_decode(model, prompt_ids, max_new_tokens=16):
    """Return the prompt followed by the tokens the model likes best."""
    ids = list(prompt_ids)
    for _ in range(max_new_tokens):
        logits = model(torch.tensor([ids])).logits[0, -1]
        next_id = int(logits.argmax())
        ids.append(next_id)
        if next_id == model.config.eos_token_id:
            break
    return ids


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int = 16):
        self.block_size = block_size
        self.free_blocks = list(range(num_blocks))
        self.ref_counts = [0] * num_blocks

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free_blocks):
            raise ValueError(f"need {n} blocks, only {len(self.free_blocks)} free")
        taken, self.free_blocks = self.free_blocks[:n], self.free_blocks[n:]
        for block_id in taken:
            self.ref_counts[block_id] += 1
        return taken

{"model": "demo", "messages": [{"role": "user", "content": "What is 2 + 2?"}], "max_tokens": 32}
{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}, "id": "call_0123456789"}

function add(a, b) { return a + b; }
const total = [1, 2, 3, 4].reduce((sum, x) => sum + x, 0);
SELECT name, count(*) FROM requests WHERE status = 'finished' GROUP BY name ORDER BY 2 DESC;

Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 256 1024 4096 65536 3.14159 2.71828 -1 +1 1e-6 0.25 99%.
Dates and times: 2024-05-17, 12:30, Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday.

Le café est très bon à Paris, où l'été est long et les élèves étudient dehors. Über die Brücke gehen
Müller und Schröder jeden Morgen zur Bäckerei. El niño comió una manzana en la mañana fría de otoño.
Москва и Санкт-Петербург — большие города. 東京は日本の首都です。我们今天学习机器学习和语言模型。
Ελληνικά γράμματα: α β γ δ ε λ μ π σ ω. Emoji: 🙂 🚀 ✅ ❤️ — and symbols: € £ ¥ © ° ± × ÷ → ≤ ≥ ∞.

Q: Why does the recurrent state need float32?
A: Because it accumulates thousands of small updates, and bfloat16 keeps only eight bits of mantissa,
so the rounding error of each update would pile up until the state forgets what it has seen.

Q: What happens when the cache is full?
A: The scheduler preempts the request that arrived last, frees its blocks and its state slot, and puts
it back at the front of the waiting queue. When memory frees up again, it is recomputed from its tokens.

The assistant thinks before it answers. It may call a tool, read the response, and then reply to the
user in plain words. A good answer is short, correct and kind; a bad answer is long, wrong and proud.
'''

# ChatML in the spirit of Qwen3.5's template. Tool calls use the qwen3_coder XML form. Each
# tool_call.function.arguments must be a mapping (OpenAI clients send a JSON string: parse it first).
# Reasoning of assistant turns is kept only after the last real user message (the current tool-calling
# round), as Qwen3.5 does; older turns are rendered without it.
CHAT_TEMPLATE = """\
{%- macro render_content(content) -%}
    {%- if content is none -%}
    {%- elif content is string -%}{{- content -}}
    {%- else -%}
        {%- for part in content -%}
            {%- if part.type == 'text' -%}{{- part.text -}}
            {%- else -%}{{- raise_exception('Unsupported content part type: ' ~ part.type) -}}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- if not messages -%}{{- raise_exception('messages must not be empty') -}}{%- endif -%}
{%- set has_system = messages[0].role == 'system' -%}
{%- if tools -%}
    {{- '<|im_start|>system\\n' -}}
    {%- if has_system -%}{{- render_content(messages[0].content) ~ '\\n\\n' -}}{%- endif -%}
    {{- '# Tools\\n\\nYou can call the following functions:\\n\\n<tools>' -}}
    {%- for tool in tools -%}
        {{- '\\n' ~ (tool.function if tool.function is defined else tool) | tojson -}}
    {%- endfor -%}
    {{- '\\n</tools>\\n\\nTo call a function, reply with exactly this form and nothing after it:\\n\\n'
        '<tool_call>\\n<function=NAME>\\n<parameter=PARAMETER_NAME>\\nVALUE\\n</parameter>\\n'
        '</function>\\n</tool_call>\\n\\n'
        'Give every required parameter. A value may span several lines. '
        'You may explain your reasoning before a call, never after it.<|im_end|>\\n' -}}
{%- elif has_system -%}
    {{- '<|im_start|>system\\n' ~ render_content(messages[0].content) ~ '<|im_end|>\\n' -}}
{%- endif -%}
{%- set ns = namespace(last_user=-1) -%}
{%- for message in messages -%}
    {%- if message.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}
{%- endfor -%}
{%- for message in messages -%}
    {%- set content = render_content(message.content) -%}
    {%- if message.role == 'system' -%}
        {%- if not loop.first -%}{{- raise_exception('A system message is only allowed first') -}}{%- endif -%}
    {%- elif message.role == 'user' -%}
        {{- '<|im_start|>user\\n' ~ content ~ '<|im_end|>\\n' -}}
    {%- elif message.role == 'assistant' -%}
        {%- set reasoning = message.reasoning_content if message.reasoning_content is string else '' -%}
        {%- if '</think>' in content -%}
            {%- set reasoning = content.split('</think>')[0].split('<think>')[-1] -%}
            {%- set content = content.split('</think>')[-1] -%}
        {%- endif -%}
        {%- set reasoning = reasoning.strip('\\n') -%}
        {%- set content = content.lstrip('\\n') -%}
        {{- '<|im_start|>assistant\\n' -}}
        {%- if loop.index0 > ns.last_user -%}{{- '<think>\\n' ~ reasoning ~ '\\n</think>\\n\\n' -}}{%- endif -%}
        {{- content -}}
        {%- for call in message.tool_calls or [] -%}
            {%- set call = call.function if call.function is defined else call -%}
            {%- if call.arguments is defined and call.arguments is not mapping -%}
                {{- raise_exception('tool_calls[].function.arguments must be a mapping, got: ' ~ call.arguments) -}}
            {%- endif -%}
            {%- if not loop.first or content.strip() -%}{{- '\\n\\n' if loop.first else '\\n' -}}{%- endif -%}
            {{- '<tool_call>\\n<function=' ~ call.name ~ '>\\n' -}}
            {%- for name, value in (call.arguments or {}).items() -%}
                {%- if value is mapping or (value is iterable and value is not string) -%}
                    {%- set value = value | tojson -%}
                {%- endif -%}
                {{- '<parameter=' ~ name ~ '>\\n' ~ value ~ '\\n</parameter>\\n' -}}
            {%- endfor -%}
            {{- '</function>\\n</tool_call>' -}}
        {%- endfor -%}
        {{- '<|im_end|>\\n' -}}
    {%- elif message.role == 'tool' -%}
        {%- if loop.first or loop.previtem.role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
        {{- '\\n<tool_response>\\n' ~ content ~ '\\n</tool_response>' -}}
        {%- if loop.last or loop.nextitem.role != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}
    {%- else -%}
        {{- raise_exception('Unexpected message role: ' ~ message.role) -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\\n' -}}
    {%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\\n\\n</think>\\n\\n' -}}
    {%- else -%}{{- '<think>\\n' -}}
    {%- endif -%}
{%- endif -%}
"""

_LEARNED_VOCAB = VOCAB_SIZE - len(ADDED_TOKENS)
# Added tokens sit right after the learned vocabulary, in ADDED_TOKENS order (as in Qwen's tokenizer).
_ADDED_IDS = {content: _LEARNED_VOCAB + i for i, (content, _) in enumerate(ADDED_TOKENS)}
EOS_TOKEN_ID = _ADDED_IDS[EOS_TOKEN]
PAD_TOKEN_ID = _ADDED_IDS[PAD_TOKEN]
MAX_POSITIONS = 4096


def build_tokenizer(corpus: str = _CORPUS) -> transformers.PreTrainedTokenizerFast:
    """Train the demo byte-level BPE tokenizer on `corpus` (deterministic, well under a second).

    The tests use the default `_CORPUS`; the trained demo model's tokenizer is trained on its dialogues
    (scripts/train_demo.py). The added tokens get their own ids, so they are cut out of the corpus first.
    """
    for content, _ in ADDED_TOKENS:
        corpus = corpus.replace(content, "\n")
    bpe = Tokenizer(models.BPE())
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    bpe.decoder = decoders.ByteLevel()
    bpe.post_processor = processors.ByteLevel(trim_offsets=False)
    # All 256 byte symbols are in the alphabet, so any text (any language, emoji) round-trips.
    trainer = trainers.BpeTrainer(
        vocab_size=_LEARNED_VOCAB,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(corpus.splitlines(keepends=True), trainer)
    if bpe.get_vocab_size() != _LEARNED_VOCAB:
        raise RuntimeError(
            f"demo corpus too small: BPE learned {bpe.get_vocab_size()} tokens, expected {_LEARNED_VOCAB}"
        )
    for content, special in ADDED_TOKENS:  # one at a time, so that ids follow ADDED_TOKENS order
        token = AddedToken(content, special=special, normalized=False)
        if special:
            bpe.add_special_tokens([token])
        else:
            bpe.add_tokens([token])
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        model_max_length=MAX_POSITIONS,
        clean_up_tokenization_spaces=False,  # decode must return exactly the text the tokens encode
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def qwen3_5_shape(**sizes) -> dict:
    """The config fields every model built here shares (the demo vocabulary and its special ids, 4 query / 2
    key-value heads, 2 key / 4 value heads in Gated DeltaNet, untied), with `sizes` (the layer sizes) added."""
    return dict(
        vocab_size=VOCAB_SIZE,
        num_attention_heads=4,
        num_key_value_heads=2,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_conv_kernel_dim=4,
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-6,
        eos_token_id=EOS_TOKEN_ID,
        pad_token_id=PAD_TOKEN_ID,
        bos_token_id=None,
        tie_word_embeddings=False,
        **sizes,
    )


# Shapes shared by all tiny models. Deliberately unequal sizes (hidden 48 != heads * head_dim 64,
# key head dim 16 != value head dim 32, 2 key heads shared by 4 value heads) so that a transposed or
# mixed-up dimension fails loudly instead of passing by coincidence. Full attention at every 4th layer
# and at the last one: two full-attention layers, four Gated DeltaNet layers.
_COMMON = qwen3_5_shape(
    hidden_size=48,
    num_hidden_layers=6,
    layer_types=["linear_attention"] * 3 + ["full_attention", "linear_attention", "full_attention"],
    head_dim=16,
    linear_key_head_dim=16,
    linear_value_head_dim=32,
)
# Rotary dim = head_dim * 0.25 = 4. Qwen3.5 carries the (interleaved M-RoPE) mrope keys as the real
# configs do; for text all three position rows are equal and it reduces to plain RoPE.
_QWEN3_5_ROPE = dict(
    rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25,
    mrope_interleaved=True, mrope_section=[1, 1, 0],
)
_MOE = dict(moe_intermediate_size=24, shared_expert_intermediate_size=32, num_experts_per_tok=2)

TINY_CONFIGS = {
    "qwen3_5": dict(_COMMON, intermediate_size=72, rope_parameters=_QWEN3_5_ROPE),
    "qwen3_5_tied": dict(
        _COMMON, intermediate_size=72, rope_parameters=_QWEN3_5_ROPE, tie_word_embeddings=True
    ),
    "qwen3_5_moe": dict(_COMMON, **_MOE, num_experts=6, rope_parameters=_QWEN3_5_ROPE),
    # intermediate_size only sizes dense layers listed in mlp_only_layers (none here, as in the release).
    "qwen3_next": dict(
        _COMMON, **_MOE, num_experts=5, intermediate_size=72, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[],
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25),
    ),
}

# arch -> (transformers config class, model class)
_CLASSES = {
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM"),
    "qwen3_5_tied": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM"),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM"),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM"),
}

_EMBED_STD = 0.5  # with tied weights this is also lm_head's std: logits std ~ 0.5 * sqrt(48) ~ 3.5
_MATRIX_GAIN = 1.5  # std = gain / sqrt(fan_in), ~0.2 at fan_in 48: outputs a bit larger than inputs
_NORM_STD = 0.1


def _randomize_weights(model: torch.nn.Module, seed: int, matrix_gain: float = _MATRIX_GAIN) -> None:
    """Replace transformers' init (std 0.02, norms at identity) with weights that give logits spread.

    With the default init every layer is nearly the identity and greedy decoding repeats one token, which
    would let a broken cache or a wrong position pass unnoticed. The GDN decay parameters (A_log, dt_bias)
    keep transformers' init, which already spans the realistic range.
    """
    generator = torch.Generator().manual_seed(seed)

    def normal_(tensor: torch.Tensor, mean: float, std: float) -> None:
        tensor.copy_(torch.randn(tensor.shape, generator=generator) * std + mean)

    with torch.no_grad():
        for module in model.modules():
            kind = type(module).__name__
            if kind.endswith("RMSNormGated"):  # plain weight: y = w * norm(x) * silu(z)
                normal_(module.weight, 1.0, _NORM_STD)
            elif kind.endswith("RMSNorm"):  # zero-centred weight: y = (1 + w) * norm(x)
                normal_(module.weight, 0.0, _NORM_STD)
        normal_(model.get_input_embeddings().weight, 0.0, _EMBED_STD)
        embedding = model.get_input_embeddings().weight
        for name, param in model.named_parameters():
            if param.dim() < 2 or param is embedding:
                continue
            # Every matrix here is applied as x @ W^T (Linear, conv taps, stacked experts, router),
            # so the last dimension is the fan-in.
            normal_(param, 0.0, matrix_gain / param.shape[-1] ** 0.5)


def build_checkpoint(
    path: str | os.PathLike,
    arch: str = "qwen3_5",
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    max_shard_size: str | int | None = None,
    matrix_gain: float = _MATRIX_GAIN,
    config_overrides: dict | None = None,
) -> Path:
    """Write a tiny random `arch` checkpoint (config, safetensors, tokenizer, generation config) to `path`.

    `A_log` stays float32 whatever `dtype` is, as in the released Qwen3.5 checkpoints. A small
    `max_shard_size` (e.g. "20KB") gives a sharded checkpoint with model.safetensors.index.json.
    `matrix_gain` sets the weight scale (std = gain / sqrt(fan_in)): the default makes the model chaotic
    (small differences grow, so cache bugs show); about 0.5 makes it tame (rounding stays small), for
    comparing precisions. `config_overrides` replaces fields of TINY_CONFIGS[arch] (other shapes, e.g. the
    multiples of 128 that quantized formats group by).
    """
    if arch not in TINY_CONFIGS:
        raise ValueError(f"arch={arch!r} is not one of {sorted(TINY_CONFIGS)}")
    config_name, model_name = _CLASSES[arch]
    config = getattr(transformers, config_name)(**dict(TINY_CONFIGS[arch], **(config_overrides or {})))
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config)
    _randomize_weights(model, seed, matrix_gain)
    for name, param in model.named_parameters():
        if not name.endswith("A_log"):
            param.data = param.data.to(dtype)
    model.config.dtype = dtype
    model.generation_config = transformers.GenerationConfig(
        # Qwen's instruct releases stop on either token.
        eos_token_id=[EOS_TOKEN_ID, PAD_TOKEN_ID],
        pad_token_id=PAD_TOKEN_ID,
    )

    path = Path(path)
    save_kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, **save_kwargs)
    build_tokenizer().save_pretrained(path)
    return path


def demo_model_path() -> Path:
    """Path of the built-in demo checkpoint: the trained one shipped in the package (`DEMO_MODEL_DIR`)."""
    missing = [name for name in ("config.json", "model.safetensors", "tokenizer.json")
               if not (DEMO_MODEL_DIR / name).is_file()]
    if missing:
        raise FileNotFoundError(f"the demo checkpoint at {DEMO_MODEL_DIR} lacks {missing}: install deltaserve "
                                "with its package data, or run scripts/train_demo.py to rebuild it")
    return DEMO_MODEL_DIR
