"""Building a stage's extension with torch.utils.cpp_extension.load (ninja).

- Each stage (and its profile variant) gets a unique extension name and its own
  build directory under build/, so two stages load side by side and a rebuild
  only recompiles what changed.
- CUDA_HOME is located robustly: an nvcc on PATH may be a wrapper script
  (e.g. /usr/local/bin/nvcc), whose folder is not the toolkit.
- CUTLASS/CuTe headers come from the ``nvidia-cutlass`` wheel (or CUTLASS_PATH).
- The profile variant is the same sources compiled with -DKDA_PROFILE.
- A build says what it does: "up to date" when ninja has nothing to do, else
  which files it compiles, with the elapsed time every few seconds. A compile
  error becomes a :class:`CompileError` whose message is the compiler's error
  lines (file:line: message), not ninja's whole log.
"""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from .paths import BUILD_DIR, INCLUDE_DIR


def _valid_cuda_home(p) -> bool:
    p = Path(p)
    return (p / "bin" / "nvcc").exists() and (p / "include" / "cuda_runtime.h").exists()


def find_cuda_home() -> str | None:
    """The CUDA toolkit directory (with bin/nvcc and include/cuda_runtime.h), or None."""
    cands = []
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            cands.append(os.environ[var])
    nvcc = shutil.which("nvcc")
    if nvcc:
        real = Path(os.path.realpath(nvcc))
        cands.append(str(real.parent.parent))
        try:  # a wrapper script: look for the path it execs
            text = real.read_text(errors="ignore")[:4096]
            for m in re.finditer(r"(/[^\s\"']+)/bin/nvcc", text):
                cands.append(m.group(1))
        except (OSError, UnicodeDecodeError):
            pass
    cands.append("/usr/local/cuda")
    cands.extend(sorted(glob.glob("/usr/local/cuda-*"), reverse=True))
    for c in cands:
        if c and _valid_cuda_home(c):
            return str(Path(c).resolve())
    return None


def setup_cuda_home() -> str | None:
    """Point CUDA_HOME (and torch's cached copy of it) at the real toolkit."""
    home = find_cuda_home()
    if home:
        os.environ["CUDA_HOME"] = home
        ce = sys.modules.get("torch.utils.cpp_extension")
        if ce is not None:
            ce.CUDA_HOME = home
    return home


def cutlass_include() -> str | None:
    """Directory holding cute/ and cutlass/ headers, or None."""
    cands = []
    if os.environ.get("CUTLASS_PATH"):
        cands += [Path(os.environ["CUTLASS_PATH"]) / "include", Path(os.environ["CUTLASS_PATH"])]
    try:
        import cutlass_library  # from the nvidia-cutlass wheel

        root = Path(cutlass_library.__file__).resolve().parent
        cands += [root / "source" / "include", root / "include"]
    except ImportError:
        pass
    for c in cands:
        if (c / "cute" / "tensor.hpp").exists():
            return str(c)
    return None


def cuda_arch_list() -> str:
    """Architectures to build for: the visible GPU's, else sm_90 (the H200)."""
    if os.environ.get("TORCH_CUDA_ARCH_LIST"):
        return os.environ["TORCH_CUDA_ARCH_LIST"]
    import torch

    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return f"{major}.{minor}"
    return "9.0"


def extension_name(stage_name: str, profile: bool = False, variant: str | None = None) -> str:
    """The module (and build directory) name: kda_<stage>[_<variant>][_prof]."""
    name = "kda_" + re.sub(r"\W", "_", stage_name)
    if variant:
        name += "_" + re.sub(r"\W", "_", variant)
    return name + ("_prof" if profile else "")


_LOADED: dict = {}


class CompileError(RuntimeError):
    """A stage's sources did not compile. ``errors`` are the compiler's error
    lines as "file:line: message" (paths relative to the repository); ``log``
    is ninja's whole output."""

    def __init__(self, name: str, log: str):
        self.name, self.log = name, log
        self.errors = compiler_errors(log)
        shown = self.errors[:12] or log.strip().splitlines()[-15:]
        more = f"\n  ... and {len(self.errors) - 12} more" if len(self.errors) > 12 else ""
        super().__init__(f"{name} does not compile:\n  " + "\n  ".join(shown) + more)


