"""Tokenizer and chat template read from the GGUF file.

Encoding: a HF `tokenizers` byte-level BPE built from `tokenizer.ggml.tokens/merges/token_type`, with the
pre-tokenizer regexes llama.cpp uses for the file's `tokenizer.ggml.pre`, so ids match llama.cpp's.
Control tokens (type 3) are special added tokens, user-defined tokens (type 4) plain added tokens: both encode
to one id when they appear in text (control ones only when `parse_special`), as in llama.cpp.
The built HF tokenizer is cached on disk (engine.tokenizer_cache): a warm start does not decode the merges.
Decoding is ours: every id maps to its raw bytes; `IncrementalDecoder` emits only complete UTF-8 characters.
Chat template: the file's Jinja template rendered in jinja2's immutable sandbox with HF's helpers.
"""
from __future__ import annotations

import codecs
import json
import unicodedata
from datetime import datetime
from functools import lru_cache, partial
from itertools import repeat
from typing import Any, Callable, Iterable, Sequence

from .errors import InputError, ModelFileError

# llama.cpp token types (tokenizer.ggml.token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Pre-tokenizer split regexes, applied in order (each piece of one split is split by the next), as in
# llama.cpp's llama-vocab.cpp for each `tokenizer.ggml.pre` value.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_QWEN2 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS: dict[str, tuple[str, ...]] = {
    "gpt2": (_GPT2,), "gpt-2": (_GPT2,), "phi-2": (_GPT2,), "olmo": (_GPT2,),
    "smollm": (r"\p{N}", _GPT2), "starcoder": (r"\p{N}", _GPT2), "refact": (r"\p{N}", _GPT2),
    "qwen2": (_QWEN2,), "deepseek-r1-qwen": (_QWEN2,),
    "llama-bpe": (_LLAMA3,), "llama3": (_LLAMA3,), "smaug-bpe": (_LLAMA3,),
}
# Tokens that end a turn besides eos (looked up by text; only control tokens count).
_EOT_TEXTS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "<|end|>", "<end_of_turn>")
ROLES = ("system", "user", "assistant", "tool")

CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


@lru_cache(maxsize=1)
def byte_decoder() -> dict[str, int]:
    """GPT-2 byte-level alphabet: printable stand-in character -> byte value."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    chars, n = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:  # unprintable bytes are shifted past 255 so every byte has a visible character
            chars[chr(256 + n)] = b
            n += 1
    return chars


@lru_cache(maxsize=1)
def _byte_translation() -> dict[int, str]:
    """str.translate table: stand-in character -> the latin-1 character of its byte. Other characters
    below 256 map to U+FFFF so that encoding to latin-1 fails for them as for any non-stand-in character."""
    table = {ord(c): chr(b) for c, b in byte_decoder().items()}
    return {i: "\uffff" for i in range(256)} | table


def _token_bytes(text: str, ttype: int) -> bytes:
    if ttype in (CONTROL, USER_DEFINED, UNKNOWN):
        return text.encode("utf-8")
    if ttype == UNUSED:
        return b""
    if ttype == BYTE and len(text) == 6 and text.startswith("<0x"):
        return bytes([int(text[3:5], 16)])
    try:  # translate + latin-1: the stand-in -> byte mapping in C (3x faster than a generator)
        return text.translate(_byte_translation()).encode("latin-1")
    except UnicodeEncodeError:  # not a byte-level string (should not happen in gpt2 vocabularies)
        return text.encode("utf-8")


class IncrementalDecoder:
    """Feed token ids one at a time; get back only complete UTF-8 text (never half a character).

    Bytes of a character split over several tokens (emoji, CJK) are held until the character is complete;
    bytes that can never form a character come out as U+FFFD. Call `flush()` at the end.
    """

    def __init__(self, tokenizer: "Tokenizer", skip_special: bool = False):
        self._tok = tokenizer
        self._skip = tokenizer.special_ids if skip_special else frozenset()
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        """Text completed by this token ('' while a character is still incomplete)."""
        if token_id in self._skip:
            return ""
        return self._dec.decode(self._tok.token_bytes(token_id))

    def flush(self) -> str:
        """Whatever is left (an incomplete character becomes U+FFFD)."""
        return self._dec.decode(b"", final=True)



def check_text(text: str, what: str) -> None:
    """InputError if `text` cannot be UTF-8: a lone UTF-16 surrogate ("\\ud800" in JSON), which no tokenizer
    takes. `what` names where the text came from."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InputError(f"{what} holds an invalid character ({text[e.start]!r} at {e.start}, a lone UTF-16 "
                         "surrogate); fix or remove it") from None

