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
shared over numba's threads: mtp._draft_kernels), as mtp.py's.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from .adaptive import AdaptiveLength
from .base import Features, top_probability
from .dflash_taps import Taps, check_taps, kv_rows
from .drafter_file import DrafterFile, DrafterFileError, find, load
from .mtp import EmbedRows, _draft_kernels, _f32, _q8

FORMAT, VERSION = "ninfer-dflash", 1
LAYER = ("attn_norm", "wq", "wk", "wv", "wo", "ffn_norm", "w_gate", "w_up", "w_down")
_GGUF_NAMES = {"attn_norm": "attn_norm.weight", "wq": "attn_q.weight", "wk": "attn_k.weight",
               "wv": "attn_v.weight", "wo": "attn_output.weight", "ffn_norm": "ffn_norm.weight",
               "w_gate": "ffn_gate.weight", "w_up": "ffn_up.weight", "w_down": "ffn_down.weight"}
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
    if why is not None:
        raise DrafterFileError(f"drafter file {path} does not fit {getattr(args, 'arch', 'this model')}: {why}")


class DFlashNet:
    """The drafter's network on the cpu kernels: `add_context(feats, pos0)` and `draft(token, pos)`.

    target: the target's model file (engine.gguf.ModelFile: its embedding and head); hot: the head over the
    file's hot vocabulary (logit j is token hot_ids[j]) instead of all rows."""

    def __init__(self, df: DrafterFile, target, capacity: int, hot: bool):
        from ..model import Model
        from ..quant import QTensor
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
        rows = head if self.hot_ids is None else QTensor(head.name, head.qtype, (len(self.hot_ids), head.shape[1]),
                                                        np.ascontiguousarray(head.data[self.hot_ids]))
        margs = dataclasses.replace(a, n_layer=self.n_layers, vocab_size=rows.shape[0], qkv_bias=False,
                                    qk_norm=False, tied_embeddings=True)
        tensors = {"token_embd.weight": rows, "output_norm.weight": _f32("norm", w["norm"])}
        for i in range(self.n_layers):
            for k, gguf_name in _GGUF_NAMES.items():
                arr = w[f"l{i}.{k}"]
                tensors[f"blk.{i}.{gguf_name}"] = _f32(k, arr) if arr.ndim == 1 else _q8(k, arr)
        self.model = Model(margs, tensors, _draft_kernels(), max_batch=max(MAX_ROWS, self.block))
        self.fc = self.model.be.prepare_weight(_q8("fc", w["fc"]))  # (d, width)
        # the model's scratch covers inputs up to max(d, q_dim, d_ff) wide; a feature row may be wider
        self.fc_scratch = self.model.be.new_scratch(MAX_ROWS, self.taps.width)
        self.hidden_norm = np.asarray(w["hidden_norm"], np.float32)
        self.mask = np.asarray(w["mask_emb"], np.float32)
        self.cache = self.model.new_cache(capacity, "f16")  # each draft layer's context K/V (+ the block's)
        self.inv_freq = np.asarray(self.model.inv_freq, np.float32)
        self.neox = bool(a.rope_neox)
        self._att_bufs: dict[int, tuple] = {}  # rows -> _attention's buffers
        self._erow = EmbedRows(self.emb)  # token -> its embedding row (the block's first)

    def add_context(self, feats: np.ndarray, pos0: int) -> None:
        """Context rows of positions pos0..pos0+T-1 (T <= MAX_ROWS) from their features (T, width); the draft
        cache must hold pos0 positions."""
        m, be = self.model, self.model.be
        s, t_n = m.state, feats.shape[0]
        c = s.xb[:t_n]
        assert t_n <= MAX_ROWS and feats.shape[1] == self.taps.width, feats.shape
        be.matmul(c, np.ascontiguousarray(feats, np.float32), self.fc, self.fc_scratch)
        be.rmsnorm(c, c, self.hidden_norm, self.eps)
        a = m.args
        for i, lw in enumerate(m.layers):
            k3 = s.k[:t_n].reshape(t_n, a.n_kv_head, a.head_dim)
            v3 = s.v[:t_n].reshape(t_n, a.n_kv_head, a.head_dim)
            be.matmul(s.k[:t_n], c, lw.wk, s.scratch)
            be.matmul(s.v[:t_n], c, lw.wv, s.scratch)
            be.rope(k3, pos0, m.inv_freq, self.neox)
            be.kv_store_f16(*self.cache.layer(i), k3, v3, pos0)
        self.cache.length = pos0 + t_n

    def draft(self, token: int, pos: int, k: int | None = None) -> np.ndarray:
        """Logits (k, head rows) of block rows 1..k (drafts of x_{pos+1}..x_{pos+k}; k <= B-1, default B-1).
        Every layer's keys and values cover the whole block (its attention is bidirectional), but only rows
        1..k of the last layer are read: their queries, attention, projections, MLP and head run, the rest of
        that layer's rows do not (each row's result is its own, so the logits are the same bits as the
        full block's rows). The block's own K/V go to cache positions pos.., which the caller truncates."""
        from ..forward import ATTENTION, LAYER_PHASES
        m, b = self.model, self.block
        s = m.state
        k = b - 1 if k is None else max(1, min(k, b - 1))
        m.begin(np.zeros(b, np.int32), pos, self.cache)
        s.x[0] = self._erow(int(token))
        s.x[1:b] = self.mask
        last = self.n_layers - 1
        for i in range(last):
            m.be.rmsnorm(s.xb[:b], s.x[:b], m.layers[i].attn_norm, self.eps)
            for ph in LAYER_PHASES:
                if ph.kind == ATTENTION:
                    self._attention(i, pos, 0, b)
                    continue
                m.phase(ph, i)
                m.tail(ph, i)  # QKV's tail: rope at pos.. and the block's K/V into the cache
        self._last_layer(last, pos, k)
        if s.logits is None or s.logits.shape[0] < k:
            s.logits = m.be.zeros((b, m.args.vocab_size), "float32")
        m.be.rmsnorm(s.xb[1:1 + k], s.x[1:1 + k], m.output_norm, self.eps)  # Model.head_device over rows 1..k
        m.be.matmul(s.logits[:k], s.xb[1:1 + k], m.output, s.scratch)
        return m.be.to_host(s.logits[:k])

    def _last_layer(self, i: int, pos: int, k: int) -> None:
        """Layer i over the block with only rows 1..k carried past the keys and values (Model.phase/tail's
        kernels and order, on row slices)."""
        m, b = self.model, self.block
        a, be, s, lw = m.args, m.be, m.state, m.layers[i]
        rows = slice(1, 1 + k)
        be.rmsnorm(s.xb[:b], s.x[:b], lw.attn_norm, self.eps)
        be.matmul(s.q[rows], s.xb[rows], lw.wq, s.scratch)
        be.matmul(s.k[:b], s.xb[:b], lw.wk, s.scratch)
        be.matmul(s.v[:b], s.xb[:b], lw.wv, s.scratch)
        be.rope(s.q[rows].reshape(k, a.n_head, a.head_dim), pos + 1, m.inv_freq, self.neox)
        k3, v3 = s.k[:b].reshape(b, a.n_kv_head, a.head_dim), s.v[:b].reshape(b, a.n_kv_head, a.head_dim)
        be.rope(k3, pos, m.inv_freq, self.neox)
        be.kv_store_f16(*self.cache.layer(i), k3, v3, pos)
        self._attention(i, pos, 1, 1 + k)
        x, xb = s.x[rows], s.xb[rows]
        be.matmul(s.proj[rows], s.att[rows], lw.wo, s.scratch)
        be.residual_add(x, s.proj[rows])
        be.rmsnorm(xb, x, lw.ffn_norm, self.eps)
        be.matmul(s.gate[rows], xb, lw.w_gate, s.scratch)
        be.matmul(s.up[rows], xb, lw.w_up, s.scratch)
        be.swiglu(s.hb[rows], s.gate[rows], s.up[rows])
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
        m, n = self.model, hi - lo
        a, s = m.args, m.state
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
            s.q[lo:hi].reshape(n, a.n_kv_head, g, a.head_dim).transpose(1, 0, 2, 3))
        k, v = self.cache.layer(layer)
        attention_f16_split(out, q1, k.view(np.uint16), v.view(np.uint16), pos + self.block - 1,
                            np.float32(m.attn_scale), sc, part)  # its SPLITS work items over the threads
        s.att[lo:hi] = out.reshape(a.n_kv_head, n, g, a.head_dim).transpose(1, 0, 2, 3).reshape(n, -1)

    def token(self, j: int) -> int:
        """The token of head row j."""
        return int(j) if self.hot_ids is None else int(self.hot_ids[j])


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
    from ..gguf import load_gguf
    path, why = find(FORMAT, VERSION, model_path)
    if path is None:
        from ..errors import ConfigError
        raise ConfigError(f"--spec dflash: {why}")
    key = (str(path), path.stat().st_mtime_ns, str(model_path), lm_head_draft, capacity)
    if key not in _NETS:  # a reply makes its drafter; the network (weights quantized, a KV cache) is kept
        target = load_gguf(model_path)
        df = load(path, FORMAT, VERSION, model_path, ("hot_ids", "fc", "hidden_norm", "mask_emb", "norm"))
        _NETS.clear()  # one model's drafter at a time
        _NETS[key] = DFlashNet(df, target, capacity or target.args.context_length, hot=lm_head_draft)
    drafter = DFlashDrafter(_NETS[key])  # reset(): the network's cache starts empty
    if not adaptive:
        return drafter
    from .adaptive import shared_cost_table
    return DFlashAdaptive(drafter, cost_table=shared_cost_table(model))
