"""The documentation's commands run, and its map of the code names what exists.

Runnable code blocks (README.md and docs/*.md)
----------------------------------------------
A fenced code block is run when its info string marks it::

    ```sh runnable            each command as written: the embedded model (a slow test)
    ```sh runnable tiny       each `tokenloom generate/config/plan/bench/quantize/eval/
                              train-medusa` command that names no --model gets
                              `--model <the tiny random LLaMA of tests/conftest.py>` (fast)
    ```python runnable        the block as a script: the embedded model (a slow test)
    ```python runnable tiny   the block as a script that builds its own tiny model (fast)
    ```toml runnable          an engine config: `tokenloom config --config <the block>` must
                              accept it (every key checked against its strategy's options; fast)

(GitHub and other renderers read the first word, `sh` or `python`, as the language and show
the rest of the info string nowhere.) A block may sit inside a list item (indented fences).
Every command must exit 0 within COMMAND_TIMEOUT_S. In a `sh` block each line is one command
(a line ending in a backslash continues it; `# ...` is a comment; blank lines are skipped),
split like a POSIX shell would split it and run without a shell: no pipes, redirections or
variables. The commands of a block run in order in one fresh temporary directory that links
the repository's `examples/` and `scripts/`, with the virtual environment's `bin/` first on
PATH, so `tokenloom`, `python` and paths such as `examples/configs/...` work as they do from
the repository root, files a command writes (`--out DIR`, `--json FILE`) stay out of the
tree, and a later command can read what an earlier one wrote. Third-party plugins load (the
test suite's TOKENLOOM_DISABLE_PLUGIN_AUTOLOAD is removed), so the example plugin's
scheduler is there once `make install` has installed it. Torch runs one thread
(TOKENLOOM_NUM_THREADS=1): the test checks that the commands work, not how fast. Blocks run
PARALLEL_BLOCKS at a time (each in its own folder, its commands in order): one-thread
processes one after another left the second core idle.

Left unmarked, because they cannot run here or would not end: commands that block
(`tokenloom serve`, `tokenloom chat`, `tokenloom router`) or need a running server (`curl`,
the example clients, `tokenloom bench serve`); torchrun across machines; `make` targets
(they may reinstall .venv); commands that need what `make install` does not install
(`make peers`, a GPU for scripts/gpu_check.py).

The code map (docs/architecture.md)
-----------------------------------
Every `path/with/slashes` or `file.py` it names exists in the repository, every
`tokenloom.dotted.name` resolves to a module (and, past the module, to a name defined at its
top level), every `ClassName` / `ClassName.member` is a class defined in the package (with
that member), and every "`name` in `file.py`" is defined in that file.
"""

from __future__ import annotations

import ast
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
ARCHITECTURE = ROOT / "docs" / "architecture.md"
VENV_BIN = Path(sys.executable).parent
COMMAND_TIMEOUT_S = 300
README_MAX_LINES = 250
#: sub-commands that take --model (the engine flags); `tokenloom plugins` and `chat` do not
MODEL_COMMANDS = {"generate", "config", "plan", "bench", "quantize", "eval", "train-medusa", "train-eagle"}


# ---- runnable blocks -----------------------------------------------------------------------

@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    lang: str
    tiny: bool
    text: str

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")


def code_blocks(path: Path) -> list[tuple[int, str, str]]:
    """Every fenced block of a markdown file: (line of the opening fence, info string, text
    with the fence's indentation removed)."""
    blocks, lines = [], path.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, info = len(m["indent"]), m["fence"], m["info"].strip()
        body, j = [], i + 1
        while j < len(lines):
            close = FENCE.match(lines[j])
            if close and close["fence"][0] == fence[0] and len(close["fence"]) >= len(fence) and not close["info"].strip():
                break
            body.append(lines[j][indent:] if lines[j][:indent].strip() == "" else lines[j])
            j += 1
        blocks.append((i + 1, info, "\n".join(body)))
        i = j + 1
    return blocks


