"""Prefix caching on the real engine (tiny checkpoints, CPU float32): exact, and hitting where prompts branch.

Every workload runs twice, with caching on and off, and must give the same greedy (or seeded) token ids and
the same logprobs within LOGPROB_TOL. Block size 4, so that short prompts span many blocks.
"""

import random

import pytest

from deltaserve import LLM, SamplingParams
from deltaserve.cache import cache_manager
from deltaserve.cache.cache_manager import DECODE_CHECKPOINT_INTERVAL

BS = 4
VOCAB = 1024
# Caching moves prefill chunk boundaries, which rounds differently in float32. The engine's own chunked
# prefill, caching off, already moves these logprobs (about -3.5) by up to 1.5e-4 on the granularity workload
# below (max_num_batched_tokens 5, 11 or 16 vs 8192; up to 3e-3 on qwen3_next in other workloads). A restore
# that skips the conv state moves them by 6e-3; one that skips the recurrent state changes the tokens.
LOGPROB_TOL = 5e-4
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


def branch(rng: random.Random, base: list[int], n: int, tail: int) -> list[int]:
    """base[:n] followed by `tail` random tokens, the first of which differs from base[n]."""
    first = (base[n] + 1 + rng.randrange(VOCAB - 1)) % VOCAB if n < len(base) else rng.randrange(VOCAB)
    return base[:n] + [first] + tokens(rng, tail - 1)


def engines(path, block_size=BS, **kwargs) -> tuple[LLM, LLM]:
    """(caching on, caching off) engines with the same settings."""
    on = LLM(str(path), block_size=block_size, max_num_seqs=8, **kwargs)
    off = LLM(str(path), block_size=block_size, max_num_seqs=8, enable_prefix_caching=False,
              **{k: v for k, v in kwargs.items() if k != "prefix_cache_state_slots"})
    return on, off


def run_waves(llm: LLM, waves) -> tuple[list, int]:
    """Submit each wave of (prompt, params) at once and run it to the end. Returns (outputs, preemptions)."""
    engine, outputs, preempted = llm.engine, [], set()
    for wave in waves:
        ids = []
        for prompt, params in wave:
            ids.append(f"r{len(outputs) + len(ids)}")
            engine.add_request(ids[-1], prompt, params)
        done = {}
        while engine.has_unfinished():
            done.update((o.request_id, o) for o in engine.step() if o.finished)
            preempted |= {r.request_id for r in engine.scheduler.waiting if r.num_preemptions}
        outputs += [done[i] for i in ids]
    return outputs, len(preempted)


def assert_exact(cached, uncached) -> None:
    assert len(cached) == len(uncached)
    for a, b in zip(cached, uncached):
        assert len(a.outputs) == len(b.outputs)
        for x, y in zip(a.outputs, b.outputs):
            assert x.token_ids == y.token_ids, f"request {a.request_id}: outputs differ with caching on"
            gaps = [abs(ex[t].logprob - ey[t].logprob) for t, ex, ey in zip(x.token_ids, x.logprobs, y.logprobs)]
            assert max(gaps) <= LOGPROB_TOL, f"request {a.request_id}: logprobs differ by {max(gaps):.3g}"


def assert_cache_idle(llm: LLM) -> None:
    """No request holds a block or a slot; cached blocks count as free (evictable)."""
    cache = llm.engine.cache_manager
    assert cache.block_pool.num_free_blocks == cache.block_pool.num_usable_blocks
    assert cache.state_pool.num_free_slots == cache.state_pool.num_slots - 1
    assert (cache.prefix_cache.num_checkpoints + cache.state_pool.num_free_checkpoint_slots
            == cache.state_pool.num_checkpoint_slots)


def shared_system_prompt_waves(seed: int):
    rng = random.Random(seed)
    system = tokens(rng, 37)
    # the first question is long enough that its prompt-end checkpoint (48) lies past the system prompt
    questions = [system + tokens(rng, 12 if i == 0 else rng.randint(1, 12)) for i in range(6)]
    return [[(questions[0], GREEDY)], [(q, GREEDY) for q in questions[1:4]], [(q, GREEDY) for q in questions[4:]]]


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def test_shared_system_prompt_is_exact_and_hit_by_later_questions(make_checkpoint, arch):
    on, off = engines(make_checkpoint(arch))
    waves = shared_system_prompt_waves(seed=1)
    cached, _ = run_waves(on, waves)
    assert_exact(cached, run_waves(off, waves)[0])
    # wave 1 caches the system prompt's KV; wave 2 (three requests at once) finds that chain without a state
    # and saves one at its end, floor(37/4)*4 = 36; wave 3 starts there
    assert [o.num_cached_tokens for o in cached] == [0, 0, 0, 0, 36, 36]
    cache = on.engine.cache_manager
    assert cache.prefix_cache_hits == 72
    assert cache.prefix_cache_queries == sum(len(p) for wave in waves for p, _ in wave)
    assert_cache_idle(on)


