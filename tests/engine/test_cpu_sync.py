"""cpu_sync: phases of claimed work inside one parallel region, and the one-region fused step built on it."""
from __future__ import annotations

import numba
import numpy as np
import pytest
from numba import njit, prange

from engine.config import SamplingParams
from engine.backends.cpu.sync import finish, grab, new_sync, open_phase, reset, wait_fetching, wait_open
from fast_cpu import fast_model
from test_speed_guard import ALL_Q4, q4_tiny  # noqa: F401  (the fixture: a tiny all-Q4 llama)


@pytest.fixture(scope="module")
def q4_parts(tmp_path_factory, make_tiny):
    """A tiny all-Q4 llama whose matrices' row groups all divide in two: its layers get a part per thread
    (cpu_fast.prepare_layers; q4_tiny's K / V have one group, so one part)."""
    return make_tiny(tmp_path_factory.mktemp("q4p") / "tiny-q4-parts.gguf", "llama", seed=4, qtypes=ALL_Q4,
                     n_head=2, n_kv_head=2, head_dim=32)


@njit(nogil=True)
def _chain(tid, nt, sync, x, y, n_ph, fetch=False):
    """n_ph phases over x's items; each phase's tail (on the finisher) needs every item of it done. fetch:
    a waiting thread asks for x's and y's cache lines meanwhile (wait_fetching), else just waits."""
    n = x.shape[0]
    for ph in range(n_ph):
        h = 0
        while True:
            h, lo, hi = grab(sync, ph, tid, nt, n, h)
            if lo >= hi:
                break
            for i in range(lo, hi):
                x[i] += y[0]
            if finish(sync, ph, hi - lo, n):
                y[0] = x.sum() % 7 + 1
                open_phase(sync, ph)
        if fetch:
            wait_fetching(sync, ph, np.int64(x.ctypes.data), (x.nbytes + 63) // 64, np.int64(y.ctypes.data))
        else:
            wait_open(sync, ph)


@njit(nogil=True, parallel=True)
def _region(nt, sync, x, y, n_ph, fetch):
    reset(sync)
    for tid in prange(nt):
        _chain(tid, nt, sync, x, y, n_ph, fetch)


def _expected(n, n_ph):
    x, y = np.zeros(n), 1.0
    for _ in range(n_ph):
        x += y
        y = x.sum() % 7 + 1
    return x


@pytest.mark.parametrize("fetch", [False, True])
@pytest.mark.parametrize("n", [1, 5, 50])
def test_phases_complete_in_order_on_all_threads(n, fetch):
    n_ph = 40
    sync = new_sync(n_ph, numba.config.NUMBA_NUM_THREADS)
    for nt in sorted({1, numba.config.NUMBA_NUM_THREADS}):
        numba.set_num_threads(nt)
        try:
            for _ in range(5):  # repeated: a race would show as a wrong sum sooner or later
                x, y = np.zeros(n), np.ones(1)
                _region(nt, sync, x, y, n_ph, fetch)
                np.testing.assert_array_equal(x, _expected(n, n_ph))
        finally:
            numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)


@pytest.mark.parametrize("order", [(0, 1), (1, 0), (2, 0, 1)])
def test_threads_run_one_after_another_do_not_deadlock(order):
    """If the runtime runs the region's iterations in sequence (fewer threads than asked), whichever comes
    first does all the work and the others find none left: same result, no wait on an absent thread."""
    n, n_ph, nt = 9, 12, len(order)
    sync = new_sync(n_ph, nt)
    x, y = np.zeros(n), np.ones(1)
    reset(sync)
    for tid in order:
        _chain(tid, nt, sync, x, y, n_ph)
    np.testing.assert_array_equal(x, _expected(n, n_ph))


