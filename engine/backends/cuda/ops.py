"""numba.cuda device kernels for everything but the weight matmuls: norms, RoPE, SwiGLU, KV store, attention,
argmax. Launch wrappers with the `backends/ref/kernels.py` signatures live in `backends/cuda/kernels.py`.

Reductions go through shared memory (no warp shuffles) so the CUDA simulator runs the same code; every
kernel loops with stride blockDim, so the simulator can launch it with a handful of threads.
"""
from __future__ import annotations

import math

from numba import cuda, float32, float64, int8, int32, int64
from numba.types import float16

MAX_BLOCK = 128  # threads per block that shared arrays are sized for
MAX_HD = 256  # largest head_dim attention supports


# ----------------------------------------------------------------------------------------- elementwise
# Launch: grid-stride 1-D over all elements.
def residual_add(out, x):
    # out (R, n) += x (R, n)
    n = out.shape[1]
    for i in range(cuda.grid(1), out.shape[0] * n, cuda.gridsize(1)):
        out[i // n, i % n] += x[i // n, i % n]


def bias_add(out, b):
    # out (R, n) += b (n,)
    n = out.shape[1]
    for i in range(cuda.grid(1), out.shape[0] * n, cuda.gridsize(1)):
        out[i // n, i % n] += b[i % n]


def swiglu(out, gate, up):
    # out (T, f) <- silu(gate) * up
    n = out.shape[1]
    for i in range(cuda.grid(1), out.shape[0] * n, cuda.gridsize(1)):
        g = gate[i // n, i % n]
        out[i // n, i % n] = g / (float32(1.0) + math.exp(-g)) * up[i // n, i % n]


# ----------------------------------------------------------------------------------------------- norms
@cuda.jit(device=True, inline=True)
def _block_sum(sm, v):
    # sum of v over the block (all threads get it); sm (MAX_BLOCK,) f32 scratch
    tid = cuda.threadIdx.x
    sm[tid] = v
    cuda.syncthreads()
    s = float32(0.0)
    for i in range(cuda.blockDim.x):
        s += sm[i]
    cuda.syncthreads()
    return s


def rmsnorm(out, x, w, eps):
    # Launch: one block per row. out (R, n) <- x (R, n) / sqrt(mean(x^2) + eps) * w (n,)
    row = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    sm = cuda.shared.array(MAX_BLOCK, float32)
    n = x.shape[1]
    ss = float32(0.0)
    for j in range(tid, n, cuda.blockDim.x):
        v = x[row, j]
        ss += v * v
    tot = _block_sum(sm, ss)
    inv = float32(1.0) / math.sqrt(tot / float32(n) + float32(eps))
    for j in range(tid, n, cuda.blockDim.x):
        out[row, j] = x[row, j] * inv * w[j]


# Position-dependent kernels (rope, kv_store_*, attention_*) take the position as `pos` (1,) int32 device array
# + `pos_base` int: plain launches pass a zero array and pos_base = pos0; a captured CUDA graph passes the
# backend's position buffer (rewritten before each replay) and pos_base = 0.

# ------------------------------------------------------------------------------------------------ rope
def rope(x, pos, pos_base, inv_freq, neox):
    # Launch: grid-stride over T*H*hd/2 pairs. x (T, H, hd) f32 rotated in place; inv_freq (hd/2,) f32.
    pos0 = pos[0] + pos_base
    t_n, n_h, hd = x.shape
    half = hd // 2
    for i in range(cuda.grid(1), t_n * n_h * half, cuda.gridsize(1)):
        p = i % half
        h = (i // half) % n_h
        t = i // (half * n_h)
        ang = float64(pos0 + t) * float64(inv_freq[p])  # f64 angle: positions reach 10^4+
        c = math.cos(ang)
        s = math.sin(ang)
        if neox:
            i0, i1 = p, p + half
        else:
            i0, i1 = 2 * p, 2 * p + 1
        a = float64(x[t, h, i0])
        b = float64(x[t, h, i1])
        x[t, h, i0] = float32(a * c - b * s)
        x[t, h, i1] = float32(a * s + b * c)


def rope_qkv(q, k, v, qkv, bias, has_bias, pos, pos_base, inv_freq, neox, k_cache, v_cache, store):
    # Fused QKV epilogue (cuda_fused): qkv (T, H*hd + 2*KV*hd) f32 = [q | k | v] columns of one matmul;
    # (+ bias (Dtot,) when has_bias) -> q (T, H, hd) and k (T, KV, hd) rotated as `rope`, v (T, KV, hd) copied;
    # store != 0: k and v also go to an f16 cache (cap, KV, hd) at pos0 + t, as kv_store_f16 writes them (the
    # same f16 values, one launch fewer per layer).
    t_n, n_h, hd = q.shape
    n_kv = k.shape[1]
    half = hd // 2
    pos0 = pos[0] + pos_base
    for i in range(cuda.grid(1), t_n * (n_h + n_kv) * half, cuda.gridsize(1)):
        p = i % half
        hh = (i // half) % (n_h + n_kv)
        t = i // (half * (n_h + n_kv))
        if neox:
            i0, i1 = p, p + half
        else:
            i0, i1 = 2 * p, 2 * p + 1
        c0 = hh * hd  # q heads then k heads, contiguous in qkv
        a = qkv[t, c0 + i0]
        b = qkv[t, c0 + i1]
        if has_bias:
            a += bias[c0 + i0]
            b += bias[c0 + i1]
        ang = float64(pos0 + t) * float64(inv_freq[p])
        c = math.cos(ang)
        s = math.sin(ang)
        ra = float32(float64(a) * c - float64(b) * s)
        rb = float32(float64(a) * s + float64(b) * c)
        if hh < n_h:
            q[t, hh, i0] = ra
            q[t, hh, i1] = rb
        else:
            k[t, hh - n_h, i0] = ra
            k[t, hh - n_h, i1] = rb
            if store:
                k_cache[pos0 + t, hh - n_h, i0] = float16(ra)
                k_cache[pos0 + t, hh - n_h, i1] = float16(rb)
    v0 = (n_h + n_kv) * hd
    for i in range(cuda.grid(1), t_n * n_kv * hd, cuda.gridsize(1)):
        d = i % hd
        h = (i // hd) % n_kv
        t = i // (hd * n_kv)
        val = qkv[t, v0 + h * hd + d]
        if has_bias:
            val += bias[v0 + h * hd + d]
        v[t, h, d] = val
        if store:
            v_cache[pos0 + t, h, d] = float16(val)


# ---------------------------------------------------------------------------------------------- argmax
def argmax(out, logits):
    # Launch: one block per row. out (T,) int32 <- first index of the max of logits (T, V)
    row = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    sv = cuda.shared.array(MAX_BLOCK, float32)
    si = cuda.shared.array(MAX_BLOCK, int32)
    best = -math.inf
    bi = int32(-1)
    for j in range(tid, logits.shape[1], cuda.blockDim.x):
        v = logits[row, j]
        if v > best or bi < 0:  # increasing j: strict > keeps the first of ties
            best = v
            bi = int32(j)
    sv[tid] = best
    si[tid] = bi
    cuda.syncthreads()
    if tid == 0:
        b = sv[0]
        k = si[0]
        for i in range(1, cuda.blockDim.x):
            if si[i] >= 0 and (k < 0 or sv[i] > b or (sv[i] == b and si[i] < k)):
                b = sv[i]
                k = si[i]
        out[row] = k


# -------------------------------------------------------------------------------------------- KV cache
def kv_store_f16(k_cache, v_cache, k, v, pos, pos_base):
    # Launch: grid-stride over T*n_kv*hd. caches (cap, n_kv, hd) f16 [pos0+t] <- k, v (T, n_kv, hd) f32
    pos0 = pos[0] + pos_base
    t_n, kvh, hd = k.shape
    for i in range(cuda.grid(1), t_n * kvh * hd, cuda.gridsize(1)):
        d = i % hd
        h = (i // hd) % kvh
        t = i // (hd * kvh)
        k_cache[pos0 + t, h, d] = float16(k[t, h, d])
        v_cache[pos0 + t, h, d] = float16(v[t, h, d])


@cuda.jit(device=True, inline=True)
def _quant_group(dst_q, dst_s, src, p, t, h, g, group):
    # symmetric int8 of src[t, h, g*group : (g+1)*group] into dst_q[p, h, ...], scale into dst_s[p, h, g]
    amax = float32(0.0)
    for d in range(g * group, (g + 1) * group):
        amax = max(amax, abs(src[t, h, d]))
    s = amax / float32(127.0)
    inv = float32(1.0) / s if s > float32(0.0) else float32(0.0)
    for d in range(g * group, (g + 1) * group):
        y = src[t, h, d] * inv
        r = int32(y + math.copysign(float32(0.5), y))  # int conversion truncates: round half away from 0
        dst_q[p, h, d] = int8(min(max(r, int32(-127)), int32(127)))
    dst_s[p, h, g] = s


def kv_store_int8(k_q, k_s, v_q, v_s, k, v, pos, pos_base):
    # Launch: grid-stride over T*n_kv*(hd/group). k_q, v_q (cap, n_kv, hd) int8; k_s, v_s (cap, n_kv, hd/g) f32
    pos0 = pos[0] + pos_base
    t_n, kvh, hd = k.shape
    ng = k_s.shape[2]
    group = hd // ng
    for i in range(cuda.grid(1), t_n * kvh * ng, cuda.gridsize(1)):
        g = i % ng
        h = (i // ng) % kvh
        t = i // (ng * kvh)
        _quant_group(k_q, k_s, k, pos0 + t, t, h, g, group)
        _quant_group(v_q, v_s, v, pos0 + t, t, h, g, group)


# ------------------------------------------------------------------------------------------- attention
# Launch: grid (T, H), one block of nt threads per (query row, head). The causal range 0..pos0+t is walked in
# chunks of nt positions: thread i scores position c0+i into shared memory, then the block does an online
# softmax update (running max m, running sum l) and thread d owns output dims d, d+nt, ... (coalesced V reads).
@cuda.jit(device=True, inline=True)
def _softmax_chunk(sp, cn, m):
    # sp[:cn] scores -> exp(score - m_new); returns (m_new, chunk sum). All threads compute the same values.
    tid = cuda.threadIdx.x
    cmax = m
    for i in range(cn):
        cmax = max(cmax, sp[i])
    cuda.syncthreads()
    if tid < cn:
        sp[tid] = math.exp(sp[tid] - cmax)
    cuda.syncthreads()
    csum = float32(0.0)
    for i in range(cn):
        csum += sp[i]
    return cmax, csum


@cuda.jit(device=True, inline=True)
def _attend(qs, acc, sp, hd, k_c, k_s, v_c, v_s, has_scale, kvh, p_begin, p_end, scale):
    # The block's online softmax over positions [p_begin, p_end) for one query row (qs[:hd], shared) of one
    # head (KV head kvh) -> (m, l): acc[:hd] (shared) <- the unnormalised weighted V sum, m the running max, l
    # the sum of exp(score - m). has_scale 1: int8 caches with per-group scales k_s / v_s; 0: f16 caches (the
    # scale arguments are not read). Every thread returns the same (m, l).
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    group = hd // k_s.shape[2]
    m = float32(-math.inf)
    ltot = float32(0.0)
    for c0 in range(p_begin, p_end, nt):
        p = c0 + tid
        if p < p_end:
            dot = float32(0.0)
            if has_scale:
                for g in range(k_s.shape[2]):
                    part = float32(0.0)
                    for d in range(g * group, (g + 1) * group):
                        part += qs[d] * float32(k_c[p, kvh, d])
                    dot += part * float32(k_s[p, kvh, g])
            else:
                for d in range(hd):
                    dot += qs[d] * float32(k_c[p, kvh, d])
            sp[tid] = dot * float32(scale)
        cuda.syncthreads()
        cn = min(nt, p_end - c0)
        cmax, csum = _softmax_chunk(sp, cn, m)
        alpha = math.exp(m - cmax)
        ltot = ltot * alpha + csum
        for d in range(tid, hd, nt):
            a = acc[d] * alpha
            for i in range(cn):
                vv = float32(v_c[c0 + i, kvh, d])
                if has_scale:
                    vv *= float32(v_s[c0 + i, kvh, d // group])
                a += sp[i] * vv
            acc[d] = a
        m = cmax
        cuda.syncthreads()
    return m, ltot


@cuda.jit(device=True, inline=True)
def _attend_row(out, q, k_c, k_s, v_c, v_s, has_scale, pos, pos_base, scale):
    # out[t, h] <- softmax(q[t, h] K^T * scale) V over the causal range 0..pos0+t (grid (T, H))
    t = cuda.blockIdx.x
    h = cuda.blockIdx.y
    hd = q.shape[2]
    qs = cuda.shared.array(MAX_HD, float32)
    acc = cuda.shared.array(MAX_HD, float32)
    sp = cuda.shared.array(MAX_BLOCK, float32)
    for d in range(cuda.threadIdx.x, hd, cuda.blockDim.x):
        qs[d] = q[t, h, d]
        acc[d] = float32(0.0)
    cuda.syncthreads()
    kvh = h // (q.shape[1] // k_c.shape[1])
    m, ltot = _attend(qs, acc, sp, hd, k_c, k_s, v_c, v_s, has_scale, kvh, 0, pos[0] + pos_base + t + 1, scale)
    for d in range(cuda.threadIdx.x, hd, cuda.blockDim.x):
        out[t, h, d] = acc[d] / ltot


def attention_f16(out, q, k_cache, v_cache, pos, pos_base, scale):
    # out (T, H, hd) <- softmax(q K^T * scale) V, causal, GQA; q (T, H, hd) f32; caches (cap, n_kv, hd) f16
    _attend_row(out, q, k_cache, k_cache, v_cache, v_cache, 0, pos, pos_base, scale)


def attention_int8(out, q, k_q, k_s, v_q, v_s, pos, pos_base, scale):
    # as attention_f16 over int8 caches: k_q, v_q (cap, n_kv, hd) int8; k_s, v_s (cap, n_kv, hd/g) f32
    _attend_row(out, q, k_q, k_s, v_q, v_s, 1, pos, pos_base, scale)


# Split attention ("flash-decoding") for few query rows over a long cache: grid (T, H, S), block s handles
# positions [s*split_len, (s+1)*split_len) of the causal range and writes its partial softmax state (running
# max m, sum l, unnormalised acc); attention_combine merges the S partials. Decode at 4k context otherwise
# runs H = 9 blocks on a 80-132 SM GPU. has_scale = 1: int8 cache with scales k_s/v_s; 0: f16 (scales unused).
def attention_split(pm, pl, pacc, q, k_c, k_s, v_c, v_s, has_scale, pos, pos_base, scale, split_len):
    # pm, pl (T, H, S) f32; pacc (T, H, S, hd) f32; q (T, H, hd); caches (cap, n_kv, hd) f16 or int8
    t = cuda.blockIdx.x
    h = cuda.blockIdx.y
    si = cuda.blockIdx.z
    tid = cuda.threadIdx.x
    hd = q.shape[2]
    qs = cuda.shared.array(MAX_HD, float32)
    acc = cuda.shared.array(MAX_HD, float32)
    sp = cuda.shared.array(MAX_BLOCK, float32)
    for d in range(tid, hd, cuda.blockDim.x):
        qs[d] = q[t, h, d]
        acc[d] = float32(0.0)
    cuda.syncthreads()
    kvh = h // (q.shape[1] // k_c.shape[1])
    p_begin = si * split_len
    p_end = min(pos[0] + pos_base + t + 1, p_begin + split_len)
    m, ltot = _attend(qs, acc, sp, hd, k_c, k_s, v_c, v_s, has_scale, kvh, p_begin, p_end, scale)
    if tid == 0:
        pm[t, h, si] = m
        pl[t, h, si] = ltot
    for d in range(tid, hd, cuda.blockDim.x):
        pacc[t, h, si, d] = acc[d]


def attention_combine(out, pm, pl, pacc):
    # Launch: grid (T, H), threads over hd. out (T, H, hd) <- merge of the S partials of attention_split
    t = cuda.blockIdx.x
    h = cuda.blockIdx.y
    n_s = pm.shape[2]
    mx = float32(-math.inf)
    for si in range(n_s):
        if pl[t, h, si] > float32(0.0):
            mx = max(mx, pm[t, h, si])
    den = float32(0.0)
    for si in range(n_s):
        if pl[t, h, si] > float32(0.0):
            den += math.exp(pm[t, h, si] - mx) * pl[t, h, si]
    for d in range(cuda.threadIdx.x, out.shape[2], cuda.blockDim.x):
        a = float32(0.0)
        for si in range(n_s):
            if pl[t, h, si] > float32(0.0):
                a += math.exp(pm[t, h, si] - mx) * pacc[t, h, si, d]
        out[t, h, d] = a / den


_f2 = float32[:, :]
_f3 = float32[:, :, :]
_pos = int32[:]  # (1,) device position: pos0 = pos[0] + pos_base (graph replays change pos[0] only)
# name -> (python function, explicit signatures)
KERNELS = {
    "residual_add": (residual_add, [(_f2, _f2)]),
    "bias_add": (bias_add, [(_f2, float32[:])]),
    "swiglu": (swiglu, [(_f2, _f2, _f2)]),
    "rmsnorm": (rmsnorm, [(_f2, _f2, float32[:], float64)]),
    "rope": (rope, [(_f3, _pos, int64, float32[:], int32)]),
    "argmax": (argmax, [(int32[:], _f2)]),
    "kv_store_f16": (kv_store_f16, [(float16[:, :, :], float16[:, :, :], _f3, _f3, _pos, int64)]),
    "kv_store_int8": (kv_store_int8, [(int8[:, :, :], _f3, int8[:, :, :], _f3, _f3, _f3, _pos, int64)]),
    "attention_f16": (attention_f16, [(_f3, _f3, float16[:, :, :], float16[:, :, :], _pos, int64, float64)]),
    "attention_int8": (attention_int8, [(_f3, _f3, int8[:, :, :], _f3, int8[:, :, :], _f3, _pos, int64,
                                         float64)]),
    "attention_split": (attention_split, [
        (_f3, _f3, float32[:, :, :, :], _f3, float16[:, :, :], _f3, float16[:, :, :], _f3, int32, _pos, int64,
         float64, int64),
        (_f3, _f3, float32[:, :, :, :], _f3, int8[:, :, :], _f3, int8[:, :, :], _f3, int32, _pos, int64,
         float64, int64)]),
    "attention_combine": (attention_combine, [(_f3, _f3, _f3, float32[:, :, :, :])]),
    "rope_qkv": (rope_qkv, [(_f3, _f3, _f3, _f2, float32[:], int32, _pos, int64, float32[:], int32,
                             float16[:, :, :], float16[:, :, :], int32)]),
}