class Tokenizer:
    """Encode/decode text for one model; chat template rendering. Build with `Tokenizer.from_gguf`."""

    def __init__(self, tokens: Sequence[str], types: list[int], merges: list[str] | Callable[[], list[str]],
                 pre: str, bos_id: int | None, eos_id: int | None, eot_id: int | None = None,
                 chat_template: str | None = None, add_bos: bool = False, source: str = "model",
                 cache_key: str | None = None):
        """tokens: any sequence (engine.gguf_reader.StringArray decodes a token when it is read); merges:
        the list, or a function returning it (called only when the tokenizer is built, not when it comes
        from the cache); cache_key: engine.tokenizer_cache key of this vocabulary (None: no
        cache)."""
        if pre not in PRE_TOKENIZERS:
            raise ModelFileError(f"{source}: pre-tokenizer {pre!r} is not supported; supported: "
                                 f"{', '.join(sorted(PRE_TOKENIZERS))}")
        if len(types) != len(tokens):
            types = [NORMAL] * len(tokens)
        for what, tid in (("bos", bos_id), ("eos", eos_id), ("eot", eot_id)):
            if tid is not None and not (isinstance(tid, int) and 0 <= tid < len(tokens)):
                raise ModelFileError(f"{source}: tokenizer.ggml.{what}_token_id = {tid!r} is not a token id (the "
                                     f"vocabulary has {len(tokens)}); re-download or re-convert the model")
        self.source = source
        self.tokens = tokens
        self.types = types
        self.vocab_size = len(tokens)
        self.bos_id, self.eos_id, self.add_bos = bos_id, eos_id, add_bos
        self.chat_template = chat_template or CHATML_TEMPLATE
        self.has_file_template = bool(chat_template)
        # Raw bytes per id, filled on first use: computing all of them cost ~0.1 s of every start.
        self._bytes: list[bytes | None] = [None] * len(tokens)

        tk = None
        if cache_key is not None:
            from . import tokenizer_cache
            tk = tokenizer_cache.load(cache_key)
        if tk is None:
            tk = _build_hf(list(tokens), types, merges() if callable(merges) else merges, pre)
            if cache_key is not None:
                tokenizer_cache.store(cache_key, tk)
        self._tk = tk
        self._tk_plain = None  # same tokenizer with control tokens treated as text, built on demand

        self.special_ids = frozenset(i for i, ty in enumerate(types) if ty == CONTROL)
        stops = {i for i in (eos_id, eot_id) if i is not None}
        # token_to_id: the BPE vocabulary, where a duplicated string maps to its first id.
        stops |= {i for i in map(tk.token_to_id, _EOT_TEXTS) if i is not None and i < len(types)
                  and types[i] == CONTROL}
        self.stop_ids = frozenset(stops)
        self.bos_token = tokens[bos_id] if bos_id is not None and 0 <= bos_id < len(tokens) else ""
        self.eos_token = tokens[eos_id] if eos_id is not None and 0 <= eos_id < len(tokens) else ""

    # ---- construction ------------------------------------------------------------------------------------
    @classmethod
    def from_gguf(cls, model) -> "Tokenizer":
        """From a `engine.gguf.ModelFile` (or a path to a .gguf file)."""
        if not hasattr(model, "field"):
            from .gguf import load_gguf
            model = load_gguf(model)
        src = str(model.path)
        kind = model.field("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ModelFileError(f"{src}: tokenizer model {kind!r} is not supported (only byte-level BPE, "
                                 "'gpt2'); use a llama3/qwen/smollm style model")
        reader = getattr(model, "reader", None)
        tokens = reader.lazy_strings("tokenizer.ggml.tokens") if hasattr(reader, "lazy_strings") else None
        if tokens is None:
            tokens = model.field("tokenizer.ggml.tokens")
        pre = model.field("tokenizer.ggml.pre", "gpt2")
        keys = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type")
        raw = [reader.raw(k) for k in keys] if hasattr(reader, "raw") else None
        if raw is not None and raw[1] is not None and len(raw[1]) > 0:
            # The merges are decoded only if the cached tokenizer cannot be used (~0.1 s).
            from . import tokenizer_cache
            merges = partial(model.field, "tokenizer.ggml.merges")
            key = tokenizer_cache.key([*(r if r is not None else b"" for r in raw), str(pre).encode()])
        else:
            merges, key = model.field("tokenizer.ggml.merges"), None
        if not tokens or not merges:
            raise ModelFileError(f"{src} has no tokenizer vocabulary/merges; re-convert the model")
        return cls(tokens, model.field("tokenizer.ggml.token_type") or [], merges, pre=pre,
                   bos_id=model.field("tokenizer.ggml.bos_token_id"),
                   eos_id=model.field("tokenizer.ggml.eos_token_id"),
                   eot_id=model.field("tokenizer.ggml.eot_token_id"),
                   chat_template=model.field("tokenizer.chat_template"),
                   add_bos=bool(model.field("tokenizer.ggml.add_bos_token", False)), source=src,
                   cache_key=key)

    # ---- encode / decode ---------------------------------------------------------------------------------
    def encode(self, text: str, *, add_bos: bool = False, parse_special: bool = True) -> list[int]:
        """Token ids of `text` (NFC-normalized first). parse_special: control tokens in the text -> their id."""
        if not isinstance(text, str):
            raise InputError(f"text to encode must be a string, got {type(text).__name__}")
        check_text(text, "the text")
        text = unicodedata.normalize("NFC", text)
        tk = self._tk
        if not parse_special:
            if self._tk_plain is None:
                from tokenizers import Tokenizer as HFTokenizer
                self._tk_plain = HFTokenizer.from_str(self._tk.to_str())
                self._tk_plain.encode_special_tokens = True
            tk = self._tk_plain
        ids = tk.encode(text, add_special_tokens=False).ids
        if add_bos and self.bos_id is not None:
            ids = [self.bos_id] + ids
        return ids

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes a token stands for (control tokens: their text)."""
        if not 0 <= token_id < self.vocab_size:
            raise InputError(f"token id {token_id} is outside the vocabulary (0..{self.vocab_size - 1})")
        b = self._bytes[token_id]
        if b is None:
            b = self._bytes[token_id] = _token_bytes(self.tokens[token_id], self.types[token_id])
        return b

    def decode(self, ids: Iterable[int], *, skip_special: bool = False) -> str:
        """Text of a token sequence; invalid UTF-8 becomes U+FFFD."""
        ids = [int(i) for i in ids]
        if skip_special:
            ids = [i for i in ids if i not in self.special_ids]
        return b"".join(self.token_bytes(i) for i in ids).decode("utf-8", errors="replace")

    def token_text(self, token_id: int) -> str:
        """Readable text of one token (lossy for a partial UTF-8 character)."""
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    def incremental_decoder(self, skip_special: bool = False) -> IncrementalDecoder:
        return IncrementalDecoder(self, skip_special)

    def token_id(self, text: str) -> int | None:
        """The id if `text` is exactly one token (e.g. '<think>' in Qwen3), else None."""
        ids = self.encode(text)
        return ids[0] if len(ids) == 1 and self.token_bytes(ids[0]) == text.encode("utf-8") else None

    def has_token(self, text: str) -> bool:
        """True when `text` encodes to a single token."""
        return self.token_id(text) is not None

    @property
    def think_ids(self) -> tuple[int, int] | None:
        """(id of '<think>', id of '</think>') when both are single added tokens (native thinking models)."""
        a, b = self.token_id("<think>"), self.token_id("</think>")
        if a is None or b is None or self.types[a] not in (CONTROL, USER_DEFINED):
            return None
        return a, b

    # ---- chat template -----------------------------------------------------------------------------------
    @property
    def template_has_thinking_switch(self) -> bool:
        """The template reads `enable_thinking` (Qwen3 style)."""
        return "enable_thinking" in self.chat_template

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **extra: Any) -> str:
        """Render a conversation with the model's chat template (ChatML when the file has none).

        extra: template variables such as enable_thinking=False or tools=[...].
        """
        validate_messages(messages)
        tmpl = _compile(self.chat_template, self.source)
        ctx = dict(bos_token=self.bos_token, eos_token=self.eos_token) | extra
        try:
            return tmpl.render(messages=messages, add_generation_prompt=add_generation_prompt, **ctx)
        except _TemplateRaised as e:
            raise InputError(f"the model's chat template rejected the conversation: {e}") from None
        except Exception as e:  # a template bug (or unsupported construct) is the file's fault
            raise ModelFileError(f"{self.source}: the chat template failed to render "
                                 f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, **extra: Any) -> list[int]:
        """Template output encoded with special tokens parsed (how HF and llama.cpp tokenize prompts)."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, **extra),
                           add_bos=self.add_bos and not self.bos_token_in_template)

    @property
    def bos_token_in_template(self) -> bool:
        return "bos_token" in self.chat_template


def validate_messages(messages: Any) -> None:
    """A conversation is a non-empty list of {'role': one of ROLES, 'content': str}; else InputError."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InputError("messages must be a non-empty list of {\"role\": ..., \"content\": ...} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise InputError(f"message {i} must be an object with 'role' and 'content', got {type(m).__name__}")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise InputError(f"message {i} has role {role!r}; use one of {', '.join(ROLES)}")
        if not isinstance(content, str):
            raise InputError(f"message {i} ({role}) needs a string 'content', got {type(content).__name__}")


def _build_hf(tokens: list[str], types: list[int], merges: list[str], pre: str):
    """The HF byte-level BPE with llama.cpp's pre-tokenizer splits and the file's added tokens."""
    from tokenizers import AddedToken, Regex
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers

    vocab = dict(zip(reversed(tokens), range(len(tokens) - 1, -1, -1)))  # a duplicated string keeps its first id
    pairs = [(a, b) for a, sep, b in map(str.partition, merges, repeat(" "))
             if sep and a in vocab and b in vocab and a + b in vocab]
    tk = HFTokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
    tk.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in PRE_TOKENIZERS[pre]]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    control = [t for t, ty in zip(tokens, types) if ty == CONTROL and t]
    user = [t for t, ty in zip(tokens, types) if ty == USER_DEFINED and t]
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    tk.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
    return tk


class _TemplateRaised(Exception):
    """raise_exception() called by a chat template (e.g. roles must alternate)."""


def _raise_exception(message: str):
    raise _TemplateRaised(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # HF's tojson: keeps non-ASCII characters (jinja2's default escapes them and HTML-quotes)
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=8)
def _compile(source: str, origin: str):
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateError as e:
        raise ModelFileError(f"{origin}: the chat template is not valid Jinja ({e}); "
                             "pass a model with a working template") from None
