"""Numba settings that must be in place before numba is imported / compiles anything.

Import this module (`import engine.numba_env`) before the first `import numba` of the process; every CPU
kernel module does so at its top. What it sets, and why (measured, see REFERENCE.md section 8):

- NUMBA_SLP_VECTORIZE=1: numba ships LLVM's SLP vectorizer off; our row-interleaved integer kernels keep one
  accumulator per row and only become SIMD code when SLP packs those accumulators (3-5x on int kernels).
- NUMBA_CACHE_DIR keyed on the flags: numba's on-disk cache index does not record optimisation flags, so a
  cache written under other flags would silently serve slower (or differently vectorized) code. We put the
  cache in a directory named after a hash of (flags, numba/llvmlite versions, CPU name + features, our
  kernel sources - numba does not notice when a callee in another file changed).
- The threading layer: OpenMP first (NUMBA_THREADING_LAYER_PRIORITY="omp tbb workqueue") with a short
  spin before sleeping (GOMP_SPINCOUNT=10000, ~10-30 us). A decode step had ~150 parallel regions (one since
  sync; the measurements below are from then), so the wake-up of the second thread was paid 150 times.
  Measured (SmolLM2, 2-core VM, decode step):
    workqueue                          20.5 ms   (its launch alone cost ~340 us under load)
    omp, OMP_WAIT_POLICY=PASSIVE       16.7 ms   (a futex wake-up per region; 1 thread alone: 12.0 ms)
    omp, GOMP_SPINCOUNT=10000           6.5 ms   (the worker is still spinning when the next region starts)
    omp, ACTIVE (spin forever)          7.5 ms, but with another process busy on one core: 47 ms (collapse:
                                        the spinner waits for a partner that is not scheduled)
  A bounded spin keeps the quiet speed and, with a busy core, falls back to sleeping within ~20 us.
  Override with NINFER_THREADING_LAYER=workqueue|omp|tbb, GOMP_SPINCOUNT or OMP_WAIT_POLICY to compare.
- OPENBLAS_THREAD_TIMEOUT: BLAS threads left spinning after a numpy matmul steal a core from decode; ask
  them to sleep quickly.

Nothing here overrides a value the user already exported, except the cache directory when it is unset.
`loop_vectorize_off()` is the per-function switch used while compiling integer kernels (LLVM's loop
vectorizer otherwise vectorizes across the wrong axis with gathers, ~5x slower).
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import struct
import sys
from pathlib import Path

# Flags that change generated code; all of them key the cache directory.
FLAGS = {
    "NUMBA_SLP_VECTORIZE": "1",
    "NUMBA_OPT": "3",
    "NUMBA_LOOP_VECTORIZE": "1",  # float kernels want it; int kernels switch it off per function
}
THREADING_PRIORITY = "omp tbb workqueue"
_applied = False


def _cpu_signature() -> str:
    """CPU model + SIMD flags (the code numba emits depends on them), without importing numba."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
        model = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), "")
        flags = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("flags")), "")
        simd = sorted(f for f in flags.split() if f.startswith(("avx", "sse", "fma", "f16c", "amx")))
        return model + "|" + " ".join(simd)
    except OSError:
        import platform
        return platform.machine() + "|" + platform.processor()


def _dist_version(pkg: str) -> str | None:
    """Version of an installed distribution read from its METADATA, as importlib.metadata.version(pkg) gives
    it (first `pkg-*.dist-info` / `.egg-info` on sys.path), without importing importlib.metadata: that
    import (email, zipfile, ...) was ~20 ms of every start, before numba. None when not found here (the
    caller then asks importlib.metadata, which knows every other way a package can be installed)."""
    want = pkg.lower().replace("-", "_").replace(".", "_")
    for entry in sys.path:
        try:
            names = os.listdir(entry or ".")
        except OSError:  # not a directory (a zip, a missing path entry)
            continue
        for name in names:
            stem, dot, ext = name.rpartition(".")
            if ext not in ("dist-info", "egg-info") or stem.split("-")[0].lower().replace(".", "_") != want:
                continue
            meta = os.path.join(entry or ".", name, "METADATA" if ext == "dist-info" else "PKG-INFO")
            try:
                with open(meta, encoding="utf-8", errors="replace") as f:
                    for line in f:
                        if line.startswith("Version:"):
                            return line[len("Version:"):].strip()
                        if not line.strip():  # end of the header block
                            break
            except OSError:
                pass
            return None  # importlib.metadata would stop at this one too: let it decide
    return None


