"""ninfer-chat: the Textual terminal chat app on top of the in-process engine (engine.api).

The UI imports only engine.api/config/options/events/paths/errors (and engine.fake for --fake); the engine
never imports the UI.
"""
