"""Which OpenAI-compatible server is at the endpoint, and what a client may ask of it.

The OpenAI API itself has no field for a thinking budget, a speculative mode or top-k; each server adds its own
(or none). `detect` tells the servers apart by the `owned_by` of their /v1/models entries (the one field every
implementation fills with its own name), and `Server` says which of our request fields it takes and, for each
feature a client cannot use there, why, so the UI can say so instead of sending something the server ignores.

    ninfer-serve       owned_by "ninfer"    everything per request: spec_mode, thinking_token_budget,
                                            chat_template_kwargs, top_k/min_p; our stats in the final chunk
    vLLM               owned_by "vllm"      thinking_token_budget, chat_template_kwargs, top_k/min_p;
                                            speculative counters on /metrics (vllm:spec_decode_*)
    SGLang             owned_by "sglang"    chat_template_kwargs, top_k/min_p
    llama.cpp server   owned_by "llamacpp"  chat_template_kwargs, top_k/min_p; `timings` in the final chunk
    llama-cpp-python   owned_by "me"        top_k/min_p
    anything else      (OpenAI's fields only: temperature, top_p, penalties, seed, stop, max_tokens)
"""
from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

from ..config import SPEC_MODES

# Features the chat can change per reply, in the words the UI uses for them.
FEATURES = {
    "spec": "speculative mode (F2)",
    "thinking": "thinking on/off (F4)",
    "budget": "thinking budget (F5/F6)",
    "top_k_min_p": "top-k and min-p",
    "context": "context size",
    "gpu": "GPU telemetry",
}


@dataclass(frozen=True)
class Server:
    """What we know of one kind of server (`detect` picks it)."""

    kind: str  # ninfer-serve | vllm | sglang | llama.cpp | llama-cpp-python | openai-compatible
    label: str  # as the UI names it
    spec_per_request: bool = False  # takes our `spec_mode` / `speculative.n_max` per request
    budget: bool = False  # takes `thinking_token_budget`
    template_kwargs: bool = False  # takes `chat_template_kwargs` (enable_thinking)
    top_k_min_p: bool = False  # takes `top_k` and `min_p`
    spec_metrics: str | None = None  # the /metrics prefix of vLLM-style speculative counters
    stream_usage: bool = True  # takes stream_options.include_usage
    neutral: tuple[tuple[str, object], ...] = ()  # fields whose server default would add to our chain, neutralised

    def unavailable(self, host: str) -> dict[str, str]:
        """feature -> why a client cannot change it on this server (features absent here can be used)."""
        out = {}
        if not self.spec_per_request:
            out["spec"] = f"{self.label} sets speculative decoding when it starts; a client cannot switch it"
        if not self.template_kwargs:
            out["thinking"] = (f"{self.label} takes no chat_template_kwargs: whether the model thinks is up to the "
                               "server's chat template")
        if not self.budget:
            out["budget"] = f"{self.label} has no per-request thinking budget"
        if not self.top_k_min_p:
            out["top_k_min_p"] = f"not OpenAI API fields, and {self.label} is not known to take them: not sent"
        out["context"] = f"{self.label} sets the context size when it starts"
        out["gpu"] = f"the model runs on {host}; that machine's GPU is not visible from here"
        return out

    def spec_modes(self, reported: dict | None = None) -> dict[str, str | None]:
        """Every speculative mode -> None (the client may ask for it) or why not."""
        if self.spec_per_request:
            reported = reported or {}
            return {m: None if m == "off" else reported.get(m, "not reported by the server") for m in SPEC_MODES}
        why = f"set when {self.label} starts"
        return {m: None if m == "off" else why for m in SPEC_MODES}


SERVERS = {
    "ninfer": Server("ninfer-serve", "ninfer-serve", spec_per_request=True, budget=True, template_kwargs=True,
                     top_k_min_p=True),
    "vllm": Server("vllm", "vLLM", budget=True, template_kwargs=True, top_k_min_p=True, spec_metrics="vllm:"),
    "sglang": Server("sglang", "SGLang", template_kwargs=True, top_k_min_p=True),
    "llamacpp": Server("llama.cpp", "llama.cpp's server", template_kwargs=True, top_k_min_p=True),
    # its repeat_penalty defaults to 1.1: sent as 1.0, so penalties are the OpenAI ones the chat shows (F3)
    "me": Server("llama-cpp-python", "llama-cpp-python's server", top_k_min_p=True, stream_usage=False,
                 neutral=(("repeat_penalty", 1.0),)),
}
GENERIC = Server("openai-compatible", "this server")


def detect(models: list[dict]) -> Server:
    """The server behind a /v1/models listing (its entries as dicts)."""
    for m in models:
        server = SERVERS.get(str(m.get("owned_by", "")).lower())
        if server is not None:
            return server
    return GENERIC


def host_of(endpoint: str) -> str:
    """host:port of an endpoint URL, for the UI."""
    return urlsplit(endpoint).netloc or endpoint


def normalize_endpoint(url: str) -> str:
    """An OpenAI base URL: http(s), no trailing slash; a URL with no path gets /v1 (llama.cpp's and vLLM's
    servers are often given as http://host:port). ValueError with the reason for anything else."""
    url = url.strip()
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"{url!r} is not an http(s) URL; give one like http://127.0.0.1:8080/v1")
    if parts.query or parts.fragment:
        raise ValueError(f"{url!r} has a query or fragment; give the API's base URL, like http://127.0.0.1:8080/v1")
    path = parts.path.rstrip("/")
    return f"{parts.scheme}://{parts.netloc}{path or '/v1'}"


def metrics_url(endpoint: str) -> str:
    """/metrics sits at the server's root (vLLM, ninfer-serve), not under /v1."""
    p = urlsplit(endpoint)
    root = p.path.rstrip("/")
    root = root.removesuffix("/v1")
    return f"{p.scheme}://{p.netloc}{root}/metrics"
