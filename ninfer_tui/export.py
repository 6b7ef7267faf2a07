"""Export a transcript to Markdown (front-matter with model and settings) or JSON, and import that JSON.

JSON keeps the whole message tree (every regenerated/edited version, reasoning, settings and stats per reply)
so an import restores the conversation exactly; Markdown shows the current branch for reading.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from engine.errors import InputError

from .store import Store

FORMAT = "ninfer-chat-transcript"
FORMAT_VERSION = 1


def export_json(store: Store, conv_id: int) -> str:
    conv = store.conversation(conv_id)
    msgs = store.all_messages(conv_id)
    doc = {
        "format": FORMAT, "version": FORMAT_VERSION, "id": conv.id, "title": conv.title, "model": conv.model,
        "created": conv.created, "updated": conv.updated, "leaf_id": conv.leaf_id,
        "messages": [{"id": m.id, "parent_id": m.parent_id, "role": m.role, "content": m.content,
                      "created": m.created, "reasoning": m.reasoning, "reasoning_forced": m.reasoning_forced,
                      "settings": m.settings, "stats": m.stats} for m in msgs],
    }
    return json.dumps(doc, indent=2, ensure_ascii=False) + "\n"


def _yaml_scalar(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    return json.dumps(str(v), ensure_ascii=False)  # a JSON string is a valid YAML scalar


def export_markdown(store: Store, conv_id: int) -> str:
    """The current branch as Markdown, with YAML front-matter (model, settings of the last reply)."""
    conv = store.conversation(conv_id)
    path = store.branch(conv_id)
    last_settings = next((m.settings for m in reversed(path) if m.role == "assistant" and m.settings), {})
    lines = ["---", f"title: {_yaml_scalar(conv.title)}", f"model: {_yaml_scalar(conv.model)}",
             f"conversation_id: {conv.id}",
             f"created: {_yaml_scalar(time.strftime('%Y-%m-%dT%H:%M:%S', time.localtime(conv.created)))}"]
    if last_settings:
        lines.append("settings:")
        lines += [f"  {k}: {_yaml_scalar(v)}" for k, v in last_settings.items()]
    lines += ["---", "", f"# {conv.title}", ""]
    for m in path:
        if m.role == "user":
            lines += ["## User", "", m.content, ""]
            continue
        lines += [f"## {m.role.capitalize()}", ""]
        if m.reasoning:
            forced = " (close forced by the thinking budget)" if m.reasoning_forced else ""
            lines += [f"<details><summary>Reasoning{forced}</summary>", "", m.reasoning, "", "</details>", ""]
        lines += [m.content, ""]
        st = m.stats
        if st:
            lines += [f"*{st.get('output_tokens', 0)} tokens, {st.get('decode_tok_s', 0):.1f} tok/s, "
                      f"finish: {st.get('finish_reason', '?')}, spec: {st.get('spec_mode', 'off')}*", ""]
    return "\n".join(lines)


def export(store: Store, conv_id: int, fmt: str = "md") -> str:
    if fmt == "json":
        return export_json(store, conv_id)
    if fmt == "md":
        return export_markdown(store, conv_id)
    raise InputError(f"--format {fmt!r} is not md or json")


def import_json(store: Store, text: str) -> int:
    """Create a new conversation from `export_json` output; returns its id. Message ids are remapped."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise InputError(f"transcript JSON is not valid JSON ({e}); export it again with --format json") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("messages"), list):
        raise InputError(f"this JSON is not a {FORMAT} export (missing 'format'/'messages')")
    if doc.get("version", 0) > FORMAT_VERSION:
        raise InputError(f"transcript format version {doc['version']} is newer than this ninfer-chat reads")
    conv_id = store.new_conversation(str(doc.get("title") or "Imported chat"), str(doc.get("model") or ""))
    new_ids: dict = {}
    for m in doc["messages"]:
        if m.get("role") not in ("user", "assistant", "system") or not isinstance(m.get("content"), str):
            raise InputError(f"message {m.get('id')!r} has no valid role/content; the file is damaged")
        parent = m.get("parent_id")
        if parent is not None and parent not in new_ids:
            raise InputError(f"message {m.get('id')!r} refers to unknown parent {parent!r}; the file is damaged")
        new_ids[m.get("id")] = store.add_message(
            conv_id, m["role"], m["content"], new_ids.get(parent), reasoning=m.get("reasoning") or "",
            reasoning_forced=bool(m.get("reasoning_forced")), settings=m.get("settings") or {},
            stats=m.get("stats") or {}, created=m.get("created"))
    leaf = new_ids.get(doc.get("leaf_id"))
    if leaf is not None:
        store.set_leaf(conv_id, leaf)
    return conv_id


def export_to_file(store: Store, conv_id: int, fmt: str, directory: Path) -> Path:
    """Write an export next to the other exports (TUI ctrl+e); returns the file path."""
    directory.mkdir(parents=True, exist_ok=True)
    out = directory / f"chat-{conv_id}-{time.strftime('%Y%m%d-%H%M%S')}.{fmt}"
    out.write_text(export(store, conv_id, fmt), encoding="utf-8")
    return out
