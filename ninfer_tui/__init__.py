"""ninfer-chat: the Textual terminal chat app on top of the in-process engine (engine.api).

The UI imports only engine.api/config/events/paths/errors; the engine never imports the UI.
"""
