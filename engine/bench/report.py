"""Aggregate runs per variant (mean and range), ratios against a baseline, the roofline, a table and JSON."""
from __future__ import annotations

import statistics

from .worker import RAMP_TOKENS

# (result key, column title, format, higher is better?) - the figures the user's protocol asks for
METRICS = (
    ("decode_tok_s", "decode tok/s", "{:.1f}", True),
    ("decode_steady_tok_s", "steady tok/s", "{:.1f}", True),  # after the reply's first tokens (worker.RAMP_TOKENS)
    ("prefill_tok_s", "prefill tok/s", "{:.1f}", True),
    ("ttft_s", "TTFT s", "{:.2f}", False),
    ("load_s", "load s", "{:.2f}", False),
    ("ms_per_round", "ms/round", "{:.2f}", False),
    ("tokens_per_round", "tok/round", "{:.2f}", True),
    ("acceptance", "accept", "{:.2f}", True),
    ("peak_rss_mb", "peak RSS MB", "{:.0f}", False),
)


def aggregate(results: list[dict], variant_names: list[str]) -> dict[str, dict]:
    """variant -> {metric: {mean, min, max, n}, sha256: [...], errors: [...], ...} over its ok runs."""
    out = {}
    for name in variant_names:
        runs = [r for r in results if r.get("variant") == name]
        ok = [r for r in runs if r.get("ok")]
        for r in ok:
            r["peak_rss_mb"] = r.get("peak_rss", 0) / 2**20
        agg: dict = {"runs": len(runs), "ok": len(ok), "errors": [r.get("error") for r in runs if not r.get("ok")]}
        for key, *_ in METRICS:
            vals = [float(r[key]) for r in ok if r.get(key) is not None]
            if vals:
                agg[key] = {"mean": statistics.fmean(vals), "min": min(vals), "max": max(vals), "n": len(vals)}
        agg["sha256"] = sorted({r.get("output_sha256") for r in ok if r.get("output_sha256")})
        for extra in ("prompt_tokens", "output_tokens", "threading_layer", "peer_version", "peer_info"):
            vals = [r.get(extra) for r in ok if r.get(extra) is not None]
            if vals:
                agg[extra] = vals[0]
        out[name] = agg
    return out


def ratios(agg: dict[str, dict], baseline: str) -> dict[str, dict]:
    """variant -> {metric: mean / baseline mean} for decode, prefill, TTFT and RSS."""
    base = agg.get(baseline, {})
    out = {}
    for name, a in agg.items():
        r = {}
        for key in ("decode_tok_s", "decode_steady_tok_s", "prefill_tok_s", "ttft_s", "peak_rss_mb"):
            if key in a and key in base and base[key]["mean"]:
                r[key] = a[key]["mean"] / base[key]["mean"]
        out[name] = r
    return out


def roofline(results: list[dict], variant_names: list[str], weight_bytes: int | None,
             kv_bytes: dict[str, int] | None = None) -> dict:
    """Decode bound if every weight byte is read once per token at the measured read bandwidth. Each run is
    set against the bandwidth measured around its own round (run_bench's "read_bandwidth"); per variant
    the share's mean and range over its runs, as for the other figures. kv_bytes (variant -> KV cache bytes
    per position of context) adds a second share that also counts the KV cache every decode step reads,
    at the run's mean context (prompt + half the output): at long context the weights alone understate
    what a token costs to read. Each share also comes pooled: the runs' mean bytes per second over their
    mean bandwidth. Where the host's bandwidth moves independently of the decode speed (the 2-core dev VM:
    correlation 0.07 over 26 runs), the mean of the runs' shares leans high (the mean of 1 / bandwidth
    exceeds 1 / its mean) and a single run's share mostly measures the noise. "steady" holds the same shares
    of the rate after each reply's first tokens (worker.RAMP_TOKENS: the probe's bandwidth is the memory's
    warm rate, which a reply's first tokens after an idle spell do not get)."""
    bws = [r["read_bandwidth"] for r in results if r.get("ok") and r.get("read_bandwidth")]
    if not weight_bytes or not bws:
        return {}

    def shares(name, per_token, key="decode_tok_s"):
        runs = [r for r in results
                if r.get("variant") == name and r.get("ok") and r.get(key) and r.get("read_bandwidth")]
        pairs = [(float(r[key]) * b, r["read_bandwidth"]) for r, b in ((r, per_token(r)) for r in runs)
                 if b is not None]
        if not pairs:
            return None
        vals = [rate / bw for rate, bw in pairs]
        return {"mean": statistics.fmean(vals), "min": min(vals), "max": max(vals), "n": len(vals),
                "pooled": statistics.fmean(rate for rate, _ in pairs) / statistics.fmean(bw for _, bw in pairs)}

    share, with_kv, steady, steady_kv = {}, {}, {}, {}
    for name in variant_names:
        for key, into in (("decode_tok_s", share), ("decode_steady_tok_s", steady)):
            if (s := shares(name, lambda r: weight_bytes, key)) is not None:
                into[name] = s
        if kv_bytes and name in kv_bytes:
            kv = kv_bytes[name]
            for key, into in (("decode_tok_s", with_kv), ("decode_steady_tok_s", steady_kv)):
                s = shares(name, lambda r: weight_bytes + kv * (r["prompt_tokens"] + r["output_tokens"] / 2)
                           if "prompt_tokens" in r and "output_tokens" in r else None, key)
                if s is not None:
                    into[name] = s
    bw = {"mean": statistics.fmean(bws) / 1e9, "min": min(bws) / 1e9, "max": max(bws) / 1e9, "n": len(bws)}
    out = {"weight_bytes_per_token": weight_bytes, "read_bandwidth_gb_s": bw,
           "roofline_tok_s": statistics.fmean(bws) / weight_bytes, "share_of_roofline": share}
    if with_kv:
        out["kv_bytes_per_position"] = kv_bytes
        out["share_with_kv"] = with_kv
    if steady:
        out["steady"] = {"share_of_roofline": steady, **({"share_with_kv": steady_kv} if steady_kv else {})}
    return out