def runnable_blocks() -> list[Block]:
    out = []
    for path in DOCS:
        for line, info, text in code_blocks(path):
            words = info.split()
            if len(words) >= 2 and words[1] == "runnable":
                assert words[0] in ("sh", "python", "toml"), f"{path}:{line}: runnable blocks are sh, python or toml"
                assert words[2:] in ([], ["tiny"]), f"{path}:{line}: unknown flags {words[2:]} (only `tiny`)"
                out.append(Block(path, line, words[0], words[2:] == ["tiny"] or words[0] == "toml", text))
    return out


def commands(block: Block, tiny_model: str | None) -> list[list[str]]:
    """The block's commands as argument lists (see the module docstring)."""
    out, pending = [], ""
    for raw in block.text.splitlines():
        pending += raw.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        words = shlex.split(pending, comments=True)
        pending = ""
        if not words:
            continue
        if tiny_model and words[0] == "tokenloom" and len(words) > 1 and words[1] in MODEL_COMMANDS \
                and not {"--model", "-m"} & set(words):
            words += ["--model", tiny_model]
        out.append(words)
    assert not pending.strip(), f"{block.id}: the last command ends in a backslash"
    return out


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("TOKENLOOM_DISABLE_PLUGIN_AUTOLOAD", None)
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("HF_HUB_OFFLINE", "1")
    # One torch thread: on a shared 2-core machine two OpenMP threads that wait on each other's
    # barriers while other work holds a core made a tiny-model command 10-30x slower.
    env["TOKENLOOM_NUM_THREADS"] = env["OMP_NUM_THREADS"] = "1"
    return env


