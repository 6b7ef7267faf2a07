"""Load test of ninfer-serve: N concurrent streaming clients on loopback, nothing lost, latency percentiles.

    python -m engine.bench.serve_load --fake --clients 16 --requests 4        # the fake engine (no model)
    python -m engine.bench.serve_load --clients 4 --requests 2 -- --threads 2 # the default model, greedy
    python -m engine.bench.serve_load --url http://127.0.0.1:8080/v1 --clients 8

Without --url it starts `python -m engine.serve.main --port 0` (arguments after `--` go to it, plus --fake)
with a queue that holds every client, waits for it, runs the clients, then stops it with SIGTERM and checks
that it exited. Each client sends --requests streaming chat requests one after another (the same prompt,
greedy), reading with the openai client. Nothing lost: every request ends with a finish chunk and usage, and
every reply's text and token count equal the first one's (greedy). It reports client-side TTFT (first content
or reasoning chunk) and end-to-end latency percentiles, the server's per-reply decode tok/s, the aggregate
throughput, and 429s (none expected while --max-queue >= clients - 1).

The server generates one reply at a time, so with N clients a request waits for up to N-1 replies: its TTFT
grows with N while the aggregate tok/s stays the single-stream rate. This measures that.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


async def one_request(client, model: str, prompt: str, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    first = None
    text, finish, usage, timings = [], None, None, None
    try:
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=max_tokens,
            stream=True)
        async for ch in stream:
            if ch.choices:
                d = ch.choices[0].delta
                piece = (d.content or "") + ((d.model_extra or {}).get("reasoning_content") or "")
                if piece and first is None:
                    first = time.perf_counter() - t0
                text.append(piece)
                if ch.choices[0].finish_reason:
                    finish = ch.choices[0].finish_reason
                    usage = ch.usage
                    timings = (ch.model_extra or {}).get("timings")
    except Exception as e:  # noqa: BLE001 - counted and reported, the run goes on
        status = getattr(e, "status_code", None)
        return {"ok": False, "status": status, "error": f"{type(e).__name__}: {e}"[:200]}
    return {"ok": finish is not None and usage is not None, "text": "".join(text), "finish": finish,
            "tokens": usage.completion_tokens if usage else None, "ttft": first, "latency": time.perf_counter() - t0,
            "decode_tok_s": (timings or {}).get("decode_tok_s")}


async def run_clients(url: str, clients: int, requests: int, prompt: str, max_tokens: int, api_key: str) -> dict:
    import openai
    client = openai.AsyncOpenAI(base_url=url, api_key=api_key, max_retries=0, timeout=3600)
    model = (await client.models.list()).data[0].id

    async def one_client() -> list[dict]:
        return [await one_request(client, model, prompt, max_tokens) for _ in range(requests)]

    t0 = time.perf_counter()
    results = [r for rs in await asyncio.gather(*(one_client() for _ in range(clients))) for r in rs]
    wall = time.perf_counter() - t0
    await client.close()
    return summarize(results, wall, clients, requests)


def summarize(results: list[dict], wall: float, clients: int, requests: int) -> dict:
    ok = [r for r in results if r["ok"]]
    ref = ok[0] if ok else None
    same = [r for r in ok if ref and r["text"] == ref["text"] and r["tokens"] == ref["tokens"]]
    tokens = sum(r["tokens"] for r in ok)
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    lat = [r["latency"] for r in ok]
    dec = [r["decode_tok_s"] for r in ok if r["decode_tok_s"]]
    return {
        "clients": clients, "requests": clients * requests, "ok": len(ok), "identical": len(same),
        "rejected_429": sum(1 for r in results if r.get("status") == 429),
        "errors": [r["error"] for r in results if not r["ok"]][:5],
        "tokens_per_reply": ref["tokens"] if ref else 0, "wall_s": round(wall, 3),
        "aggregate_tok_s": round(tokens / wall, 1) if wall else 0.0,
        "ttft_s": {f"p{int(q * 100)}": round(percentile(ttft, q), 4) for q in (0.5, 0.9, 0.99)},
        "latency_s": {f"p{int(q * 100)}": round(percentile(lat, q), 4) for q in (0.5, 0.9, 0.99)},
        "server_decode_tok_s_median": round(percentile(dec, 0.5), 1) if dec else None,
    }


def start_server(extra: list[str], queue: int) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "engine.serve.main", "--port", "0", "--max-queue", str(queue),
           "--log-level", "warning", *extra]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env={**os.environ, "NINFER_API_KEY": ""})
    deadline = time.monotonic() + 600  # a cold numba cache compiles for a while
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line and proc.poll() is not None:
            raise SystemExit(f"serve_load: the server exited ({proc.returncode}) before it started")
        print(line, end="", file=sys.stderr)
        if "serving" in line and " on " in line:
            return proc, line.split(" on ")[1].split()[0]
    proc.kill()
    raise SystemExit("serve_load: the server did not start within 600 s")


def stop_server(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        rc = proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = proc.wait(10)
        print("serve_load: the server did not stop on SIGTERM; killed", file=sys.stderr)
    proc.stderr.close()
    return rc


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    server_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(prog="serve_load", description=__doc__.splitlines()[0])
    p.add_argument("--url", help="an already running server's base URL (…/v1); default: start one")
    p.add_argument("--fake", action="store_true", help="start the server on the fake engine")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--requests", type=int, default=2, help="requests per client, one after another")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt", default="What is the capital of France? Answer in one sentence.")
    p.add_argument("--api-key", default=os.environ.get("NINFER_API_KEY", "none"))
    p.add_argument("--max-queue", type=int, help="the started server's queue (default: clients - 1, no 429s)")
    p.add_argument("--json", metavar="FILE", help="also write the summary as JSON")
    a = p.parse_args(argv)
    proc = None
    url = a.url
    if url is None:
        proc, url = start_server(server_args + (["--fake"] if a.fake else []), queue=max(a.clients - 1, 0) if a.max_queue is None else a.max_queue)
    try:
        summary = asyncio.run(run_clients(url, a.clients, a.requests, a.prompt, a.max_tokens, a.api_key))
    finally:
        if proc is not None:
            rc = stop_server(proc)
            print(f"serve_load: server stopped (status {rc})", file=sys.stderr)
    print(json.dumps(summary, indent=1))
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=1)
    lost = summary["requests"] - summary["identical"] - summary["rejected_429"]
    return 0 if lost == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