def _share(name: str, s: dict) -> str:
    """A variant's roofline share: mean [range] of its runs, then pooled (roofline's docstring)."""
    pooled = f" (pooled {100 * s['pooled']:.0f}%)" if "pooled" in s else ""
    return f"{name} {_range(s, '{:.0f}', 100)}%{pooled}"


def _range(m: dict, fmt: str, scale: float = 1.0) -> str:
    """'mean [min-max]' of a {mean, min, max, n} figure (the range only when it is one)."""
    s = fmt.format(m["mean"] * scale)
    if m["n"] > 1 and m["max"] > m["min"]:
        s += " [" + fmt.format(m["min"] * scale) + "-" + fmt.format(m["max"] * scale) + "]"
    return s


def _cell(a: dict, key: str, fmt: str) -> str:
    return _range(a[key], fmt) if key in a else "-"


def table(agg: dict[str, dict], rat: dict[str, dict], baseline: str, roof: dict | None = None) -> str:
    """A readable fixed-width table: one row per variant, mean [min-max], ratios vs the baseline."""
    keys = [m for m in METRICS if any(m[0] in a for a in agg.values())]
    head = ["variant"] + [m[1] for m in keys] + [f"decode x {baseline}", f"prefill x {baseline}", "sha256"]
    rows = [head]
    base_sha = agg.get(baseline, {}).get("sha256", [])
    for name, a in agg.items():
        r = rat.get(name, {})
        sha = ",".join(h[:10] for h in a.get("sha256", [])) or "-"
        if base_sha and a.get("sha256") == base_sha and name != baseline:
            sha += " (= base)"
        row = [name + ("" if a["ok"] == a["runs"] else f" ({a['runs'] - a['ok']} failed)")]
        row += [_cell(a, k, fmt) for k, _, fmt, _ in keys]
        row += [f"{r['decode_tok_s']:.2f}x" if "decode_tok_s" in r else "-",
                f"{r['prefill_tok_s']:.2f}x" if "prefill_tok_s" in r else "-", sha]
        rows.append(row)
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(head))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    if roof:
        lines.append("")
        lines.append(f"roofline: {roof['weight_bytes_per_token'] / 1e6:.1f} MB of weights per token at "
                     f"{_range(roof['read_bandwidth_gb_s'], '{:.1f}')} GB/s read bandwidth (a stream of "
                     + (f"{roof['probe_bytes'] >> 20} MiB, a step's weights and KV cache" if "probe_bytes" in roof
                        else "the weights' size")
                     + f", measured around each round) -> {roof['roofline_tok_s']:.0f} tok/s; "
                     "share, each run against its round's bandwidth: "
                     + ", ".join(_share(n, s) for n, s in roof["share_of_roofline"].items()))
        if roof.get("share_with_kv"):
            lines.append("counting the KV cache read per token too (at each run's mean context): "
                         + ", ".join(_share(n, s) for n, s in roof["share_with_kv"].items()))
        if st := roof.get("steady"):
            line = (f"steady (the rate after each reply's first {RAMP_TOKENS + 1} tokens, which meet the memory's "
                    "ramp after an idle spell): " + ", ".join(_share(n, s) for n, s in st["share_of_roofline"].items()))
            if st.get("share_with_kv"):
                line += "; with the KV cache: " + ", ".join(_share(n, s) for n, s in st["share_with_kv"].items())
            lines.append(line)
    if note := length_note(agg):
        lines.append(note)
    for name, a in agg.items():
        for e in a.get("errors", []):
            lines.append(f"{name}: FAILED {e}")
    return "\n".join(lines)


def length_note(agg: dict[str, dict]) -> str | None:
    """A warning when the variants' replies have different lengths (one stopped at end-of-sequence, another
    ran to the limit): their tok/s then average over different contexts and are not like for like."""
    n = {name: a["output_tokens"] for name, a in agg.items() if a.get("output_tokens") is not None}
    if len(set(n.values())) < 2:
        return None
    return ("note: the replies differ in length (" + ", ".join(f"{k} {v}" for k, v in n.items()) + " tokens), so "
            "decode tok/s compares different contexts; the synthetic workload (--prompt-tokens) decodes exactly "
            "--decode-tokens for every variant")


def markdown_table(agg: dict[str, dict], rat: dict[str, dict], baseline: str) -> str:
    """The same figures as a Markdown table (for bench/results-*.md)."""
    keys = [m for m in METRICS if any(m[0] in a for a in agg.values())]
    head = ["variant"] + [m[1] for m in keys] + [f"decode vs {baseline}", f"prefill vs {baseline}", "sha256"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, a in agg.items():
        r = rat.get(name, {})
        cells = [name] + [_cell(a, k, fmt) for k, _, fmt, _ in keys]
        cells += [f"{r['decode_tok_s']:.2f}x" if "decode_tok_s" in r else "-",
                  f"{r['prefill_tok_s']:.2f}x" if "prefill_tok_s" in r else "-",
                  ",".join(h[:10] for h in a.get("sha256", [])) or "-"]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)