def _versions() -> str:
    out = []
    for pkg in ("numba", "llvmlite", "numpy"):
        v = _dist_version(pkg)
        if v is None:
            from importlib import metadata
            try:
                v = metadata.version(pkg)
            except metadata.PackageNotFoundError:
                v = "?"
        out.append(f"{pkg}={v}")
    return ",".join(out)


# modules of the cpu backend with no jitted code (start-up, runner, caches): editing them keeps the cache
NOT_JITTED = ("__init__.py", "runner.py", "tier.py", "compile_bg.py", "weight_store.py", "step_weights.py",
              "fast_weights.py")


def _kernel_sources() -> str:
    """Hash of our kernel sources. numba invalidates a cached function when ITS file changes, not when a
    callee in another module does; a jitted function that inlines kernels from backends/cpu/fast.py would otherwise
    keep running the old callee code (seen: an out-of-bounds write after a layout change). sampling_fast.py
    counts as a kernel: the fused step's decode blocks call its sampling chain, and triggers.py: they end at its
    keys. The fused step compiles in forward.py's phase list as constants: the list (not the file) counts too."""
    h = hashlib.sha256()
    here = Path(__file__).resolve().parent
    kernels = [f for f in sorted((here / "backends" / "cpu").glob("*.py")) if f.name not in NOT_JITTED]
    for f in kernels + [here / n for n in ("quant.py", "sampling_fast.py", "triggers.py")]:
        try:
            h.update(f.name.encode() + f.read_bytes())
        except OSError:
            pass
    from .forward import LAYER_PHASES
    h.update(repr(LAYER_PHASES).encode())
    return h.hexdigest()[:16]


def flags_key() -> str:
    """Short hash of everything that changes the machine code numba produces for our kernels."""
    items = [f"{k}={os.environ.get(k, v)}" for k, v in sorted(FLAGS.items())]
    items += [_versions(), _cpu_signature(), sys.version.split()[0], _kernel_sources()]
    return hashlib.sha256("\n".join(items).encode()).hexdigest()[:16]


def cache_root() -> Path:
    """Parent of the flag-keyed numba cache directories (NINFER_CACHE_DIR, else the user cache dir)."""
    env = os.environ.get("NINFER_CACHE_DIR")
    if env:
        return Path(env)
    try:
        import platformdirs
        return Path(platformdirs.user_cache_dir("ninfer-chat"))
    except ImportError:  # pragma: no cover - platformdirs is a declared dependency
        return Path.home() / ".cache" / "ninfer-chat"


STALE_DAYS = 30  # a flag-keyed cache dir unused this long belongs to an old version/flag set: remove it


def prune_stale(root: Path, current: Path, days: float = STALE_DAYS) -> list[Path]:
    """Remove `numba-*` siblings of the current cache dir not used for `days` (every kernel change or
    upgrade makes a new dir, so without this they pile up). The current dir's mtime is refreshed so a
    dir in use is never stale. Best effort: any error leaves things as they are. Returns what was removed."""
    import shutil
    import time
    removed = []
    try:
        if current.is_dir():
            os.utime(current)
        cutoff = time.time() - days * 86400
        for d in root.glob("numba-*"):
            if d != current and d.is_dir() and d.stat().st_mtime < cutoff:
                shutil.rmtree(d, ignore_errors=True)
                removed.append(d)
    except OSError:
        pass
    return removed


