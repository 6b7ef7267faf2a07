"""A transcript store that cannot take another write (a full disk: SQLite's SQLITE_FULL, made here with
max_page_count): the chat goes on, the user is told once, and nothing on screen is lost."""
from __future__ import annotations

import pytest

from engine.fake import Script
from ninfer_tui.widgets.chat import ReplyView

from tui_helpers import ready, send, wait_for

pytestmark = pytest.mark.anyio
SIZE = (120, 40)


def _fill(store) -> None:
    """No page beyond those the file has: the next write that needs one fails with 'database or disk is full'."""
    pages = store.db.execute("PRAGMA page_count").fetchone()[0]
    store.db.execute(f"PRAGMA max_page_count = {pages}")


async def test_full_disk_keeps_the_chat_going(make_app):
    app = make_app(Script(answer="a reply that is long enough " * 40))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "first question")
        saved = app.store.list_conversations()
        assert len(saved) == 1 and saved[0].n_messages == 2
        _fill(app.store)
        await send(pilot, "second question " * 200)
        await send(pilot, "third question")
        await wait_for(pilot, lambda: not app.generating)
        assert app.is_running
        full = [n.message for n in app._notifications if "full" in n.message]
        assert len(full) == 1 and full[0].endswith("this conversation goes on unsaved"), full
        assert [m.role for m in app.chat.path] == ["user", "assistant"] * 3  # the branch stays whole on screen
        assert len(app.query(ReplyView)) == 3
        assert app.store.list_conversations()[0].n_messages == 2  # what was saved before is intact
        assert app.chat.engine_messages()[2]["content"].startswith("second question")
        await pilot.press("ctrl+r")  # regenerate the unsaved reply: in memory too
        await wait_for(pilot, lambda: not app.generating and len(app.chat.path) == 6)
        app.store.db.execute("PRAGMA max_page_count = 1000000")  # space again: a new chat is saved
        await pilot.press("ctrl+n")
        await send(pilot, "fourth question")
        convs = app.store.list_conversations()
        assert len(convs) == 2 and sorted(c.n_messages for c in convs) == [2, 2]


def test_store_write_on_a_full_disk_is_one_line_and_rolls_back(tmp_path):
    from ninfer_tui.store import Store, StoreError
    st = Store(tmp_path / "t.db")
    c = st.new_conversation("kept", "m")
    first = st.add_message(c, "user", "q")
    _fill(st)
    with pytest.raises(StoreError, match=r"database or disk is full\); free some disk space") as e:
        st.add_message(c, "assistant", "x" * 100_000, first)
    assert "\n" not in str(e.value)
    assert [m.content for m in st.branch(c)] == ["q"] and not st.db.in_transaction
    st.close()


async def test_an_unsaved_chat_can_still_be_exported(make_app, tmp_path):
    """With the store full (or no store at all), ctrl+s writes the conversation as shown, and its JSON imports
    into a working store (it used to say "nothing to export", so the chat could only be lost)."""
    import json

    from ninfer_tui.export import import_json
    from ninfer_tui.store import Store
    for store in (True, False):
        app = make_app(Script(answer="kept answer"), store=store)
        app.settings.export_format = "json"
        async with app.run_test(size=SIZE) as pilot:
            await ready(pilot)
            await send(pilot, "first question")
            if store:
                _fill(app.store)
            await send(pilot, "second question " * 200)
            await pilot.press("ctrl+s")
            await pilot.pause()
            assert any("not in the transcripts" in n.message for n in app._notifications)
        files = sorted((tmp_path / "data" / "exports").glob("*.json"))
        doc = json.loads(files[-1].read_text())
        assert [m["content"][:15] for m in doc["messages"]] == ["first question", "kept answer",
                                                                 "second question", "kept answer"]
        other = Store(tmp_path / f"other-{store}.db")
        conv = import_json(other, files[-1].read_text())
        assert [m.content for m in other.branch(conv)][-1] == "kept answer"
        for f in files:
            f.unlink()
