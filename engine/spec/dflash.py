"""DFlash drafter (block diffusion, Chen et al. 2026), trained by us for the default model (train/dflash_*.py).

One round drafts a whole block in ONE forward of a small network, so its cost does not grow with the number
of drafts the way a recursive drafter's (MTP) does. At position pos (the target's cache holds tokens
0..pos-1; x_pos is the last emitted token, not fed yet):

    context rows   c_p = rmsnorm(W_fc f_p, hidden_norm) for p < pos; f_p the tapped features of position p
                   (engine/spec/dflash_taps: the last block's output h_p and K/V rows of a few early and middle
                   layers read from the target's KV cache); each draft layer keeps rope(Wk c_p), Wv c_p in
                   its own KV cache, added as positions are fed
    block          [E[x_pos], m, ..., m] at positions pos..pos+B-1 (m: the trained mask embedding), through
                   the draft layers (llama blocks) with attention over every context row and, bidirectionally,
                   the whole block; row i >= 1's logits (target head rows, hot or all) draft x_{pos+i}

The block always has the B rows it was trained with (the drafts asked for are its first k rows); the head,
most of a round's cost, runs over those k rows only. `DFlashAdaptive` chooses k with the measured costs
(engine/bench/speculative.py measures a round's draft cost against a target step). Taps and block size are
recorded in the drafter file and checked at load. The network runs on the cpu backend's kernels (Q8_0 weights,
or Q4_1 where the file was trained for them: its meta `weights`; shared over numba's threads:
mtp._draft_kernels) in few calls (DFlashNet).
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from .adaptive import AdaptiveLength
from .base import Features, top_probability
from .dflash_taps import Taps, check_taps, kv_rows
from .drafter_file import DrafterFile, DrafterFileError, find, kept_network
from .mtp import EmbedRows, _draft_kernels, _q4, _q8, head_rows

FORMAT, VERSION = "ninfer-dflash", 1
LAYER = ("attn_norm", "wq", "wk", "wv", "wo", "ffn_norm", "w_gate", "w_up", "w_down")
WEIGHTS = ("q8_0", "q4_1")  # the file's meta "weights": how its matrices (and the hot head rows) are held
MAX_ROWS = 64  # context rows per pass (a prompt's are added in chunks)
_NETS: dict = {}  # (drafter file, model, head, capacity) -> DFlashNet: one reply at a time


def file_taps(meta: dict) -> Taps:
    return Taps(tuple(int(j) for j in meta["tap_kv_layers"]), int(meta["tap_hidden_layer"]), int(meta["d_model"]),
                int(meta["kv_dim"]))


def check_meta(meta: dict, args, path) -> None:
    """DrafterFileError (one line) when the file's taps, block or shapes do not fit this target."""
    try:
        taps, block, n_layers = file_taps(meta), int(meta["block_size"]), int(meta["n_layers"])
    except (KeyError, TypeError, ValueError) as e:
        raise DrafterFileError(f"drafter file {path} lacks its taps or block size ({e}); re-export it with "
                               "train/dflash_train.py --export") from None
    why = check_taps(taps, args)
    if why is None and not 2 <= block <= 64:
        why = f"its block size {block} is not 2..64"
    if why is None and (n_layers < 1 or int(meta.get("feat_width", -1)) != taps.width):
        why = f"its feature width {meta.get('feat_width')} does not match its taps ({taps.width})"
    if why is None and meta.get("weights", "q8_0") not in WEIGHTS:
        why = f"its weights {meta.get('weights')!r} are not one of {', '.join(WEIGHTS)} (a newer file?)"
    if why is not None:
        raise DrafterFileError(f"drafter file {path} does not fit {getattr(args, 'arch', 'this model')}: {why}")


