"""Shared check of a packaged drafter on the default model (test_mtp.py, test_dflash.py)."""
from __future__ import annotations

import pytest

from engine.config import EngineArgs, GenerateRequest, SamplingParams


def greedy_lossless(smollm2_path, mode: str, k_for) -> object:
    """Greedy replies (chat and counting, 48 tokens) with the packaged `mode` drafter, full head and hot head
    (k_for(hot) drafts), equal plain decode's and drafted something; skips without a packaged drafter.
    Returns the hot-head engine (for the caller's sampled checks)."""
    from engine.api import Engine
    for hot in (False, True):
        eng = Engine.load(EngineArgs(model=str(smollm2_path), max_context=1024, prefix_reuse=False,
                                     lm_head_draft=hot))
        if eng.spec_modes()[mode] is not None:
            pytest.skip(f"no packaged {mode} drafter: {eng.spec_modes()[mode]}")
        for prompt in ("What is the capital of France?", "Count from 1 to 300."):
            msgs = [{"role": "user", "content": prompt}]
            want = list(eng.session().generate(msgs, GenerateRequest(SamplingParams(greedy=True, max_new=48))))[-1]
            req = GenerateRequest(SamplingParams(greedy=True, max_new=48), spec=mode, draft_tokens=k_for(hot))
            got = list(eng.session().generate(msgs, req))[-1]
            assert got.token_ids == want.token_ids and got.drafted > 0, (prompt, k_for(hot), hot)
    return eng
