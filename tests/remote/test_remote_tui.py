"""The chat on `--endpoint`, driven headless, against a real ninfer-serve on loopback serving the tiny random-weight
llama (the real generation loop on the numpy reference backend): streaming, reasoning apart, stop, regenerate,
transcripts and export with the endpoint recorded, features the server cannot change saying why, and one-line
errors for a wrong key or URL."""
from __future__ import annotations

import dataclasses

import pytest
from tui_helpers import ready, send, wait_for

from engine.remote.servers import GENERIC

pytestmark = pytest.mark.anyio
SIZE = (120, 40)
WORDY = {"temperature": 1.5, "top_k": 0, "top_p": 1.0, "min_p": 0.0}  # the random model's text is not all newlines


def notes(app) -> list[str]:
    return [n.message for n in app._notifications]


async def test_streaming_reply_figures_transcript_and_export(serve, tiny_engine, remote_app, tmp_path):
    with serve(tiny_engine, model_id="tiny-llama") as (url, _):
        app = remote_app(url, max_new=24, seed=3, **WORDY)  # seeded: an unseeded draw was all blank once in CI
        async with app.run_test(size=SIZE) as pilot:
            await ready(pilot)
            assert app.model_name == f"tiny-llama @ {url}"
            assert any(n.startswith("connected to ninfer-serve at") and "context size" in n for n in notes(app))
            await send(pilot, "Hello there")
            final, reply = app.last_final, app.chat.path[-1]
            assert final.finish_reason == "length" and final.output_tokens == 24 and final.backend == "remote"
            assert final.prompt_tokens > 0 and final.ttft_s > 0 and final.decode_tok_s > 0
            assert reply.role == "assistant" and reply.content.strip()
            assert app.query("ReplyView").last().text == reply.content  # what streamed is what was saved
            panel = app.query_one("#stats")
            assert panel.engine_info["backend"] == "remote" and panel.engine_info["context_capacity"] == 4096
            gpu = str(app.query_one("#gpu").render())
            assert "its GPU is not visible from here" in gpu
            conv = app.store.conversation(app.chat.conv_id)
            assert conv.model == f"tiny-llama @ {url}" and reply.stats["backend"] == "remote"
            await pilot.press("ctrl+s")
            await wait_for(pilot, lambda: any(n.startswith("exported to") for n in notes(app)))
            text = next((tmp_path / "data" / "exports").glob("*.md")).read_text()
            assert f'model: "tiny-llama @ {url}"' in text  # the export names the endpoint too
            # a server that reports drafts but no rounds (llama.cpp's timings): the panel shows its acceptance
            panel.on_final(dataclasses.replace(final, spec_mode="server", drafted=10, accepted=6, rounds=0))
            spec = str(app.query_one("#spec").render())
            assert "last reply    server" in spec and "acceptance         60%" in spec and "drafted" in spec


async def test_reasoning_is_shown_apart(serve, tiny_engine, remote_app):
    # the tiny llama has no thinking markers: ninfer-serve prompts for reasoning and streams it as reasoning_content
    with serve(tiny_engine) as (url, _):
        app = remote_app(url, max_new=16, thinking="on", seed=3, **WORDY)  # seeded: a random draw can be all blank
        async with app.run_test(size=SIZE) as pilot:
            await ready(pilot)
            assert app.prompted_thinking  # the model card says "prompted": the reply labels it so
            await send(pilot, "Think first")
            view, reply = app.query("ReplyView").last(), app.chat.path[-1]
            assert view.reasoning and reply.reasoning == view.reasoning and app.last_final.reasoning_tokens > 0
            assert view.text == reply.content  # the answer is apart from the reasoning (here empty: max_new)
            assert "<think>" not in view.reasoning + view.text


async def test_stop_and_regenerate(serve, tiny_engine, remote_app):
    with serve(tiny_engine) as (url, app_):
        finals, worker = [], app_.state.worker
        observe = worker.on_final
        worker.on_final = lambda st: (finals.append(st), observe(st))
        app = remote_app(url, max_new=3500, **WORDY)
        async with app.run_test(size=SIZE) as pilot:
            await ready(pilot)
            await send(pilot, "Tell me a long story", wait=False)
            await wait_for(pilot, lambda: app.reply_view is not None and app.reply_view.text)
            await pilot.press("escape")
            await wait_for(pilot, lambda: not app.generating, timeout=5)
            assert app.last_final.finish_reason == "cancelled" and app.last_final.output_tokens < 3500
            await wait_for(pilot, lambda: bool(finals), timeout=5)  # the server stopped generating too
            assert finals[-1].finish_reason == "cancelled"
            first = app.chat.path[-1]
            assert first.role == "assistant" and first.stats["finish_reason"] == "cancelled"
            app.settings.max_new = 12
            await pilot.press("ctrl+r")
            await wait_for(pilot, lambda: app.replies_started == 2 and not app.generating)
            second = app.chat.path[-1]
            assert second.id != first.id and app.chat.versions(second) == (2, 2)
            assert [m.role for m in app.chat.path] == ["user", "assistant"]


async def test_what_the_server_cannot_change_says_why(serve, tiny_engine, remote_app):
    """The same server, taken for one that takes only OpenAI's fields (what detect() picks for an unknown one)."""
    def as_generic(engine):
        engine.server = GENERIC
    with serve(tiny_engine) as (url, _):
        app = remote_app(url, after_connect=as_generic, budget=64, max_new=8)
        async with app.run_test(size=SIZE) as pilot:
            await ready(pilot)
            # the config's budget cannot be honoured: said, and off
            assert app.settings.budget == 0 and any("thinking budget 64 from the config is not applied" in n
                                                    for n in notes(app))
            for key, words in (("f2", "speculative mode (F2) is unavailable: this server sets speculative decoding"),
                               ("f4", "thinking on/off (F4) is unavailable: this server takes no chat_template_kwargs"),
                               ("f6", "thinking budget (F5/F6) is unavailable: this server has no per-request")):
                before = (app.settings.spec, app.settings.thinking, app.settings.budget)
                await pilot.press(key)
                await wait_for(pilot, lambda w=words: any(n.startswith(w) for n in notes(app)))
                assert (app.settings.spec, app.settings.thinking, app.settings.budget) == before
            assert "unavailable" in str(app.query_one("#spec").render())  # the panel lists the modes it lacks
            await pilot.press("f9")
            await wait_for(pilot, lambda: app.screen.query("#set-max_context"))
            assert app.screen.query_one("#set-max_context").disabled  # context size: set on the server
            await pilot.press("escape")
            await send(pilot, "still answers")
            assert app.last_final.finish_reason == "length"


@pytest.mark.parametrize("case", ["bad key", "bad url", "no such model"])
async def test_connection_errors_are_one_line(serve, tiny_engine, remote_app, case):
    with serve(tiny_engine, model_id="tiny", api_key="sekrit") as (url, _):
        target, kw, want = {
            "bad key": (url, {"api_key": "wrong"}, "refused the API key (HTTP 401"),
            "bad url": ("http://127.0.0.1:9/v1", {}, "cannot reach http://127.0.0.1:9/v1"),
            "no such model": (url, {"api_key": "sekrit", "model": "big"}, "has no model 'big'; it serves tiny"),
        }[case]
        app = remote_app(target, **kw)
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: app.load_error is not None)
            assert want in app.load_error and "\n" not in app.load_error
            assert str(app.query_one("#status").render()).startswith("model failed to load: ")
            app.query_one("#prompt").load_text("hi")
            await pilot.press("enter")
            assert any(n.startswith("no model: ") and want in n for n in notes(app))
