"""`--model org/name`: a Hugging Face hub id, resolved through ``huggingface_hub`` (its cache,
``HF_HOME`` / ``HF_HUB_CACHE``, ``HF_HUB_OFFLINE``, ``HF_TOKEN``) to a local path the loaders read.

Three forms:

- ``org/name``: the repository's Hugging Face checkpoint; only the files the engine reads
  are downloaded (:data:`HF_FILES`), into a snapshot directory the ``hf`` format loads.
- ``org/name:QUANT``: one GGUF file of the repository, llama.cpp's ``-hf org/name:Q4_K_M``:
  the ``.gguf`` whose name ends in ``QUANT`` (any case, after ``-``, ``.`` or ``_``).
- ``org/name/path/in/repo.gguf``: that GGUF file.

A revision (branch, tag or commit hash; default ``main``) applies to all three. Offline
(``HF_HUB_OFFLINE=1``, or the hub cannot be reached) only the cache answers.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from tokenloom.core.errors import ConfigError

#: What ``org/name`` downloads: everything the ``hf`` format and the tokenizer read, nothing else
#: (no PyTorch .bin duplicates, no ONNX/GGUF/TF copies, no README images).
HF_FILES = [
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "quantize_config.json",
    "quant_config.json",
    "chat_template.jinja",
    "chat_template.json",
]

# The hub's repo-id shape: owner/name, letters, digits, '-', '_', '.', no '--' or '..' (checked below).
_NAME = r"[A-Za-z0-9][A-Za-z0-9_.-]{0,95}"
_HUB_ID = re.compile(rf"^(?P<repo>{_NAME}/{_NAME})(?::(?P<quant>[A-Za-z0-9_.-]+)|/(?P<file>[^:]+\.gguf))?$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_SPLIT = re.compile(r"-\d{5}-of-\d{5}\.gguf$", re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class HubRef:
    """A parsed ``--model`` hub id."""

    model: str  # as given
    repo: str  # org/name
    quant: str | None = None  # org/name:QUANT
    filename: str | None = None  # org/name/file.gguf


def parse_hub_id(model: str) -> HubRef | None:
    """``model`` as a hub id, or None when it does not have the shape of one (the caller has
    already ruled out an existing local path)."""
    m = _HUB_ID.match(model)
    if m is None:
        return None
    repo = m["repo"]
    if "--" in repo or ".." in repo or repo.endswith((".", "-")) or repo.lower().endswith(".gguf"):
        return None  # not a valid repo name; a missing `dir/file.gguf` is a missing path
    return HubRef(model, repo, m["quant"], m["file"])


def resolve_hub_model(ref: HubRef, revision: str | None = None) -> Path:
    """Download (or find in the cache) what ``ref`` names; return the snapshot directory of an
    ``org/name`` id, or the path of the one GGUF file of the other forms."""
    import huggingface_hub as hub

    cache, offline = hub_cache_dir(), hub_offline()
    common: dict[str, Any] = dict(revision=revision, cache_dir=cache, local_files_only=offline,
                                  library_name="tokenloom")
    try:
        if ref.filename is not None:
            return Path(str(hub.hf_hub_download(ref.repo, ref.filename, **common)))
        if ref.quant is not None:
            files, cached = _repo_files(ref, revision, cache, offline)
            filename = pick_gguf(ref, files, revision, "the cached copy's" if cached else "its")
            return Path(str(hub.hf_hub_download(ref.repo, filename, **common)))
        snapshot = Path(hub.snapshot_download(ref.repo, allow_patterns=HF_FILES, **common))
    except ConfigError:
        raise
    except Exception as exc:
        mapped = hub_error(ref, revision, cache, offline, exc)
        if mapped is None:
            raise
        raise mapped from exc
    if not (snapshot / "config.json").is_file():
        raise ConfigError(
            f"{_what(ref, revision)} has no config.json, so it is not a Hugging Face checkpoint; for a "
            f"repository of GGUF files name one: {ref.repo}:QUANT (e.g. {ref.repo}:Q4_K_M) or "
            f"{ref.repo}/<file>.gguf")
    return snapshot


def hub_cache_dir() -> Path:
    """The hub cache as huggingface_hub finds it, read now (its own constants are read once,
    when it is first imported): ``HF_HUB_CACHE``, else ``$HF_HOME/hub``, else its default."""
    from huggingface_hub import constants

    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.environ[var]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return Path(constants.HF_HUB_CACHE)


def hub_offline() -> bool:
    """``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) as set now, else as huggingface_hub read it."""
    from huggingface_hub import constants

    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE")
    if value is not None:
        return value.strip().upper() in ("1", "ON", "YES", "TRUE")
    return bool(constants.HF_HUB_OFFLINE)


def pick_gguf(ref: HubRef, files: list[str], revision: str | None, whose: str = "its") -> str:
    """The one ``.gguf`` of ``files`` that ``ref.quant`` names (llama.cpp's ``org/name:QUANT``);
    ``whose`` says where ``files`` came from, for the error ("its", "the cached copy's")."""
    assert ref.quant is not None
    ggufs = sorted(f for f in files if f.lower().endswith(".gguf")
                   and not PurePosixPath(f).name.lower().startswith("mmproj"))
    tag = re.compile(rf"(?:^|[-._]){re.escape(ref.quant)}(?:-\d{{5}}-of-\d{{5}})?\.gguf$", re.IGNORECASE)
    hits = [f for f in ggufs if tag.search(PurePosixPath(f).name)]
    what = _what(ref, revision)
    if not hits:
        held = f"{whose} GGUF files: {', '.join(ggufs)}" if ggufs else f"{whose} files include no .gguf"
        raise ConfigError(f"{what}: no .gguf file for {ref.quant!r} ({held})")
    if any(_SPLIT.search(f) for f in hits):
        raise ConfigError(f"{what}: the {ref.quant} GGUF is split into {len(hits)} files ({', '.join(hits)}); "
                          "tokenloom reads a single-file GGUF (merge them with llama.cpp's "
                          "`llama-gguf-split --merge`)")
    if len(hits) > 1:
        raise ConfigError(f"{what}: {len(hits)} .gguf files match {ref.quant!r} ({', '.join(hits)}); "
                          f"name one as {ref.repo}/<file>.gguf")
    return hits[0]


def _repo_files(ref: HubRef, revision: str | None, cache: Path, offline: bool) -> tuple[list[str], bool]:
    """The repository's files: from the hub, else (offline, unreachable) the cached snapshot's;
    and whether they are the cache's."""
    import huggingface_hub as hub
    from huggingface_hub.utils import HfHubHTTPError

    unreachable: Exception | None = None
    if not offline:
        try:
            return list(hub.list_repo_files(ref.repo, revision=revision)), False
        except HfHubHTTPError:
            raise  # the hub answered (no such repo, gated, no such revision): mapped by the caller
        except _unreachable() as exc:
            unreachable = exc
    snapshot = cached_snapshot(cache, ref.repo, revision)
    if snapshot is None:
        raise _not_cached(ref, revision, cache, offline, unreachable)
    return [p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file()], True


def cached_snapshot(cache: Path, repo: str, revision: str | None) -> Path | None:
    """The cached snapshot directory of ``repo`` at ``revision`` (a commit hash, or a branch or
    tag the cache has a ref for), or None."""
    folder = cache / ("models--" + repo.replace("/", "--"))
    rev = revision or "main"
    if _COMMIT.match(rev):
        commit = rev
    elif (folder / "refs" / rev).is_file():
        commit = (folder / "refs" / rev).read_text().strip()
    else:
        return None
    snapshot = folder / "snapshots" / commit
    return snapshot if snapshot.is_dir() else None


def hub_error(ref: HubRef, revision: str | None, cache: Path, offline: bool, exc: Exception) -> ConfigError | None:
    """huggingface_hub's exception as a ConfigError sentence naming the id; None: not the hub's."""
    from huggingface_hub.utils import (
        EntryNotFoundError,
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    what = _what(ref, revision)
    if type(exc).__name__ == "IncompleteSnapshotError":  # huggingface_hub >= 2.x: a LocalEntryNotFoundError
        return ConfigError(f"{what}: the cached copy in {cache} is incomplete and the hub cannot be reached "
                           f"({_reason(offline, exc.__cause__)}); download it again where there is network "
                           f"with `{_download_command(ref, revision)}`")
    if isinstance(exc, LocalEntryNotFoundError):
        return _not_cached(ref, revision, cache, offline, exc.__cause__)
    if isinstance(exc, GatedRepoError):  # (a RepositoryNotFoundError: first)
        return ConfigError(f"{what} is a gated repository: accept its terms on https://huggingface.co/{ref.repo} "
                           "and log in (`hf auth login`, or set HF_TOKEN)")
    if isinstance(exc, RepositoryNotFoundError):
        return ConfigError(f"{what} is neither an existing local path nor a repository on the Hugging Face hub "
                           "(a private one needs `hf auth login` or HF_TOKEN)")
    if isinstance(exc, RevisionNotFoundError):
        return ConfigError(f"{what}: the repository {ref.repo} has no revision {revision or 'main'!r} "
                           "(a branch, tag or commit hash)")
    if isinstance(exc, EntryNotFoundError):
        return ConfigError(f"{what}: the repository {ref.repo} has no file {ref.filename!r}")
    if isinstance(exc, HfHubHTTPError):
        return ConfigError(f"{what} could not be fetched from the Hugging Face hub: {_first_line(exc)}")
    if isinstance(exc, ValueError):  # HFValidationError: not a valid repo id or revision
        return ConfigError(f"{what} is not a valid Hugging Face id: {_first_line(exc)}")
    if isinstance(exc, _unreachable()):
        return _not_cached(ref, revision, cache, offline, exc)
    return None


def _not_cached(ref: HubRef, revision: str | None, cache: Path, offline: bool,
                cause: BaseException | None) -> ConfigError:
    return ConfigError(
        f"{_what(ref, revision)} is not in the Hugging Face cache ({cache}) and the hub cannot be reached "
        f"({_reason(offline, cause)}); download it where there is network with "
        f"`{_download_command(ref, revision)}` or pass a local path")


def _what(ref: HubRef, revision: str | None) -> str:
    return f"model {ref.model!r}" + (f" at revision {revision!r}" if revision else "")


def _reason(offline: bool, cause: BaseException | None) -> str:
    if offline:
        return "HF_HUB_OFFLINE=1"
    return f"{type(cause).__name__}: {_first_line(cause)}" if cause is not None else "no network"


def _first_line(exc: BaseException | None) -> str:
    return str(exc).strip().splitlines()[0] if exc is not None and str(exc).strip() else type(exc).__name__


def _download_command(ref: HubRef, revision: str | None) -> str:
    """The shell command that fills the cache with what ``ref`` needs (``hf`` since huggingface_hub 0.34)."""
    import huggingface_hub

    major, minor = (int(p) if p.isdigit() else 0 for p in (huggingface_hub.__version__.split(".") + ["0"])[:2])
    words = ["hf" if (major, minor) >= (0, 34) else "huggingface-cli", "download", ref.repo]
    if ref.filename is not None:
        words.append(ref.filename)
    elif ref.quant is not None:
        words += ["--include", f"'*{ref.quant}*.gguf'"]
    if revision:
        words += ["--revision", revision]
    return " ".join(words)


def _unreachable() -> tuple[type[Exception], ...]:
    """What "the hub cannot be reached" raises: OSError (requests' errors and huggingface_hub's
    offline-mode error are OSErrors) and the transport errors of the HTTP client it uses since
    1.0 (httpx, then httpx2)."""
    import importlib

    errors: list[type[Exception]] = [OSError]
    for client in ("httpx2", "httpx"):
        try:
            errors.append(importlib.import_module(client).TransportError)
        except (ImportError, AttributeError):
            pass
    return tuple(errors)
