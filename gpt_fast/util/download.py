"""`gpt-fast download ORG/NAME`: fetch what the converter needs from the Hugging Face hub into checkpoints/ORG/NAME/hf.

Only the config, the tokenizer files and one weight format are fetched (safetensors when the repository has them,
else ``pytorch_model*.bin``), never Meta's ``original/consolidated*.pth``. Offline (``HF_HUB_OFFLINE=1``) the files
come from the local Hugging Face cache instead.
"""

from __future__ import annotations

import fnmatch
import logging
import os
import re
import shutil
import socket
import sys
import urllib.parse
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from huggingface_hub import HfApi, constants, snapshot_download

from gpt_fast.util.fileio import atomic_path, first_line
from gpt_fast.util.paths import CHECKPOINTS_DIR, HF_SUBDIR

try:
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )
except ImportError:  # huggingface_hub 0.24 keeps these in huggingface_hub.utils only
    from huggingface_hub.utils import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

EXTRA_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "original/tokenizer.model",  # Meta's tiktoken-format Llama 3 tokenizer
)
# (shard glob, index file), in order of preference; the globs only match files at the repository's top level
WEIGHT_FORMATS = (
    ("model*.safetensors", "model.safetensors.index.json"),
    ("pytorch_model*.bin", "pytorch_model.bin.index.json"),
)
REPO_ID = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]*[A-Za-z0-9_])?/[A-Za-z0-9_](?:[A-Za-z0-9_.-]*[A-Za-z0-9_])?")
TRUE_VALUES = {"1", "ON", "YES", "TRUE"}
# connection-level errors of the HTTP client huggingface_hub uses (httpx2, httpx or requests), by module and name
REACH_TIMEOUT_S = 5.0  # a first connection to the hub's host that takes longer counts as unreachable
PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")
NEXT_STEPS = (
    "with the files already in the local Hugging Face cache, set HF_HUB_OFFLINE=1; for a mirror, set HF_ENDPOINT; "
    "or convert a local folder: gpt-fast convert PATH"
)
TRANSPORT_ERRORS = (
    ("httpx2", "TransportError"),
    ("httpx", "TransportError"),
    ("requests", "ConnectionError"),
    ("requests", "Timeout"),
)


def download(
    repo_id: str, root: Path = CHECKPOINTS_DIR, hf_token: str | None = None, revision: str | None = None
) -> Path:
    """Fetch ``repo_id`` into ``root/repo_id/hf`` and return that folder.

    ``hf_token`` defaults to what huggingface_hub finds itself (``HF_TOKEN``, then the stored login).
    """
    check_repo_id(repo_id)
    hf_dir = Path(root) / repo_id / HF_SUBDIR
    if not is_offline():
        check_reachable(constants.ENDPOINT)
    try:
        if is_offline():
            copy_from_cache(repo_id, revision, hf_dir)
        else:
            fetch(repo_id, revision, hf_token or None, hf_dir)
    except (HfHubHTTPError, LocalEntryNotFoundError, OfflineModeIsEnabled, *transport_errors()) as err:
        raise hub_error(err, repo_id, revision) from err
    return hf_dir


def check_repo_id(repo_id: str) -> None:
    if not REPO_ID.fullmatch(repo_id) or ".." in repo_id or "--" in repo_id:
        raise ValueError(
            f"invalid repository id {repo_id!r}: expected ORG/NAME (letters, digits, '-', '_' and '.'), "
            "e.g. openlm-research/open_llama_7b"
        )


def is_offline() -> bool:
    """huggingface_hub reads HF_HUB_OFFLINE when it is imported; a later change of the variable counts too."""
    return bool(constants.HF_HUB_OFFLINE) or os.environ.get("HF_HUB_OFFLINE", "").upper() in TRUE_VALUES


def files_to_fetch(repo_files: Iterable[str]) -> list[str]:
    """The files of a repository listing the converter needs: config, tokenizer files and one weight format."""
    files = set(repo_files)
    return sorted(files.intersection(EXTRA_FILES) | weight_files(files))


def weight_files(files: set[str]) -> set[str]:
    for shard_glob, index in WEIGHT_FORMATS:
        shards = {f for f in files if "/" not in f and fnmatch.fnmatchcase(f, shard_glob)}
        if shards:
            return shards | files.intersection([index])
    return set()


def fetch(repo_id: str, revision: str | None, token: str | None, hf_dir: Path) -> None:
    with quiet_hub():
        listing = HfApi(token=token).list_repo_files(repo_id, revision=revision)
        wanted = files_to_fetch(listing)
        require_weights(wanted, f"{repo_id} has")
        snapshot_download(repo_id, revision=revision, token=token, local_dir=hf_dir, allow_patterns=wanted)


