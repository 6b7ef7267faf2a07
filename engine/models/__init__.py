"""Finding and naming model files: what GGUF files this machine has (finder.py, places.py), what each one is
(header.py, header and metadata only), which one a name means (choose.py), their sha256 (digest.py, cached)
and an optional download from the Hugging Face Hub (download.py). Never imports the UI."""
from .choose import choose_model, model_dirs
from .finder import FoundModel, find_models, resolve_name
from .header import ModelInfo, read_info

__all__ = ["FoundModel", "ModelInfo", "choose_model", "find_models", "model_dirs", "read_info", "resolve_name"]
