#!/usr/bin/env python3
"""Bit-level evidence for issue 2: reads llama.cpp's intermediate tensors (ggml eval callback) and shows
  1. ggml's AVX2 Q4_1 x Q8_1 dot product reproduced bit for bit (`dot_q4_1_q8_1`, the recipe below), and
  2. where llama.cpp's own batched and one-token-per-eval paths first differ (per op, per layer).

Recipe of ggml_vec_dot_q4_1_q8_1 (AVX2, llama-cpp-python 0.3.36), per output y[r] = W[r] . x:
  x is quantized per 32 values by quantize_act (probes/llama_numerics.py): d = f16(amax/127),
  q = rint(x * (127/amax)), s = f16(d_f32 * sum(q)).  For each block b (in order):
      summs  += f32(m_b * s_b)                      (exact: both f16)
      dd      = f32(d_w,b * d_x,b)                  (exact: both f16)
      lane[j] = fma(dd, sum_{k<4} qw[4j+k]*qx[4j+k], lane[j])   j = 0..7, one f32 fma each
  y = f32(f32(f32(lane0+lane4) + f32(lane2+lane6)) + f32(f32(lane1+lane5) + f32(lane3+lane7))) + summs
Q8_0 x Q8_0 (the head) is the same without summs.

Usage: probes/llama_bitexact.py [MODEL] [--layers 0,5,20] [--tokens 40]
"""
from __future__ import annotations

import argparse
import ctypes
import sys
from pathlib import Path

import numpy as np
from numba import njit, prange

ROOT = Path(__file__).resolve().parent.parent


class _GGMLTensor(ctypes.Structure):
    """The head of ggml.h's struct ggml_tensor (stable across recent ggml versions)."""
    _fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p), ("ne", ctypes.c_int64 * 4),
                ("nb", ctypes.c_size_t * 4), ("op", ctypes.c_int), ("op_params", ctypes.c_int32 * 16),
                ("flags", ctypes.c_int32), ("src", ctypes.c_void_p * 10), ("view_src", ctypes.c_void_p),
                ("view_offs", ctypes.c_size_t), ("data", ctypes.c_void_p), ("name", ctypes.c_char * 64)]


class Tap:
    """While installed, every llama.cpp context created records its f32 tensors whose names start with one
    of `prefixes`, as {name: [array per evaluation]} (shape in numpy order)."""

    def __init__(self, prefixes):
        from llama_cpp import llama_cpp as lc
        self.lc, self.prefixes, self.got = lc, tuple(prefixes), {}
        self._cb = lc.ggml_backend_sched_eval_callback(self._on_tensor)
        self._orig = lc.llama_context_default_params

    def _on_tensor(self, t, ask, _user):
        tt = ctypes.cast(t, ctypes.POINTER(_GGMLTensor)).contents
        name = tt.name.decode()
        if ask:
            return name.startswith(self.prefixes)
        if tt.type == 0 and "(" not in name:  # f32, not a view/reshape of an already seen tensor
            ne, nb = list(tt.ne), list(tt.nb)
            n = max((ne[i] - 1) * nb[i] for i in range(4)) + 4
            buf = np.frombuffer((ctypes.c_char * n).from_address(tt.data), np.float32)
            arr = np.lib.stride_tricks.as_strided(buf, ne[::-1], nb[::-1]).copy()
            self.got.setdefault(name, []).append(arr)
        return True

    def __enter__(self):
        def params():
            p = self._orig()
            p.cb_eval, p.cb_eval_user_data = self._cb, None
            return p
        self.lc.llama_context_default_params = params
        return self

    def __exit__(self, *exc):
        self.lc.llama_context_default_params = self._orig


@njit(parallel=True)
def dot_q4_1_q8_1(wq, wd, wm, xq, xd, xs, out):
    """out (T, R) f32 = ggml's AVX2 Q4_1 . Q8_1 for weights (wq u8 (R, nb, 32), wd/wm f32 (R, nb)) and
    quantized activations (xq int8 (T, nb, 32), xd/xs f32 (T, nb)). f32 fma emulated in f64 (exact
    product, one rounding)."""
    for t in prange(xq.shape[0]):
        lane = np.empty(8, np.float32)
        for r in range(wq.shape[0]):
            lane[:] = 0
            summs = np.float32(0)
            for b in range(wq.shape[1]):
                summs = np.float32(summs + np.float32(wm[r, b] * xs[t, b]))
                dd = np.float32(wd[r, b] * xd[t, b])
                for j in range(8):
                    isum = 0
                    for k in range(4 * j, 4 * j + 4):
                        isum += np.int32(wq[r, b, k]) * np.int32(xq[t, b, k])
                    lane[j] = np.float32(np.float64(dd) * np.float64(isum) + np.float64(lane[j]))
            h02 = np.float32(np.float32(lane[0] + lane[4]) + np.float32(lane[2] + lane[6]))
            h13 = np.float32(np.float32(lane[1] + lane[5]) + np.float32(lane[3] + lane[7]))
            out[t, r] = np.float32(np.float32(h02 + h13) + summs)


