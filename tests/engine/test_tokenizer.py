"""engine.tokenizer: round trips, incremental UTF-8 decoding, NFC, special tokens, chat templates."""
from __future__ import annotations

import pytest

from engine.errors import InputError
from engine.gguf import load_gguf
from engine.tokenizer import CHATML_TEMPLATE, Tokenizer

CORPUS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b  # sum\n\n\tprint(add(1, 22))",
    "Numbers 0 12 345 6789 and 3.14159, x**2 >= y != z",
    "日本語のテキストと中文字符，还有한국어 문장.",
    "Emoji: 😀👍🏽🇫🇷 👨‍👩‍👧 ✨",
    "   leading spaces,\n\n\nnewlines\r\n and   runs    of   whitespace   ",
    "Ünïcödé àccents, Ελληνικά, русский, עברית, العربية",
]


@pytest.fixture(scope="module")
def tiny_toks(tiny_models):
    return {arch: Tokenizer.from_gguf(load_gguf(p)) for arch, p in tiny_models.items()}


@pytest.fixture(scope="module")
def smol(smollm2_path):
    return Tokenizer.from_gguf(load_gguf(smollm2_path))


def _all(tiny_toks, request):
    toks = list(tiny_toks.values())
    try:
        toks.append(request.getfixturevalue("smol"))
    except pytest.skip.Exception:
        pass
    return toks


def test_roundtrip(tiny_toks, request):
    for tok in _all(tiny_toks, request):
        for text in CORPUS:
            ids = tok.encode(text)
            assert all(0 <= i < tok.vocab_size for i in ids)
            assert tok.decode(ids) == text


def test_merges_are_used(tiny_toks):
    # The learned merges compress common English: fewer tokens than bytes.
    text = "the quick brown fox jumps over the lazy dog"
    for tok in tiny_toks.values():
        assert len(tok.encode(text)) < len(text.encode()) * 0.7


def test_incremental_decoder_never_emits_half_a_character(tiny_toks, request):
    for tok in _all(tiny_toks, request):
        for text in CORPUS:
            dec = tok.incremental_decoder()
            chunks = [dec.feed(i) for i in tok.encode(text)] + [dec.flush()]
            assert "".join(chunks) == text
            assert not any("\ufffd" in c for c in chunks)
    # The tiny vocabularies have no CJK tokens, so characters really are split over byte tokens.
    tok = tiny_toks["llama"]
    ids = tok.encode("語")
    assert len(ids) == 3
    dec = tok.incremental_decoder()
    assert [dec.feed(i) for i in ids] == ["", "", "語"]


def test_incremental_decoder_invalid_bytes(tiny_toks):
    tok = tiny_toks["llama"]
    lead, cont = tok.encode("語")[:2]  # an incomplete 3-byte sequence followed by plain text
    dec = tok.incremental_decoder()
    out = dec.feed(lead) + dec.feed(cont) + "".join(dec.feed(i) for i in tok.encode("ok")) + dec.flush()
    assert out == "\ufffdok"
    dec = tok.incremental_decoder()
    assert dec.feed(lead) == "" and dec.flush() == "\ufffd"  # a dangling prefix shows up only at the end


def test_nfc_normalization(tiny_toks, request):
    for tok in _all(tiny_toks, request):
        assert tok.encode("cafe\u0301 \u1100\u1161") == tok.encode("caf\u00e9 \uac00")


def test_special_tokens(tiny_toks, request):
    for tok in _all(tiny_toks, request):
        start, end = tok.encode("<|im_start|>"), tok.encode("<|im_end|>")
        assert len(start) == 1 and len(end) == 1 and start[0] in tok.special_ids
        assert end[0] in tok.stop_ids and tok.eos_id in tok.stop_ids
        assert tok.encode("<|endoftext|>")[0] in tok.stop_ids
        ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
        assert ids[0] == start[0] and ids[-1] == end[0]
        plain = tok.encode("<|im_start|>", parse_special=False)
        assert len(plain) > 1 and tok.decode(plain) == "<|im_start|>"
        assert tok.decode(ids, skip_special=True) == "user\nhi"
        assert tok.has_token("<|im_end|>") and tok.token_id("<|im_end|>") == end[0]


def test_think_tokens(tiny_toks, request):
    q3 = tiny_toks["qwen3"]
    a, b = q3.think_ids
    assert q3.encode("<think>\nhmm</think>")[0] == a and q3.encode("</think>") == [b]
    assert q3.token_text(a) == "<think>"
    assert tiny_toks["llama"].think_ids is None and not tiny_toks["llama"].has_token("<think>")
    try:
        smol = request.getfixturevalue("smol")
    except pytest.skip.Exception:
        return
    assert smol.think_ids is None and len(smol.encode("<think>")) > 1


