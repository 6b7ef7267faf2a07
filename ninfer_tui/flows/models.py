"""Choosing a model in a chat: the model screen (ctrl+l), reloading the engine with the status line's load
progress (LoadFlow), keeping the chat where it fits the new model's context or continuing it in a new chat
with the last turns that do (said either way), going back to the previous model where the new one fails to
load, and the model's sha256 computed in a background thread for the transcript."""
from __future__ import annotations

import dataclasses
from functools import partial
from pathlib import Path

from textual.message import Message

from engine.errors import NinferError

from ..chat import turns
from ..models_screen import ModelsScreen
from ..widgets.stats import StatsPanel


class ModelHashed(Message):
    """A model file's sha256 is known (None and `error`: it could not be read)."""

    def __init__(self, file: tuple[str, int, float], name: str, sha256: str | None, error: str | None = None):
        super().__init__()
        self.file, self.name, self.sha256, self.error = file, name, sha256, error


class ModelsFlow:
    """ChatApp's part that switches models (mixed into the app). LoadFlow calls _on_model_ready /
    _on_model_failed when a load ends."""

    _switch_from: tuple[str | None, str] | None = None  # (model path, name) before a switch, while it loads
    # set by the entry point: the config's model_dirs and model, and why this chat cannot switch model (a
    # remote endpoint, --fake); None: it can
    model_dirs: tuple[str, ...] = ()
    config_model: str | None = None
    no_model_switch: str | None = None

    def _find_models(self):
        """The model screen's search: an iterator of FoundModel (engine.models.finder.iter_models)."""
        from engine.models.finder import iter_models
        current = [self.engine_args.model] if self.engine_args.model else []
        return iter_models(self.model_dirs, self.config_model, extra=current)

    def action_models(self) -> None:
        if self.no_model_switch is not None:
            self.notify(self.no_model_switch, severity="warning", timeout=8)
            return
        if self._load_ticker is not None:  # a load in flight finishes first (its thread cannot be stopped)
            self.notify(f"{self.model_name} is still loading; choose another model once it is ready",
                        severity="warning", timeout=5)
            return

        async def chosen(found) -> None:
            if found is None:
                return
            if isinstance(found, str):  # ORG/REPO/FILE.gguf typed: download (a reply may go on), then switch
                self._download(found)
                return
            if self.engine_args.model and Path(found.path).resolve() == Path(self.engine_args.model).resolve() \
                    and self.session is not None:
                self.notify(f"{found.name} is the model loaded now", timeout=4)
                return
            await self._when_idle(partial(self._switch_model, found))
        self.push_screen(ModelsScreen(self._find_models, self.engine_args.model), chosen)

    async def _switch_model(self, found) -> None:
        """Drop the engine and load `found` (its memory is freed first: two large models may not fit)."""
        import gc
        if self._switch_from is None:  # a second choice while one loads keeps the first fallback
            self._switch_from = (self.engine_args.model, self.model_name)
        self.engine = self.session = self.bridge = None  # the last reply's bridge holds the old session too
        gc.collect()  # the old model's buffers and mapped file go now, not at some later collection
        self.load_error = None
        self.engine_args = dataclasses.replace(self.engine_args, model=str(found.path))
        self.model_name = found.name
        self.query_one("#stats", StatsPanel).on_engine({"model": found.name})
        self.notify(f"loading {found.name}...", timeout=3)
        self._start_loading()

    def _download(self, spec: str) -> None:
        """Fetch a Hugging Face file in a worker thread (the status line counts the seconds), then load it
        (once a reply in flight has ended)."""
        import time
        started = time.monotonic()
        got = [0, None]  # bytes so far, total (written by the download thread)

        def show() -> None:
            done, total = got
            size = (f" {done / 1e6:.1f} of {total / 1e6:.1f} MB ({100 * done / total:.0f}%)," if total
                    else f" {done / 1e6:.1f} MB," if done else "")
            self._status(f"downloading {spec} from the Hugging Face Hub...{size} "
                         f"{time.monotonic() - started:.0f} s")
        ticker = self.set_interval(0.5, show)
        self._status(f"downloading {spec} from the Hugging Face Hub...")

        def report(done: int, total) -> None:
            got[:] = [done, total]

        def fetch() -> None:
            from engine.models.download import download
            from engine.models.finder import FoundModel
            from engine.models.header import read_info
            try:
                path = download(spec, quiet=True, progress=report)
                found, error = FoundModel(spec, path, "hf", read_info(path)), None
            except NinferError as e:
                found, error = None, str(e)
            self.call_from_thread(done, found, error)

        def done(found, error) -> None:
            ticker.stop()
            self._ready_status()
            if error is not None:
                self.notify(error, severity="error", timeout=15)
            elif not found.supported:
                self.notify(f"{spec} was downloaded but cannot run here: {found.info.problem}", severity="error",
                            timeout=15)
            else:
                self.call_later(self._when_idle, partial(self._switch_model, found))
        self.run_worker(fetch, thread=True, group="download", exclusive=True, exit_on_error=False)

    def _on_model_ready(self) -> None:
        """The engine is loaded (at start or after a switch): record the model for the transcript, start its
        sha256, and after a switch keep the chat where it fits (else continue it in a new chat)."""
        path = getattr(self.engine, "model_path", None)
        if path:
            self.engine.name = self.model_name  # the name the user knows it by (an Ollama blob's is a hash)
            self.query_one("#stats", StatsPanel).on_engine({"model": self.model_name})
        try:
            self.chat.set_model(self.model_name, path)
        except OSError as e:
            self.notify(f"the model file cannot be read for the transcript record ({e.strerror or e})",
                        severity="warning")
        if path and self.chat.model_file is not None:
            self._hash_model(self.chat.model_file, self.model_name)
        switched, self._switch_from = self._switch_from is not None, None
        if switched:
            self.call_later(self._after_switch)

    def _on_model_failed(self, error: str) -> None:
        """A load failed: after a switch, load the model the chat had before (said in one line)."""
        if self._switch_from is None:
            return
        (path, name), self._switch_from = self._switch_from, None
        failed = self.model_name
        self.notify(f"{failed} failed to load ({error}); loading {name} again", severity="error", timeout=15)
        self.engine_args = dataclasses.replace(self.engine_args, model=path)
        self.model_name = name
        self.load_error = None
        self._start_loading()

    def _hash_model(self, file: tuple[str, int, float], name: str) -> None:
        """sha256 of the model file in a thread of its own (niced; cached by path, size and mtime)."""
        from engine.models.digest import hash_in_background
        hash_in_background(file[0], lambda sha, error: self.post_message(ModelHashed(file, name, sha, error)))

    def on_model_hashed(self, message: ModelHashed) -> None:
        if message.sha256 is None:
            self.notify(f"the sha256 of {message.name} could not be computed ({message.error}); the transcript "
                        "records the model without it", severity="warning", timeout=8)
            return
        self.chat.set_model_sha256(message.file, message.sha256)
        self._saving_notice()

    def _chat_tokens(self, msgs: list[dict]) -> int:
        return len(self.session.prompt_tokens([*self.chat.system_messages(), *msgs], self.settings.request()))

    async def _after_switch(self) -> None:
        """Keep the chat if it fits the new model's context with room for a reply, else continue it in a new
        chat with the last turns that fit. The notice says which."""
        if self.session is None or not self.chat.path:
            return
        context, room = self.engine.max_context, self._reply_room()
        all_turns = turns(self.chat.path)
        as_msgs = [{"role": m.role, "content": m.content} for m in self.chat.path]
        try:
            used = self._chat_tokens(as_msgs)
            if used + room <= context:
                self.notify(f"{self.model_name} goes on with this chat ({used} of {context} tokens)", timeout=8)
                return
            keep = self._last_turns_fitting(all_turns, lambda msgs: self._chat_tokens(msgs) + room <= context)
        except NinferError as e:
            self.notify(f"this chat is kept; its size under {self.model_name} is unknown ({e})", severity="warning")
            return
        await self._carry_over(all_turns, keep, lambda was, old_id: (
            f"{was.capitalize()} ({used} tokens) does not fit {self.model_name}'s context of {context} with room "
            f"for a reply: a new chat goes on with the last {keep} of {len(all_turns)} turns"
            + (f" ({was} stays in the transcripts)" if old_id else "") + "."))
