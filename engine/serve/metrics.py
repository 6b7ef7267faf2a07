"""/metrics in Prometheus text format (prometheus_client, one registry per app so tests stay apart).

Names follow vLLM's where a counterpart exists (prefix ninfer_ for vllm:), so a dashboard or client that
reads vLLM's speculative counters reads ours by swapping the prefix:
  ninfer_requests_total{endpoint, status}          every request answered, by HTTP status (429s included)
  ninfer_num_requests_running / _waiting           gauges read at scrape time
  ninfer_prompt_tokens_total, ninfer_prompt_cached_tokens_total, ninfer_generation_tokens_total,
  ninfer_reasoning_tokens_total
  ninfer_spec_decode_num_draft_tokens_total, ninfer_spec_decode_num_accepted_tokens_total,
  ninfer_spec_decode_num_rounds_total              acceptance = accepted / draft over any window
  ninfer_decode_seconds_total                      decode tok/s over a window = generation tokens / this
  ninfer_time_to_first_token_seconds               histogram (from the engine's start on the reply)
  ninfer_queue_wait_seconds                        histogram: arrival to the engine's start on the reply
  ninfer_e2e_request_latency_seconds               histogram (engine wall time of a reply)
  ninfer_decode_tokens_per_second                  gauge: the last reply's decode rate
"""
from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from ..events import FinalStats

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class Metrics:
    def __init__(self, counts=None):
        disable_created_metrics()  # no *_created gauges: they double the page and nothing here reads them
        r = self.registry = CollectorRegistry()
        self.requests = Counter("ninfer_requests", "Requests answered, by endpoint and HTTP status",
                                ("endpoint", "status"), registry=r)
        self.prompt_tokens = Counter("ninfer_prompt_tokens", "Prompt tokens of finished replies", registry=r)
        self.cached_tokens = Counter("ninfer_prompt_cached_tokens", "Prompt tokens reused from the KV cache",
                                     registry=r)
        self.generation_tokens = Counter("ninfer_generation_tokens", "Tokens generated (reasoning + answer)",
                                         registry=r)
        self.reasoning_tokens = Counter("ninfer_reasoning_tokens", "Reasoning tokens generated", registry=r)
        self.drafted = Counter("ninfer_spec_decode_num_draft_tokens", "Draft tokens proposed", registry=r)
        self.accepted = Counter("ninfer_spec_decode_num_accepted_tokens", "Draft tokens accepted", registry=r)
        self.rounds = Counter("ninfer_spec_decode_num_rounds", "Decode rounds (speculative or plain)", registry=r)
        self.decode_seconds = Counter("ninfer_decode_seconds", "Seconds spent decoding after the first token",
                                      registry=r)
        self.ttft = Histogram("ninfer_time_to_first_token_seconds", "Time to first token", registry=r,
                              buckets=LATENCY_BUCKETS)
        self.queue_wait = Histogram("ninfer_queue_wait_seconds", "Time a request waited for the engine",
                                    registry=r, buckets=LATENCY_BUCKETS)
        self.e2e = Histogram("ninfer_e2e_request_latency_seconds", "Engine wall time of a reply", registry=r,
                             buckets=LATENCY_BUCKETS)
        self.decode_rate = Gauge("ninfer_decode_tokens_per_second", "Decode tok/s of the last reply", registry=r)
        if counts is not None:  # () -> (running, waiting)
            Gauge("ninfer_num_requests_running", "Replies being generated", registry=r).set_function(
                lambda: counts()[0])
            Gauge("ninfer_num_requests_waiting", "Requests waiting for the engine", registry=r).set_function(
                lambda: counts()[1])

    def observe(self, st: FinalStats) -> None:
        """One finished reply (called from the engine thread; prometheus_client is thread-safe)."""
        self.prompt_tokens.inc(st.prompt_tokens)
        self.cached_tokens.inc(st.cached_prompt_tokens)
        self.generation_tokens.inc(st.output_tokens)
        self.reasoning_tokens.inc(st.reasoning_tokens)
        self.drafted.inc(st.drafted)
        self.accepted.inc(st.accepted)
        self.rounds.inc(st.rounds)
        if st.output_tokens:
            self.ttft.observe(st.ttft_s)
            self.decode_seconds.inc(max(st.wall_s - st.ttft_s, 0.0))
            self.decode_rate.set(st.decode_tok_s)
        self.e2e.observe(st.wall_s)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
