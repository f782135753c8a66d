"""Multi-turn sessions: agent-like traffic where each request extends the conversation before it.

Turn 0 sends a random prompt of --random-input-len tokens. Turn k > 0 sends the previous prompt + the
previous answer text + a new random text of --multi-turn-new-tokens tokens (completions backends: one string;
chat backends: the message list grows by the assistant answer and a new user message). Turns of one session
run strictly in order; sessions run side by side, at most --max-concurrency at once, and start at
--request-rate arrival times. Later turns re-send everything before them, so a server's prefix cache shows
up as a TTFT that stays flat across turns: the report gives TTFT per turn index.

A turn that fails ends its session: the turns after it are recorded as failed ("not sent"), so completed +
failed always equals sessions x turns.
"""

import functools
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import numpy as np

from deltaserve.bench.client import RequestInput, RequestOutput
from deltaserve.bench.randtext import RandomTextGenerator


@dataclass
class SessionPlan:
    """The text a session will add: turn 0's prompt, then one new user text per later turn."""

    first_prompt: str
    new_texts: list[str]  # appended at turns 1 .. num_turns - 1
    output_len: int  # max_tokens of every turn

    @property
    def num_turns(self) -> int:
        return 1 + len(self.new_texts)


def plan_sessions(
    gen: RandomTextGenerator, num_sessions: int, num_turns: int, first_len: int, new_tokens: int, output_len: int
) -> list[SessionPlan]:
    """All random text up front, so that no tokenizer work runs while requests are being timed."""
    return [
        SessionPlan(gen.text(first_len), [gen.text(new_tokens) for _ in range(num_turns - 1)], output_len)
        for _ in range(num_sessions)
    ]


async def run_session(
    plan: SessionPlan,
    chat: bool,
    request_id_prefix: str,
    send: Callable[[RequestInput], Awaitable[RequestOutput]],
) -> list[tuple[RequestInput, RequestOutput]]:
    """Run one session's turns in order; each turn is (what was sent, what came back)."""
    turns: list[tuple[RequestInput, RequestOutput]] = []
    messages: list[dict] = []
    prompt_text = ""
    answer = ""
    for turn in range(plan.num_turns):
        user_text = plan.first_prompt if turn == 0 else plan.new_texts[turn - 1]
        if chat:
            messages.append({"role": "user", "content": user_text})
            prompt: str | list[dict] = list(messages)
        else:
            prompt_text = prompt_text + answer + user_text
            prompt = prompt_text
        request = RequestInput(prompt, None, plan.output_len, f"{request_id_prefix}t{turn}")
        output = await send(request)
        turns.append((request, output))
        if not output.success:
            break
        answer = output.generated_text
        if chat:
            messages.append({"role": "assistant", "content": answer})
    note = f"not sent: turn {len(turns) - 1} of this session failed"
    for turn in range(len(turns), plan.num_turns):
        skipped = RequestInput("", None, plan.output_len, f"{request_id_prefix}t{turn}")
        turns.append((skipped, RequestOutput(prompt_len=0, error=note)))
    return turns


def prompt_token_count(prompt: str | list[dict], count_tokens: Callable[[str], int]) -> int:
    """Client-side prompt size: the text's tokens, or the sum over chat message contents (no template)."""
    if isinstance(prompt, str):
        return count_tokens(prompt)
    return sum(count_tokens(message["content"]) for message in prompt)


def ttft_by_turn(outputs: Sequence[RequestOutput], turn_indices: Sequence[int], num_turns: int) -> dict:
    """Per turn index: mean and median TTFT (ms) and mean input length over successful requests
    (None where no request of that turn succeeded), and the number of successes."""
    means, medians, input_lens, counts = [], [], [], []
    for turn in range(num_turns):
        done = [out for out, t in zip(outputs, turn_indices) if t == turn and out.success]
        ttfts_ms = [out.ttft * 1000.0 for out in done]
        means.append(float(np.mean(ttfts_ms)) if done else None)
        medians.append(float(np.median(ttfts_ms)) if done else None)
        input_lens.append(float(np.mean([out.prompt_len or 0 for out in done])) if done else None)
        counts.append(len(done))
    return {
        "ttft_by_turn_ms": means,
        "median_ttft_by_turn_ms": medians,
        "mean_input_len_by_turn": input_lens,
        "completed_by_turn": counts,
    }


def format_turn_lines(by_turn: dict) -> list[str]:
    """The "TTFT by Turn" section of the console table."""
    lines = ["{s:{c}^{n}}".format(s="TTFT by Turn", n=50, c="-")]
    lines.append(f"{'Turn':<6}{'Mean TTFT (ms)':>15}{'Median (ms)':>13}{'Mean input len':>16}")

    def cell(value, width: int, fmt: str) -> str:
        return f"{'-':>{width}}" if value is None else f"{value:>{width}{fmt}}"

    for turn, (mean, median, input_len) in enumerate(
        zip(by_turn["ttft_by_turn_ms"], by_turn["median_ttft_by_turn_ms"], by_turn["mean_input_len_by_turn"])
    ):
        lines.append(f"{turn:<6}{cell(mean, 15, '.2f')}{cell(median, 13, '.2f')}{cell(input_len, 16, '.1f')}")
    return lines


async def gather_sessions(
    plans: Sequence[SessionPlan],
    chat: bool,
    request_id_prefix: str,
    send: Callable[[RequestInput], Awaitable[RequestOutput]],
    dispatch: Callable[[list[Callable[[], Awaitable]]], Awaitable[list]],
) -> tuple[list[RequestInput], list[RequestOutput], list[int]]:
    """Run every session through `dispatch` (which applies arrival times and the concurrency limit);
    return inputs, outputs and turn indices, flattened session by session."""
    jobs = [
        functools.partial(run_session, plan, chat, f"{request_id_prefix}s{i}-", send)
        for i, plan in enumerate(plans)
    ]
    inputs, outputs, turn_indices = [], [], []
    for turns in await dispatch(jobs):
        for turn, (request, output) in enumerate(turns):
            inputs.append(request)
            outputs.append(output)
            turn_indices.append(turn)
    return inputs, outputs, turn_indices