class DFlashNet:
    """The drafter's network on the cpu kernels: `add_context(feats, pos0)` and `draft(token, pos)`.

    target: the target's model file (engine.gguf.ModelFile: its embedding and head); hot: the head over the
    file's hot vocabulary (logit j is token hot_ids[j]) instead of all rows.

    The network makes few calls and quantizes each activation once: each layer's q, k and v are one matmul
    over the rows [Wq; Wk; Wv] (and the context rows' k, v one over [Wk; Wv]), gate and up one over
    [Wgate; Wup], and RoPE with the cache store one call (backends/cpu/dflash_kernels); 11 matmuls a round
    instead of 7 took ~0.1-0.2 ms more on count300 (bench/results-spec-dflash.md). What a round costs is
    mostly its 9.6 MB of weights, back from memory after every target pass, not its calls: the whole network
    as two jitted calls measured the same. Each output row of a matmul is its weight row's dot with the
    activations in the same order whatever rows sit beside it, so these are the bits of separate calls
    (tests/engine/test_dflash.py)."""

    def __init__(self, df: DrafterFile, target, capacity: int, hot: bool):
        from ..kv_cache import KVCache
        from ..model import RunState, rope_inv_freq
        a, w, t, meta = target.args, df.arrays, target.tensors, df.meta
        check_meta(meta, a, df.path)
        self.taps, self.block, self.n_layers = file_taps(meta), int(meta["block_size"]), int(meta["n_layers"])
        missing = [f"l{i}.{k}" for i in range(self.n_layers) for k in LAYER if f"l{i}.{k}" not in w]
        if missing:
            raise DrafterFileError(f"drafter file {df.path} lacks {', '.join(missing[:3])}; re-export it")
        self.eps = float(a.rms_eps)
        self.emb = t["token_embd.weight"]  # (vocab, d): the block's first row, dequantized per round
        head = t.get("output.weight", self.emb)
        self.hot_ids = np.asarray(w["hot_ids"], np.int64) if hot else None
        # "q4_1": a file trained quantization-aware for 4-bit matrices (train/dflash_model.py), the head rows
        # too (their Q4_1 copy): ~5.6 MB a round to read instead of ~9.6
        self.weights = meta.get("weights", "q8_0")
        rows = head_rows(head, self.hot_ids, q4=self.weights == "q4_1")
        self.args = dataclasses.replace(a, n_layer=self.n_layers, vocab_size=rows.shape[0], qkv_bias=False,
                                        qk_norm=False, tied_embeddings=True)
        self.be = be = _draft_kernels()
        quant = _q4 if self.weights == "q4_1" else _q8
        self.head = be.prepare_weight(rows)
        self.norm = np.asarray(w["norm"], np.float32)

        def mat(name, *parts):  # the rows of parts stacked, one weight
            return be.prepare_weight(quant(name, np.concatenate([np.asarray(p, np.float32) for p in parts])))
        self.layers = []
        for i in range(self.n_layers):
            lw = {k: w[f"l{i}.{k}"] for k in LAYER}
            self.layers.append(_Layer(
                attn_norm=np.asarray(lw["attn_norm"], np.float32), ffn_norm=np.asarray(lw["ffn_norm"], np.float32),
                wqkv=mat("wqkv", lw["wq"], lw["wk"], lw["wv"]), wkv=mat("wkv", lw["wk"], lw["wv"]),
                wo=mat("wo", lw["wo"]), wgu=mat("wgu", lw["w_gate"], lw["w_up"]), w_down=mat("w_down", lw["w_down"])))
        rows_max = max(MAX_ROWS, self.block)
        self.state = RunState(be, self.args, rows_max)
        q_dim, kv_dim, d_ff = self.args.q_dim, self.args.kv_dim, self.args.d_ff
        self.qkv = np.zeros((rows_max, q_dim + 2 * kv_dim), np.float32)  # [q | k | v] of a pass's rows
        self.gu = np.zeros((rows_max, 2 * d_ff), np.float32)  # [gate | up]
        self.fc = mat("fc", w["fc"])  # (d, width)
        # the state's scratch covers inputs up to max(d, q_dim, d_ff) wide; a feature row may be wider
        self.fc_scratch = be.new_scratch(MAX_ROWS, self.taps.width)
        self.hidden_norm = np.asarray(w["hidden_norm"], np.float32)
        self.mask = np.asarray(w["mask_emb"], np.float32)
        # each draft layer's context K/V (+ the block's)
        self.cache = KVCache(be, self.n_layers, capacity, a.n_kv_head, a.head_dim, "f16")
        self.inv_freq = rope_inv_freq(a.head_dim, a.rope_base)
        self.attn_scale = np.float32(1.0 / math.sqrt(a.head_dim))
        self.neox = bool(a.rope_neox)
        self._att_bufs: dict[int, tuple] = {}  # rows -> _attention's buffers
        self._erow = EmbedRows(self.emb)  # token -> its embedding row (the block's first)

    def add_context(self, feats: np.ndarray, pos0: int) -> None:
        """Context rows of positions pos0..pos0+T-1 (T <= MAX_ROWS) from their features (T, width); the draft
        cache must hold pos0 positions."""
        from ..backends.cpu.dflash_kernels import rope_store
        be, s, a, t_n = self.be, self.state, self.args, feats.shape[0]
        c = s.xb[:t_n]
        assert t_n <= MAX_ROWS and feats.shape[1] == self.taps.width, feats.shape
        be.matmul(c, np.ascontiguousarray(feats, np.float32), self.fc, self.fc_scratch)
        be.rmsnorm(c, c, self.hidden_norm, self.eps)
        kv = self.qkv[:t_n, :2 * a.kv_dim]
        for i, lw in enumerate(self.layers):
            be.matmul(kv, c, lw.wkv, s.scratch)
            k16, v16 = (m.view(np.uint16) for m in self.cache.layer(i))
            rope_store(kv[:0], 0, kv, k16, v16, pos0, self.inv_freq, self.neox, a.n_kv_head, a.head_dim)
        self.cache.length = pos0 + t_n

    def draft(self, token: int, pos: int, k: int | None = None) -> np.ndarray:
        """Logits (k, head rows) of block rows 1..k (drafts of x_{pos+1}..x_{pos+k}; k <= B-1, default B-1).
        Every layer's keys and values cover the whole block (its attention is bidirectional), but only rows
        1..k of the last layer are read: their attention, projections, MLP and head run, the rest of that
        layer's rows do not (each row's result is its own, so the logits are the same bits as the full
        block's rows). The block's own K/V go to cache positions pos.., which the caller truncates."""
        be, s, b = self.be, self.state, self.block
        k = b - 1 if k is None else max(1, min(k, b - 1))
        s.x[0] = self._erow(int(token))
        s.x[1:b] = self.mask
        for i in range(self.n_layers):
            self._layer(i, pos, 1 if i == self.n_layers - 1 else 0, k if i == self.n_layers - 1 else b - 1)
        if s.logits is None or s.logits.shape[0] < k:
            s.logits = be.zeros((b, self.args.vocab_size), "float32")
        be.rmsnorm(s.xb[1:1 + k], s.x[1:1 + k], self.norm, self.eps)  # Model.head's order over rows 1..k
        be.matmul(s.logits[:k], s.xb[1:1 + k], self.head, s.scratch)
        return be.to_host(s.logits[:k])

    def _layer(self, i: int, pos: int, lo: int, k: int) -> None:
        """Layer i over the block: keys and values of all B rows (into the cache at pos..), the rest for rows
        lo..k only (the last layer: 1..k; the others: all)."""
        from ..backends.cpu.dflash_kernels import rope_store
        be, s, a, lw, b = self.be, self.state, self.args, self.layers[i], self.block
        rows, hi = slice(lo, k + 1), k + 1
        be.rmsnorm(s.xb[:b], s.x[:b], lw.attn_norm, self.eps)
        qkv = self.qkv[:b]
        be.matmul(qkv, s.xb[:b], lw.wqkv, s.scratch)  # row 0's q is not read in the last layer (one call)
        k16, v16 = (m.view(np.uint16) for m in self.cache.layer(i))
        rope_store(qkv[lo:hi, :a.q_dim], pos + lo, qkv[:, a.q_dim:], k16, v16, pos, self.inv_freq, self.neox,
                   a.n_kv_head, a.head_dim)
        self._attention(i, pos, lo, hi)
        x, xb = s.x[rows], s.xb[rows]
        be.matmul(s.proj[rows], s.att[rows], lw.wo, s.scratch)
        be.residual_add(x, s.proj[rows])
        be.rmsnorm(xb, x, lw.ffn_norm, self.eps)
        gu, gate, up = self.gu[rows], s.gate[rows], s.up[rows]
        be.matmul(gu, xb, lw.wgu, s.scratch)
        gate[:], up[:] = gu[:, :a.d_ff], gu[:, a.d_ff:]  # swiglu's contiguous rows (its compiled form)
        be.swiglu(s.hb[rows], gate, up)
        be.matmul(s.proj[rows], s.hb[rows], lw.w_down, s.scratch)
        be.residual_add(x, s.proj[rows])

    def _attention(self, layer: int, pos: int, lo: int, hi: int) -> None:
        """att[lo:hi] (rows, H, hd) <- block rows lo..hi-1 over cache positions 0..pos+B-1 (the context and the
        whole block): the cpu kernel's one-row form (attention_f16_split, its work items shared over the
        threads), the rows of a KV head's group laid side by side as one row's heads. Its buffers are kept per
        row count, the scores scratch (a row per head and thread) grown by doubling to the context's longest
        chunk, not the cache's capacity."""
        import numba

        from ..backends.cpu.attn import SPLITS, attention_f16_split, chunk_cap
        n, a, s = hi - lo, self.args, self.state
        g = a.n_head // a.n_kv_head
        bufs = self._att_bufs.get(n)
        need = chunk_cap(pos + self.block)  # the longest chunk of positions a work item scores
        if bufs is None or bufs[1].shape[2] < need:  # the kernels write every value they read back: never cleared
            width = min(max(need, 2 * (0 if bufs is None else bufs[1].shape[2]), 64), chunk_cap(self.cache.capacity))
            bufs = self._att_bufs[n] = (
                np.empty((1, a.n_kv_head * n * g, a.head_dim), np.float32),  # q1: head (kh, t, j) reads kh
                np.empty((numba.config.NUMBA_NUM_THREADS, a.n_kv_head * n * g, width), np.float32),  # scores
                np.empty((1, a.n_kv_head, SPLITS, n * g, a.head_dim + 2), np.float32),  # the chunks' parts
                np.empty((1, a.n_kv_head * n * g, a.head_dim), np.float32))  # merged
        q1, sc, part, out = bufs
        q1.reshape(a.n_kv_head, n, g, a.head_dim)[:] = (  # (n_kv, n, g, hd)
            self.qkv[lo:hi, :a.q_dim].reshape(n, a.n_kv_head, g, a.head_dim).transpose(1, 0, 2, 3))
        k, v = self.cache.layer(layer)
        attention_f16_split(out, q1, k.view(np.uint16), v.view(np.uint16), pos + self.block - 1,
                            self.attn_scale, sc, part)  # its SPLITS work items over the threads
        s.att[lo:hi] = out.reshape(a.n_kv_head, n, g, a.head_dim).transpose(1, 0, 2, 3).reshape(n, -1)

    def token(self, j: int) -> int:
        """The token of head row j."""
        return int(j) if self.hot_ids is None else int(self.hot_ids[j])


