"""The fused step's weights: each layer-matrix role as one table of per-layout stacks, whatever mix of types
the file has (step_mm.py's docstring gives the table).

Why tables: numba compiles the step for fixed argument types, and a Q4_K_M file mixes types per role and per
layer (llama.cpp gives attn_v and ffn_down Q6_K in some layers only, Q5_0 where rows are not a multiple of
256 values, Q8_0 here and there). A role's table holds one stack per layout (fast's Q4, Q4K and Q8, kquant's Q5
and Q6; empty where the role has none) and per layer its layout and slot, so every mix is the same types.

No second copy of the weights is kept: a role whose layers are all in fast.prepare_layers' buffer keeps that
view (its per-thread parts); the others are copied here once into stacks, their weights then view their
slots (the plain walk reads the same bytes) and the old arrays are freed (the weight store lets go of them:
WeightStore.release). All roles share prepare_layers' part count P when every
role's row groups divide into it, else P = 1 (then the prepared views are stacked again). Nothing here is
jitted (numba_env.NOT_JITTED).
"""
from __future__ import annotations

import numpy as np

from ...forward import MATRIX_ROLES
from .fast import FastWeight
from .kquant import KWeight, with_m
from .layout import G
from .step_mm import Q4, Q4K, Q5, Q6, Q8

_DTYPE = {Q4: np.uint8, Q8: np.int8, Q5: np.uint8, Q6: np.uint8}
_PARTED = (Q4, Q4K)  # the layouts whose stacks come in P parts (fast.prepare_layers' views)


def layout(w) -> int | None:
    """A prepared weight's layout (step_mm.Q4 / Q4K / Q8 / Q5 / Q6), or None: not one the fused step takes."""
    if isinstance(w, FastWeight):
        return {"q4": Q4, "q4k": Q4K}.get(w.kind, Q8)
    if isinstance(w, KWeight):
        return Q5 if w.bits == 5 else Q6
    return None


