"""tests/background.py: a job's key names one command."""
from __future__ import annotations

import sys

import pytest

import background


def test_a_key_names_one_command():
    """The same key with the same command is the same job (its result once); with another command, an error
    rather than the first command's output."""
    key = "test-background:one-key"
    first = background.Job(key, [sys.executable, "-c", "print('first')"], timeout=60)
    assert background.result(first).stdout.strip() == "first"
    again = background.Job(key, [sys.executable, "-c", "print('first')"], timeout=60)
    assert background.result(again) is first.proc
    with pytest.raises(ValueError, match="two commands"):
        background.result(background.Job(key, [sys.executable, "-c", "print('second')"], timeout=60))
