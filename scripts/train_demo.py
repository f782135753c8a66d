"""Train the built-in demo model on its shipped dialogues, on the CPU, and write the checkpoint deltaserve serves.

    python scripts/train_demo.py                      # writes deltaserve/demo_model/ (about 9 CPU-minutes, 1 thread)
    python scripts/train_demo.py --steps 20 --out /tmp/demo-check

Input: deltaserve/demo_model/training_text.txt (written by scripts/demo_dialogues.py). Output, in the layout
`deltaserve serve DIR` loads: config.json, model.safetensors (bfloat16, A_log float32 as in the releases),
generation_config.json, the tokenizer files, and training.json (the recipe, the loss, the wall time and the
weights' sha256).

The model is transformers' own Qwen3_5ForCausalLM with `DEMO_CONFIG`: the Qwen3.5 layout (Gated DeltaNet and
gated attention layers 3:1, GQA, partial interleaved M-RoPE) at 2 M parameters. The tokenizer is the demo
byte-level BPE trained on the same dialogues. Only the assistant's final turn is learned (the text after the
served generation prompt), so the model learns to think, close `</think>`, answer and stop.

Reproducible: fixed seeds, deterministic algorithms, one thread (`THREADS`), batches in an order drawn from
a seeded generator. The same torch build on the same kind of CPU gives the same bytes (training.json records
their sha256); another CPU or BLAS may round differently and train an equivalent model.

The weights ship in bfloat16: deltaserve serves a float32 checkpoint in bfloat16 on a GPU anyway, so bf16
weights make the CPU (which computes in float32 on these exact values) and the GPU serve the same model, at
half the file size. Training itself is float32.
"""

import argparse
import contextlib
import hashlib
import json
import math
import sys
import time
from pathlib import Path

import torch
import transformers

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from deltaserve.demo import (  # noqa: E402
    EOS_TOKEN, EOS_TOKEN_ID, PAD_TOKEN_ID, build_tokenizer, qwen3_5_shape,
)

DEMO_DIR = ROOT / "deltaserve" / "demo_model"
TEXT_PATH = DEMO_DIR / "training_text.txt"
SEPARATOR = "<|endoftext|>\n"
THINK_OFF = "<think>\n\n</think>\n\n"  # the template's generation prompt with thinking switched off

SEED = 0
THREADS = 1  # one thread: deterministic, and on a shared 2-core machine two threads stall each other
STEPS = 800
BATCH_SIZE = 16
BUCKET = 8  # batches whose dialogues are sorted by length together (see batch_order)
PEAK_LR = 3e-3
WARMUP_STEPS = 30
MIN_LR_RATIO = 0.05  # cosine decay from PEAK_LR down to this fraction of it
WEIGHT_DECAY = 0.01
GRAD_CLIP = 1.0

# Qwen3.5's layer pattern (three Gated DeltaNet layers, then one gated full-attention layer) twice.
# Rotary dim = head_dim * 0.25 = 8, so mrope_section covers 4 frequency pairs.
DEMO_CONFIG = qwen3_5_shape(
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=8,
    layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2,
    head_dim=32,
    linear_key_head_dim=32,
    linear_value_head_dim=32,
    rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25,
                         mrope_interleaved=True, mrope_section=[2, 1, 1]),
)


def split_dialogue(text: str) -> tuple[str, str]:
    """(served prompt, the assistant's final turn up to and including its end token) of one rendered dialogue."""
    head, sep, last_turn = text.rpartition("<|im_start|>assistant\n")
    if not sep or not last_turn.endswith(EOS_TOKEN + "\n"):
        raise ValueError(f"not a rendered dialogue ending with an assistant turn: {text[:80]!r}")
    generation_prompt = THINK_OFF if last_turn.startswith(THINK_OFF) else "<think>\n"
    prompt = head + sep + generation_prompt
    return prompt, last_turn[len(generation_prompt):-1]


def encode_dialogues(text: str, tokenizer) -> list[tuple[list[int], int]]:
    """Each dialogue as (token ids, number of prompt tokens): the prompt is tokenized on its own, as served."""
    examples = []
    for dialogue in text.split(SEPARATOR)[:-1]:
        prompt, turn = split_dialogue(dialogue)
        prompt_ids = tokenizer.encode(prompt)
        examples.append((prompt_ids + tokenizer.encode(turn), len(prompt_ids)))
    return examples