_ERROR_LINE = re.compile(
    r"^(?P<file>[^\s:()]+\.(?:cu|cuh|cpp|cc|h|hpp))"  # a source file
    r"(?:\((?P<l1>\d+)\)|:(?P<l2>\d+)(?::\d+)?)"  # nvcc: file(12)  gcc: file:12:5
    r":\s*(?:fatal\s+)?error\b:?\s*(?P<msg>.*)$")


def compiler_errors(log: str) -> list[str]:
    """The error lines of a compiler log, as "file:line: message", file
    relative to the repository when it is inside it; duplicates dropped."""
    from .paths import REPO_ROOT

    out = []
    for line in log.splitlines():
        m = _ERROR_LINE.match(line.strip())
        if not m:
            continue
        f = m.group("file")
        try:
            f = str(Path(f).resolve().relative_to(REPO_ROOT))
        except ValueError:
            pass
        item = f"{f}:{m.group('l1') or m.group('l2')}: error: {m.group('msg').strip()}"
        if item not in out:
            out.append(item)
    return out


def pending_work(build_dir) -> list[str] | None:
    """What ninja would compile in ``build_dir``: [] when it is up to date,
    the source files to compile otherwise, None when unknown (no build yet)."""
    build_dir = Path(build_dir)
    ninja = shutil.which("ninja")
    if ninja is None:
        try:
            import ninja as _ninja  # the pip package ships the binary

            ninja = str(Path(_ninja.BIN_DIR) / "ninja")
        except (ImportError, AttributeError):
            return None
    if not (build_dir / "build.ninja").exists():
        return None
    out = subprocess.run([ninja, "-n", "-C", str(build_dir)], capture_output=True, text=True)
    if out.returncode != 0:
        return None
    if "no work to do" in out.stdout:
        return []
    return [Path(f).name for f in re.findall(r" -c (\S+) -o \S+\.o\b", out.stdout)] or ["the link step"]


_SAY = [lambda msg: print(msg, flush=True)]  # where build progress goes (pytest shows it past its capture)


def set_progress(say):
    """Send the build's progress lines ("first build ...", "still compiling (N s)") to ``say(line)``
    instead of print; returns the previous sink. tests' conftest points it at pytest's terminal,
    so that a 20-minute cold compile under ``pytest`` shows where it is."""
    old, _SAY[0] = _SAY[0], say
    return old


def _say(msg: str) -> None:
    _SAY[0](f"[kdalab] {msg}")


class _Ticker:
    """Prints the elapsed time every ``every`` seconds while a build runs, so a
    long compile never looks like a hang."""

    def __init__(self, name: str, every: float = 15.0):
        self.name, self.every, self.t0 = name, every, time.time()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.wait(self.every):
            _say(f"{self.name}: still compiling ({time.time() - self.t0:.0f} s)")

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()