def _groups(w) -> int:
    return -(-w.shape[0] // G)


def _viewed(ws) -> bool:
    """All of a role's layers are slots of one (L, P, h, nb, BLK4 | nsb, SB4K) view (prepare_layers, or an
    earlier build)."""
    st = ws[0].stack if isinstance(ws[0], FastWeight) else None
    return st is not None and st.shape[0] == len(ws) and all(
        isinstance(w, FastWeight) and w.kind == ws[0].kind and w.stack is st for w in ws)


def plain(model) -> bool:
    """The model's matrices are all fast 4-bit blocks, its embedding and head Q4 / Q8 (the plain set of
    argument types, step_mm's docstring)."""
    ws = [getattr(lw, r) for lw in model.layers for r in MATRIX_ROLES]
    return all(isinstance(w, FastWeight) and w.kind == "q4" for w in ws) and all(
        isinstance(w, FastWeight) and w.kind in ("q4", "q8") for w in (model.tok_embd, model.output))


def role_tables(layers, mixed: bool = True) -> dict:
    """{role: its table} for the layers' matrices (MATRIX_ROLES), each of a layout step_mm takes; without
    `mixed` (a plain model) the (q4 stack, acc16) pairs."""
    if not mixed:
        return {r: (st, getattr(layers[0], r).acc16) for r, st in role_stacks(layers).items()}
    roles = {r: [getattr(lw, r) for lw in layers] for r in MATRIX_ROLES}
    views = {r: ws[0].stack for r, ws in roles.items() if _viewed(ws)}
    ps = {st.shape[1] for st in views.values()}
    P = ps.pop() if len(ps) == 1 else 1
    if P > 1 and any(_groups(ws[0]) % P for ws in roles.values()):
        P = 1
    return {r: (_view_table(views[r], layout(ws[0])) if r in views and views[r].shape[1] == P
                else _stacked_table(ws, P)) for r, ws in roles.items()}


def _view_table(st, k: int) -> tuple:
    n_l, P, h = st.shape[:3]
    return (st if k == Q4 else _empty_parts(P, h), np.zeros((P * h, G), np.int16), np.full(n_l, k, np.int64),
            np.arange(n_l, dtype=np.int64), *_others(P * h, {k: st}))


def _empty_parts(P: int, h: int) -> np.ndarray:
    """A stack of no 4-bit layers that still says P and h (step_mm._mm_groups reads them from w[0])."""
    return np.zeros((0, P, h, 1, 1), np.uint8)


def _stacked_table(ws, P: int) -> tuple:
    """A role's stacks by layout (copies, which its weights then view) with P parts for its 4-bit layers."""
    ng = _groups(ws[0])
    kinds = [layout(w) for w in ws]
    at, seen = np.zeros(len(ws), np.int64), {}
    for l, k in enumerate(kinds):  # layer l's slot: how many layers of its layout come before it
        at[l] = seen[k] = seen.get(k, -1) + 1
    stacks = {k: _stack([w for w, kk in zip(ws, kinds) if kk == k], k, ng, P) for k in seen}
    q4 = stacks.get(Q4, _empty_parts(P, ng // P))
    for w in ws:  # an all-4-bit role is one view now (a later build takes it as it is: _viewed)
        if isinstance(w, FastWeight):
            k = layout(w)
            w.stack = stacks[k] if len(seen) == 1 and k in _PARTED else None
    return (q4, np.zeros((ng, G), np.int16), np.array(kinds, np.int64), at, *_others(ng, stacks))


def _others(ng: int, stacks: dict) -> tuple:
    """(q8 stack, acc32, q5 stack, q6 stack, q4k stack) of a table: stacks' or empty ones."""
    def get(k):
        st = stacks.get(k)
        return st if st is not None else np.zeros((0, 1, 1, 1), _DTYPE[k])
    q4k = stacks.get(Q4K)
    return (get(Q8), np.zeros((ng if Q8 in stacks else 0, G), np.int32), get(Q5), get(Q6),
            q4k if q4k is not None else np.zeros((0, 1, 1, 1, 1), np.uint8))


def _stack(ws, k: int, ng: int, P: int) -> np.ndarray:
    """The weights' blocks as one (n, ...) stack: (n, P, ng / P, nb, BLK4 | nsb, SB4K) for Q4 / Q4K, (n, ng,
    nb, BLK) else; each weight then views its slot (its own blocks are freed once nothing else holds them)."""
    blocks = [w.blocks.reshape((ng,) + w.blocks.shape[-2:]) for w in ws]
    if k == Q5 and len({b.shape[-1] for b in blocks}) > 1:  # Q5_0 (no m) beside Q5_1 / Q5_K: all with m
        blocks = [with_m(b) for b in blocks]
    st = np.stack([b.reshape((P, ng // P) + b.shape[1:]) if k in _PARTED else b for b in blocks])
    for i, w in enumerate(ws):
        if isinstance(w, FastWeight):
            w.set_blocks(st[i])
        else:
            w.blocks = st[i]
    return st


def table(w, mixed: bool = True) -> tuple:
    """An embedding / head table: (layout, blocks u8 if Q4 / Q5 / Q6, blocks i8 if Q8, acc16, acc32), and for
    a mixed model a sixth element (its mark: step_mm._mixed)."""
    k = layout(w)
    u8, i8 = np.zeros((1, 1, 1), np.uint8), np.zeros((1, 1, 1), np.int8)
    if isinstance(w, FastWeight):
        t = (k, w.blocks if k in _PARTED else u8, w.blocks if k == Q8 else i8, w.acc16, w.acc32)
    else:
        t = (k, w.blocks, i8, np.zeros((0, G), np.int16), np.zeros((0, G), np.int32))
    return t + (True,) if mixed else t


def role_stacks(layers) -> dict:
    """Per role (layers all in 4-bit blocks: a plain model's role tables' first arrays), the layers' blocks as
    one (L, P, ng / P, nb, BLK4) array of P parts: the view that
    fast.prepare_layers made (no copy of the weights at load) when every role has one with the same P,
    else stacked copies of one part (P = 1). The layers' FastWeights then view their slots."""
    stacks = {r: getattr(layers[0], r).stack for r in MATRIX_ROLES}
    if any(st is None or any(getattr(lw, r).stack is not st for lw in layers) for r, st in stacks.items()) \
            or len({st.shape[1] for st in stacks.values()}) != 1:
        stacks = {}
        for r in MATRIX_ROLES:
            ws = [getattr(lw, r) for lw in layers]
            stacks[r] = np.stack([w.blocks.reshape((-1,) + w.blocks.shape[-2:]) for w in ws])[:, None]
            for i, w in enumerate(ws):
                w.set_blocks(stacks[r][i])
                w.stack = stacks[r]
    return stacks