def test_smollm2_chat_template(smol):
    msgs = [{"role": "user", "content": "What is 2+2?"}]
    text = smol.apply_chat_template(msgs)
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                    "<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    msgs = [{"role": "system", "content": "Be brief."}] + msgs + [{"role": "assistant", "content": "4"}]
    text = smol.apply_chat_template(msgs, add_generation_prompt=False)
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n") and text.endswith("4<|im_end|>\n")
    ids = smol.encode_chat(msgs[:2])
    assert ids[0] == smol.token_id("<|im_start|>") and smol.bos_id not in ids[1:2]


def test_qwen3_thinking_switch(tiny_toks):
    q3 = tiny_toks["qwen3"]
    msgs = [{"role": "user", "content": "hi"}]
    assert q3.template_has_thinking_switch and not tiny_toks["llama"].template_has_thinking_switch
    on = q3.apply_chat_template(msgs)
    off = q3.apply_chat_template(msgs, enable_thinking=False)
    assert on == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert off == on + "<think>\n\n</think>\n\n"
    # earlier reasoning is dropped from history, as in Qwen3's template
    hist = q3.apply_chat_template(msgs + [{"role": "assistant", "content": "<think>\nx\n</think>\n\nHello"}],
                                  add_generation_prompt=False)
    assert hist.endswith("<|im_start|>assistant\nHello<|im_end|>\n")


def _variant(tok: Tokenizer, template: str | None) -> Tokenizer:
    return Tokenizer(tok.tokens, tok.types, [], "qwen2", tok.bos_id, tok.eos_id, chat_template=template)


def test_chatml_fallback_and_template_errors(tiny_toks):
    base = tiny_toks["qwen2"]
    fallback = _variant(base, None)
    assert fallback.chat_template == CHATML_TEMPLATE and not fallback.has_file_template
    assert fallback.apply_chat_template([{"role": "user", "content": "x"}]) == \
        "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n"
    strict = _variant(base, "{% if messages[0].role != 'user' %}{{ raise_exception('first must be user') }}"
                            "{% endif %}{{ messages | tojson }}{{ strftime_now('%Y') | length }}")
    with pytest.raises(InputError, match="first must be user"):
        strict.apply_chat_template([{"role": "assistant", "content": "x"}])
    assert strict.apply_chat_template([{"role": "user", "content": "é"}]) == '[{"role": "user", "content": "é"}]4'
    sandboxed = _variant(base, "{{ messages.__class__.__mro__ }}")
    with pytest.raises(Exception) as ei:
        sandboxed.apply_chat_template([{"role": "user", "content": "x"}])
    assert "\n" not in str(ei.value)


@pytest.mark.parametrize("bad", [
    None, "hello", [], [{"content": "x"}], [{"role": "wizard", "content": "x"}],
    [{"role": "user", "content": 3}], [{"role": "user"}], ["user: hi"],
])
def test_invalid_messages(tiny_toks, bad):
    with pytest.raises(InputError):
        tiny_toks["llama"].apply_chat_template(bad)


def test_bad_ids_and_text(tiny_toks):
    tok = tiny_toks["llama"]
    with pytest.raises(InputError):
        tok.decode([tok.vocab_size])
    with pytest.raises(InputError):
        tok.encode(b"bytes")  # type: ignore[arg-type]


def _reference_token_bytes(text: str, ttype: int) -> bytes:
    """The per-character definition of a token's bytes (the tokenizer computes it with str.translate)."""
    from engine.tokenizer import BYTE, CONTROL, UNKNOWN, UNUSED, USER_DEFINED, byte_decoder
    if ttype in (CONTROL, USER_DEFINED, UNKNOWN):
        return text.encode("utf-8")
    if ttype == UNUSED:
        return b""
    if ttype == BYTE and len(text) == 6 and text.startswith("<0x"):
        return bytes([int(text[3:5], 16)])
    try:
        return bytes(byte_decoder()[c] for c in text)
    except KeyError:
        return text.encode("utf-8")


def test_token_bytes_match_the_per_character_definition(tiny_toks, request):
    for tok in _all(tiny_toks, request):
        for i in range(tok.vocab_size):
            assert tok.token_bytes(i) == _reference_token_bytes(tok.tokens[i], tok.types[i]), i
    odd = ["", "é", "a b", "\x00", "\xad", "\uffff", "Ġhello", "日本", "ĠĊ", "\u0100", "x\u00adz", "<0x0A>"]
    from engine.tokenizer import _token_bytes
    for text in odd:
        for ttype in range(1, 7):
            assert _token_bytes(text, ttype) == _reference_token_bytes(text, ttype), (text, ttype)