def load_extension(stage_dir, stage_name: str, sources, *, cuda: bool = False, profile: bool = False,
                   cutlass: bool = False, extra_cflags=(), extra_cuda_cflags=(), verbose: bool = False,
                   quiet: bool = False, variant: str | None = None, defines=(), sm90a: bool = False):
    """Build (if needed) and import one stage's extension.

    ``sources`` are file names relative to ``stage_dir``. The build lives in
    build/<extension name>/; ninja rebuilds only what changed. Raises
    :class:`CompileError` when the sources do not compile.

    ``variant`` names a build of the same sources with extra preprocessor
    ``defines`` (an ablation: "KDA_NO_LOAD_WARP" or "NAME=VALUE"); it gets its
    own module and build directory. Every build defines KDA_STAGE_NAME, so the
    sources name their stage without a string written by hand
    (common/include/kda_binding.h).

    ``sm90a``: where the target is sm_90 (the H200, or no GPU visible), build for
    sm_90a instead, the Hopper-only feature set (setmaxnreg, ...); elsewhere the
    GPU's own architecture, as for every stage.
    """
    if bool(variant) != bool(defines):
        raise ValueError("variant and defines go together")
    name = extension_name(stage_name, profile, variant)
    if name in _LOADED:
        return _LOADED[name]
    home = setup_cuda_home()  # before torch.utils.cpp_extension reads it at import
    import logging

    # On a machine without a GPU torch warns at import that it found no CUDA runtime; expected here.
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    if cuda:
        if home is None:
            raise RuntimeError("CUDA toolkit not found: set CUDA_HOME to the directory holding bin/nvcc "
                               "and include/cuda_runtime.h")
        os.environ["TORCH_CUDA_ARCH_LIST"] = cuda_arch_list()
    arch_restore = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if cuda and sm90a and arch_restore == "9.0":
        os.environ["TORCH_CUDA_ARCH_LIST"] = "9.0a"  # for this build only (restored below)
    from torch.utils import cpp_extension

    stage_dir = Path(stage_dir)
    build_dir = BUILD_DIR / name
    build_dir.mkdir(parents=True, exist_ok=True)
    includes = [str(INCLUDE_DIR), str(stage_dir)]
    if cutlass:
        inc = cutlass_include()
        if inc is None:
            raise RuntimeError("CUTLASS/CuTe headers not found: pip install nvidia-cutlass "
                               "(or set CUTLASS_PATH to a CUTLASS checkout)")
        includes.append(inc)
    if not re.fullmatch(r"\w+", stage_name):
        raise ValueError(f"stage name {stage_name!r} must be a C identifier-like token")
    defs = [f"-DKDA_STAGE_NAME={stage_name}"] + [f"-D{d}" for d in defines]
    defs += ["-DKDA_PROFILE"] if profile else []
    # torch adds the C++ standard its headers need (C++20 from torch 2.14 on)
    cflags = ["-O3"] + defs + list(extra_cflags)
    cuda_flags = ["-O3", "-lineinfo"] + defs + list(extra_cuda_cflags)
    t0 = time.time()
    with _build_lock(build_dir):
        todo = pending_work(build_dir)
        if not quiet:
            if todo == []:
                what = "up to date"
            elif todo is None:
                what = (f"first build: compiling {', '.join(sources)} "
                        f"(about {'0.5-2 minutes' if cutlass else '30 s'} on 2 cores: results/cpu/ci_time.json)")
            else:
                what = "compiling what changed: " + ", ".join(todo)
            _say(f"{name}: {what}")
        try:
            with (contextlib.nullcontext() if quiet else _Ticker(name)):
                mod = cpp_extension.load(
                    name=name,
                    sources=[str(stage_dir / s) for s in sources],
                    extra_include_paths=includes,
                    extra_cflags=cflags,
                    extra_cuda_cflags=cuda_flags if cuda else None,
                    build_directory=str(build_dir),
                    verbose=verbose,
                    with_cuda=cuda,
                )
        except RuntimeError as e:
            # torch rebuilds a name it has seen in this process only when a source file or a flag changed, not a
            # header: forget it, so that the next call builds again (and fails again) instead of importing the
            # last module that did build
            cpp_extension.JIT_EXTENSION_VERSIONER.entries.pop(name, None)
            if "Error building extension" in str(e):
                raise CompileError(name, str(e)) from None
            raise
        finally:
            if arch_restore is not None:
                os.environ["TORCH_CUDA_ARCH_LIST"] = arch_restore
    if not quiet and (todo != [] or time.time() - t0 > 5):
        _say(f"{name}: built and loaded ({time.time() - t0:.0f} s)")
    _LOADED[name] = mod
    return mod


class _build_lock:
    """A file lock per build directory, so parallel test workers don't race ninja."""

    def __init__(self, build_dir: Path):
        self.path = build_dir / ".kdalab.lock"

    def __enter__(self):
        import fcntl

        self.fh = open(self.path, "w")
        fcntl.flock(self.fh, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        import fcntl

        fcntl.flock(self.fh, fcntl.LOCK_UN)
        self.fh.close()


def sources_hash(stage_dir) -> str:
    """A hash of what a stage's build compiles: its C++/CUDA files and the shared headers
    (common/include), by name and content; a record made from those sources carries it."""
    import hashlib

    h = hashlib.sha256()
    for f in sorted(Path(stage_dir).glob("*")) + sorted(INCLUDE_DIR.glob("*")):
        if f.is_file() and f.suffix in (".cu", ".cuh", ".h", ".cpp"):
            h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:16]