def apply() -> dict:
    """Set the flags, the cache dir and the threading layer in os.environ (idempotent); returns them.

    Must run before numba is imported: numba reads these when its config module loads. If numba was
    imported earlier, the values are also written into numba.core.config (works for everything not yet
    compiled), so a late import degrades to "correct but maybe slower", never to a crash.
    """
    global _applied
    for k, v in FLAGS.items():
        os.environ.setdefault(k, v)
    if "NUMBA_CACHE_DIR" not in os.environ:
        current = cache_root() / f"numba-{flags_key()}"
        os.environ["NUMBA_CACHE_DIR"] = str(current)
        if not _applied:
            prune_stale(current.parent, current)
    os.environ.setdefault("NUMBA_THREADING_LAYER_PRIORITY", THREADING_PRIORITY)
    if os.environ.get("NINFER_THREADING_LAYER"):
        os.environ["NUMBA_THREADING_LAYER"] = os.environ["NINFER_THREADING_LAYER"]
    os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "1")
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ.setdefault("GOMP_SPINCOUNT", "10000")
    os.environ.setdefault("KMP_BLOCKTIME", "0")
    if "numba" in sys.modules and not _applied:
        from numba.core import config
        config.SLP_VECTORIZE = int(os.environ["NUMBA_SLP_VECTORIZE"])
        config.CACHE_DIR = os.environ["NUMBA_CACHE_DIR"]
        config.THREADING_LAYER_PRIORITY = os.environ["NUMBA_THREADING_LAYER_PRIORITY"].split()
        if os.environ.get("NINFER_THREADING_LAYER"):
            config.THREADING_LAYER = os.environ["NINFER_THREADING_LAYER"]
    _applied = True
    return {k: os.environ.get(k) for k in (*FLAGS, "NUMBA_CACHE_DIR", "NUMBA_THREADING_LAYER_PRIORITY",
                                           "GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}


# numba versions whose Cache.load_overload / _load_overload `lazy_cache_refresh` was checked against
LAZY_REFRESH_VERSIONS = ("0.68.",)
_HASH_SECRET = b"_numba_hashsecret_"  # symbols only numba.cpython.hashing's import registers with LLVM


def lazy_cache_refresh() -> bool:
    """Load cached CPU functions without first refreshing numba's target context (idempotent; True if on).

    Why: numba's Cache.load_overload calls target_context.refresh() before every load. The first refresh of
    a process imports ~70 numba modules and installs ~1000 typing templates: ~230 ms of every warm start
    (2-core VM), though a cached function needs none of it to run. What a loaded library does need is kept:
    the NRT (rtsys.initialize: its symbols and atomics), the C helpers and math symbols (installed when the
    context is created), and for code that hashes, the hash-secret symbols of numba.cpython.hashing (such a
    library gets the full refresh). Anything numba compiles still refreshes first (its compiler does so
    itself), so only the order of that work changes; results are the same code. Only for numba versions in
    LAZY_REFRESH_VERSIONS (else False, numba unchanged); NINFER_NUMBA_FULL_REFRESH=1 turns it off."""
    global _lazy_on
    if _lazy_on:
        return True
    import numba
    if os.environ.get("NINFER_NUMBA_FULL_REFRESH") == "1" or not numba.__version__.startswith(LAZY_REFRESH_VERSIONS):
        return False
    from numba.core.caching import Cache
    from numba.core.cpu import CPUContext
    from numba.core.runtime import rtsys
    full = Cache.load_overload

    def load_overload(self, sig, target_context):
        if not isinstance(target_context, CPUContext):
            return full(self, sig, target_context)
        rtsys.initialize(target_context)
        with self._guard_against_spurious_io_errors():
            if not self._enabled:
                return None
            data = self._cache_file.load(self._index_key(sig, target_context.codegen()))
            if data is None:
                return None
            if _mentions(data, _HASH_SECRET):
                target_context.refresh()
            return self._impl.rebuild(target_context, data)
        # None when the `with` block swallowed an I/O error (as numba's own load_overload)

    Cache.load_overload = load_overload
    _lazy_linking_module()
    _lazy_on = True
    return True


def _lazy_linking_module() -> None:
    """A library loaded from numba's cache parses its "module for linking" (the whole LLVM bitcode of the
    function, kept so that other jitted code can inline it) only when something links against it, and takes
    its defined symbols from the object code's ELF symbol table instead: the fused step's bitcode took ~0.1 s
    of every warm start to parse, and nothing links against an entry point called from Python. Object code
    that is not ELF (other platforms), or that does not parse, goes numba's way. Applied by
    lazy_cache_refresh, so for the same numba versions; NINFER_NUMBA_FULL_REFRESH=1 turns both off."""
    from numba.core.codegen import CPUCodeLibrary
    import llvmlite.binding as ll
    unserialize, for_linking = CPUCodeLibrary._unserialize.__func__, CPUCodeLibrary._get_module_for_linking

    def _unserialize(cls, codegen, state):
        name, kind, data = state
        symbols = _elf_defined_symbols(data[0]) if kind == "object" else None
        if symbols is None:
            return unserialize(cls, codegen, state)
        self = codegen.create_library(name)
        self.enable_object_caching()
        self._set_compiled_object(data[0])
        self._lazy_bitcode = data[1]
        self._finalize_final_module()
        self._codegen._engine._defined_symbols |= symbols
        return self

    def _get_module_for_linking(self):
        bitcode = self.__dict__.pop("_lazy_bitcode", None)
        if bitcode is not None:
            self._shared_module = ll.parse_bitcode(bitcode)
        return for_linking(self)

    CPUCodeLibrary._unserialize = classmethod(_unserialize)
    CPUCodeLibrary._get_module_for_linking = _get_module_for_linking


def _elf_defined_symbols(obj: bytes) -> set[str] | None:
    """Names of the functions and data an ELF64 little-endian object defines (what numba's
    _load_defined_symbols takes from the module), or None when obj is not such an object."""
    if obj[:6] != b"\x7fELF\x02\x01":
        return None
    try:
        return _elf_symbols(obj)
    except (struct.error, IndexError, ValueError, UnicodeDecodeError):
        return None


def _elf_symbols(obj: bytes) -> set[str]:
    """_elf_defined_symbols' walk of the section headers and the symbol tables (struct.error, IndexError
    or ValueError when the object is cut short)."""
    shoff, = struct.unpack_from("<Q", obj, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", obj, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", obj, shoff + i * shentsize) for i in range(shnum)]
    out: set[str] = set()
    for _, sh_type, _, _, off, size, link, _, _, entsize in sections:
        if sh_type != 2:  # SHT_SYMTAB
            continue
        str_off = sections[link][4]
        for k in range(0, size, entsize or 24):
            st_name, st_info, _, st_shndx = struct.unpack_from("<IBBH", obj, off + k)
            if st_name and st_shndx != 0 and st_info & 15 not in (3, 4):  # not UNDEF, SECTION, FILE
                end = obj.index(b"\0", str_off + st_name)
                out.add(obj[str_off + st_name:end].decode())
    return out


_lazy_on = False


def _mentions(obj, needle: bytes) -> bool:
    """True if any bytes object inside nested tuples/lists (a cache payload: its object code) contains needle."""
    if isinstance(obj, (bytes, bytearray)):
        return needle in obj
    if isinstance(obj, (tuple, list)):
        return any(_mentions(x, needle) for x in obj)
    return False


@contextlib.contextmanager
def loop_vectorize_off():
    """Compile the numba functions created (eagerly) inside this block with LLVM's loop vectorizer off.

    numba builds its pass manager per compiled library from numba.core.config at that moment, so the
    switch is per function. The cached object code keeps what it was compiled with; the cache source
    stamp changes when the kernel file changes.
    """
    from numba.core import config
    old_lv, old_slp = config.LOOP_VECTORIZE, config.SLP_VECTORIZE
    config.LOOP_VECTORIZE, config.SLP_VECTORIZE = 0, 1
    try:
        yield
    finally:
        config.LOOP_VECTORIZE, config.SLP_VECTORIZE = old_lv, old_slp


apply()