@dataclasses.dataclass
class _Layer:
    """A draft layer's weights (prepared for the cpu kernels; matrices (out, in), stacked where one call
    runs several)."""

    attn_norm: np.ndarray
    ffn_norm: np.ndarray
    wqkv: object  # [Wq; Wk; Wv] (q_dim + 2 kv_dim, d): the block's q, k, v
    wkv: object  # [Wk; Wv] (2 kv_dim, d): the context rows' k, v
    wo: object
    wgu: object  # [Wgate; Wup] (2 d_ff, d)
    w_down: object


class DFlashDrafter:
    """engine.spec.base.Drafter over a DFlashNet. The target's hidden rows arrive through `observe` (the
    fed positions, in order since `reset`); the KV taps are read from the target's cache (`bind_target`,
    called by the speculative round) when a round drafts, which first adds every position fed since."""

    name = "dflash"

    @property
    def calibration_key(self):
        """The network whose confidences these are (engine.spec.adaptive.shared_calibration)."""
        return self.net

    def __init__(self, net: DFlashNet):
        self.net = net
        self.features_needed = (net.taps.hidden_layer,)
        self.target_cache = None
        self.reset()

    def bind_target(self, model, cache) -> None:
        """The target's KV cache of this reply (the taps of the fed positions are read from it)."""
        self.target_cache = cache

    @property
    def confidence(self) -> list[float]:
        """The drafter's probability of each draft of the last propose, computed when read (DFlash's adaptive
        length does not cut by it: a round need not pay the softmax over k x the head's rows)."""
        return [top_probability(row) for row in self._logits]

    def reset(self) -> None:
        self._logits: np.ndarray | list = []  # the last propose's draft logits (k, head rows)
        self.net.cache.truncate(0)
        self.n = 0  # positions whose context rows are in the draft cache
        self.n_obs = 0  # hidden rows observed since reset (the last n_obs fed positions)
        self.pending: list[np.ndarray] = []  # hidden rows not yet added, in position order

    def observe(self, tokens: Sequence[int], features: Features | None) -> None:
        if not tokens:
            return
        h = None if features is None else features.get(self.net.taps.hidden_layer)
        if h is None:  # fed without features: what follows cannot be placed
            self.reset()
            return
        self.pending.append(np.asarray(h, np.float32).reshape(len(tokens), -1))
        self.n_obs += len(tokens)

    def _catch_up(self, pos: int) -> bool:
        """Context rows for positions n..pos-1; positions fed before the observed ones (a reused prefix)
        get h = 0 beside their KV taps. False when the target's cache does not hold exactly pos positions."""
        cache = self.target_cache
        if cache is None or cache.length != pos or pos < self.n:
            return False
        taps = self.net.taps
        pend = np.concatenate(self.pending) if self.pending else np.zeros((0, taps.d_model), np.float32)
        first = pos - len(pend)  # the position of pend[0]
        for lo in range(self.n, pos, MAX_ROWS):
            hi = min(lo + MAX_ROWS, pos)
            feats = np.zeros((hi - lo, taps.width), np.float32)
            own = max(lo, first)
            if own < hi:
                feats[own - lo:, :taps.d_model] = pend[own - first:hi - first]
            feats[:, taps.d_model:] = kv_rows(cache, taps, lo, hi, self.net.inv_freq, self.net.neox)
            self.net.add_context(feats, lo)
        self.n, self.pending = pos, []
        return True

    def propose(self, context_tokens: Sequence[int], k: int, features: Features | None) -> list[int]:
        pos = len(context_tokens) - 1
        k = min(k, self.net.block - 1, self.net.cache.capacity - pos - self.net.block)
        self._logits = []
        if k <= 0 or pos < 0 or not self._catch_up(pos):
            return []
        self.net.cache.truncate(pos)
        logits = self.net.draft(int(context_tokens[-1]), pos, k)
        self.net.cache.truncate(pos)  # the block's rows are speculative
        self._logits = logits
        return [self.net.token(j) for j in np.argmax(logits, axis=-1)]


