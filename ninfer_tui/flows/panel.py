"""The stats panel: shown where the terminal is wide enough (or as F8 chose), fed settings and GPU telemetry."""
from __future__ import annotations

from textual.css.query import NoMatches

from ..widgets.stats import StatsPanel

PANEL_MIN_COLUMNS = 100  # a narrower terminal folds the stats panel away (F8 shows it): the chat keeps the width


class PanelFlow:
    """ChatApp's part for the stats panel (mixed into the app)."""

    def action_toggle_stats(self) -> None:
        panel = self.query_one("#stats", StatsPanel)
        self._panel_choice = not panel.display
        self._fit_panel()

    def _fit_panel(self, width: int | None = None) -> None:
        """Show the stats panel where the settings want it and the terminal (`width` columns, default the
        app's) has room for it, or as F8 last chose."""
        if (panel := self._panel()) is None:
            return
        wide = (width or self.size.width) >= PANEL_MIN_COLUMNS
        panel.display = self._panel_choice if self._panel_choice is not None else self.settings.show_stats and wide
        if self.session is not None and not self.generating:
            self._ready_status()

    def on_resize(self, event) -> None:
        self._fit_panel(event.size.width)  # runs before App's own handler records the new size

    def _refresh_panel_settings(self) -> None:
        self.query_one("#stats", StatsPanel).on_settings(self.settings, self.spec_available,
                                                         self.native_thinking)

    def _poll_gpu(self) -> None:
        panel = self._panel()
        if panel is None:  # shutting down: the chat screen is gone
            return
        tel = self.telemetry
        panel.on_gpu(tel.sample() if tel is not None else [], tel.reason if tel else "")

    def _panel(self) -> StatsPanel | None:
        try:
            return self.screen_stack[0].query_one("#stats", StatsPanel) if self.screen_stack else None
        except NoMatches:
            return None