def _run(argv: list[str], cwd: Path, what: str) -> str | None:
    """Run one command; None when it exits 0, else what went wrong."""
    try:
        done = subprocess.run(argv, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"{what}: no exit within {COMMAND_TIMEOUT_S} s"
    if done.returncode != 0:
        return (f"{what}: exit status {done.returncode}\n"
                f"--- stdout\n{done.stdout[-3000:]}\n--- stderr\n{done.stderr[-3000:]}")
    return None


def run_block(block: Block, folder: Path, tiny_model: str | None) -> str | None:
    """The block's commands in order in ``folder`` (see the module docstring); None when every
    one exits 0, else what went wrong with the first that did not."""
    for name in ("examples", "scripts"):
        (folder / name).symlink_to(ROOT / name)
    if block.lang == "python":
        script = folder / "block.py"
        script.write_text(block.text, encoding="utf-8")
        return _run([sys.executable, str(script)], folder, f"{block.id} (python)")
    if block.lang == "toml":
        config = folder / "block.toml"
        config.write_text(block.text, encoding="utf-8")
        return _run(["tokenloom", "config", "--config", str(config)], folder, f"{block.id} (tokenloom config)")
    cmds = commands(block, tiny_model)
    if not cmds:
        return f"{block.id}: a runnable block with no command"
    for argv in cmds:
        if (failed := _run(argv, folder, f"{block.id}: {shlex.join(argv)}")) is not None:
            return failed
    return None


BLOCKS = runnable_blocks()
#: blocks run at once (each command on one torch thread): one per core of a 2-core machine
PARALLEL_BLOCKS = 2


@pytest.fixture(scope="module")
def block_runs(request, tmp_path_factory):
    """The blocks of this session's test_runnable_block_exits_0 items (after -k / -m), started
    in their order, PARALLEL_BLOCKS at a time: {block id: Future of run_block's answer}."""
    from concurrent.futures import ThreadPoolExecutor

    blocks = [item.callspec.params["block"] for item in request.session.items
              if getattr(item, "originalname", None) == "test_runnable_block_exits_0"
              and item.module is request.module]
    needs_tiny = any(b.tiny and b.lang == "sh" for b in blocks)
    tiny = str(request.getfixturevalue("tiny_model_dir")) if needs_tiny else None
    pool = ThreadPoolExecutor(PARALLEL_BLOCKS, thread_name_prefix="doc-block")
    runs = {b.id: pool.submit(run_block, b, tmp_path_factory.mktemp(re.sub(r"\W+", "_", b.id)),
                              tiny if b.tiny else None)
            for b in blocks}
    yield runs
    pool.shutdown(wait=True, cancel_futures=True)


@pytest.mark.parametrize("block", [pytest.param(b, id=b.id, marks=() if b.tiny else pytest.mark.slow) for b in BLOCKS])
def test_runnable_block_exits_0(block: Block, block_runs, tmp_path: Path, request):
    run = block_runs.get(block.id)
    if run is not None:
        failed = run.result()
    else:  # not among the session's items when block_runs started them: run it here
        tiny = str(request.getfixturevalue("tiny_model_dir")) if block.tiny and block.lang == "sh" else None
        failed = run_block(block, tmp_path, tiny)
    assert failed is None, failed


def test_every_page_has_runnable_blocks_where_they_belong():
    """The convention is in use: the README's tour and each how-to page run something."""
    pages = {b.path.name for b in BLOCKS}
    for name in ("README.md", "configuration.md", "quantization.md", "speculative-decoding.md", "scaling-out.md",
                 "benchmarks.md", "plugins.md", "serving.md"):
        assert name in pages, f"{name} has no runnable block"


def test_block_parsing_handles_indents_continuations_and_the_tiny_model(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("- item\n\n  ```sh runnable tiny\n  tokenloom generate -n 4 \\\n      \"a b\"  # note\n\n"
                    "  tokenloom plugins\n  tokenloom plan --model x.gguf\n  ```\n\n```sh\nnot run\n```\n")
    [(line, info, text), _] = code_blocks(page)
    assert (line, info) == (3, "sh runnable tiny")
    block = Block(page, line, "sh", True, text)
    assert commands(block, "/m") == [["tokenloom", "generate", "-n", "4", "a b", "--model", "/m"],
                                     ["tokenloom", "plugins"], ["tokenloom", "plan", "--model", "x.gguf"]]


# ---- the README ----------------------------------------------------------------------------

def test_readme_is_short():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines < README_MAX_LINES, f"README.md has {lines} lines; keep it under {README_MAX_LINES} (move detail to docs/)"


def test_readme_starts_with_the_two_setup_commands():
    first = code_blocks(ROOT / "README.md")[0][2].splitlines()
    assert [ln.split()[:2] for ln in first] == [["make", "run"], ["make", "test"]]
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^run:", makefile, re.M) and re.search(r"^test:", makefile, re.M)


def test_relative_links_between_pages_resolve():
    for path in DOCS:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text(encoding="utf-8")):
            if "://" in target:
                continue
            assert (path.parent / target).exists(), f"{path.relative_to(ROOT)} links to {target}, which does not exist"


def test_results_page_has_each_generated_section_once():
    import update_results
    from claims import table as claims_table

    text = (ROOT / "docs" / "results.md").read_text(encoding="utf-8")
    for begin, end in ((update_results.START, update_results.END), (claims_table.BEGIN, claims_table.END)):
        assert text.count(begin) == 1 and text.count(end) == 1 and text.index(begin) < text.index(end), (begin, end)


def test_update_results_rewrites_only_its_section_and_fails_early_without_markers(tmp_path, capsys):
    import update_results as ur

    page = f"# R\n\nbefore\n\n{ur.START}\nold\n{ur.END}\n\nafter\n"
    assert ur.replace_section(page, f"{ur.START}\nnew\n{ur.END}") == page.replace("old", "new")
    for bad in ("# R\n", page + ur.START, f"{ur.END}\n{ur.START}\n"):
        with pytest.raises(ValueError, match="exactly one"):
            ur.replace_section(bad, "")
    target = tmp_path / "results.md"
    target.write_text("# no markers\n")
    assert ur.main(["--no-peers", "--write", str(target)]) == 2  # before any bench runs
    assert "results:start" in capsys.readouterr().out and target.read_text() == "# no markers\n"
    assert ur.command_line(["--quick", "--no-peers"]) == "python scripts/update_results.py --quick --no-peers"


# ---- the code map --------------------------------------------------------------------------

SKIP_DIRS = {".git", ".venv", "__pycache__", "build", "dist", ".mypy_cache", ".ruff_cache", ".pytest_cache",
             ".hypothesis", ".peers", "bench-results", "test-artifacts"}
#: capitalised names the map uses that are no class of this package: other libraries'
#: classes, an HTTP header
NOT_OURS = {"RuleBasedStateMachine", "ServerConnection", "Struct", "AssertionError", "StreamingResponse", "Origin"}


def repo_files() -> list[Path]:
    out = []
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS and not d.endswith(".egg-info")]
        out += [Path(dirpath, f) for f in filenames]
    return out