def q4_1_parts(qt):
    """A Q4_1 QTensor as (q u8 (R, nb, 32), d f32 (R, nb), m f32 (R, nb))."""
    from engine.quant import _raw_rows
    rows, cols = qt.shape
    raw = _raw_rows(qt).reshape(rows, cols // 32, 20)
    d = raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    qs = raw[..., 4:]
    return np.ascontiguousarray(np.concatenate([qs & 15, qs >> 4], -1)), d, m


def exact_matmul(qt, x):
    """x (T, n) f32 -> (T, R) f32 exactly as llama.cpp's CPU mul_mat with a Q4_1 weight (AVX2)."""
    from llama_numerics import quantize_act
    q, d, s = quantize_act(x)
    wq, wd, wm = q4_1_parts(qt)
    out = np.empty((x.shape[0], wq.shape[0]), np.float32)
    dot_q4_1_q8_1(wq, wd, wm, q.astype(np.int8), d.astype(np.float32), s.astype(np.float32), out)
    return out


MATMULS = (("Qcur", "attn_q", "attn_norm"), ("Kcur", "attn_k", "attn_norm"), ("Vcur", "attn_v", "attn_norm"),
           ("attn_out", "attn_output", "kqv_out"), ("ffn_gate", "ffn_gate", "ffn_norm"),
           ("ffn_up", "ffn_up", "ffn_norm"), ("ffn_out", "ffn_down", "ffn_swiglu"))
OPS = ("attn_norm", "Qcur", "Kcur", "Vcur", "kq", "kq_soft_max", "kqv", "kqv_out", "attn_out", "ffn_inp",
       "ffn_norm", "ffn_gate", "ffn_up", "ffn_swiglu", "ffn_out", "l_out")


def capture(path, ids, one_by_one):
    """{name: (T, ...) f32} of layer ops for ids read in one batch or one token per eval (first record of
    each name per eval: the op output before reshapes)."""
    import oracle_agreement as oa
    with Tap([o + "-" for o in OPS]) as tap:
        ref = oa.llama_cpp_model(path, n_ctx=512, n_batch=512, logits_all=True)
        for part in ([[t] for t in ids] if one_by_one else [ids]):
            ref.eval(part)
    return tap.got


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?")
    ap.add_argument("--layers", default="0,5,20")
    ap.add_argument("--tokens", type=int, default=40)
    args = ap.parse_args(argv)
    sys.path[:0] = [str(ROOT), str(ROOT / "probes")]
    import oracle_agreement as oa

    from engine.gguf import load_gguf
    from engine.paths import resolve_model
    from engine.tokenizer import Tokenizer
    path = resolve_model(args.model)
    mf = load_gguf(path)
    ids = Tokenizer.from_gguf(path).encode(oa.TEXT_FILE.read_text(encoding="utf-8"))[:args.tokens]
    one = capture(path, ids, one_by_one=True)
    batch = capture(path, ids, one_by_one=False)
    layers = [int(v) for v in args.layers.split(",")]
    print(f"1. Q4_1 matmuls recomputed from llama.cpp's own inputs ({len(ids)} tokens, batched eval):")
    for layer in layers:
        cells = []
        for out, w, inp in MATMULS:
            x = batch[f"{inp}-{layer}"][0].reshape(len(ids), -1)
            want = batch[f"{out}-{layer}"][0].reshape(len(ids), -1)
            got = exact_matmul(mf.tensors[f"blk.{layer}.{w}.weight"], x)
            cells.append(f"{out} {(got == want).mean():.0%}")
        print(f"  layer {layer}: bit-exact " + ", ".join(cells))
    print("2. llama.cpp batched vs one token per eval, max |difference| per op (first 3 layers):")
    for layer in range(3):
        cells = []
        for op in OPS:
            b = batch[f"{op}-{layer}"][0]
            rows = one[f"{op}-{layer}"]
            rows = rows[::len(rows) // len(ids)]  # a name can be recorded more than once per eval
            if op in ("kq", "kq_soft_max"):  # (H, T, n_kv): compare the causal part
                d = max(np.abs(b[0, :, t, :t + 1] - rows[t][0, :, 0, :t + 1]).max() for t in range(len(ids)))
            elif op == "kqv":
                d = max(np.abs(b[0, :, t] - rows[t][0, :, 0]).max() for t in range(len(ids)))
            else:
                d = np.abs(b.reshape(len(ids), -1) - np.concatenate([r.reshape(1, -1) for r in rows])).max()
            cells.append(f"{op} {d:.1e}" if d else f"{op} 0")
        print(f"  layer {layer}: " + ", ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
