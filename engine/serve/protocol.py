"""The OpenAI wire format: request models (pydantic, strict types), the error shape, and the response and
chunk bodies built from engine events.

Request fields beyond OpenAI's are named as the servers our users already run name them:
  top_k, min_p                         vLLM and llama.cpp's server (top_k -1 = off, as in vLLM; 0 too)
  chat_template_kwargs.enable_thinking vLLM / SGLang / llama.cpp (Qwen3's template switch): thinking on/off
  thinking_token_budget                vLLM's per-request reasoning budget (tokens before the close is forced);
  thinking_budget_tokens               accepted as the same field (the name in our issue tracker and some
                                       llama.cpp front ends); chat_template_kwargs.thinking_budget (SGLang's
                                       Qwen3 template hint) is read as the budget too
  reasoning_effort                     OpenAI's: low | medium | high = 1/4, 1/2, 3/4 of max_tokens
                                       (engine.options), "none" = thinking off
  speculative.n_max                    llama.cpp's server: drafts per round (our --draft-tokens)
  spec_mode                            ours (no server has a per-request mode): off | ngram | mtp | dflash
Unknown fields are ignored (clients send vendor fields); known fields we cannot honour (n > 1, logprobs,
tools, a JSON response_format, echo, suffix, best_of > 1) are a 400 that names them, never silently dropped.
"""
from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
)

from ..config import SPEC_MODES
from ..events import FinalStats

MAX_STOPS = 16  # OpenAI allows 4; llama.cpp any number. Each is checked after every token, so keep it small.