def _defined_names(tree: ast.Module) -> set[str]:
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                names |= {n.id for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    for node in tree.body:  # what a module's __all__ promises (tokenloom.testing loads some lazily)
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            names |= {e.value for e in getattr(node.value, "elts", []) if isinstance(e, ast.Constant)}
    return names


def _class_members(cls: ast.ClassDef) -> set[str]:
    names = set()
    for node in ast.walk(cls):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
    return names


class CodeIndex:
    """What the repository defines: files, classes (with their members) and top-level names."""

    def __init__(self):
        self.files = repo_files()
        self.rel = {f.relative_to(ROOT).as_posix() for f in self.files}
        self.dirs = {d.relative_to(ROOT).as_posix() + "/" for f in self.files for d in f.parents
                     if d != ROOT and ROOT in d.parents}
        self.classes: dict[str, set[str]] = {}
        self.trees: dict[str, ast.Module] = {}
        for f in self.files:
            rel = f.relative_to(ROOT).as_posix()
            if f.suffix != ".py" or rel.startswith(("tests/", "examples/")):
                continue
            tree = ast.parse(f.read_text(encoding="utf-8"))
            self.trees[rel] = tree
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef):
                    self.classes.setdefault(node.name, set()).update(_class_members(node))
            for node in tree.body:  # type aliases (DecoderOutput = dict[...]) name a type too
                if isinstance(node, ast.Assign) and isinstance(node.value, ast.Subscript):
                    for t in node.targets:
                        if isinstance(t, ast.Name) and t.id[:1].isupper():
                            self.classes.setdefault(t.id, set())
        for f in self.files:  # the C++ ops' classes (kernels/csrc), bound to Python by name
            if f.suffix in (".cpp", ".h"):
                for name in re.findall(r"\b(?:struct|class)\s+([A-Z]\w*)", f.read_text(encoding="utf-8")):
                    self.classes.setdefault(name, set())

    def path_exists(self, token: str) -> bool:
        token = token.rstrip("/") + ("/" if token.endswith("/") else "")
        if token in self.rel or token in self.dirs or token + "/" in self.dirs:
            return True
        suffix = "/" + token  # relative to a package the sentence is about: schedulers/, static/, schema.py
        return any(("/" + p).endswith(suffix) or ("/" + p).endswith(suffix + "/") for p in self.rel | self.dirs)

    def module_file(self, dotted: str) -> tuple[str | None, list[str]]:
        """``tokenloom.a.b.c`` -> (the file of the longest module prefix, the names after it)."""
        parts = dotted.split(".")[1:]
        for n in range(len(parts), -1, -1):
            base = "/".join(parts[:n])
            for cand in ((base + ".py") if base else "__init__.py", (base + "/__init__.py") if base else None):
                if cand and cand in self.trees:
                    return cand, parts[n:]
        return None, parts

    def dotted_exists(self, dotted: str) -> bool:
        path, rest = self.module_file(dotted)
        if path is None:
            return False
        if not rest:
            return True
        if rest[0] not in _defined_names(self.trees[path]):
            return False
        return len(rest) == 1 or rest[1] in self.classes.get(rest[0], set())

    def defines(self, path: str, name: str) -> bool:
        return path in self.trees and any(
            isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.name == name
            or isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Store)
            for n in ast.walk(self.trees[path]))


