"""The openai client's exceptions as one line for the user: what happened and what to do about it."""
from __future__ import annotations

from ..errors import NinferError


class RemoteError(NinferError):
    """A remote endpoint could not be used (unreachable, refused the key, has no such model, failed a reply)."""


def _server_message(e) -> str:
    """The message the server put in its error body (OpenAI's {"error": {"message"}}, FastAPI's "detail", ...)."""
    body = getattr(e, "body", None)
    if isinstance(body, dict):
        inner = body.get("error", body)
        if isinstance(inner, dict):
            body = inner.get("message") or inner.get("detail") or inner.get("msg") or inner
        else:
            body = inner
    text = body if isinstance(body, str) else getattr(e, "message", "") or str(e)
    return " ".join(str(text).split())[:300]


def explain(e: BaseException, endpoint: str, model: str | None = None, served: list[str] | None = None) -> RemoteError:
    """A RemoteError for an exception of the openai client (others: their type and text)."""
    import openai

    if isinstance(e, openai.APITimeoutError):
        return RemoteError(f"{endpoint} did not answer in time; check that the server is up and not overloaded, "
                           "or raise [remote] timeout")
    if isinstance(e, openai.APIConnectionError):
        cause = e.__cause__ or e.__context__
        why = " ".join(str(cause).split())[:160] if cause else "connection failed"
        return RemoteError(f"cannot reach {endpoint} ({why}); check the URL (--endpoint) and that the server is "
                           "running")
    if isinstance(e, (openai.AuthenticationError, openai.PermissionDeniedError)):
        return RemoteError(f"{endpoint} refused the API key (HTTP {e.status_code}: {_server_message(e)}); pass the "
                           "server's key with --api-key or [remote] api_key")
    if isinstance(e, openai.NotFoundError):
        msg = _server_message(e)
        if model and "model" in msg.lower():
            listed = f"; it serves {', '.join(served)}" if served else ""
            return RemoteError(f"{endpoint} has no model {model!r}{listed}; pick one with --model")
        return RemoteError(f"{endpoint} has no OpenAI API there (HTTP 404: {msg}); the URL usually ends in /v1")
    if isinstance(e, openai.RateLimitError):
        return RemoteError(f"{endpoint} is busy (HTTP 429: {_server_message(e)}); try again in a moment")
    if isinstance(e, openai.APIStatusError):
        if e.status_code >= 500:
            return RemoteError(f"{endpoint} failed (HTTP {e.status_code}: {_server_message(e)}); see the server's log")
        return RemoteError(f"{endpoint} refused the request (HTTP {e.status_code}: {_server_message(e)})")
    if isinstance(e, openai.APIError):  # an error event in the middle of a stream
        return RemoteError(f"{endpoint} stopped the reply with an error: {_server_message(e)}")
    if isinstance(e, openai.OpenAIError):
        return RemoteError(f"{endpoint}: {' '.join(str(e).split())[:300]}")
    return RemoteError(f"{endpoint}: {type(e).__name__}: {' '.join(str(e).split())[:300]}")
