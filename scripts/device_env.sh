# Sourced by the device scripts (gpu_check.sh, device_model.sh): picks $PY (a python with numpy) and makes
# /tmp/ninfer-site hold what the device image lacks, from the carried wheels in .whl/ (gguf, numba-cuda >=
# 0.30.4, platformdirs; how to make them: scripts/gpu_check.sh's header), then exports PYTHONPATH.
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  for c in python3 /opt/torch/.venv/bin/python3 .venv/bin/python; do
    if command -v "$c" >/dev/null 2>&1 && "$c" -c "import numpy" 2>/dev/null; then PY=$c; break; fi
  done
fi
[ -n "$PY" ] || { echo "device_env: no python with numpy found"; exit 2; }

SITE=/tmp/ninfer-site
mkdir -p "$SITE"
if ! "$PY" -c "import gguf" 2>/dev/null; then
  ls .whl/gguf-*.whl >/dev/null 2>&1 && "$PY" -m pip install -q --no-index --no-deps --no-compile \
    --target "$SITE" .whl/gguf-*.whl || "$PY" -m pip install -q --retries 0 --timeout 5 --target "$SITE" gguf || true
fi
# numba-cuda >= 0.30.4 launches into cuda.core graph builders; an older one gets the carried wheel
if ! "$PY" - <<'EOF' 2>/dev/null
import importlib.metadata as m, sys
v = tuple(int(x) for x in m.version("numba-cuda").split(".")[:3] if x.isdigit())
sys.exit(0 if v >= (0, 30, 4) else 1)
EOF
then
  ls .whl/numba_cuda-*.whl >/dev/null 2>&1 && "$PY" -m pip install -q --no-index --no-deps --no-compile \
    --target "$SITE" .whl/numba_cuda-*.whl || "$PY" -m pip install -q --retries 0 --timeout 5 --target "$SITE" 'numba-cuda>=0.30.4,<0.31' || true
  # its .pth redirector (numba.cuda -> numba_cuda) only runs from a site dir: make $SITE one
  printf 'import os, site\nsite.addsitedir(os.path.dirname(os.path.abspath(__file__)))\n' > "$SITE/sitecustomize.py"
  # the carried numba-cuda must work with the image's numba / cuda-core; else keep the image's (plain launches)
  if ! PYTHONPATH="$SITE" "$PY" -c "from numba import cuda; assert cuda.is_available()" 2>/dev/null; then
    echo "device_env: carried numba-cuda does not start with this image; using the image's numba-cuda"
    rm -rf "$SITE"/numba_cuda* "$SITE"/_numba_cuda_redirector* "$SITE/sitecustomize.py"
  fi
fi
# numba-cuda 0.30 registers an overload for np.row_stack, which numpy 2.5 removed: alias it before numba loads
cat >> "$SITE/sitecustomize.py" <<'PYEOF'
try:
    import numpy as _np
    if not hasattr(_np, "row_stack"):
        _np.row_stack = _np.vstack
except Exception:
    pass
PYEOF
export PYTHONPATH="$SITE:$PWD:$PWD/tests/engine${PYTHONPATH:+:$PYTHONPATH}"
