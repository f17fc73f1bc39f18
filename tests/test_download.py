"""`gpt_fast.util.download` and `scripts/prepare.sh`, offline: a Hugging Face cache written in tmp_path, and the
hub's HTTP errors built by huggingface_hub's own ``hf_raise_for_status`` from hand-made responses."""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

import huggingface_hub
import pytest
from huggingface_hub import constants
from huggingface_hub.utils import hf_raise_for_status

import gpt_fast.util.download as dl
from gpt_fast.util.download import (
    GatedRepoError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
    download,
    files_to_fetch,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
PREPARE = REPO_ROOT / "scripts" / "prepare.sh"
REPO = "tiny-org/tiny-llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
API_URL = f"https://huggingface.co/api/models/{REPO}/revision/main"
NEEDED = {
    "config.json": b'{"model_type": "llama"}',
    "generation_config.json": b"{}",
    "tokenizer.json": b'{"version": "1.0"}',
    "tokenizer_config.json": b"{}",
    "special_tokens_map.json": b"{}",
    "original/tokenizer.model": b"IQ== 0\n",
    "model.safetensors": b"safetensors bytes",
}
NOT_NEEDED = {
    "pytorch_model.bin": b"pickle bytes",
    "original/consolidated.00.pth": b"meta bytes",
    "original/params.json": b"{}",
    "README.md": b"# tiny",
    ".gitattributes": b"*.bin filter=lfs",
}


def write_cached_repo(cache: Path, repo_id: str, files: dict[str, bytes], ref: str = "main") -> Path:
    """The hub cache's layout: blobs named by hash, snapshots/<commit>/ of relative symlinks, refs/<ref> -> commit."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / COMMIT
    for name, data in files.items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / ref).write_text(COMMIT)
    return snapshot


def tree(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


@pytest.fixture
def hf_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty hub cache, in offline mode (environment and the constants huggingface_hub read at import)."""
    home = tmp_path / "hf_home"
    cache = home / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HOME", str(home))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    for module in map(importlib.import_module, ("huggingface_hub.file_download", "huggingface_hub._snapshot_download")):
        if hasattr(module, "HF_HUB_CACHE"):  # huggingface_hub 0.x copies the constant at import
            monkeypatch.setattr(module, "HF_HUB_CACHE", str(cache))
    return cache


@pytest.fixture
def online(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)


class FakeHub:
    """Stands in for the listing (HfApi) and snapshot_download; records the calls."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, listing: list[str] | BaseException) -> None:
        self.listing = listing
        self.tokens: list[str | None] = []
        self.downloads: list[dict] = []
        hub = self
        monkeypatch.setattr(dl, "check_reachable", lambda endpoint: None)  # the stand-in hub is always there

        class Api:
            def __init__(self, token: str | None = None) -> None:
                hub.tokens.append(token)

            def list_repo_files(self, repo_id: str, revision: str | None = None) -> list[str]:
                if isinstance(hub.listing, BaseException):
                    raise hub.listing
                return hub.listing

        monkeypatch.setattr(dl, "HfApi", Api)
        monkeypatch.setattr(
            dl, "snapshot_download", lambda repo_id, **kwargs: self.downloads.append({"repo_id": repo_id, **kwargs})
        )


# --- offline, from the cache -------------------------------------------------------------------------------------


def test_offline_copies_only_the_needed_files(hf_cache: Path, tmp_path: Path) -> None:
    write_cached_repo(hf_cache, REPO, {**NEEDED, **NOT_NEEDED})
    assert [r.repo_id for r in huggingface_hub.scan_cache_dir(hf_cache).repos] == [REPO]  # the layout is the real one

    out = download(REPO, root=tmp_path / "checkpoints")

    assert out == tmp_path / "checkpoints" / REPO / "hf"
    assert tree(out) == NEEDED
    assert not any(p.is_symlink() for p in out.rglob("*"))


def test_offline_falls_back_to_bin_shards(hf_cache: Path, tmp_path: Path) -> None:
    bins = {
        "pytorch_model-00001-of-00002.bin": b"a",
        "pytorch_model-00002-of-00002.bin": b"b",
        "pytorch_model.bin.index.json": b"{}",
    }
    write_cached_repo(
        hf_cache, REPO, {"config.json": b"{}", "tokenizer.model": b"sp", **bins, "original/consolidated.00.pth": b"x"}
    )

    out = download(REPO, root=tmp_path)

    assert tree(out) == {"config.json": b"{}", "tokenizer.model": b"sp", **bins}


def test_offline_revision_from_refs(hf_cache: Path, tmp_path: Path) -> None:
    write_cached_repo(hf_cache, REPO, NEEDED, ref="v1.0")

    assert tree(download(REPO, root=tmp_path, revision="v1.0")) == NEEDED
    assert tree(download(REPO, root=tmp_path / "by-commit", revision=COMMIT)) == NEEDED


def test_offline_replaces_earlier_files(hf_cache: Path, tmp_path: Path) -> None:
    write_cached_repo(hf_cache, REPO, NEEDED)
    stale = tmp_path / REPO / "hf" / "config.json"
    stale.parent.mkdir(parents=True)
    stale.write_text("old")

    assert tree(download(REPO, root=tmp_path)) == NEEDED


def test_offline_repo_not_cached(hf_cache: Path, tmp_path: Path) -> None:
    with pytest.raises(
        FileNotFoundError,
        match=f"^offline and {REPO} is not in the local Hugging Face cache; unset HF_HUB_OFFLINE to download it, "
        "or convert a local folder: gpt-fast convert PATH$",
    ):
        download(REPO, root=tmp_path)
    assert not (tmp_path / REPO).exists()


def test_offline_cache_without_weights(hf_cache: Path, tmp_path: Path) -> None:
    write_cached_repo(hf_cache, REPO, {"config.json": b"{}", "original/consolidated.00.pth": b"x"})

    with pytest.raises(
        FileNotFoundError,
        match=f"the cached copy of {REPO} has no model\\*.safetensors or pytorch_model\\*.bin weights",
    ):
        download(REPO, root=tmp_path)


# --- repository ids ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "repo_id",
    [
        "",
        "gpt2",
        "/org/name",
        "org/name/extra",
        "org/../name",
        "../name",
        "org/..",
        "org//name",
        "org/name/",
        "org/na me",
        ".org/name",
        "org/name-",
        "org--x/name",
        "~/name",
    ],
)
def test_bad_repo_id(repo_id: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="invalid repository id .*expected ORG/NAME"):
        download(repo_id, root=tmp_path)


@pytest.mark.parametrize(
    "repo_id",
    ["openlm-research/open_llama_7b", "meta-llama/Meta-Llama-3.1-8B-Instruct", "a/b", "HuggingFaceTB/SmolLM2-135M"],
)
def test_good_repo_id(repo_id: str) -> None:
    dl.check_repo_id(repo_id)


# --- which files, online -----------------------------------------------------------------------------------------

LLAMA3_LISTING = [
    ".gitattributes",
    "LICENSE",
    "README.md",
    "config.json",
    "generation_config.json",
    "model-00001-of-00004.safetensors",
    "model-00002-of-00004.safetensors",
    "model-00003-of-00004.safetensors",
    "model-00004-of-00004.safetensors",
    "model.safetensors.index.json",
    "original/consolidated.00.pth",
    "original/params.json",
    "original/tokenizer.model",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
]
OPEN_LLAMA_LISTING = [
    ".gitattributes",
    "README.md",
    "config.json",
    "generation_config.json",
    "pytorch_model-00001-of-00002.bin",
    "pytorch_model-00002-of-00002.bin",
    "pytorch_model.bin.index.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "tokenizer_config.json",
]


@pytest.mark.parametrize(
    ("listing", "expected"),
    [
        (
            LLAMA3_LISTING,
            [
                "config.json",
                "generation_config.json",
                *[f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)],
                "model.safetensors.index.json",
                "original/tokenizer.model",
                "special_tokens_map.json",
                "tokenizer.json",
                "tokenizer_config.json",
            ],
        ),
        (
            OPEN_LLAMA_LISTING,
            [
                "config.json",
                "generation_config.json",
                "pytorch_model-00001-of-00002.bin",
                "pytorch_model-00002-of-00002.bin",
                "pytorch_model.bin.index.json",
                "special_tokens_map.json",
                "tokenizer.model",
                "tokenizer_config.json",
            ],
        ),
        (
            ["config.json", "model.safetensors", "pytorch_model.bin", "chat_template.jinja"],
            ["chat_template.jinja", "config.json", "model.safetensors"],
        ),
        # Mistral keeps a consolidated.safetensors beside the transformers shards: not ours
        (
            [
                "config.json",
                "consolidated.safetensors",
                "model-00001-of-00001.safetensors",
                "model.safetensors.index.json",
            ],
            ["config.json", "model-00001-of-00001.safetensors", "model.safetensors.index.json"],
        ),
        (["config.json", "consolidated.safetensors", "pytorch_model.bin"], ["config.json", "pytorch_model.bin"]),
        (["config.json", "onnx/model.safetensors", "pytorch_model.bin"], ["config.json", "pytorch_model.bin"]),
    ],
)
def test_files_to_fetch(listing: list[str], expected: list[str]) -> None:
    assert files_to_fetch(listing) == expected


@pytest.mark.usefixtures("online")
@pytest.mark.parametrize("listing", [LLAMA3_LISTING, OPEN_LLAMA_LISTING])
def test_online_downloads_the_listed_needed_files(
    listing: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hub = FakeHub(monkeypatch, listing)

    out = download(REPO, root=tmp_path / "checkpoints", hf_token="hf_secret", revision="v2")

    assert out == tmp_path / "checkpoints" / REPO / "hf"
    assert hub.tokens == ["hf_secret"]
    assert hub.downloads == [
        {
            "repo_id": REPO,
            "revision": "v2",
            "token": "hf_secret",
            "local_dir": out,
            "allow_patterns": files_to_fetch(listing),
        }
    ]


@pytest.mark.usefixtures("online")
def test_online_token_defaults_to_huggingface_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hub = FakeHub(monkeypatch, OPEN_LLAMA_LISTING)
    download(REPO, root=tmp_path, hf_token="")
    assert hub.tokens == [None]
    assert hub.downloads[0]["token"] is None and hub.downloads[0]["revision"] is None


@pytest.mark.usefixtures("online")
def test_online_repo_without_weights(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hub = FakeHub(monkeypatch, ["config.json", "original/consolidated.00.pth", "model.gguf"])
    with pytest.raises(
        FileNotFoundError, match=f"^{REPO} has no model\\*.safetensors or pytorch_model\\*.bin weights$"
    ):
        download(REPO, root=tmp_path)
    assert hub.downloads == []


# --- hub errors ---------------------------------------------------------------------------------------------------


def http_module():
    return importlib.import_module(HfHubHTTPError.__mro__[1].__module__.split(".")[0])


def hub_response(status: int, url: str, headers: dict[str, str]):
    http = http_module()
    if http.__name__ == "requests":
        response = http.Response()
        response.status_code, response.url, response._content = status, url, b""
        response.headers.update(headers)
        response.request = http.Request("GET", url).prepare()
        return response
    return http.Response(status, headers=headers, request=http.Request("GET", url))


def hub_http_error(status: int, url: str = API_URL, **headers: str) -> HfHubHTTPError:
    """The exception huggingface_hub raises for this answer of the hub."""
    with pytest.raises(HfHubHTTPError) as info:
        hf_raise_for_status(hub_response(status, url, {k.replace("_", "-"): v for k, v in headers.items()}))
    return info.value


def connection_error() -> Exception:
    http = http_module()
    if http.__name__ == "requests":
        return http.ConnectionError("Failed to establish a new connection: [Errno 111] Connection refused")
    return http.ConnectError("[Errno 111] Connection refused", request=http.Request("GET", API_URL))


GATED = f"^{REPO} is gated: accept its licence on https://huggingface.co/{REPO} and use a token with access$"
MISSING = f"^no such repository {REPO} \\(or it is private: pass a token\\)$"
NOT_AUTHORISED = "^not authorised: pass --hf_token or set HF_TOKEN$"


@pytest.mark.usefixtures("online")
@pytest.mark.parametrize(
    ("error", "hub_class", "ours", "message"),
    [
        (lambda: hub_http_error(404, X_Error_Code="RepoNotFound"), RepositoryNotFoundError, FileNotFoundError, MISSING),
        (
            lambda: hub_http_error(401),
            RepositoryNotFoundError,
            FileNotFoundError,
            MISSING,
        ),  # no token, private or missing
        (lambda: hub_http_error(403, X_Error_Code="GatedRepo"), GatedRepoError, PermissionError, GATED),
        (lambda: hub_http_error(401, X_Error_Code="GatedRepo"), GatedRepoError, PermissionError, GATED),
        (
            lambda: hub_http_error(403, X_Error_Message="Forbidden"),
            HfHubHTTPError,
            PermissionError,
            GATED,
        ),  # token without access
        (
            lambda: hub_http_error(401, "https://huggingface.co/api/whoami-v2"),
            HfHubHTTPError,
            PermissionError,
            NOT_AUTHORISED,
        ),
        (
            lambda: hub_http_error(404, X_Error_Code="RevisionNotFound"),
            RevisionNotFoundError,
            FileNotFoundError,
            f"^no such revision v9 of {REPO}$",
        ),
        (
            lambda: hub_http_error(500),
            HfHubHTTPError,
            ConnectionError,
            f"^the Hugging Face hub failed to serve {REPO}: .*500",
        ),
        (connection_error, Exception, ConnectionError, "^cannot reach the Hugging Face hub: .*Connection refused"),
    ],
)
def test_hub_errors(
    error, hub_class: type, ours: type, message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    raised = error()
    assert type(raised) is hub_class or hub_class is Exception
    FakeHub(monkeypatch, raised)

    with pytest.raises(ours, match=message) as info:
        download(REPO, root=tmp_path, revision="v9")

    assert info.value.__cause__ is raised
    assert "\n" not in str(info.value)


@pytest.mark.usefixtures("online")
def test_invalid_token(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    raised = hub_http_error(401, X_Error_Message="Invalid credentials in Authorization header")
    FakeHub(monkeypatch, raised)
    # huggingface_hub < 1.0 reports every 401 of the repository API as RepositoryNotFoundError
    expected = (
        (FileNotFoundError, MISSING)
        if isinstance(raised, RepositoryNotFoundError)
        else (PermissionError, NOT_AUTHORISED)
    )
    with pytest.raises(expected[0], match=expected[1]):
        download(REPO, root=tmp_path, hf_token="hf_wrong")


@pytest.mark.usefixtures("online")
def test_hub_unreachable_during_snapshot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """snapshot_download turns a failed connection into LocalEntryNotFoundError when the cache cannot help."""
    FakeHub(monkeypatch, ["config.json", "model.safetensors"])
    cause = connection_error()

    def unreachable(repo_id: str, **kwargs: object) -> None:
        raise LocalEntryNotFoundError("An error happened while trying to locate the files on the Hub") from cause

    monkeypatch.setattr(dl, "snapshot_download", unreachable)
    with pytest.raises(ConnectionError, match="^cannot reach the Hugging Face hub: .*Connection refused"):
        download(REPO, root=tmp_path)


def test_an_unreachable_hub_fails_at_once_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in dl.PROXY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    with socket.socket() as listener:  # a port nothing listens on: connections are refused
        listener.bind(("127.0.0.1", 0))
        port = listener.getsockname()[1]
    for endpoint in (f"http://127.0.0.1:{port}", "https://no-such-host.invalid"):
        with pytest.raises(ConnectionError) as info:
            dl.check_reachable(endpoint)
        message = str(info.value)
        assert message.startswith(f"cannot reach the Hugging Face hub at {endpoint} (") and "\n" not in message
        assert "HF_HUB_OFFLINE=1" in message and "HF_ENDPOINT" in message and "gpt-fast convert PATH" in message


def test_the_reachability_check_steps_aside_behind_a_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.invalid:3128")
    dl.check_reachable("https://no-such-host.invalid")


# --- online, against a local stand-in for the hub -----------------------------------------------------------------

HUB_FILES = {**NEEDED, **NOT_NEEDED}
HUB_ERRORS = {"gated-org/model": (403, "GatedRepo"), "nobody/model": (401, "RepoNotFound")}


class HubHandler(BaseHTTPRequestHandler):
    """Answers the few endpoints huggingface_hub uses to list and fetch REPO's files (repo info, tree, resolve)."""

    requests: list[tuple[str, str, str | None]] = []

    def do_GET(self) -> None:
        self.answer(with_body=True)

    def do_HEAD(self) -> None:
        self.answer(with_body=False)

    def answer(self, with_body: bool) -> None:
        path = unquote(urlparse(self.path).path)
        self.requests.append((self.command, path, self.headers.get("Authorization")))
        api = re.fullmatch(r"/api/models/([^/]+/[^/]+)/(revision|tree)/([^/]+)(?:/.*)?", path)
        resolve = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
        repo, revision = (api or resolve).group(1, api and 3 or 2) if api or resolve else (None, None)
        if repo in HUB_ERRORS:
            return self.send(HUB_ERRORS[repo][0], b"{}", {"X-Error-Code": HUB_ERRORS[repo][1]}, with_body)
        if repo != REPO:
            return self.send(404, b"{}", {"X-Error-Code": "RepoNotFound"}, with_body)
        if revision not in ("main", COMMIT):
            return self.send(404, b"{}", {"X-Error-Code": "RevisionNotFound"}, with_body)
        if api and api.group(2) == "revision":
            info = {
                "id": REPO,
                "modelId": REPO,
                "sha": COMMIT,
                "private": False,
                "siblings": [{"rfilename": f} for f in HUB_FILES],
            }
            return self.send(200, json.dumps(info).encode(), {"Content-Type": "application/json"}, with_body)
        if api:
            entries = [
                {"type": "file", "path": f, "size": len(d), "oid": hashlib.sha1(d).hexdigest()}
                for f, d in HUB_FILES.items()
            ]
            return self.send(200, json.dumps(entries).encode(), {"Content-Type": "application/json"}, with_body)
        data = HUB_FILES.get(resolve.group(3))
        if data is None:
            return self.send(404, b"{}", {"X-Error-Code": "EntryNotFound"}, with_body)
        return self.send(200, data, {"X-Repo-Commit": COMMIT, "ETag": f'"{hashlib.sha1(data).hexdigest()}"'}, with_body)

    def send(self, status: int, body: bytes, headers: dict[str, str], with_body: bool) -> None:
        self.send_response(status)
        for key, value in {**headers, "Content-Length": str(len(body))}.items():
            self.send_header(key, value)
        self.end_headers()
        if with_body:
            self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def hub_endpoint() -> Iterator[str]:
    HubHandler.requests = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), HubHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    thread.join()