@pytest.mark.parametrize("interval", [BS, 16])  # decode checkpoints at every block, or every 4 blocks
def test_multi_turn_conversations_continue_from_the_previous_turn(make_checkpoint, monkeypatch, interval):
    monkeypatch.setattr(cache_manager, "DECODE_CHECKPOINT_INTERVAL", interval)
    on, off = engines(make_checkpoint("qwen3_5"))
    rng = random.Random(2)
    conversations = [tokens(rng, n) for n in (11, 26, 5)]
    previous_ends = [0, 0, 0]
    for turn in range(4):  # the conversations advance together (concurrent requests)
        wave = [(prompt, GREEDY) for prompt in conversations]
        cached, _ = run_waves(on, [wave])
        assert_exact(cached, run_waves(off, [wave])[0])
        for i, out in enumerate(cached):
            # the previous turn left a checkpoint at the last multiple of the interval it computed past its
            # prompt's end checkpoint (its last token is sampled, never computed): this turn starts there, or at
            # that prompt-end checkpoint
            assert out.num_cached_tokens == previous_ends[i]
            prompt_end = (len(out.prompt_token_ids) - 1) // BS * BS
            finished = out.prompt_token_ids + out.outputs[0].token_ids
            previous_ends[i] = max(prompt_end, (len(finished) - 1) // interval * interval)
            conversations[i] = finished + tokens(rng, rng.randint(2, 9))
    assert_cache_idle(on)


def test_hit_granularity_for_prompts_diverging_at_random_positions(make_checkpoint):
    """base (200 tokens) runs first. For each N, B_N shares base's first N tokens: it hits the longest
    checkpoint at or below floor(N/4)*4 (the divergence point, where base's cached block goes on with other
    tokens) and creates one there, however near its hit; C_N, sharing the same N tokens with a different tail,
    then reuses exactly floor(N/4)*4 tokens."""
    on, off = engines(make_checkpoint("qwen3_5"))
    rng = random.Random(3)
    base = tokens(rng, 200)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=1)
    divergences = [3, 22, 58, 70, 90, 131, 150, 190] + rng.sample(range(1, 200), 6)
    waves = [[(base, params)]]
    for n in divergences:
        waves += [[(branch(rng, base, n, 5), params)], [(branch(rng, base, n, 7), params)]]
    cached, _ = run_waves(on, waves)
    assert_exact(cached, run_waves(off, waves)[0])
    checkpoints_on_base = {0, (len(base) - 1) // BS * BS}  # base's prompt-end checkpoint, 196
    nearer = 0
    for i, n in enumerate(divergences):
        b, c = cached[1 + 2 * i], cached[2 + 2 * i]
        point = n // BS * BS
        below = max(p for p in checkpoints_on_base if p <= point)
        assert b.num_cached_tokens == below, f"B_{n}"
        nearer += 0 < point - below < DECODE_CHECKPOINT_INTERVAL
        checkpoints_on_base.add(point)
        assert c.num_cached_tokens == point, f"C_{n}"
    assert nearer >= 3  # branch points less than a decode-checkpoint interval past B's hit are exercised


BRANCH_DEPTHS = [17, 33, 50, 95, 130]  # at block size 16: one to three blocks in (under one stride), past it


@pytest.mark.parametrize("order", ["sequential", "concurrent"])
def test_prompts_branching_inside_prompts_hit_the_last_block_boundary_before_the_branch(make_checkpoint, order):
    """Block size 16, the default decode-checkpoint stride (64). For each depth d, A (160 tokens) and B share
    d tokens; C shares d + 10 with A and hits floor(d/16)*16, whether B came after A or with it. Then a tree:
    Q branches off P at 50, R off Q at 95, S off R at 130, T off R at 100 (sequentially, or in pairs Q+R, S+T),
    and prompts leaving it later hit the boundary at or below the deepest branch point they pass."""
    on, off = engines(make_checkpoint("qwen3_5"), block_size=16)
    rng = random.Random(5)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, logprobs=1)
    waves, expected = [], []
    for d in BRANCH_DEPTHS:
        a = tokens(rng, 160)
        b, c = branch(rng, a, d, 40), branch(rng, a, d + 10, 8)
        waves += [[(a, params)], [(b, params)]] if order == "sequential" else [[(a, params), (b, params)]]
        waves.append([(c, params)])
        expected += [0, 0, d // 16 * 16]
    p = tokens(rng, 160)
    q = branch(rng, p, 50, 90)  # 140 tokens
    r = branch(rng, q, 95, 50)  # 145: its prompt-end checkpoint (144) lies past S's branch point
    s, t = branch(rng, r, 130, 20), branch(rng, r, 100, 20)
    if order == "sequential":
        waves += [[(x, params)] for x in (p, q, r, s, t)]
        expected += [0, 0, 48, 80, 80]
    else:
        waves += [[(p, params)], [(q, params), (r, params)], [(s, params), (t, params)]]
        expected += [0, 0, 0, 80, 80]
    for source, shared, hit in ((p, 60, 48), (q, 97, 80), (r, 101, 96), (s, 135, 128)):
        waves.append([(branch(rng, source, shared, 12), params)])
        expected.append(hit)
    cached, _ = run_waves(on, waves)
    assert_exact(cached, run_waves(off, waves)[0])
    assert [o.num_cached_tokens for o in cached] == expected
    assert_cache_idle(on)


@pytest.mark.parametrize("setting", ["small cache", "preemption", "chunked prefill"])
def test_exact_under_eviction_preemption_chunking_with_n_samples(make_checkpoint, setting):
    kwargs = {
        "small cache": {"num_gpu_blocks_override": 48, "prefix_cache_state_slots": 3},  # 188 tokens of KV
        "preemption": {"num_gpu_blocks_override": 24, "prefix_cache_state_slots": 4},
        "chunked prefill": {"max_num_batched_tokens": 7},
    }[setting]
    on, off = engines(make_checkpoint("qwen3_5"), **kwargs)
    rng = random.Random(4)
    system = tokens(rng, 30)
    sampled = SamplingParams(n=3, temperature=0.8, seed=11, max_tokens=5, ignore_eos=True, logprobs=1)
    waves = []
    for _ in range(3):  # one question alone, then at once: two more, its resend, a branch with n = 3 samples
        prompts = [system + tokens(rng, rng.randint(1, 10)) for _ in range(3)]
        waves.append([(prompts[0], GREEDY)])
        waves.append([(p, GREEDY) for p in prompts[1:]] + [(prompts[0], GREEDY), (branch(rng, system, 17, 9), sampled)])
        system = tokens(rng, 30) if setting == "small cache" else system  # a new prefix pushes the old out
    cached, preemptions = run_waves(on, waves)
    uncached, _ = run_waves(off, waves)
    assert_exact(cached, uncached)
    prefix, pool = on.engine.cache_manager.prefix_cache, on.engine.cache_manager.block_pool
    assert prefix.hits > 0
    if setting == "small cache":
        assert pool.num_evictions > 0 and prefix.num_evictions > 0
    if setting == "preemption":
        assert preemptions > 0
    assert_cache_idle(on)


def random_prompt(rng: random.Random, earlier: list[int]) -> list[int]:
    kind = rng.choice(["new", "resend", "branch", "next turn"])
    if kind == "new":
        return tokens(rng, rng.randint(2, 40))
    if kind == "resend":
        return list(earlier)
    if kind == "branch":
        return branch(rng, earlier, rng.randrange(1, len(earlier)), rng.randint(1, 12))
    return earlier + tokens(rng, rng.randint(1, 8))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_mix_of_new_prompts_resends_branches_and_next_turns(make_checkpoint, seed):
    """Waves of 1-4 requests, each one of: a new prompt, a resend of an earlier prompt, a branch of an earlier
    sequence at a random position, or the next turn of an earlier finished sequence; a small cache."""
    on, off = engines(make_checkpoint("qwen3_5"), num_gpu_blocks_override=64, prefix_cache_state_slots=6,
                      max_num_batched_tokens=24)
    rng = random.Random(100 + seed)
    seen = [tokens(rng, 20)]  # prompts and finished sequences later requests build on
    for _ in range(6):
        wave = []
        for _ in range(rng.randint(1, 4)):
            params = SamplingParams(temperature=0, max_tokens=rng.randint(1, 9), ignore_eos=True, logprobs=1)
            wave.append((random_prompt(rng, rng.choice(seen)), params))
        cached, _ = run_waves(on, [wave])
        assert_exact(cached, run_waves(off, [wave])[0])
        seen += [o.prompt_token_ids for o in cached] + [o.prompt_token_ids + o.outputs[0].token_ids for o in cached]
    assert on.engine.cache_manager.prefix_cache_hits > 0
    assert_cache_idle(on)


def test_caching_off_keeps_nothing(make_checkpoint):
    _, off = engines(make_checkpoint("qwen3_5"))
    run_waves(off, shared_system_prompt_waves(seed=5))
    cache = off.engine.cache_manager
    assert cache.prefix_cache is None and cache.block_pool.num_cached_blocks == 0
    assert cache.state_pool.num_checkpoint_slots == 0
