"""Fetch a GGUF file from the Hugging Face Hub by its `ORG/REPO/FILE.gguf` name, through `huggingface_hub` (an
optional dependency: `pip install 'ninfer-chat[hub]'`). The file lands in the hub cache, where the finder
lists it from then on (offline too). Every failure is one ModelFileError line saying what to do: the library
not installed, offline, no such repository / file, a gated repository, a full disk.
"""
from __future__ import annotations

import re
from pathlib import Path

from ..errors import ModelFileError

INSTALL_HINT = "pip install 'ninfer-chat[hub]' (or pip install huggingface_hub)"
_SPEC = re.compile(r"^([A-Za-z0-9][\w.-]*)/([\w.-]+)/(.+\.gguf)$", re.IGNORECASE)


def parse_hub_name(spec: str) -> tuple[str, str] | None:
    """(repo_id, file in the repo) for "ORG/REPO/[DIR/]FILE.gguf", else None."""
    m = _SPEC.match(spec.strip())
    if m is None or ".." in m.group(3).split("/"):
        return None
    return f"{m.group(1)}/{m.group(2)}", m.group(3)


def _error(name: str) -> type:
    """huggingface_hub's error class `name` (errors moved from .utils to .errors over versions), else a class
    that matches nothing."""
    for mod in ("huggingface_hub.errors", "huggingface_hub.utils"):
        try:
            cls = getattr(__import__(mod, fromlist=[name]), name, None)
        except ImportError:
            cls = None
        if isinstance(cls, type):
            return cls
    return type(f"_No{name}", (Exception,), {})


class _Null:
    """Where the reporting bar draws: nowhere."""
    def write(self, _s):
        pass

    def flush(self):
        pass


def _reporting_bar(report):
    """A tqdm class that draws nothing and calls report(bytes done, total bytes or None) as the file arrives
    (huggingface_hub's `tqdm_class`; a plain tqdm subclass, so its global bar switch leaves it on)."""
    from tqdm import tqdm

    class Bar(tqdm):
        def __init__(self, *args, **kwargs):
            kwargs.pop("name", None)  # huggingface_hub's own bars take a name; tqdm refuses it
            kwargs.update(disable=False, file=_Null())
            super().__init__(*args, **kwargs)
            report(self.n, self.total)

        def update(self, n=1):
            shown = super().update(n)
            report(self.n, self.total)
            return shown
    return Bar


def download(spec: str, quiet: bool = False, progress=None) -> Path:
    """Download (or find in the hub cache) ORG/REPO/FILE.gguf; returns the local path. huggingface_hub shows
    its progress bars on stderr, except `quiet` (a full-screen UI, which says it is downloading itself);
    progress(bytes done, total bytes or None) is called as the file arrives, from the downloading thread."""
    parsed = parse_hub_name(spec)
    if parsed is None:
        raise ModelFileError(f"{spec!r} is not a Hugging Face file name; give ORG/REPO/FILE.gguf, e.g. "
                             "Qwen/Qwen3-0.6B-GGUF/Qwen3-0.6B-Q8_0.gguf")
    repo, filename = parsed
    try:
        import huggingface_hub
    except ImportError:
        raise ModelFileError(f"{spec} is not on this machine and downloading it needs huggingface_hub; "
                             f"{INSTALL_HINT}") from None
    if quiet:
        from huggingface_hub.utils import disable_progress_bars
        disable_progress_bars()
    gated, no_repo = _error("GatedRepoError"), _error("RepositoryNotFoundError")
    no_file, no_rev = _error("EntryNotFoundError"), _error("RevisionNotFoundError")
    offline, http = _error("LocalEntryNotFoundError"), _error("HfHubHTTPError")
    kw = {}
    if progress is not None:
        import inspect
        params = inspect.signature(huggingface_hub.hf_hub_download).parameters
        if "tqdm_class" in params or any(p.kind is p.VAR_KEYWORD for p in params.values()):
            kw["tqdm_class"] = _reporting_bar(progress)
    try:
        return Path(huggingface_hub.hf_hub_download(repo, filename, **kw))
    except offline:  # first: it is an EntryNotFoundError too
        raise ModelFileError(f"cannot download {spec}: offline (the Hugging Face Hub cannot be reached, or "
                             "HF_HUB_OFFLINE is set) and it is not in the cache; connect, or give a local "
                             "path") from None
    except gated:  # before no_repo: a subclass of it
        raise ModelFileError(f"{repo} is gated: accept its terms on https://huggingface.co/{repo} and log in "
                             "(hf auth login), then try again") from None
    except no_repo:
        raise ModelFileError(f"no repository {repo} on the Hugging Face Hub (or it is private: log in with "
                             "hf auth login); check the name") from None
    except no_rev:
        raise ModelFileError(f"{repo} has no main revision; check the name") from None
    except no_file:
        raise ModelFileError(f"{repo} has no file {filename}; see https://huggingface.co/{repo}/tree/main for "
                             "its files") from None
    except http as e:
        raise ModelFileError(f"cannot download {spec}: {str(e).splitlines()[0][:160]}") from None
    except OSError as e:
        raise ModelFileError(f"cannot download {spec}: {e.strerror or e}; free disk space or set HF_HUB_CACHE "
                             "to a disk with room") from None
    except Exception as e:  # noqa: BLE001 - the HTTP stack's errors (a refused connection, a timeout) vary
        detail = str(e).splitlines()[0][:160] if str(e) else ""
        raise ModelFileError(f"cannot download {spec}: {type(e).__name__}{': ' + detail if detail else ''}; "
                             "check the connection, or give a local path") from None
