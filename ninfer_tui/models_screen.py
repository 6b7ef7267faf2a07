"""The model screen (ctrl+l, the command palette's "Models"): the GGUF files this machine has, with what each
one is and whether the engine can run it; choosing one dismisses with it (the app then reloads the engine,
flows/models.py).

The search (engine.models.finder.iter_models: folders walked, every file's header read) runs in a worker
thread and the rows appear as it finds them (a large vocabulary's header takes ~0.2 s), so the screen opens at
once. A file the engine cannot run is listed with the reason and cannot be chosen; the
line under the table gives the highlighted file's path and the reason in full.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

from rich.text import Text
from textual import on
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import DataTable, Input, Label, Static

from engine.models.download import parse_hub_name
from engine.models.finder import COLUMNS, FoundModel

SHOW_EVERY_S = 0.25  # while searching, the rows found so far reach the table this often
CELL_WIDTHS = (40, 7, 6, 9, 28, 12, 22)  # the longest cell shown per column (the rest is in the line below)


def _cell(text: str, width: int, style: str = "", middle: bool = False) -> Text:
    """A cell as Text (a str would be read as markup: a name like "[q4]" is not), cut to `width`: at the end,
    or in the `middle` (a name's end says which file of a repository it is)."""
    if len(text) > width:
        head = width // 3 if middle else width - 1
        text = text[:head] + "…" + (text[len(text) - (width - 1 - head):] if middle else "")
    return Text(text, style=style)


class ModelsScreen(ModalScreen[FoundModel | str | None]):
    """Dismisses with the chosen FoundModel, an ORG/REPO/FILE.gguf name typed in the filter that no file here
    matches (to download), or None (closed)."""

    BINDINGS = [
        Binding("escape", "close", "Close", id="models_close"),
        Binding("enter", "choose", "Load", id="models_choose", priority=True),
        Binding("up", "move(-1)", show=False),
        Binding("down", "move(1)", show=False),
    ]
    DEFAULT_CSS = """
    ModelsScreen { align: center middle; }
    #models-box { width: 95%; height: 85%; border: thick $accent; background: $surface; padding: 0 1; }
    #models-table { height: 1fr; }
    #models-detail { height: 3; color: $text-muted; }
    """

    def __init__(self, find: Callable[[], Iterable[FoundModel]], current: str | None = None):
        super().__init__()
        self.find = find  # the search, run in a worker thread
        self.current = current  # the path of the model loaded now
        self.found: list[FoundModel] | None = None  # None until the search has ended
        self.so_far: list[FoundModel] = []  # what the search found until now
        self.shown: list[FoundModel] = []

    def compose(self):
        with Vertical(id="models-box"):
            yield Label("Models  (type to filter · ↑/↓ choose · enter load · esc close)")
            yield Input(placeholder="filter by name, architecture, quant or source; or ORG/REPO/FILE.gguf to "
                        "download from the Hugging Face Hub", id="models-filter")
            yield DataTable(id="models-table", cursor_type="row", zebra_stripes=True)
            yield Static("searching for GGUF files...", id="models-detail", markup=False)

    def on_mount(self) -> None:
        self.query_one(DataTable).add_columns(*COLUMNS)
        self.query_one("#models-filter", Input).focus()
        self._incoming: list[FoundModel] = []
        self._poller = self.set_interval(SHOW_EVERY_S, self._poll)
        self.run_worker(self._search, thread=True, exclusive=True, group="models-search", exit_on_error=False)

    def _search(self) -> None:
        """Worker thread: appends to `_incoming` (the UI shows it every SHOW_EVERY_S, also while a slow folder
        holds the search up), then hands over the whole list."""
        error = None
        try:
            for m in self.find():
                self._incoming.append(m)  # list.append is atomic: the UI thread reads a copy
        except Exception as e:  # noqa: BLE001 - bad files are in the list; this is the unforeseen rest, one line
            error = f"the model search failed: {type(e).__name__}: {e}"
        self.app.call_from_thread(self._fill, list(self._incoming), error, True)

    def _poll(self) -> None:
        if self.found is None and len(self._incoming) != len(self.so_far):
            self._fill(list(self._incoming), None, False)

    def _fill(self, found: list[FoundModel], error: str | None = None, done: bool = True) -> None:
        cursor = self.query_one(DataTable).cursor_row
        self.so_far = found
        if done:
            self.found = found
            self._poller.stop()
        self._refresh_rows()
        table = self.query_one(DataTable)
        if 0 < cursor < table.row_count:  # rows added while the user moved: the highlight stays
            table.move_cursor(row=cursor)
        if error is not None:
            self.query_one("#models-detail", Static).update(error)
            self.notify(error, severity="error", timeout=10)

    def _matches(self, m: FoundModel, words: list[str]) -> bool:
        """Every word is in the name, architecture, quant or source (not in a reason: "qwen3" would match every
        file of another architecture)."""
        name, arch, _params, _size, quant, source, _runs = m.row()
        hay = f"{name} {arch} {quant} {source}".lower()
        return all(w in hay for w in words)

    def _refresh_rows(self) -> None:
        table = self.query_one(DataTable)
        table.clear()
        words = self.query_one("#models-filter", Input).value.lower().split()
        self.shown = [m for m in self.so_far if self._matches(m, words)]
        for i, m in enumerate(self.shown):
            style = "" if m.supported else "dim"
            cells = list(m.row())
            if self.current is not None and str(m.path) == self.current:
                cells[0] = "● " + cells[0]
            table.add_row(*(_cell(c, w, style, middle=(col == 0)) for col, (c, w) in enumerate(zip(cells, CELL_WIDTHS))),
                          key=str(i))
        typed = self.query_one("#models-filter", Input).value.strip()
        if not self.shown:
            self.query_one("#models-detail", Static).update(
                "searching for GGUF files..." if self.found is None else
                f"enter downloads {typed} from the Hugging Face Hub" if parse_hub_name(typed) else
                "no GGUF file matches the filter" if self.found else
                "no GGUF files found: add folders to model_dirs in the config (the Hugging Face cache, LM Studio "
                "and Ollama are searched where they exist)")
        else:
            self._detail(0)

    def _detail(self, row: int) -> None:
        if not 0 <= row < len(self.shown):
            return
        m = self.shown[row]
        i = m.info
        facts = [str(m.path)]
        if i.title:
            facts.append(f"general.name {i.title!r}")
        if i.context_length:
            facts.append(f"context {i.context_length}")
        state = "● loaded now" if self.current is not None and str(m.path) == self.current else \
            ("runs here" if m.supported else f"cannot run here: {i.problem}")
        self.query_one("#models-detail", Static).update(" · ".join(facts) + "\n" + state)

    @on(DataTable.RowHighlighted, "#models-table")
    def _highlighted(self, event: DataTable.RowHighlighted) -> None:
        self._detail(event.cursor_row)

    @on(Input.Changed, "#models-filter")
    def _filter(self) -> None:
        self._refresh_rows()

    def action_move(self, step: int) -> None:
        table = self.query_one(DataTable)
        if table.row_count:
            table.move_cursor(row=max(0, min(table.row_count - 1, table.cursor_row + step)))

    def selected(self) -> FoundModel | None:
        table = self.query_one(DataTable)
        return self.shown[table.cursor_row] if self.shown and 0 <= table.cursor_row < len(self.shown) else None

    def action_choose(self) -> None:
        m = self.selected()
        typed = self.query_one("#models-filter", Input).value.strip()
        if m is None and self.found is not None and parse_hub_name(typed):
            self.dismiss(typed)
            return
        if m is None:
            self.notify("still searching..." if self.found is None else "no model matches the filter",
                        severity="warning")
            return
        if not m.supported:
            self.notify(f"{m.name} cannot run here: {m.info.problem}", severity="warning", timeout=10)
            return
        self.dismiss(m)

    def action_close(self) -> None:
        self.dismiss(None)