def check_reachable(endpoint: str) -> None:
    """Fail in seconds, in one line, when the hub's host cannot be reached at all (no name resolution, no
    connection), rather than after huggingface_hub's half a minute of retries. Behind a proxy the direct
    connection says nothing, so it is not tried."""
    if any(os.environ.get(name) for name in PROXY_VARIABLES):
        return
    url = urllib.parse.urlsplit(endpoint)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname, port), timeout=REACH_TIMEOUT_S).close()
    except OSError as err:
        reason = err.strerror or first_line(err)
        raise ConnectionError(f"cannot reach the Hugging Face hub at {endpoint} ({reason}); {NEXT_STEPS}") from err


@contextmanager
def quiet_hub() -> Iterator[None]:
    """huggingface_hub logs every retry as a warning; the error we raise says what went wrong, once."""
    logger = logging.getLogger("huggingface_hub")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def copy_from_cache(repo_id: str, revision: str | None, hf_dir: Path) -> None:
    snapshot = cached_snapshot(repo_id, revision)
    present = [p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file()]
    wanted = files_to_fetch(present)
    require_weights(wanted, f"the cached copy of {repo_id} has")
    for name in wanted:
        place(snapshot / name, hf_dir / name)


def cached_snapshot(repo_id: str, revision: str | None) -> Path:
    """The cached snapshot folder; it may hold both weight formats, or only some of the repository's files."""
    patterns = [*EXTRA_FILES, *(p for fmt in WEIGHT_FORMATS for p in fmt)]
    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=patterns, local_files_only=True))
    except LocalEntryNotFoundError as err:
        # IncompleteSnapshotError (recent huggingface_hub) points at the cached files when its cached listing of the
        # repository names more, e.g. the weight format we do not want; the converter checks the files it reads.
        partial = getattr(err, "snapshot_path", None)
        if partial is None:
            raise
        return Path(partial)


def require_weights(files: list[str], who: str) -> None:
    if not any(f.endswith((".safetensors", ".bin")) for f in files):
        raise FileNotFoundError(f"{who} no model*.safetensors or pytorch_model*.bin weights")


def place(src: Path, dest: Path) -> None:
    """Hard-link the cached blob (no second copy of many GB) where the file system allows it, else copy; either
    way through a temporary name (a partial copy is never seen, a link at ``dest`` is replaced, not followed)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(dest) as tmp:
        try:
            os.link(src.resolve(), tmp)
        except OSError:
            shutil.copyfile(src, tmp)


def transport_errors() -> tuple[type[BaseException], ...]:
    """An error's class is only ever raised once its module is imported, so sys.modules is enough to look in."""
    found: list[type[BaseException]] = [ConnectionError, TimeoutError]
    for module_name, class_name in TRANSPORT_ERRORS:
        cls = getattr(sys.modules.get(module_name), class_name, None)
        if isinstance(cls, type) and issubclass(cls, BaseException):
            found.append(cls)
    return tuple(found)


def hub_error(err: BaseException, repo_id: str, revision: str | None) -> Exception:
    """A one-line error saying what went wrong and what to do about it."""
    gated = PermissionError(
        f"{repo_id} is gated: accept its licence on https://huggingface.co/{repo_id} and use a token with access"
    )
    missing = FileNotFoundError(f"no such repository {repo_id} (or it is private: pass a token)")
    if isinstance(err, GatedRepoError):  # before RepositoryNotFoundError, its base class
        return gated
    if isinstance(err, RevisionNotFoundError):
        return FileNotFoundError(f"no such revision {revision} of {repo_id}")
    if isinstance(err, RepositoryNotFoundError):
        return missing
    if isinstance(err, (LocalEntryNotFoundError, OfflineModeIsEnabled)) or not isinstance(err, HfHubHTTPError):
        return unreachable(err, repo_id)  # before HfHubHTTPError: huggingface_hub 0.24's LocalEntryNotFoundError is one
    status = getattr(getattr(err, "response", None), "status_code", None)
    if status == 401:
        return PermissionError("not authorised: pass --hf_token or set HF_TOKEN")
    if status == 403:
        return gated
    if status == 404:
        return missing
    return ConnectionError(f"the Hugging Face hub failed to serve {repo_id}: {first_line(err)}")


def unreachable(err: BaseException, repo_id: str) -> Exception:
    if is_offline():
        return FileNotFoundError(
            f"offline and {repo_id} is not in the local Hugging Face cache; unset HF_HUB_OFFLINE to download it, "
            "or convert a local folder: gpt-fast convert PATH"
        )
    reason = err.__cause__ if isinstance(err, LocalEntryNotFoundError) and err.__cause__ is not None else err
    return ConnectionError(f"cannot reach the Hugging Face hub: {first_line(reason)}; {NEXT_STEPS}")
