"""The chat and `ninfer` on a remote engine: any OpenAI-compatible server (ninfer-serve, vLLM, SGLang,
llama.cpp's server, llama-cpp-python, Ollama) behind the same event API as the in-process engine.

  client.py   RemoteEngine / RemoteSession (the official openai client), RemoteOptions from [remote] + flags
  stream.py   chunks -> TextDelta / ReasoningDelta / StepStats / FinalStats; tok/s and TTFT from the stream
  servers.py  which server it is (its /v1/models owned_by) and what a client may ask of it, with the reasons
  metrics.py  vLLM's speculative counters from /metrics (prometheus_client's parser)
  loop.py     the asyncio loop thread the async client runs on (a cancel closes the stream at once)
  errors.py   the client's exceptions as one line saying what to do

The engine never imports this package; the chat and `ninfer` do, only with an endpoint (docs/remote.md).
"""
from .client import RemoteEngine, RemoteOptions, RemoteSession, remote_options
from .errors import RemoteError

__all__ = ["RemoteEngine", "RemoteError", "RemoteOptions", "RemoteSession", "remote_options"]
