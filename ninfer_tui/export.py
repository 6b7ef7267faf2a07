"""Export a transcript to Markdown (front-matter with model and settings) or JSON, and import that JSON.

JSON keeps the whole message tree (every regenerated/edited version, reasoning, settings and stats per reply,
the model file each reply came from with its sha256) and the system prompt, so an import restores the
conversation exactly; Markdown shows the system prompt and the current branch for reading.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from engine.errors import InputError

from .store import Conversation, Message, ModelRecord, Store, StoreError

FORMAT = "ninfer-chat-transcript"
FORMAT_VERSION = 1


def export_json(store: Store, conv_id: int) -> str:
    conv = store.conversation(conv_id)
    return _json(conv, store.all_messages(conv_id), store.models(conv_id))


def _model_doc(r: ModelRecord) -> dict:
    return {"name": r.name, "path": r.path, "size": r.size, "mtime": r.mtime, "sha256": r.sha256}


def _json(conv: Conversation, msgs: list[Message], models: dict[int, ModelRecord] | None = None) -> str:
    models = models or {}
    doc = {
        "format": FORMAT, "version": FORMAT_VERSION, "id": conv.id, "title": conv.title, "model": conv.model,
        "model_path": conv.model_path, "model_sha256": conv.model_sha256,
        "created": conv.created, "updated": conv.updated, "leaf_id": conv.leaf_id,
        "system_prompt": conv.system_prompt,
        "messages": [{"id": m.id, "parent_id": m.parent_id, "role": m.role, "content": m.content,
                      "created": m.created, "reasoning": m.reasoning, "reasoning_forced": m.reasoning_forced,
                      "settings": m.settings, "stats": m.stats}
                     | ({"model": _model_doc(models[m.model_id])} if m.model_id in models else {}) for m in msgs],
    }
    return json.dumps(doc, indent=2, ensure_ascii=False) + "\n"


def export_branch(path: list[Message], title: str, model: str, fmt: str = "md", system_prompt: str = "") -> str:
    """A branch held in memory (a chat the transcript store could not take) in either format; the JSON
    imports like any other export."""
    if not path:
        raise InputError("nothing to export yet")
    conv = Conversation(path[0].conversation_id or 0, title, model, path[0].created, path[-1].created, path[-1].id,
                        len(path), system_prompt)
    if fmt == "json":
        return _json(conv, path)
    if fmt == "md":
        return _markdown(conv, path)
    raise InputError(f"--format {fmt!r} is not md or json")


def _yaml_scalar(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    return json.dumps(str(v), ensure_ascii=False)  # a JSON string is a valid YAML scalar


def export_markdown(store: Store, conv_id: int) -> str:
    """The current branch as Markdown, with YAML front-matter (model; the settings every reply ran with, or
    the last reply's, each other reply then noting where its own differed)."""
    return _markdown(store.conversation(conv_id), store.branch(conv_id), store.models(conv_id))


def _differences(settings: dict, base: dict) -> str:
    """The settings that differ from `base`, as "name value, ..." ("" when none)."""
    keys = list(settings) + [k for k in base if k not in settings]
    return ", ".join(f"{k} {_yaml_scalar(settings.get(k))}" for k in keys if settings.get(k) != base.get(k))


def _markdown(conv: Conversation, path: list[Message], models: dict[int, ModelRecord] | None = None) -> str:
    models = models or {}
    replies = [m.settings for m in path if m.role == "assistant" and m.settings]
    last_settings = replies[-1] if replies else {}
    # "settings" only where they were the chat's: the settings change between replies (F-keys, the screen)
    same = all(r == last_settings for r in replies)
    lines = ["---", f"title: {_yaml_scalar(conv.title)}", f"model: {_yaml_scalar(conv.model)}",
             f"conversation_id: {conv.id}",
             f"created: {_yaml_scalar(time.strftime('%Y-%m-%dT%H:%M:%S', time.localtime(conv.created)))}"]
    if conv.model_path:
        lines += [f"model_file: {_yaml_scalar(conv.model_path)}",
                  f"model_sha256: {_yaml_scalar(conv.model_sha256 or None)}"]
    if conv.system_prompt:
        lines.append(f"system_prompt: {_yaml_scalar(conv.system_prompt)}")
    if last_settings:
        lines.append("settings:" if same else "last_reply_settings:")
        lines += [f"  {k}: {_yaml_scalar(v)}" for k, v in last_settings.items()]
    lines += ["---", "", f"# {conv.title}", ""]
    if conv.system_prompt:
        lines += ["## System", "", conv.system_prompt, ""]
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
        if (r := models.get(m.model_id)) is not None and r.path != conv.model_path:  # the chat switched model
            lines += [f"*model: {r.name} ({r.path}, sha256 {r.sha256 or 'not computed'})*", ""]
        if m.settings and (diff := _differences(m.settings, last_settings)):
            lines += [f"*this reply's settings, where they differ from the last reply's: {diff}*", ""]
    return "\n".join(lines)


def export(store: Store, conv_id: int, fmt: str = "md") -> str:
    if fmt == "json":
        return export_json(store, conv_id)
    if fmt == "md":
        return export_markdown(store, conv_id)
    raise InputError(f"--format {fmt!r} is not md or json")


def import_json(store: Store, text: str) -> int:
    """Create a new conversation from `export_json` output; returns its id. Message ids are remapped. The whole
    file is checked before anything is written, and a write that fails midway leaves no partial chat."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise InputError(f"transcript JSON is not valid JSON ({e}); export it again with --format json") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("messages"), list):
        raise InputError(f"this JSON is not a {FORMAT} export (missing 'format'/'messages')")
    version = doc.get("version", 0)
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise InputError(f"transcript format version {version!r} is newer than this ninfer-chat reads "
                         f"({FORMAT_VERSION}); upgrade ninfer-chat")
    seen: set = set()
    for i, m in enumerate(doc["messages"]):
        what = f"message {i + 1}" + (f" (id {m['id']!r})" if isinstance(m, dict) and "id" in m else "")
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant", "system") \
                or not isinstance(m.get("content"), str):
            raise InputError(f"{what} has no valid role/content; the file is damaged (nothing was imported)")
        parent = m.get("parent_id")
        if parent is not None and parent not in seen:
            raise InputError(f"{what} refers to unknown parent {parent!r}; the file is damaged (nothing was "
                             "imported)")
        seen.add(m.get("id"))
    system = doc.get("system_prompt")  # absent in files exported before it existed
    conv_id = store.new_conversation(str(doc.get("title") or "Imported chat"), str(doc.get("model") or ""),
                                     system if isinstance(system, str) else "")
    try:
        new_ids: dict = {}
        for m in doc["messages"]:
            new_ids[m.get("id")] = store.add_message(
                conv_id, m["role"], m["content"], new_ids.get(m.get("parent_id")),
                reasoning=str(m.get("reasoning") or ""), reasoning_forced=bool(m.get("reasoning_forced")),
                settings=m.get("settings") if isinstance(m.get("settings"), dict) else {},
                stats=m.get("stats") if isinstance(m.get("stats"), dict) else {},
                created=m.get("created") if isinstance(m.get("created"), (int, float)) else None,
                model_id=_import_model(store, m.get("model")))
        leaf = new_ids.get(doc.get("leaf_id"))
        if leaf is not None:
            store.set_leaf(conv_id, leaf)
        times = [doc.get(k) for k in ("created", "updated")]
        if all(isinstance(t, (int, float)) and not isinstance(t, bool) and t > 0 for t in times):
            store.set_times(conv_id, float(times[0]), float(times[1]))  # the chat keeps its age
    except StoreError:
        try:
            store.delete(conv_id)
        except StoreError:
            pass  # the store refuses writes altogether: the half chat stays, the error below says why
        raise
    return conv_id


def _import_model(store: Store, doc) -> int | None:
    """The models row of a message's exported "model" (absent in older exports, or not a model: None)."""
    if not isinstance(doc, dict) or not all(isinstance(doc.get(k), str) for k in ("name", "path")):
        return None
    size, mtime = doc.get("size"), doc.get("mtime")
    if not isinstance(size, int) or not isinstance(mtime, (int, float)):
        return None
    sha = doc.get("sha256") if isinstance(doc.get("sha256"), str) else ""
    return store.model_record(doc["name"], doc["path"], size, float(mtime), sha256=sha)


def export_to_file(store: Store, conv_id: int, fmt: str, directory: Path) -> Path:
    """Write an export next to the other exports (TUI ctrl+s); returns the file path."""
    return write_export(export(store, conv_id, fmt), conv_id, fmt, directory)


def write_export(text: str, name: int | str, fmt: str, directory: Path) -> Path:
    """Write an export made already as chat-NAME-TIME.FMT in `directory`; returns the file path."""
    directory.mkdir(parents=True, exist_ok=True)
    out = directory / f"chat-{name}-{time.strftime('%Y%m%d-%H%M%S')}.{fmt}"
    out.write_text(text, encoding="utf-8")
    return out