@pytest.mark.parametrize("kv_dtype", ["f16", "int8"])
def test_a_waiting_thread_fetches_where_its_next_items_start(q4_tiny, kv_dtype):
    """_ahead (what a thread waiting at a phase's end asks the caches for): the first bytes of the first
    items cpu_sync.grab hands the thread in the next phase, in the arrays those items read."""
    from engine.backends.cpu import attn as cpu_attn
    from engine.backends.cpu.step import AHEAD, SPLITS, _ahead
    model, ff = fast_model(q4_tiny)
    r = ff.roles
    cache = model.new_cache(64, kv_dtype)
    kv = ff.kv_tuple(cache)
    n_layer = r["wq"][0].shape[0]
    nxt = {1: ["wo"], 2: ["w_gate", "w_up"], 3: ["w_down"], 4: ["wq", "wk", "wv"]}  # the matmuls after kind k

    def first(tid, n):
        return grab(new_sync(1, 2), 0, tid, 2, n, 0)[1]

    def ahead(tid, kind, l, pos0=37, t_n=1):
        return _ahead(tid, 2, kind, l, r["wq"], r["wk"], r["wv"], r["wo"], r["w_gate"], r["w_up"], r["w_down"],
                      ff.head, kv, pos0, t_n)

    for tid in (0, 1):
        for l in (0, n_layer - 1):
            for kind, roles in nxt.items():
                if kind == 4 and l == n_layer - 1:
                    continue
                layer = l + 1 if kind == 4 else l
                h = sum(r[x][0].shape[2] for x in roles)  # items per part (cpu_fast_step._mm_groups)
                i = first(tid, h * r[roles[0]][0].shape[1])
                p, g = i // h, i % h
                for role in roles:  # the item's matmul, its part and its row group within that part
                    if g < r[role][0].shape[2]:
                        break
                    g -= r[role][0].shape[2]
                part = r[role][0][layer, p]
                lines = min(AHEAD, (part.shape[0] - g) * part.strides[0] // 64)  # to the part's end
                assert ahead(tid, kind, l) == (part[g].ctypes.data, lines, 0)  # one stream: scales in the blocks
        head = ff.head[2]  # a Q8_0 head (ff.head[0] == 1): its blocks (scales included) in head[2]
        assert ff.head[0] == 1
        g = first(tid, head.shape[0])
        lines = min(AHEAD, (head.ctypes.data + head.nbytes - head[g].ctypes.data) // 64)
        want = (head[g].ctypes.data, lines, 0)
        assert ahead(tid, 4, n_layer - 1) == want
        it = first(tid, SPLITS)  # a decode step's attention: its first item's positions, K then V rows
        _, _, lo, hi = cpu_attn._work_item(it, 37)
        kc, vc = (kv[0], kv[1]) if kv_dtype == "f16" else (kv[0], kv[2])
        lines = -(-(hi - lo) * kc.strides[1] // 64)
        assert 0 < lines <= AHEAD
        assert ahead(tid, 0, 1) == (kc[1, lo].ctypes.data, lines, vc[1, lo].ctypes.data)
        assert ahead(tid, 0, 1, t_n=5)[1] == 0  # a prompt's attention: nothing


def test_grab_takes_own_part_first_then_steals():
    sync = new_sync(1, 2)
    n = 40
    got, h = [], 0
    while True:  # thread 1 alone: its own half (items 20..39) first, then thread 0's
        h, lo, hi = grab(sync, 0, 1, 2, n, h)
        if lo >= hi:
            break
        got.append((lo, hi))
    assert got[0][0] == 20 and sorted(i for lo, hi in got for i in range(lo, hi)) == list(range(n))
    sizes = [hi - lo for lo, hi in got]
    assert sizes[:7] == [6, 4, 3, 2, 1, 1, 1]  # guided: a third of what is left of the part, down to one item


@pytest.mark.parametrize("n_prompt", [11, 40])  # 40: a prompt's pass, its tails phases of their own
def test_fused_step_threads_in_sequence_match_the_region(q4_tiny, n_prompt):
    """The one-region fused step: its threads' functions run one after another in any order (as a runtime
    with fewer threads would run them) give the region's logits bit for bit, prefill and decode."""
    from engine.backends.cpu import step as cpu_fast_step
    model, ff = fast_model(q4_tiny)
    r = ff.roles

    def by_hand(tokens, pos0, cache, order):
        ff._alloc(len(tokens), 1)
        reset(ff.sync)
        for tid in order:
            cpu_fast_step._step_thread(tid, len(order), ff.sync, 0, tokens, pos0, 1, ff.bufs, ff.emb, ff.head,
                                       ff.norms, ff.rope, r["wq"], r["wk"], r["wv"], r["wo"], r["w_gate"], r["w_up"],
                                       r["w_down"], ff.bias, ff.qk_norm, ff.kv_tuple(cache),
                                       ff._attn_scratch(cache.capacity))
        cache.length = pos0 + len(tokens)
        return ff.bufs[13][:1].copy()

    toks = np.resize(np.array([3, 17, 42, 5, 99, 7, 1, 250, 31, 8, 77], np.int32), n_prompt)
    c1, c2 = model.new_cache(64), model.new_cache(64)
    want = ff(toks, 0, c1)
    np.testing.assert_array_equal(by_hand(toks, 0, c2, (1, 0)), want)
    tok = int(want[0].argmax())
    for i, order in enumerate([(0, 1), (1, 0), (0,), (1, 0)]):
        want = ff(np.array([tok], np.int32), len(toks) + i, c1)
        np.testing.assert_array_equal(by_hand(np.array([tok], np.int32), len(toks) + i, c2, order), want)
        tok = int(want[0].argmax())


def _single_steps(model, tok, pos0, cache, n, stops):
    """What n plain rounds choose: forward, np.argmax, until a token in stops (kept)."""
    out = []
    for i in range(n):
        tok = int(np.argmax(model.forward(np.array([tok], np.int32), pos0 + i, cache)[0]))
        out.append(tok)
        if tok in stops:
            break
    return out


def test_greedy_block_chooses_what_single_steps_choose(q4_tiny):
    """FusedForward.greedy (one call, the argmax chosen inside) gives the tokens, the KV rows and the cache
    length of plain forward + np.argmax rounds; a token in the stop set ends the block and is returned."""
    from engine.backends.cpu.step import BLOCK
    model, ff = fast_model(q4_tiny)
    toks = np.array([3, 17, 42, 5, 99, 7, 1, 250, 31, 8, 77], np.int32)
    c1, c2 = model.new_cache(64), model.new_cache(64)
    first = int(np.argmax(model.forward(toks, 0, c1)[0]))
    model.forward(toks, 0, c2)
    want = _single_steps(model, first, len(toks), c1, 2 * BLOCK + 3, frozenset())
    got, tok = [], first
    while len(got) < len(want):
        blk = model.decode_block(tok, len(toks) + len(got), c2, len(want) - len(got), frozenset())
        assert 1 <= len(blk) <= BLOCK
        got += blk
        tok = got[-1]
    assert got == want
    assert c2.length == c1.length == len(toks) + len(want)
    np.testing.assert_array_equal(c2.k[:, :c2.length], c1.k[:, :c1.length])
    np.testing.assert_array_equal(c2.v[:, :c2.length], c1.v[:, :c1.length])
    # a stop token: the block ends with it (its row not forwarded), the others come from the stop set too
    stop = want[4]
    c1.truncate(len(toks))
    c2.truncate(len(toks))
    want = _single_steps(model, first, len(toks), c1, BLOCK, frozenset({stop, 10**6}))
    got = model.decode_block(first, len(toks), c2, BLOCK, frozenset({stop, 10**6}))
    assert got == want and got[-1] == stop and len(got) == want.index(stop) + 1
    assert c2.length == c1.length == len(toks) + len(got)


def test_a_block_ends_after_a_trigger(q4_tiny):
    """triggers (engine.triggers): the block ends after the first token whose last three tokens (the context's
    last-but-one and last tokens counting) pack to a key, with the tokens, KV rows and cache length of single
    steps; keys of other tokens do not end it."""
    from engine.backends.cpu.step import BLOCK
    from engine.triggers import gram_key
    model, ff = fast_model(q4_tiny)
    toks = np.array([3, 17, 42, 5, 99, 7, 1, 250, 31, 8, 77], np.int32)
    c1, c2 = model.new_cache(64), model.new_cache(64)
    first = int(np.argmax(model.forward(toks, 0, c1)[0]))
    model.forward(toks, 0, c2)
    want = _single_steps(model, first, len(toks), c1, BLOCK, frozenset())
    seq = [int(toks[-1]), first, *want]  # the block's three-token windows: seq[i:i + 3] ends at want[i]
    for end in (0, 3):
        hit = gram_key(*seq[end:end + 3])
        miss = gram_key(10**5, 10**5 + 1, 10**5 + 2)
        keys = np.array(sorted({hit, miss}), np.int64)
        cut = next(i for i in range(BLOCK) if gram_key(*seq[i:i + 3]) == hit)  # (an earlier window may match)
        c2.truncate(len(toks))
        got = model.decode_block(first, len(toks), c2, BLOCK, frozenset(), triggers=(keys, int(toks[-1])))
        assert got == want[:cut + 1] and c2.length == len(toks) + len(got)
        np.testing.assert_array_equal(c2.k[:, :c2.length], c1.k[:, :c2.length])
    c2.truncate(len(toks))
    keys = np.array([gram_key(10**5, 10**5 + 1, 10**5 + 2)], np.int64)
    assert model.decode_block(first, len(toks), c2, BLOCK, frozenset(), triggers=(keys, -1)) == want


def test_block_hands_out_each_pass_hidden_row(q4_tiny):
    """decode_block(capture=(last layer,)) sets captured to each pass's last hidden row: the rows single
    forwards with capture give for the same tokens, bit for bit (a speculative round that falls back to a
    block feeds them to its drafter); another layer it cannot capture: None, nothing run."""
    model, ff = fast_model(q4_tiny)
    last = model.args.n_layer - 1
    toks = np.array([3, 17, 42, 5, 99, 7, 1], np.int32)
    c1, c2 = model.new_cache(64), model.new_cache(64)
    first = int(np.argmax(model.forward(toks, 0, c1)[0]))
    model.forward(toks, 0, c2)
    assert model.decode_block(first, len(toks), c2, 6, frozenset(), capture=(0,)) is None
    assert c2.length == len(toks)
    got = model.decode_block(first, len(toks), c2, 6, frozenset(), capture=(last,))
    rows = model.captured[last]
    assert len(got) == 6 and rows.shape == (6, model.args.d_model)
    for i, tok in enumerate([first, *got[:-1]]):
        model.forward(np.array([tok], np.int32), len(toks) + i, c1, capture=(last,))
        np.testing.assert_array_equal(rows[i], model.captured[last][0])


def test_greedy_block_threads_in_sequence_match_the_region(q4_tiny):
    """The block's per-thread function run one thread after another (a runtime with fewer threads) chooses
    the same tokens as the region: the choice phase never waits for a particular thread."""
    from engine.backends.cpu import step as cpu_fast_step
    model, ff = fast_model(q4_tiny)
    toks = np.array([3, 17, 42, 5, 99, 7], np.int32)
    c1, c2 = model.new_cache(64), model.new_cache(64)
    first = int(np.argmax(model.forward(toks, 0, c1)[0]))
    model.forward(toks, 0, c2)
    want = model.decode_block(first, len(toks), c1, 5, frozenset())
    chain = np.zeros(6, np.int32)
    chain[0] = first
    args = ff.call_args(chain[:1], len(toks), 1, ff.kv_tuple(c2), ff._attn_scratch(c2.capacity), 2, chain)
    reset(ff.sync)
    for tid in (1, 0):
        cpu_fast_step._passes(tid, *args[20:21], *args[19:20], *args[:19], *args[21:])
    assert chain[1:].tolist() == want


@pytest.mark.parametrize("n", [1, 7, 8, 50, 49152])
def test_argmax_row_is_numpys(n):
    from engine.backends.cpu.kernels import argmax_row
    rng = np.random.default_rng(n)
    x = rng.standard_normal(n).astype(np.float32)
    assert argmax_row(x) == np.argmax(x)
    x[n // 3] = x[-1] = x.max() + 1  # ties: the first
    assert argmax_row(x) == np.argmax(x)
    x[:] = -np.inf
    assert argmax_row(x) == np.argmax(x) == 0
    x[n // 2] = np.nan  # a NaN is np.argmax's answer
    assert argmax_row(x) == np.argmax(x)


@pytest.mark.parametrize("n_prompt,tiny", [(11, "q4_tiny"), (40, "q4_tiny"), (11, "q4_parts")])
def test_fused_step_matches_leaf_forward_bit_for_bit(request, n_prompt, tiny):
    """compile_tier.LeafForward (the per-kernel form that runs while the fused step compiles) and the fused
    step give the same bits, prefill and decode: same kernels on the same items, whichever thread runs
    them, and the fastmath helpers keep their own flags inside the (non-fastmath) step. 40 rows: a prompt's
    attention in row tiles (cpu_attn_prefill); q4_parts: weights in a part per thread."""
    from engine.backends.cpu.tier import LeafForward
    model, ff = fast_model(request.getfixturevalue(tiny))
    assert ff.roles["wk"][0].shape[1] == (2 if tiny == "q4_parts" and numba.get_num_threads() == 2 else 1)
    leaf = LeafForward(ff)
    toks = np.resize(np.array([3, 17, 42, 5, 99, 7, 1, 250, 31, 8, 77], np.int32), n_prompt)
    c1, c2 = model.new_cache(64), model.new_cache(64)

    def both(tokens, pos0):
        """The fused step's logits, then LeafForward's; also the last layer's residual stream (x) and
        swiglu output (hb), which the 8-bit quantization after them would otherwise hide."""
        want = ff(tokens, pos0, c1).copy()
        x, hb = ff.bufs[0][:len(tokens)].copy(), ff.bufs[9][:len(tokens)].copy()
        c2.check_room(pos0 + len(tokens))
        leaf.forward(tokens, pos0, ff.kv_tuple(c2), 1, ff._attn_scratch(c2.capacity))
        c2.length = pos0 + len(tokens)
        np.testing.assert_array_equal(ff.bufs[0][:len(tokens)], x)
        np.testing.assert_array_equal(ff.bufs[9][:len(tokens)], hb)
        np.testing.assert_array_equal(ff.bufs[13][:1], want)
        return want

    want = both(toks, 0)
    tok = int(want[0].argmax())
    for i in range(4):
        want = both(np.array([tok], np.int32), len(toks) + i)
        np.testing.assert_array_equal(c2.k[:, :len(toks) + i + 1], c1.k[:, :len(toks) + i + 1])
        tok = int(want[0].argmax())


def test_per_kernel_forward_over_parts_matches_the_fused_step(q4_parts):
    """Model.forward kernel by kernel (cpu_fast.matmul over each part of a layer matrix) gives the fused
    step's logits on weights in a part per thread: the same group kernels, so the same bits."""
    model, ff = fast_model(q4_parts)
    toks = np.array([3, 17, 42, 5, 99, 7, 1, 250, 31, 8, 77], np.int32)
    c1, c2 = model.new_cache(64), model.new_cache(64)
    np.testing.assert_array_equal(ff(toks, 0, c2, all_logits=True), model.model.forward(toks, 0, c1, all_logits=True))
    tok = np.array([5], np.int32)
    np.testing.assert_array_equal(ff(tok, len(toks), c2), model.model.forward(tok, len(toks), c1))


def test_plain_round_uses_a_greedy_block(q4_tiny):
    """The decode loop's round: a greedy chooser, with penalties or without, gets up to block_size() tokens
    per round (the tokens single rounds give, each accepted by the chooser)."""
    from engine.config import SamplingParams
    from engine.rounds import RoundContext, block_size, plain_round
    from engine.sampling import TokenChooser
    model, ff = fast_model(q4_tiny)
    toks = [3, 17, 42, 5, 99, 7]
    first = int(np.argmax(model.forward(np.array(toks, np.int32), 0, model.new_cache(64))[0]))
    runs = {}
    for name, sp in (("greedy", SamplingParams(greedy=True)),
                     ("penalised", SamplingParams(greedy=True, presence_penalty=0.5))):
        cache = model.new_cache(64)
        model.forward(np.array(toks, np.int32), 0, cache)
        chooser = TokenChooser(sp, model.args.vocab_size)
        assert chooser.block(4) is not None
        chooser.accepted([])
        ctx = RoundContext(model, cache, toks + [first], chooser, 12, frozenset())
        rnd = plain_round(ctx)
        runs[name] = rnd.tokens
        assert cache.length == len(toks) + len(rnd.tokens) and chooser.n_accepted == len(rnd.tokens)
    assert len(runs["greedy"]) == len(runs["penalised"]) == min(12, block_size())
    cache = model.new_cache(64)
    model.forward(np.array(toks, np.int32), 0, cache)
    ctx = RoundContext(model, cache, toks + [first], TokenChooser(SamplingParams(greedy=True), model.args.vocab_size),
                       12, frozenset(), reply_start=len(toks) + 1)
    assert plain_round(ctx).tokens == runs["greedy"][:1]  # a reply's first token goes out alone
    cache = model.new_cache(64)
    model.forward(np.array(toks, np.int32), 0, cache)
    assert runs["greedy"] == _single_steps(model, first, len(toks), cache, len(runs["greedy"]), frozenset())


def test_greedy_block_of_one_is_a_plain_round(q4_tiny, monkeypatch):
    """NINFER_DECODE_BLOCK=1 turns blocks off: the round forwards and chooses in Python (Model.forward)."""
    from engine import rounds
    from engine.config import SamplingParams
    from engine.sampling import TokenChooser
    model, ff = fast_model(q4_tiny)
    monkeypatch.setattr(rounds, "block_size", lambda: 1)
    monkeypatch.setattr(model, "decode_block", lambda *a: pytest.fail("a block of one token"))
    toks = [3, 17, 42, 5, 99, 7]
    cache = model.new_cache(64)
    first = int(np.argmax(model.forward(np.array(toks, np.int32), 0, cache)[0]))
    chooser = TokenChooser(SamplingParams(greedy=True), model.args.vocab_size)
    rnd = rounds.plain_round(rounds.RoundContext(model, cache, toks + [first], chooser, 12, frozenset()))
    assert len(rnd.tokens) == 1 and cache.length == len(toks) + 1


@pytest.mark.parametrize("sp", [
    SamplingParams(temperature=1.5, top_k=20, top_p=0.95, presence_penalty=12.0, frequency_penalty=0.5, seed=42),
    SamplingParams(temperature=2.0, top_k=0, top_p=0.98, presence_penalty=12.0, frequency_penalty=0.5, seed=3),
    SamplingParams(temperature=1.2, top_k=200, min_p=0.02, frequency_penalty=3.0, seed=5),
    SamplingParams(greedy=True, presence_penalty=12.0, frequency_penalty=0.5, seed=7)],
    ids=["sampled", "top-k-off", "top-k-200", "greedy"])
def test_penalised_block_chooses_what_single_rounds_choose(q4_tiny, sp):
    """A decode block with penalties (strong enough to move this tiny model off its one peaked token),
    sampling (seeded; top-k 20, or the full-vocabulary path: top-k off or above KMAX) or greedy (top-1 of
    the penalised logits): the same tokens as choose + accept rounds, the same penalty state after, and the
    generator where single rounds leave it (greedy: untouched)."""
    from engine.backends.cpu.step import BLOCK
    from engine.sampling import TokenChooser
    model, ff = fast_model(q4_tiny)
    toks = np.array([3, 17, 42, 5, 99, 7], np.int32)
    c1, c2 = model.new_cache(64), model.new_cache(64)
    ch1, ch2 = TokenChooser(sp, model.args.vocab_size), TokenChooser(sp, model.args.vocab_size)
    first = ch1.choose(model.forward(toks, 0, c1)[0])
    ch1.accept(first)
    assert ch2.choose(model.forward(toks, 0, c2)[0]) == first
    ch2.accept(first)
    n_new = 2 * BLOCK + 3
    want, tok = [], first
    for i in range(n_new):
        tok = ch1.choose(model.forward(np.array([tok], np.int32), len(toks) + i, c1)[0])
        ch1.accept(tok)
        want.append(tok)
    got, tok = [], first
    while len(got) < n_new:
        n = min(BLOCK, n_new - len(got))
        blk = model.decode_block(tok, len(toks) + len(got), c2, n, frozenset(), ch2.block(n))
        ch2.accepted(blk)
        got += blk
        tok = got[-1]
    assert got == want and len(set(got)) > 3
    assert c2.length == c1.length
    np.testing.assert_array_equal(ch2.counts, ch1.counts)
    np.testing.assert_array_equal(ch2._pen, ch1._pen)
    assert ch2.n_accepted == ch1.n_accepted
    r1, r2 = ch1.rng.random(), ch2.rng.random()
    assert r1 == r2 and (not sp.is_greedy or r2 == np.random.default_rng(sp.seed).random())


def test_block_choice_only_where_the_chain_allows_it(q4_tiny):
    """TokenChooser.block hands the choice over for greedy and sampling (top-k off as k 0, top-k at or above
    the vocabulary too), and only where the thinking state cannot force within the block; a block that was
    not run (None) leaves the generator untouched."""
    from engine.config import SamplingParams
    from engine.sampling import TokenChooser
    from engine.thinking import ThinkingPlan, ThinkingState
    v = 300
    assert TokenChooser(SamplingParams(greedy=True), v).block(4).mode == 0
    assert TokenChooser(SamplingParams(temperature=0.7, top_k=20), v).block(4).mode == 1
    wide = TokenChooser(SamplingParams(temperature=0.7, top_k=0, top_p=0.9), v).block(4)  # the full-vocabulary path
    assert wide[:3] == (1, 0.7, 0) and wide.work.shape == (v,)  # k 0, the chooser's work row
    assert TokenChooser(SamplingParams(temperature=0.7, top_k=v), v).block(4).top_k == 0  # k >= vocabulary: off
    assert TokenChooser(SamplingParams(temperature=0.7, top_k=20), v).block(4).work.shape == (0,)
    pen = TokenChooser(SamplingParams(greedy=True, frequency_penalty=0.5), v)
    assert pen.block(4)[:3] == (1, 1.0, 1) and pen.block(4).uniforms.tolist() == [0.0] * 4  # top-1, zero uniforms
    plan = ThinkingPlan("prompted", open_ids=(5,), close_ids=(6,), forced_ids=(6,), budget=3, start="reasoning")
    reasoning = TokenChooser(SamplingParams(greedy=True), v, thinking=ThinkingState(plan))
    assert reasoning.block(4) is None and reasoning.block_room(4) == 3  # the budget's boundary may force
    assert reasoning.block(3) is not None
    assert TokenChooser(SamplingParams(greedy=True), v, thinking=ThinkingState(plan, start="idle")).block(4) is None
    ch, ref = (TokenChooser(SamplingParams(temperature=0.7, top_k=20, seed=1), v) for _ in range(2))
    assert ch.block(8) is not None
    ch.accepted([])
    assert ch.rng.random() == ref.rng.random()
