#!/usr/bin/env python3
"""Write tiny random-weight GGUF models (llama, qwen2, qwen3) for tests, with the `gguf` package's writer.

Each model is a complete, loadable file (llama.cpp runs them too): metadata, a small byte-level BPE vocabulary
(256 byte tokens + merges learned from a fixed corpus + ChatML special tokens), a chat template and weights in
a mix of quant types, so every dequant path is exercised end to end:

    llama  GQA 4q/2kv, NORM rope, tied head; Q8_0 embd, Q4_0/Q4_1/Q8_0/F16 attention, Q4_K ffn_down
    qwen2  qkv bias, untied F16 head; Q8_0/F16/Q4_0/Q4_1 attention, BF16 gate, Q6_K ffn_down
    qwen3  q/k RMSNorm, <think> </think> added tokens, Qwen3-style template with `enable_thinking`;
           BF16 attn_output, F32 ffn_up, Q4_K / Q6_K ffn_down per layer

Output is a pure function of (arch, seed, overrides). Usage: scripts/make_tiny_models.py OUT_DIR [--seed N]
"""
from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import GGUFWriter
from gguf.quants import quantize

ARCHS = ("llama", "qwen2", "qwen3")
NORMAL, CONTROL, USER_DEFINED = 1, 3, 4

# Fixed training text for the merges (English, code, digits): merges only need to be plausible and stable.
CORPUS = """The quick brown fox jumps over the lazy dog. The dog sleeps in the sun, and the fox runs away.
Hello world! Hello there, how are you today? I am fine, thank you. What is the capital of France?
The capital of France is Paris. Paris is a beautiful city with many museums and old buildings.
def main(args):
    for item in items:
        if item is not None:
            print(item)
    return 0
class Model:
    def __init__(self, name):
        self.name = name
import numpy as np
x = np.zeros((3, 4), dtype=np.float32)
Once upon a time there was a little girl who lived in a village near the forest. She liked to read books.
the of and to in is that for it as with was on be by this are at from or an which have not
""" * 3

DEFAULT_DIMS = dict(n_layer=2, d_model=64, n_head=4, n_kv_head=2, head_dim=16, d_ff=256,
                    context_length=512, rope_base=10000.0, rms_eps=1e-5, n_merges=200)

# Quant type per tensor role; "ffn_down" may be a list (one per layer, cycled). K-quants need 256-wide rows.
QTYPES = {
    "llama": dict(token_embd=QT.Q8_0, attn_q=QT.Q4_0, attn_k=QT.Q4_1, attn_v=QT.Q8_0, attn_output=QT.F16,
                  ffn_gate=QT.Q4_0, ffn_up=QT.Q4_1, ffn_down=[QT.Q4_K]),
    "qwen2": dict(token_embd=QT.Q8_0, attn_q=QT.Q8_0, attn_k=QT.F16, attn_v=QT.Q4_0, attn_output=QT.Q4_1,
                  ffn_gate=QT.BF16, ffn_up=QT.Q8_0, ffn_down=[QT.Q6_K], output=QT.F16),
    "qwen3": dict(token_embd=QT.Q8_0, attn_q=QT.Q4_1, attn_k=QT.Q4_0, attn_v=QT.F16, attn_output=QT.BF16,
                  ffn_gate=QT.Q8_0, ffn_up=QT.F32, ffn_down=[QT.Q4_K, QT.Q6_K]),
}

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
          "+ '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
          "{% endif %}")
QWEN3_TEMPLATE = """{%- for message in messages %}
{%- if message.role == 'assistant' %}
{%- set content = message.content %}
{%- if '</think>' in content %}{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}
{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}"""


def _byte_alphabet() -> list[str]:
    """GPT-2 byte-level characters, index = byte value."""
    from engine.tokenizer import byte_decoder
    inv = {b: c for c, b in byte_decoder().items()}
    return [inv[b] for b in range(256)]