class ApiError(Exception):
    """An error the client gets in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def from_validation(e: ValidationError) -> ApiError:
    """The first pydantic error as one 400 naming the field (the JSON path, dotted)."""
    err = e.errors(include_url=False)[0]
    loc = ".".join(str(p) for p in err["loc"] if not (isinstance(p, str) and p.startswith(("function-", "list[",
                                                                                               "union["))))
    got = err.get("input")
    shown = repr(got)[:60] if not isinstance(got, dict) else "an object"
    return ApiError(400, f"{loc or 'body'}: {err['msg']} (got {shown})", param=loc or None, code="invalid_value")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, populate_by_name=True)


class StreamOptions(_Strict):
    include_usage: StrictBool = False


class ContentPart(_Strict):
    type: StrictStr
    text: StrictStr | None = None


class Message(_Strict):
    role: StrictStr
    content: StrictStr | list[ContentPart] | None = None

    def text(self, i: int) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        out = []
        for j, part in enumerate(self.content):
            if part.type != "text" or part.text is None:
                raise ApiError(400, f"messages.{i}.content.{j}: only text parts are supported, got type "
                               f"{part.type!r}", param=f"messages.{i}.content", code="unsupported_content")
            out.append(part.text)
        return "".join(out)


Number = Annotated[float, Field(allow_inf_nan=False)]


class SamplingFields(_Strict):
    """The fields both endpoints share: model, length, sampling chain, penalties, stop, stream, speculation."""

    model: StrictStr | None = None
    max_tokens: StrictInt | None = Field(None, ge=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    temperature: Number | None = Field(None, ge=0, le=100)
    top_p: Number | None = Field(None, gt=0, le=1)
    top_k: StrictInt | None = Field(None, ge=-1)
    min_p: Number | None = Field(None, ge=0, le=1)
    presence_penalty: Number | None = Field(None, ge=-100, le=100)
    frequency_penalty: Number | None = Field(None, ge=-100, le=100)
    seed: StrictInt | None = Field(None, ge=0, lt=2 ** 63)
    stop: StrictStr | list[StrictStr] | None = None
    n: StrictInt = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    logprobs: Any = None
    top_logprobs: Any = None
    spec_mode: Literal[SPEC_MODES] | None = None  # type: ignore[valid-type]
    speculative_n_max: StrictInt | None = Field(None, alias="speculative.n_max", ge=1, le=15)

    def check_supported(self) -> None:
        if self.n != 1:
            raise ApiError(400, f"n: only 1 choice per request is supported, got {self.n}", param="n")
        if self.logprobs not in (None, False, 0) or self.top_logprobs not in (None, 0):
            raise ApiError(400, "logprobs: not supported by this server", param="logprobs")
        stops = self.stops()
        if len(stops) > MAX_STOPS or any(not s for s in stops):
            raise ApiError(400, f"stop: give at most {MAX_STOPS} non-empty strings", param="stop")

    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def max_new(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def sampling_flags(self) -> dict:
        """The keyword arguments of engine.options.sampling_params (None: the server's config value)."""
        return {"temperature": self.temperature, "top_p": self.top_p, "min_p": self.min_p, "seed": self.seed,
                "top_k": 0 if self.top_k == -1 else self.top_k, "max_new": self.max_new(),
                "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
                "stop": self.stops()}

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatRequest(SamplingFields):
    messages: list[Message] = Field(min_length=1)
    reasoning_effort: Literal["none", "low", "medium", "high"] | None = None
    thinking_token_budget: StrictInt | None = Field(None, ge=0)
    thinking_budget_tokens: StrictInt | None = Field(None, ge=0)
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list | None = None
    response_format: dict | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.tools:
            raise ApiError(400, "tools: tool calling is not supported by this server", param="tools")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise ApiError(400, f"response_format: only type 'text' is supported, got "
                           f"{self.response_format.get('type')!r}", param="response_format")

    def engine_messages(self) -> list[dict]:
        return [{"role": m.role, "content": m.text(i)} for i, m in enumerate(self.messages)]

    def thinking_flags(self) -> dict:
        """The keyword arguments of engine.options.thinking_params: mode, budget, effort."""
        kw = self.chat_template_kwargs or {}
        enable = kw.get("enable_thinking")
        if enable is not None and not isinstance(enable, bool):
            raise ApiError(400, "chat_template_kwargs.enable_thinking: must be true or false",
                           param="chat_template_kwargs.enable_thinking")
        budgets = {name: v for name, v in (("thinking_token_budget", self.thinking_token_budget),
                                           ("thinking_budget_tokens", self.thinking_budget_tokens),
                                           ("chat_template_kwargs.thinking_budget", kw.get("thinking_budget")))
                   if v is not None}
        for name, v in budgets.items():
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ApiError(400, f"{name}: must be an integer >= 0, got {v!r}", param=name)
        if len(set(budgets.values())) > 1:
            raise ApiError(400, f"{' and '.join(budgets)} disagree; give one thinking budget", param=next(iter(budgets)))
        budget = next(iter(budgets.values()), None)
        effort = self.reasoning_effort
        off = enable is False or effort == "none"
        if off and (budget is not None or effort not in (None, "none")):
            raise ApiError(400, "thinking is off (enable_thinking false or reasoning_effort none): a thinking "
                           "budget has nothing to limit; drop one of them", param="reasoning_effort")
        if budget is not None and effort not in (None, "none"):
            raise ApiError(400, "give a thinking budget or reasoning_effort, not both", param="reasoning_effort")
        mode = "off" if off else "on" if enable or budget is not None or effort else None
        return {"mode": mode, "budget": budget, "effort": None if effort == "none" else effort}


class CompletionRequest(SamplingFields):
    prompt: StrictStr | list[StrictStr] | list[StrictInt]
    echo: StrictBool = False
    suffix: StrictStr | None = None
    best_of: StrictInt | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise ApiError(400, "echo: not supported by this server", param="echo")
        if self.suffix:
            raise ApiError(400, "suffix: not supported by this server", param="suffix")
        if self.best_of not in (None, 1):
            raise ApiError(400, "best_of: only 1 is supported", param="best_of")
        if isinstance(self.prompt, list):
            if not self.prompt:
                raise ApiError(400, "prompt: must not be empty", param="prompt")
            if isinstance(self.prompt[0], str) and len(self.prompt) != 1:
                raise ApiError(400, "prompt: one prompt per request (a list of one string, or token ids)",
                               param="prompt")
        elif not self.prompt:
            raise ApiError(400, "prompt: must not be empty", param="prompt")


# -- responses ------------------------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


FINISH = {"stop": "stop", "length": "length", "cancelled": "stop", "error": "stop"}


def finish_reason(st: FinalStats | None) -> str:
    return FINISH.get(st.finish_reason, "stop") if st is not None else "stop"


def usage(st: FinalStats | None) -> dict:
    """OpenAI's usage object; reasoning tokens count in completion_tokens, as OpenAI counts them."""
    if st is None:
        return {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    return {"prompt_tokens": st.prompt_tokens, "completion_tokens": st.output_tokens,
            "total_tokens": st.prompt_tokens + st.output_tokens,
            "prompt_tokens_details": {"cached_tokens": st.cached_prompt_tokens},
            "completion_tokens_details": {"reasoning_tokens": st.reasoning_tokens}}


def timings(st: FinalStats | None) -> dict | None:
    """llama.cpp's server `timings` object (its key names), with our speculative and latency figures added."""
    if st is None:
        return None
    decode_s = max(st.wall_s - st.ttft_s, 0.0)
    return {
        # llama.cpp's names
        "prompt_n": st.prompt_tokens, "cache_n": st.cached_prompt_tokens,
        "prompt_ms": round(st.ttft_s * 1000, 3), "prompt_per_second": round(st.prefill_tok_s, 3),
        "predicted_n": st.output_tokens, "predicted_ms": round(decode_s * 1000, 3),
        "predicted_per_second": round(st.decode_tok_s, 3),
        "draft_n": st.drafted, "draft_n_accepted": st.accepted,
        # ours
        "ttft_ms": round(st.ttft_s * 1000, 3), "decode_tok_s": round(st.decode_tok_s, 3),
        "prefill_tok_s": round(st.prefill_tok_s, 3), "wall_ms": round(st.wall_s * 1000, 3),
        "reasoning_tokens": st.reasoning_tokens, "thinking_forced": st.thinking_forced,
        "spec_mode": st.spec_mode, "rounds": st.rounds, "acceptance": round(st.acceptance, 4),
        "tokens_per_round": round(st.tokens_per_round, 3), "ms_per_round": round(st.ms_per_round, 3),
        "draft_ms": round(st.draft_ms, 3), "verify_ms": round(st.verify_ms, 3),
        "backend": st.backend, "kv_dtype": st.kv_dtype, "finish_detail": st.stop_reason_detail,
    }


def chat_chunk(rid: str, created: int, model: str, delta: dict, finish: str | None = None,
               final: FinalStats | None = None, choices: bool = True) -> dict:
    out = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
           "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}] if choices else []}
    if final is not None:
        out["usage"] = usage(final)
        out["timings"] = timings(final)
    return out


def chat_response(rid: str, created: int, model: str, answer: str, reasoning: str, final: FinalStats | None) -> dict:
    msg = {"role": "assistant", "content": answer}
    if reasoning:
        msg["reasoning_content"] = reasoning
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": msg, "logprobs": None, "finish_reason": finish_reason(final)}],
            "usage": usage(final), "timings": timings(final)}


def completion_chunk(rid: str, created: int, model: str, text: str, finish: str | None = None,
                     final: FinalStats | None = None, choices: bool = True) -> dict:
    out = {"id": rid, "object": "text_completion", "created": created, "model": model,
           "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}] if choices else []}
    if final is not None:
        out["usage"] = usage(final)
        out["timings"] = timings(final)
    return out