def test_duplicated_token_string_keeps_its_first_id():
    tok = Tokenizer(["a", "b", "ab", "a", "<|im_end|>"], [1, 1, 1, 1, 3], ["a b"], "gpt2", None, None)
    assert tok.encode("ab") == [2] and tok.encode("a") == [0] and 4 in tok.stop_ids


CACHE_CORPUS = CORPUS + ["<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "<think>x</think> <tool_call>",
                         "\x00\x01 tabs\t\tand \u200b zero-width, ﬁ ligature, Å vs Å", "a" * 500 + " " + "ab " * 50]


def _cache_files(root):
    return sorted((root / "tokenizers").glob("*.json"))


def test_cached_tokenizer_encodes_like_a_fresh_build(tiny_models, tmp_path, monkeypatch, request):
    from engine import tokenizer_cache
    monkeypatch.setenv("NINFER_CACHE_DIR", str(tmp_path))
    paths = list(tiny_models.values())
    try:
        paths.append(request.getfixturevalue("smollm2_path"))
    except pytest.skip.Exception:
        pass
    for n, path in enumerate(paths, 1):
        mf = load_gguf(path)
        first = Tokenizer.from_gguf(mf)  # builds and stores
        assert len(_cache_files(tmp_path)) == n
        loads = []
        real_load = tokenizer_cache.load
        monkeypatch.setattr(tokenizer_cache, "load", lambda k: loads.append(real_load(k)) or loads[-1])
        cached = Tokenizer.from_gguf(mf)
        monkeypatch.setattr(tokenizer_cache, "load", real_load)
        assert loads and loads[0] is not None  # served from the cache
        assert cached._tk.to_str() == first._tk.to_str()
        for text in CACHE_CORPUS:
            for special in (True, False):
                assert cached.encode(text, parse_special=special) == first.encode(text, parse_special=special)
        assert cached.stop_ids == first.stop_ids and cached.special_ids == first.special_ids


def test_cache_key_changes_with_the_vocabulary(tiny_models):
    from engine import tokenizer_cache
    keys = {tokenizer_cache.key([load_gguf(p).reader.raw("tokenizer.ggml.tokens"), b"gpt2"])
            for p in tiny_models.values()}
    assert len(keys) == len(tiny_models)
    k = tokenizer_cache.key([b"ab", b"c"])
    assert k != tokenizer_cache.key([b"a", b"bc"]) and k == tokenizer_cache.key([b"ab", b"c"])


@pytest.mark.parametrize("damage", ["truncate", "flip", "garbage", "empty", "valid_json_wrong_digest"])
def test_damaged_cache_file_is_rebuilt(tiny_models, tmp_path, monkeypatch, damage):
    monkeypatch.setenv("NINFER_CACHE_DIR", str(tmp_path))
    mf = load_gguf(tiny_models["qwen3"])
    fresh = Tokenizer.from_gguf(mf)
    (f,) = _cache_files(tmp_path)
    raw = f.read_bytes()
    if damage == "truncate":
        f.write_bytes(raw[:len(raw) // 2])
    elif damage == "flip":
        f.write_bytes(raw[:-100] + bytes([raw[-100] ^ 1]) + raw[-99:])
    elif damage == "garbage":
        f.write_bytes(b"\xff\xfe not json at all")
    elif damage == "empty":
        f.write_bytes(b"")
    else:
        f.write_bytes(b"0" * 64 + raw[64:])
    again = Tokenizer.from_gguf(mf)
    for text in CACHE_CORPUS:
        assert again.encode(text) == fresh.encode(text)
    assert f.read_bytes() == raw  # rewritten whole


def test_unwritable_cache_dir_still_loads(tiny_models, tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("NINFER_CACHE_DIR", str(blocker))
    tok = Tokenizer.from_gguf(load_gguf(tiny_models["llama"]))
    assert tok.decode(tok.encode(CORPUS[0])) == CORPUS[0]


def test_cache_compacts_merges_only_when_unambiguous():
    import json

    from engine.tokenizer_cache import _compact
    plain = json.dumps({"model": {"merges": [["a", "b"], ["ab", "c"]]}})
    assert json.loads(_compact(plain))["model"]["merges"] == ["a b", "ab c"]
    spaced = json.dumps({"model": {"merges": [["a", "b c"], ["ab", "c"]]}})
    assert _compact(spaced) == spaced