def resource_usage(stage_dir, sources, *, arch: str = "sm_90", cutlass: bool = False, profile: bool = False,
                   extra_flags=()):
    """Registers, shared memory, stack and spills per kernel, from ptxas -v.

    Compiles only the device code of each .cu source (no torch headers). Returns
    a list of dicts: kernel, registers, smem_bytes, stack_bytes, spill_stores,
    spill_loads. Cached in build/resources/ under a hash of the stage's sources,
    the shared headers and the flags, so a notebook re-run does not recompile.
    """
    import hashlib
    import json

    home = setup_cuda_home()
    if home is None:
        raise RuntimeError("CUDA toolkit not found (CUDA_HOME)")
    stage_dir = Path(stage_dir)
    files = sorted(stage_dir.glob("*")) + sorted(INCLUDE_DIR.glob("*"))
    h = hashlib.sha256(f"{arch} {cutlass} {profile} {sources} {list(extra_flags)}".encode())
    for f in files:
        if f.is_file():
            h.update(f.name.encode() + f.read_bytes())
    cache = BUILD_DIR / "resources" / f"{stage_dir.name}-{h.hexdigest()[:16]}.json"
    if cache.exists():
        return json.loads(cache.read_text())
    rows = []
    for src in sources:
        if not src.endswith(".cu"):
            continue
        path = stage_dir / src
        cmd = [str(Path(home) / "bin" / "nvcc"), "-std=c++17", "-O3", f"-arch={arch}", "-Xptxas=-v",
               "-cubin", "-o", os.devnull, f"-I{INCLUDE_DIR}", f"-I{stage_dir}", *extra_flags, str(path)]
        if "sm_90a" in arch:
            cmd[3] = "-gencode=arch=compute_90a,code=sm_90a"
        if cutlass:
            cmd.insert(1, f"-I{cutlass_include()}")
        if profile:
            cmd.insert(1, "-DKDA_PROFILE")
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            raise CompileError(f"ptxas report of {path.name}", out.stderr)
        rows += _parse_ptxas(out.stderr)
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps(rows))
    return rows


def _demangle(names):
    cxxfilt = shutil.which("c++filt")
    if not cxxfilt or not names:
        return names
    out = subprocess.run([cxxfilt], input="\n".join(names), capture_output=True, text=True)
    dem = out.stdout.strip().split("\n")
    return dem if len(dem) == len(names) else names


def _parse_ptxas(text: str):
    rows, cur = [], None
    for line in text.splitlines():
        m = re.search(r"Function properties for (\S+)", line)
        if m:
            cur = {"kernel": m.group(1), "registers": 0, "smem_bytes": 0, "stack_bytes": 0,
                   "spill_stores": 0, "spill_loads": 0}
            rows.append(cur)
            continue
        if cur is None:
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            cur["stack_bytes"], cur["spill_stores"], cur["spill_loads"] = map(int, m.groups())
        m = re.search(r"Used (\d+) registers", line)
        if m:
            cur["registers"] = int(m.group(1))
            s = re.search(r"(\d+) bytes smem", line)
            cur["smem_bytes"] = int(s.group(1)) if s else 0
    # ptxas lists device functions too; keep kernels (they report registers)
    rows = [r for r in rows if r["registers"] > 0]
    names = _demangle([r["kernel"] for r in rows])
    for r, n in zip(rows, names):
        r["kernel"] = re.sub(r"\(.*", "", n.replace("(anonymous namespace)::", ""))
    return rows


def import_module_from(path: Path, name: str):
    """Import a Python file by path (stage directories start with a digit)."""
    spec = importlib.util.spec_from_file_location(name, str(path))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod
