"""engine.gguf_types: the copy of gguf's enums and block sizes matches the installed gguf exactly."""
import subprocess
import sys

import gguf

from engine import gguf_types


def test_enums_match_gguf():
    for ours, theirs in ((gguf_types.GGMLQuantizationType, gguf.GGMLQuantizationType),
                         (gguf_types.GGUFValueType, gguf.GGUFValueType)):
        assert ours.__name__ == theirs.__name__
        assert [(m.name, m.value) for m in ours] == [(m.name, m.value) for m in theirs]
        for m in ours:  # interchangeable where code still uses gguf's enums: equal, same hash, same lookup
            assert m == theirs[m.name] and hash(m) == hash(theirs[m.name]) and theirs(m) is theirs[m.name]


def test_sizes_and_alignment_match_gguf():
    assert gguf_types.GGUF_DEFAULT_ALIGNMENT == gguf.GGUF_DEFAULT_ALIGNMENT
    assert {int(k): v for k, v in gguf_types.GGML_QUANT_SIZES.items()} == \
        {int(k): v for k, v in gguf.GGML_QUANT_SIZES.items()}


def test_reader_does_not_import_the_gguf_package():
    code = "import sys, engine.gguf_reader, engine.gguf_types; print('gguf' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
