"""The chat on a remote endpoint (engine.remote): its loader, the GPU section's reason, and what the app says
about features the server cannot change per request.

The app asks `refuse(app, feature)` where a key would change something the server does not take (F2, F4,
F5/F6): the key then says why, and the setting stays as it is. `on_connected` names the chat after the served
model and endpoint (the transcript records both), turns off settings from the config that the server cannot
honour (saying so), and says once what is unavailable there. With the in-process engine all of them do nothing.
"""
from __future__ import annotations

from engine.remote.servers import FEATURES, host_of


class RemoteTelemetry:
    """The panel's GPU section on a remote engine: no samples, and the reason."""

    available = False

    def __init__(self, endpoint: str):
        self.reason = f"the model runs on {host_of(endpoint)}; its GPU is not visible from here"

    def sample(self) -> list:
        return []

    def close(self) -> None:
        pass


def remote_loader(opts):
    """(loader, provisional chat name) for ChatApp / run_plain: the loader connects (RemoteEngine.connect)."""
    from engine.remote import RemoteEngine

    def loader(args, progress=None):
        return RemoteEngine.connect(opts, progress=progress)
    return loader, f"{opts.model or 'the served model'} @ {opts.endpoint}"


def unavailable(engine, feature: str) -> str | None:
    """Why `feature` (engine.remote.servers.FEATURES) cannot be used with this engine; None where it can."""
    fn = getattr(engine, "unavailable", None)
    return fn().get(feature) if callable(fn) else None


def refuse(app, feature: str) -> bool:
    """True (after saying why) where the engine cannot do `feature`; the caller then changes nothing."""
    why = unavailable(app.engine, feature)
    if why is None:
        return False
    app.notify(f"{FEATURES[feature]} is unavailable: {why}", severity="warning", timeout=8)
    return True


def on_connected(app, engine) -> None:
    """A remote engine is ready: name the chat after it, fit the settings to the server, say what it lacks."""
    if not callable(getattr(engine, "unavailable", None)):
        return
    app.model_name = app.chat.model_name = engine.chat_name
    why = engine.unavailable()
    notes = list(engine.notes)
    s = app.settings
    if "thinking" in why and s.thinking != "auto":
        notes.append(f"thinking {s.thinking} from the config is not applied ({why['thinking']})")
        s.thinking = "auto"
    if "budget" in why and s.budget:
        notes.append(f"the thinking budget {s.budget} from the config is not applied ({why['budget']})")
        s.budget = 0
    notes.append(f"connected to {engine.server.label} at {engine.endpoint}; unavailable here: "
                 + "; ".join(f"{FEATURES[k]} ({reason})" for k, reason in why.items()))
    app.notify("\n".join(notes), timeout=20)
