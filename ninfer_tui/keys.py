"""The chat's keys: the app's actions with their binding ids and default keys (config.toml's [keymap] mirrors
them), a check of a user's [keymap], and the rows of the help screen."""
from __future__ import annotations

# (binding id, action, footer label, default key, shown in footer)
ACTIONS = [
    ("stop", "stop", "Stop", "escape", True),
    ("regenerate", "regenerate", "Regenerate", "ctrl+r", True),
    ("spec_cycle", "spec_cycle", "Spec", "f2", True),
    ("penalties", "penalties", "Penalties", "f3", True),
    ("thinking", "thinking", "Think", "f4", True),
    ("budget_down", "budget(-1)", "Budget -", "f5", False),
    ("budget_up", "budget(1)", "Budget +", "f6", False),
    ("copy_reply", "copy_reply", "Copy reply", "f7", False),
    ("toggle_stats", "toggle_stats", "Stats panel", "f8", False),
    ("settings", "settings", "Settings", "f9", False),
    ("system_prompt", "system_prompt", "System prompt", "ctrl+t", False),
    ("models", "models", "Models", "ctrl+l", False),
    ("new_chat", "new_chat", "New chat", "ctrl+n", False),
    ("transcripts", "transcripts", "Transcripts", "ctrl+o", True),
    ("export", "export", "Export", "ctrl+s", False),
    ("help", "help", "Help", "f1", True),
    ("quit", "quit", "Quit", "ctrl+q", True),
]
# Shown/used only on the chat screen (priority so that the focused TextArea cannot swallow them).
MAIN_ONLY = {a for _, a, *_ in ACTIONS} - {"quit", "help"}
PROMPT_KEYS = {"send": "enter", "newline": "ctrl+j,shift+enter"}  # the prompt's own keys (PromptInput)
# keys of a focused message (widgets/chat.py): (binding id, default keys, what it does)
MESSAGE_KEYS = [
    ("edit_prompt", "e,enter", "Edit & resend the focused prompt"),
    ("copy_message", "c", "Copy the focused message"),
    ("copy_code", "b", "Copy the focused message's code block"),
    ("version_prev", "left", "Previous version of the focused message (regenerated / edited); continues from it"),
    ("version_next", "right", "Next version of the focused message"),
]


def keymap_problems(keymap: dict[str, str]) -> list[str]:
    """What is wrong with a [keymap] (keys that are not keys, a key bound to two actions), a line each."""
    out, owner = [], {}
    defaults = {bid: key for bid, _, _, key, _ in ACTIONS} | PROMPT_KEYS
    for bid, default in defaults.items():
        value = keymap.get(bid, default)
        for key in (k.strip() for k in value.split(",")):
            if not key or key.startswith("+") or key.endswith("+"):
                out.append(f"keymap: {bid} = {value!r} is not a key list (e.g. \"ctrl+r\" or \"f2,ctrl+k\")")
                break
            if key in owner:
                out.append(f"keymap: {key} is bound to both {owner[key]} and {bid}; give one of them another key")
            owner.setdefault(key, bid)
    return out


def help_rows(keymap: dict[str, str]) -> list[tuple[str, str, str]]:
    """(keys as the user has them, binding id, description) for every key of the chat."""
    rows = [(keymap.get(bid, key), bid, label) for bid, _, label, key, _ in ACTIONS]
    rows += [(keymap.get("send", "enter"), "send", "Send the prompt"),
             (keymap.get("newline", "ctrl+j,shift+enter"), "newline", "New line in the prompt"),
             ("up", "history_prev", "Previous prompt (on an empty input)")]
    rows += [(keymap.get(bid, key), bid, text) for bid, key, text in MESSAGE_KEYS]
    return rows