def train_merges(pre: str, n_merges: int) -> list[tuple[str, str]]:
    """Greedy BPE on CORPUS: most frequent adjacent pair first, ties broken by the pair's text."""
    from tokenizers import Regex, pre_tokenizers

    from engine.tokenizer import PRE_TOKENIZERS
    pt = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r), behavior="isolated") for r in PRE_TOKENIZERS[pre]]
                                 + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    words = Counter(piece for piece, _ in pt.pre_tokenize_str(CORPUS))
    seqs = {w: list(w) for w in words}
    merges: list[tuple[str, str]] = []
    for _ in range(n_merges):
        pairs: Counter = Counter()
        for w, s in seqs.items():
            for a, b in zip(s, s[1:]):
                pairs[(a, b)] += words[w]
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        for w, s in seqs.items():
            out, i = [], 0
            while i < len(s):
                if i + 1 < len(s) and (s[i], s[i + 1]) == best:
                    out.append(s[i] + s[i + 1])
                    i += 2
                else:
                    out.append(s[i])
                    i += 1
            seqs[w] = out
    return merges


def build_vocab(arch: str, n_merges: int) -> tuple[list[str], list[int], list[str], dict[str, int]]:
    """tokens, token types, merges ('a b'), and the ids of the special tokens."""
    pre = "smollm" if arch == "llama" else "qwen2"
    merges = train_merges(pre, n_merges)
    body = _byte_alphabet() + [a + b for a, b in merges]
    specials = [("<|endoftext|>", CONTROL), ("<|im_start|>", CONTROL), ("<|im_end|>", CONTROL)]
    if arch == "qwen3":  # like real Qwen3 files: added but not "special" tokens -> user-defined
        specials += [("<think>", USER_DEFINED), ("</think>", USER_DEFINED)]
    if arch == "llama":  # SmolLM2 layout: specials first
        tokens = [t for t, _ in specials] + body
        types = [ty for _, ty in specials] + [NORMAL] * len(body)
    else:  # Qwen layout: specials last
        tokens = body + [t for t, _ in specials]
        types = [NORMAL] * len(body) + [ty for _, ty in specials]
    ids = {t: tokens.index(t) for t, _ in specials}
    return tokens, types, [f"{a} {b}" for a, b in merges], ids


def _kquant_bytes(rng: np.random.Generator, qtype: QT, rows: int, cols: int) -> np.ndarray:
    """Random but valid K-quant blocks (gguf cannot quantize these), scales chosen for weights ~0.05."""
    nb = cols // 256
    if qtype == QT.Q4_K:  # d f16, dmin f16, 12 bytes packed 6-bit scales/mins, 128 bytes 4-bit quants
        blk = rng.integers(0, 256, size=(rows, nb, 144), dtype=np.uint8)
        blk[..., 0:2] = np.frombuffer(np.float16(0.0002).tobytes(), np.uint8)
        blk[..., 2:4] = np.frombuffer(np.float16(0.0002).tobytes(), np.uint8)
    elif qtype == QT.Q6_K:  # 128 ql, 64 qh, 16 int8 scales, d f16
        blk = rng.integers(0, 256, size=(rows, nb, 210), dtype=np.uint8)
        blk[..., 192:208] = rng.integers(-40, 41, size=(rows, nb, 16)).astype(np.int8).view(np.uint8)
        blk[..., 208:210] = np.frombuffer(np.float16(0.00015).tobytes(), np.uint8)
    else:
        raise ValueError(qtype)
    return blk.reshape(rows, nb * blk.shape[-1])


def _add(w: GGUFWriter, rng: np.random.Generator, name: str, arr: np.ndarray, qtype: QT) -> None:
    if qtype == QT.F32:
        w.add_tensor(name, arr.astype(np.float32))
    elif qtype == QT.F16:
        w.add_tensor(name, arr.astype(np.float16))
    elif qtype in (QT.Q4_K, QT.Q6_K):
        w.add_tensor(name, _kquant_bytes(rng, qtype, *arr.shape), raw_dtype=qtype)
    else:
        w.add_tensor(name, quantize(arr.astype(np.float32), qtype), raw_dtype=qtype)


