"""engine.config.check_messages: the one check of a chat's messages, for the local engine (every key kept) and
a remote server (role and content only); content NFC-normalized for both; one-line errors."""
from __future__ import annotations

import pytest

from engine.config import check_messages
from engine.errors import InputError


def test_messages_are_copied_nfc_normalized_with_their_keys_or_text_only():
    msgs = [{"role": "system", "content": "e\u0301t\u00e9"}, {"role": "user", "content": "hi", "name": "ann"}]
    got = check_messages(msgs)
    assert got == [{"role": "system", "content": "\u00e9t\u00e9"}, {"role": "user", "content": "hi", "name": "ann"}]
    assert got[0] is not msgs[0] and msgs[0]["content"] == "e\u0301t\u00e9"  # the caller's list is untouched
    assert check_messages(tuple(msgs), text_only=True)[1] == {"role": "user", "content": "hi"}


@pytest.mark.parametrize("bad, want", [
    ([], "non-empty list"), ("hi", "non-empty list"), (None, "non-empty list"),
    ([{"role": "user"}], "message 0 must be an object"),
    ([{"role": "user", "content": "a"}, {"role": 1, "content": "b"}], "message 1 must be an object"),
    ([["user", "a"]], "message 0"),
])
def test_what_is_not_a_chat_is_one_line(bad, want):
    for text_only in (False, True):
        with pytest.raises(InputError, match=want) as e:
            check_messages(bad, text_only=text_only)
        assert "\n" not in str(e.value)