class DFlashAdaptive(AdaptiveLength):
    """AdaptiveLength with DFlash's cost model (a round's draft time is one block forward, fixed, plus the
    head over the k rows asked for: a k not yet drafted is scaled from the nearest one as (k + 2) / (k0 + 2),
    the block costs about two head rows) and the target's cache handed through.

    A round that drafts drafts the whole block (`shadow`: the rows past those the length planned cost ~0.07
    ms each against a ~2 ms verify row) and verifies the first rows worth their calibrated chances (`keep`),
    calibrated per block row (`conf_positions`: a row's confidence is its marginal, not given the rows before
    it; one table for all rows had cut count300_en 1.57-1.67x to 1.41-1.55x). Every row drafted, verified or
    not, is scored against the reply as it comes, so each position's acceptance is learnt at every round, not
    one position deeper per probe: count300_plain_en 1.50-1.54x -> 1.67-1.77x, held-out chat the same
    (bench/results-spec-dflash.md, "The adaptive length drafts the block")."""

    rate_keep = True  # the rows worth their calibrated confidence, priced at the rounds' own rate (keep)

    def __init__(self, inner, **kw):
        rows = max(getattr(getattr(inner, "net", None), "block", 8) - 1, 1)  # the block's draft rows
        super().__init__(inner, draft_fixed=2.0, shadow=rows, conf_positions=rows, **kw)

    def bind_target(self, model, cache) -> None:
        self.inner.bind_target(model, cache)


def unavailable_reason(model_path: str | None) -> str | None:
    """None when a drafter file for this model is installed, else why not (one line)."""
    return find(FORMAT, VERSION, model_path)[1]


def make_drafter(model=None, model_path: str | None = None, *, lm_head_draft: bool = False,
                 adaptive: bool = True, capacity: int | None = None, **_options):
    """Registry entry (engine.spec.base). lm_head_draft: draft over the hot vocabulary's head rows;
    adaptive: draft only as many tokens as pay for their verify cost (DFlashAdaptive)."""
    net = kept_network(_NETS, "dflash", FORMAT, VERSION, model_path, ("hot_ids", "fc", "hidden_norm", "mask_emb",
                       "norm"), (lm_head_draft, capacity),
                       lambda df, target: DFlashNet(df, target, capacity or target.args.context_length,
                                                    hot=lm_head_draft))
    drafter = DFlashDrafter(net)  # reset(): the network's cache starts empty
    if not adaptive:
        return drafter
    from .adaptive import shared_costs
    return DFlashAdaptive(drafter, **shared_costs(model, "dflash"))