def make_tiny_model(path: str | Path, arch: str, seed: int = 0, *, qtypes: dict | None = None,
                    drop: tuple[str, ...] = (), extra: dict[str, np.ndarray] | None = None,
                    arch_name: str | None = None, **dims) -> Path:
    """Write a tiny `arch` model to `path`; deterministic in (arch, seed, arguments). Returns the path.

    dims override DEFAULT_DIMS (n_layer, d_model, n_head, n_kv_head, head_dim, d_ff, context_length, ...);
    qtypes override the per-role quant types; drop/extra remove/add tensors and arch_name writes another
    general.architecture (for the loader's error tests).
    """
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}")
    d = DEFAULT_DIMS | dims
    qt = QTYPES[arch] | (qtypes or {})
    rng = np.random.default_rng([seed, ARCHS.index(arch)])
    tokens, types, merges, ids = build_vocab(arch, d["n_merges"])
    n_vocab = len(tokens)
    name = arch_name or arch
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)

    w = GGUFWriter(str(path), name)
    w.add_name(f"tiny-{arch}")
    w.add_context_length(d["context_length"])
    w.add_embedding_length(d["d_model"])
    w.add_block_count(d["n_layer"])
    w.add_feed_forward_length(d["d_ff"])
    w.add_head_count(d["n_head"])
    w.add_head_count_kv(d["n_kv_head"])
    w.add_key_length(d["head_dim"])
    w.add_value_length(d["head_dim"])
    w.add_rope_dimension_count(d["head_dim"])
    w.add_rope_freq_base(d["rope_base"])
    w.add_layer_norm_rms_eps(d["rms_eps"])
    w.add_vocab_size(n_vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm" if arch == "llama" else "qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(ids["<|im_start|>"] if arch == "llama" else ids["<|endoftext|>"])
    w.add_eos_token_id(ids["<|im_end|>"])
    w.add_add_bos_token(False)
    w.add_chat_template(QWEN3_TEMPLATE if arch == "qwen3" else CHATML)

    dm, hd, q_dim, kv_dim, ff = d["d_model"], d["head_dim"], d["n_head"] * d["head_dim"], \
        d["n_kv_head"] * d["head_dim"], d["d_ff"]

    def mat(rows, cols, scale=0.08):  # (rows, cols) = (out, in)
        return (rng.standard_normal((rows, cols)) * scale).astype(np.float32)

    def norm(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    tensors: list[tuple[str, np.ndarray, QT]] = [("token_embd.weight", mat(n_vocab, dm, 0.5), qt["token_embd"]),
                                                 ("output_norm.weight", norm(dm), QT.F32)]
    if arch == "qwen2":
        tensors.append(("output.weight", mat(n_vocab, dm, 0.1), qt["output"]))
    for i in range(d["n_layer"]):
        b = f"blk.{i}."
        down = qt["ffn_down"]
        down = down[i % len(down)] if isinstance(down, (list, tuple)) else down
        tensors += [(b + "attn_norm.weight", norm(dm), QT.F32),
                    (b + "attn_q.weight", mat(q_dim, dm), qt["attn_q"]),
                    (b + "attn_k.weight", mat(kv_dim, dm), qt["attn_k"]),
                    (b + "attn_v.weight", mat(kv_dim, dm), qt["attn_v"]),
                    (b + "attn_output.weight", mat(dm, q_dim), qt["attn_output"]),
                    (b + "ffn_norm.weight", norm(dm), QT.F32),
                    (b + "ffn_gate.weight", mat(ff, dm), qt["ffn_gate"]),
                    (b + "ffn_up.weight", mat(ff, dm), qt["ffn_up"]),
                    (b + "ffn_down.weight", mat(dm, ff, 0.05), down)]
        if arch == "qwen2":
            tensors += [(b + "attn_q.bias", 0.1 * rng.standard_normal(q_dim).astype(np.float32), QT.F32),
                        (b + "attn_k.bias", 0.1 * rng.standard_normal(kv_dim).astype(np.float32), QT.F32),
                        (b + "attn_v.bias", 0.1 * rng.standard_normal(kv_dim).astype(np.float32), QT.F32)]
        if arch == "qwen3":
            tensors += [(b + "attn_q_norm.weight", norm(hd), QT.F32), (b + "attn_k_norm.weight", norm(hd), QT.F32)]
    for tname, arr, q in tensors:
        if tname not in drop:
            _add(w, rng, tname, arr, q)
    for tname, arr in (extra or {}).items():
        w.add_tensor(tname, np.asarray(arr, dtype=np.float32))

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--arch", choices=ARCHS, action="append", help="default: all")
    a = ap.parse_args(argv)
    for arch in a.arch or ARCHS:
        p = make_tiny_model(a.out_dir / f"tiny-{arch}.gguf", arch, seed=a.seed)
        print(f"{p} ({p.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere
    sys.exit(main())
