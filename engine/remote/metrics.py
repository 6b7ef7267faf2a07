"""A server's speculative-decoding counters from its Prometheus /metrics page (vLLM's names), read around a
reply: the difference is that reply's drafts and acceptances.

    vllm:spec_decode_num_drafts                 rounds with a draft
    vllm:spec_decode_num_draft_tokens           tokens proposed
    vllm:spec_decode_num_accepted_tokens        tokens accepted
    vllm:spec_decode_num_accepted_tokens_per_pos{position="i"}   accepted at draft position i

The counters are the server's, over all its clients: with other traffic in flight the difference includes
theirs (docs/remote.md). Parsed with prometheus_client's own text parser.
"""
from __future__ import annotations

from dataclasses import dataclass

DRAFTS, DRAFT_TOKENS, ACCEPTED, PER_POS = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens",
                                           "spec_decode_num_accepted_tokens",
                                           "spec_decode_num_accepted_tokens_per_pos")


@dataclass(frozen=True)
class SpecCounters:
    drafts: float = 0.0  # rounds
    draft_tokens: float = 0.0
    accepted: float = 0.0
    per_pos: tuple[float, ...] = ()  # accepted tokens at each draft position

    def minus(self, before: SpecCounters) -> SpecCounters:
        n = len(self.per_pos)
        old = before.per_pos + (0.0,) * max(0, n - len(before.per_pos))
        return SpecCounters(self.drafts - before.drafts, self.draft_tokens - before.draft_tokens,
                            self.accepted - before.accepted, tuple(a - b for a, b in zip(self.per_pos, old)))

    def per_position_accept(self) -> tuple[float, ...]:
        """Acceptance rate at each draft position (accepted there / rounds)."""
        return tuple(round(p / self.drafts, 4) for p in self.per_pos) if self.drafts > 0 else ()


def parse_spec_counters(text: str, prefix: str, model: str | None = None) -> SpecCounters | None:
    """The counters named `prefix` + DRAFT_TOKENS etc. in a Prometheus text page, summed over the samples of
    `model` (label model_name; all samples where there is no such label); None where the page has none."""
    from prometheus_client.parser import text_string_to_metric_families

    sums: dict[str, float] = {}
    per_pos: dict[int, float] = {}
    try:
        families = list(text_string_to_metric_families(text))
    except ValueError:
        return None
    for fam in families:
        if not fam.name.startswith(prefix):
            continue
        key = fam.name[len(prefix):].removesuffix("_total")
        if key not in (DRAFTS, DRAFT_TOKENS, ACCEPTED, PER_POS):
            continue
        for s in fam.samples:
            if s.name.endswith(("_created", "_bucket", "_count", "_sum")):
                continue
            if model is not None and s.labels.get("model_name", model) != model:
                continue
            if key == PER_POS:
                try:
                    pos = int(s.labels.get("position", ""))
                except ValueError:
                    continue
                per_pos[pos] = per_pos.get(pos, 0.0) + s.value
            else:
                sums[key] = sums.get(key, 0.0) + s.value
    if DRAFT_TOKENS not in sums:
        return None
    positions = tuple(per_pos.get(i, 0.0) for i in range(max(per_pos) + 1)) if per_pos else ()
    return SpecCounters(sums.get(DRAFTS, 0.0), sums[DRAFT_TOKENS], sums.get(ACCEPTED, 0.0), positions)