def make_batch(examples: list[tuple[list[int], int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded input ids and labels [B, T]; labels are -100 on the prompt and the padding.

    No attention mask is needed: padding comes after every real token, and both layer types are causal.
    """
    length = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), length), PAD_TOKEN_ID)
    labels = torch.full((len(examples), length), -100)
    for row, (ids, num_prompt) in enumerate(examples):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        labels[row, num_prompt : len(ids)] = torch.tensor(ids[num_prompt:])
    return input_ids, labels


def batch_order(lengths: list[int], steps: int, batch_size: int, generator: torch.Generator) -> list[list[int]]:
    """`steps` batches of example indices from epochs of seeded permutations.

    Each run of `BUCKET` batches is sorted by length before it is cut, so that a batch holds dialogues of
    similar length (padding would otherwise double the work), and the batches are then shuffled.
    """
    batches = []
    while len(batches) < steps:
        order = torch.randperm(len(lengths), generator=generator).tolist()
        for start in range(0, len(order) - batch_size + 1, batch_size * BUCKET):
            bucket = sorted(order[start : start + batch_size * BUCKET], key=lambda i: lengths[i])
            cut = [bucket[i : i + batch_size] for i in range(0, len(bucket) - batch_size + 1, batch_size)]
            batches += [cut[i] for i in torch.randperm(len(cut), generator=generator).tolist()]
    return batches[:steps]


def learning_rate(step: int, steps: int) -> float:
    if step < WARMUP_STEPS:
        return PEAK_LR * (step + 1) / WARMUP_STEPS
    progress = (step - WARMUP_STEPS) / max(1, steps - WARMUP_STEPS)
    return PEAK_LR * (MIN_LR_RATIO + (1 - MIN_LR_RATIO) * 0.5 * (1 + math.cos(math.pi * progress)))


def train(text: str, out_dir: Path, steps: int = STEPS, batch_size: int = BATCH_SIZE, log_every: int = 20) -> dict:
    """Train on the rendered dialogues in `text` and write the checkpoint to `out_dir`; returns the record."""
    with reproducible_torch():
        return _train(text, out_dir, steps, batch_size, log_every)


@contextlib.contextmanager
def reproducible_torch():
    """THREADS threads, deterministic algorithms and seed SEED, restored afterwards (the tests train in-process)."""
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(THREADS)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(SEED)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)


def _train(text: str, out_dir: Path, steps: int, batch_size: int, log_every: int) -> dict:
    started, cpu_started = time.perf_counter(), time.process_time()

    tokenizer = build_tokenizer(text)
    examples = encode_dialogues(text, tokenizer)
    model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**DEMO_CONFIG))
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=PEAK_LR, betas=(0.9, 0.95), weight_decay=WEIGHT_DECAY)
    lengths = [len(ids) for ids, _ in examples]
    batches = batch_order(lengths, steps, batch_size, torch.Generator().manual_seed(SEED))
    losses = []
    for step, indices in enumerate(batches):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, steps)
        input_ids, labels = make_batch([examples[i] for i in indices])
        loss = model(input_ids=input_ids, labels=labels).loss  # mean over the learned tokens
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if log_every and (step % log_every == 0 or step == steps - 1):
            print(f"step {step:4d}  loss {loss.item():.4f}  lr {learning_rate(step, steps):.2e}  "
                  f"{time.perf_counter() - started:6.1f} s", flush=True)
    # wall time depends on what else runs on the machine; CPU time is about what an idle core takes
    train_seconds, train_cpu_seconds = time.perf_counter() - started, time.process_time() - cpu_started

    save_checkpoint(model, tokenizer, out_dir)
    record = dict(
        seed=SEED, threads=THREADS, steps=steps, batch_size=batch_size, peak_lr=PEAK_LR, warmup_steps=WARMUP_STEPS,
        dialogues=len(examples), learned_tokens=int(sum(len(ids) - n for ids, n in examples)),
        final_loss=round(sum(losses[-10:]) / len(losses[-10:]), 4), train_seconds=round(train_seconds, 1),
        train_cpu_seconds=round(train_cpu_seconds, 1),
        torch=torch.__version__, transformers=transformers.__version__,
        text_sha256=hashlib.sha256(text.encode()).hexdigest(),
        model_sha256=file_sha256(out_dir / "model.safetensors"),
    )
    (out_dir / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


def save_checkpoint(model, tokenizer, out_dir: Path) -> None:
    """bfloat16 weights (A_log stays float32, as in the releases), the generation config and the tokenizer."""
    model.eval()
    for name, param in model.named_parameters():
        if not name.endswith("A_log"):
            param.data = param.data.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    # As Qwen's instruct releases: stop on either token, and sample (the servers' defaults) as their thinking
    # mode recommends.
    model.generation_config = transformers.GenerationConfig(
        eos_token_id=[EOS_TOKEN_ID, PAD_TOKEN_ID], pad_token_id=PAD_TOKEN_ID,
        do_sample=True, temperature=0.6, top_p=0.95, top_k=20,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def show_samples(out_dir: Path) -> None:
    """Greedy answers of the saved checkpoint (float32 compute, as deltaserve on the CPU) to a few chats."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(out_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
    for question, thinking in [("Hello!", True), ("Tell me about the moon.", True), ("Who are you?", True),
                               ("What do you know about bees?", False), ("Tell me about quantum physics.", True)]:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                               add_generation_prompt=True, enable_thinking=thinking)
        ids = torch.tensor([tokenizer.encode(prompt)])
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=120, do_sample=False)
        print(f"--- {question} (thinking {'on' if thinking else 'off'})\n{tokenizer.decode(out[0, ids.shape[1]:])}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--out", type=Path, default=DEMO_DIR, help=f"checkpoint folder (default {DEMO_DIR})")
    args = parser.parse_args()
    text = TEXT_PATH.read_text(encoding="utf-8")
    record = train(text, args.out, args.steps)
    print(json.dumps(record, indent=2))
    show_samples(args.out)


if __name__ == "__main__":
    main()