PATH_TOKEN = re.compile(r"^\w[\w.-]*(/[\w.-]+)*/?$")
CLASS_TOKEN = re.compile(r"^(?P<cls>[A-Z][a-z]\w*)(?:\.(?P<member>\w+))?(?:\(.*\))?$")
NAME_IN_FILE = re.compile(r"`(?P<name>\w+)` in `(?P<path>[\w/]+\.py)`")


def missing_names(text: str, index: CodeIndex) -> list[str]:
    """What ``text`` names in backticks that the repository does not have."""
    missing = []
    for span in re.findall(r"`([^`\n]+)`", text):
        for found in re.finditer(r"\btokenloom(?:\.\w+)+", span):
            if span[found.end():].startswith(".<"):
                continue  # a name with a placeholder part (the subprotocol tokenloom.bearer.<key>), not a module
            if not index.dotted_exists(found[0]):
                missing.append(f"module {found[0]}")
        token = span.strip()
        if PATH_TOKEN.match(token) and ("/" in token or token.endswith(".py")) and not token.startswith("tokenloom."):
            if not index.path_exists(token):
                missing.append(f"path {token}")
        m = CLASS_TOKEN.match(token)
        if m and m["cls"] not in NOT_OURS:
            members = index.classes.get(m["cls"])
            if members is None:
                missing.append(f"class {m['cls']}")
            elif m["member"] and m["member"] not in members:
                missing.append(f"member {m['cls']}.{m['member']}")
    for m in NAME_IN_FILE.finditer(text):
        if not index.defines(m["path"], m["name"]):
            missing.append(f"{m['name']} in {m['path']}")
    return missing


@pytest.fixture(scope="module")
def code_index() -> CodeIndex:
    return CodeIndex()


def test_architecture_names_only_what_exists(code_index):
    missing = missing_names(ARCHITECTURE.read_text(encoding="utf-8"), code_index)
    assert not missing, "docs/architecture.md names what the code does not have:\n  " + "\n  ".join(missing)


def test_the_map_check_catches_a_bogus_name(code_index):
    text = ARCHITECTURE.read_text(encoding="utf-8") + (
        "\n`core/bogus.py`, `protocols/nowhere/`, `tokenloom.core.no_such_module`, `tokenloom.core.engine.NoSuchName`,"
        " `NoSuchClass`, `AsyncEngine.no_such_method`, `nothing_here` in `core/engine.py`\n")
    assert missing_names(text, code_index) == [
        "path core/bogus.py", "path protocols/nowhere/", "module tokenloom.core.no_such_module",
        "module tokenloom.core.engine.NoSuchName", "class NoSuchClass", "member AsyncEngine.no_such_method",
        "nothing_here in core/engine.py"]


def test_every_page_names_existing_paths(code_index):
    """The other pages' file paths (not their class names, which are prose there) exist too."""
    bad = {}
    for path in DOCS:
        if path == ARCHITECTURE:
            continue
        missing = [m for m in missing_names(path.read_text(encoding="utf-8"), code_index)
                   if m.startswith(("path ", "module ")) and not _made_by_a_command(m)]
        if missing:
            bad[path.name] = missing
    assert not bad, bad


#: paths the pages name that a documented command creates (not in the tree)
CREATED = {"smollm2-gptq", "smollm2-awq", "smollm2-rtn", "smollm2-int8", "smollm2-fp8", "q-gptq",
           "heads.safetensors", "bench-results/claims.json", "gpu-check.json", "peers.png", "key.txt",
           ".peers/", "test-artifacts/", "~/.cache/tokenloom/medusa/<model>.safetensors"}


def _made_by_a_command(item: str) -> bool:
    name = item.split(" ", 1)[1]
    return name in CREATED or name.startswith(("/tmp/", "~/", "bench-results/", ".peers/"))