DOWNLOADS = """
import json, sys
from pathlib import Path
from gpt_fast.util.download import download
results = []
for repo_id, token in json.loads(sys.argv[1]):
    try:
        results.append(["ok", str(download(repo_id, root=Path(sys.argv[2]), hf_token=token))])
    except (ValueError, OSError) as err:
        results.append([type(err).__name__, str(err)])
print(json.dumps(results))
"""


def with_hub(endpoint: str, tmp_path: Path, script: str, *args: str) -> str:
    """Run ``script`` against ``endpoint``, with the cache of the hf_cache fixture; huggingface_hub reads HF_ENDPOINT
    when it is imported (0.x bakes it into URL templates), hence a fresh process."""
    env = {
        **os.environ,
        "HF_ENDPOINT": endpoint,
        "HF_HOME": str(tmp_path / "hf_home"),
        "HF_HUB_CACHE": str(tmp_path / "hf_home" / "hub"),
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
    }
    env = {k: v for k, v in env.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN")}
    result = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_online_against_a_local_hub(hub_endpoint: str, tmp_path: Path) -> None:
    calls = [(REPO, "hf_test"), ("gated-org/model", None), ("nobody/model", None)]

    output = with_hub(hub_endpoint, tmp_path, DOWNLOADS, json.dumps(calls), str(tmp_path / "checkpoints"))
    ok, gated, missing = json.loads(output.strip().splitlines()[-1])

    hf_dir = tmp_path / "checkpoints" / REPO / "hf"
    assert ok == ["ok", str(hf_dir)]
    assert {k: v for k, v in tree(hf_dir).items() if not k.startswith(".cache/")} == NEEDED
    fetched = {
        path.split("/resolve/")[1].split("/", 1)[1]
        for method, path, _ in HubHandler.requests
        if method == "GET" and "/resolve/" in path
    }
    assert fetched == set(NEEDED)
    assert {auth for _, path, auth in HubHandler.requests if REPO in path} == {"Bearer hf_test"}
    assert gated == [
        "PermissionError",
        "gated-org/model is gated: accept its licence on https://huggingface.co/gated-org/model and use a token "
        "with access",
    ]
    assert missing == ["FileNotFoundError", "no such repository nobody/model (or it is private: pass a token)"]


def test_offline_after_a_partial_download_into_the_cache(hub_endpoint: str, hf_cache: Path, tmp_path: Path) -> None:
    """A cache filled by another tool with only some files; recent huggingface_hub also caches the repository's
    listing, and then raises IncompleteSnapshotError, since pytorch_model.bin matches our patterns but is not cached."""
    fill = (
        "import sys\nfrom huggingface_hub import snapshot_download\n"
        "snapshot_download(sys.argv[1], allow_patterns=sys.argv[2:])"
    )
    with_hub(hub_endpoint, tmp_path, fill, REPO, *NEEDED)  # hf_cache is that process's cache too

    assert tree(download(REPO, root=tmp_path / "checkpoints")) == NEEDED


def test_subfolder_matches_the_converter(tmp_path: Path) -> None:
    pytest.importorskip("gguf", reason="gpt_fast.convert needs gguf (a declared dependency)")
    from gpt_fast.convert.auto import default_output_dir
    from gpt_fast.util.paths import HF_SUBDIR

    hf_dir = tmp_path / REPO / HF_SUBDIR
    hf_dir.mkdir(parents=True)
    assert default_output_dir(hf_dir) == tmp_path / REPO


def test_download_then_convert_offline(hf_cache: Path, tmp_path: Path) -> None:
    """What prepare.sh does, in-process: the downloaded folder is one the converter takes as it is."""
    pytest.importorskip("transformers")
    pytest.importorskip("gguf", reason="gpt_fast.convert needs gguf (a declared dependency)")
    from tiny import save_hf_llama

    from gpt_fast.convert.auto import convert_source

    source = tmp_path / "source"
    save_hf_llama(source, weights="sharded")
    write_cached_repo(hf_cache, REPO, {**tree(source), **NOT_NEEDED})

    hf_dir = download(REPO, root=tmp_path / "checkpoints")

    assert tree(hf_dir) == tree(source)
    weights = convert_source(hf_dir, tmp_path / "checkpoints" / REPO)
    assert weights.is_file() and (weights.parent / "config.json").is_file()


# --- scripts/prepare.sh -----------------------------------------------------------------------------------------

RECORDER = '#!/bin/sh\necho "$0 $*" >> "{log}"\n'


def recorder(path: Path, log: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(RECORDER.format(log=log))
    path.chmod(0o755)
    return path


def run_prepare(args: list[str], cwd: Path, script: Path = PREPARE, **env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "VIRTUAL_ENV")}
    return subprocess.run(
        [str(script), *args], cwd=cwd, env={**base, **env}, capture_output=True, text=True, timeout=300
    )


def test_prepare_is_executable() -> None:
    assert os.access(PREPARE, os.X_OK)


@pytest.mark.parametrize("args", [[], ["--hf_token", "x"]])
def test_prepare_usage(args: list[str], tmp_path: Path) -> None:
    result = run_prepare(args, tmp_path)
    assert result.returncode != 0
    assert result.stderr.startswith("usage: ") and "REPO_ID [--hf_token TOKEN]" in result.stderr


def test_prepare_runs_download_then_convert(tmp_path: Path) -> None:
    log = tmp_path / "calls.log"
    python = recorder(tmp_path / "bin" / "mypython", log)

    result = run_prepare([REPO, "--hf_token", "hf_x"], tmp_path, PYTHON=str(python))

    assert result.returncode == 0, result.stderr
    assert log.read_text().splitlines() == [
        f"{python} -m gpt_fast download {REPO} --hf_token hf_x",
        f"{python} -m gpt_fast convert checkpoints/{REPO}/hf --output_dir checkpoints/{REPO}",
    ]


def test_prepare_python_choice(tmp_path: Path) -> None:
    """The repository's .venv (beside scripts/) unless a virtualenv is active; python3 then."""
    script = tmp_path / "repo" / "scripts" / "prepare.sh"
    script.parent.mkdir(parents=True)
    shutil.copy2(PREPARE, script)
    log = tmp_path / "calls.log"
    venv_python = recorder(tmp_path / "repo" / ".venv" / "bin" / "python", log)
    path_python = recorder(tmp_path / "bin" / "python3", log)
    path = f"{path_python.parent}{os.pathsep}{os.environ['PATH']}"

    assert run_prepare([REPO], tmp_path, script, PATH=path).returncode == 0
    assert run_prepare([REPO], tmp_path, script, PATH=path, VIRTUAL_ENV="/some/venv").returncode == 0

    used = [line.split()[0] for line in log.read_text().splitlines()]
    assert used == [str(venv_python)] * 2 + [str(path_python)] * 2


def test_prepare_end_to_end_offline(hf_cache: Path, tmp_path: Path) -> None:
    from gpt_fast.cli.main import cli

    if "download" not in cli.commands:
        pytest.skip("the CLI has no `download` command yet")
    pytest.importorskip("transformers")
    pytest.importorskip("gguf", reason="gpt_fast.convert needs gguf (a declared dependency)")
    from tiny import save_hf_llama

    source = tmp_path / "source"
    save_hf_llama(source)
    write_cached_repo(hf_cache, REPO, tree(source))
    env = {
        "PYTHON": sys.executable,
        "HF_HOME": str(hf_cache.parent),
        "HF_HUB_CACHE": str(hf_cache),
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
    }

    result = run_prepare([REPO], tmp_path, **env)

    assert result.returncode == 0, result.stderr
    out = tmp_path / "checkpoints" / REPO
    assert sorted(p.name for p in (out / "hf").iterdir()) == sorted(p.name for p in source.iterdir())
    assert (out / "model.pth").is_file() and (out / "config.json").is_file()
