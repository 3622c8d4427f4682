"""Models by Hugging Face Hub id, wherever a MODEL or checkpoint is taken (`llgraph generate org/name`,
`open_runner("org/name:Q4_K_M", "ort")`), fetched with `huggingface_hub` into its own cache:

- `org/name`: the repo's safetensors, config and tokenizer files (an HF folder); a repo of GGUF files alone gives
  its Q4_K_M file (else its only or first one), as llama.cpp's `-hf` does;
- `org/name:FILE.gguf`: that file; `org/name:Q4_K_M` (any quantization tag, any case): the GGUF file named with it.

`huggingface_hub` does the rest: its cache (`HF_HOME`, `HF_HUB_CACHE`), `HF_HUB_OFFLINE=1` (the cached copy, no
network), `HF_TOKEN` (gated and private repos), `HF_ENDPOINT` (a mirror), progress bars, resuming a cut download.
A revision (branch, tag or commit) comes from `--revision` or `org/name@REV`. Each failure is one line: no network
and nothing cached, no such repo, a gated repo without a token, no such revision, no file of that quantization.

Nothing is written outside the Hub cache, whatever the id or the endpoint says: a repo id is checked by
huggingface_hub's own validator, a revision as git checks a ref name (no `..`, no leading `/`, no control
characters), a tag as one file name; and every answer of the endpoint passes a check before huggingface_hub turns
it into a path (a commit is 40 hex digits, an ETag one bare name): a hostile mirror or proxy cannot name a place.
"""

from __future__ import annotations

import re
from pathlib import Path

from llgraph.errors import ExportError

HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.\-]*/[\w.\-]+)(?:@(?P<revision>[\w.\-/]+?))?(?::(?P<tag>[^/:@]+))?$")
HF_FILES = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model", "*.txt"]  # an HF folder: weights, config, tokens
DEFAULT_QUANT = "Q4_K_M"  # llama.cpp's -hf default
_SPLIT = re.compile(r"-\d{5}-of-\d{5}\.gguf$")


class HubError(ExportError):
    """A Hub model that cannot be had: one line naming the repo and what to do."""


def is_hub_id(ref) -> bool:
    """Whether `ref` reads as a Hub id (`org/name[@REV][:TAG]`) and names no existing local path."""
    if not isinstance(ref, str) or HUB_ID.match(ref) is None:
        return False
    try:
        return not Path(ref).exists()
    except OSError:  # a name too long to be a path
        return True


_REF_BAD = re.compile(r"[\x00-\x20\x7f~^:?*\[\\]|\.\.|@\{|//")


def check_revision(revision: str) -> None:
    """A branch, tag or commit as git allows its name (`git check-ref-format`): no `..`, `//`, leading or trailing
    `/`, component starting with `.` or ending in `.lock`, control character or `~^:?*[\\`; at most 255 characters."""
    parts = revision.split("/")
    if (not revision or len(revision) > 255 or _REF_BAD.search(revision) or revision == "@"
            or any(not p or p.startswith(".") or p.endswith((".lock", ".")) for p in parts)):
        raise HubError(f"revision {_short(revision)} is not a branch, tag or commit name (no '..', no leading '/', "
                       "no control characters); give one the repo has")


def _short(text: str) -> str:
    return repr(text if len(text) <= 80 else text[:80] + "...")


def _check_ref(repo: str, revision: str | None, tag: str | None) -> None:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo)
    except HFValidationError:
        raise HubError(f"{_short(repo)} is not a Hub repo id (org/name of letters, digits, '-', '_', '.', at most 96 "
                       "characters, no '--' or '..'); check the id") from None
    if revision is not None:
        check_revision(revision)
    if tag is not None and (len(tag) > 255 or tag.startswith(".") or "\\" in tag):
        raise HubError(f"{_short(tag)} is not a GGUF file name or quantization tag; give e.g. {repo}:Q4_K_M")


_FETCHED: dict[tuple[str, str | None], Path] = {}  # this process's answers: a reference is resolved more than once


def fetch(ref: str, revision: str | None = None) -> Path:
    """The local path of a Hub model (downloaded, or from the cache): an HF folder or a GGUF file."""
    if (ref, revision) not in _FETCHED:
        _FETCHED[ref, revision] = _fetch(ref, revision)
    return _FETCHED[ref, revision]


def _fetch(ref: str, revision: str | None) -> Path:
    match = HUB_ID.match(ref)
    if match is None:
        raise HubError(f"{ref!r} is neither a local path nor a Hub id (org/name, org/name:Q4_K_M, "
                       "org/name:FILE.gguf)")
    repo, tag = match["repo"], match["tag"]
    revision = revision or match["revision"]
    _check_ref(repo, revision, tag)
    _guard_endpoint()
    try:
        offline = not _online()
        files = _files(repo, revision, offline)
        ggufs = sorted(f for f in files if f.endswith(".gguf") and not _SPLIT.search(f))
        if tag is not None or not {"config.json"} <= set(files) or not any(f.endswith(".safetensors")
                                                                          for f in files):
            return Path(_download(repo, _gguf(repo, ggufs, tag, files), revision, offline))
        return Path(_snapshot(repo, revision, offline))
    except HubError:
        raise
    except Exception as e:
        raise HubError(_explain(e, repo, revision)) from None


_COMMIT = re.compile(r"[0-9a-f]{40}")
_ETAG = re.compile(r'(W/)?"?[A-Za-z0-9_\-]{1,128}"?')  # ASCII: a blob's file name on any file system


def _guard_endpoint() -> None:
    """Every response huggingface_hub gets passes `_check_answer` first: its client factory, wrapped once."""
    from huggingface_hub import set_client_factory
    from huggingface_hub.utils import _http

    if getattr(_http, "_llgraph_guarded", False):
        return

    def guarded():
        client = _http.default_client_factory()
        hooks = client.event_hooks
        client.event_hooks = {**hooks, "response": [*hooks.get("response", []), _check_answer]}
        return client

    set_client_factory(guarded)
    _http._llgraph_guarded = True


def _check_answer(response) -> None:
    """Refuses an answer whose commit or ETag is not a bare name (huggingface_hub builds `snapshots/<commit>` and
    `blobs/<etag>` from them), and a revision answer whose `sha` is not a commit."""
    commit = response.headers.get("X-Repo-Commit")
    bad = [f"commit {_short(commit)}"] if commit is not None and not _COMMIT.fullmatch(commit) else []
    bad += [f"ETag {_short(e)}" for e in (response.headers.get(h) for h in ("X-Linked-Etag", "ETag"))
            if e is not None and not _ETAG.fullmatch(e)]
    if not bad and "/revision/" in response.request.url.path and response.status_code == 200:
        response.read()
        try:
            sha = response.json().get("sha")
        except Exception:
            sha = None
        if sha is not None and not (isinstance(sha, str) and _COMMIT.fullmatch(sha)):
            bad.append(f"commit {_short(str(sha))}")
    if bad:
        raise HubError(f"the Hub endpoint {_endpoint()} answered {bad[0]}, which is no commit or file name; nothing "
                       "was written from it — check HF_ENDPOINT (a mirror or proxy you trust)")


def _online() -> bool:
    """Whether the Hub may be asked: not offline mode, and its host answers a connection within 3 s (without
    network, huggingface_hub would retry each request for ~25 s before giving up)."""
    import socket
    from urllib.parse import urlsplit

    from huggingface_hub import constants

    if _offline_mode():
        return False
    url = urlsplit(constants.ENDPOINT)
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), 3).close()
        return True
    except OSError:
        return False


def _offline_mode() -> bool:
    from huggingface_hub import constants

    return bool(getattr(constants, "is_offline_mode", lambda: constants.HF_HUB_OFFLINE)())


def _files(repo: str, revision: str | None, offline: bool) -> list[str]:
    """The repo's files: asked of the Hub, or, offline, what its cached snapshot holds."""
    from huggingface_hub import HfApi, snapshot_download

    if not offline:
        try:
            return HfApi().list_repo_files(repo, revision=revision)
        except Exception as e:
            if not _unreachable(e):
                raise
    folder = Path(snapshot_download(repo, revision=revision, local_files_only=True))
    return [str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()]


def _gguf(repo: str, ggufs: list[str], tag: str | None, files: list[str]) -> str:
    ggufs = [f for f in ggufs if _safe_name(f)]
    if tag is not None and tag.lower().endswith(".gguf"):
        if tag not in files or not _safe_name(tag):
            raise HubError(f"{repo} has no file {tag}; it has {_listing(ggufs)}")
        return tag
    if not ggufs:
        raise HubError(f"{repo} holds neither a GGUF file nor safetensors with a config.json; give a repo of an "
                       "HF model or of GGUF files")
    wanted = (tag or DEFAULT_QUANT).lower()
    named = [f for f in ggufs if re.search(rf"(^|[\W_]){re.escape(wanted)}([\W_]|$)", Path(f).stem.lower())]
    if len(named) > 1:
        raise HubError(f"{repo} has {len(named)} GGUF files of quantization {tag or DEFAULT_QUANT}: "
                       f"{_listing(named)}; name one, e.g. {repo}:{Path(named[0]).name}")
    if named:
        return named[0]
    if tag is None:
        return ggufs[0]
    raise HubError(f"{repo} has no GGUF file of quantization {tag}; it has {_listing(ggufs)}")


def _safe_name(name: str) -> bool:
    """A file name of the repo that stays inside it: relative, no `..` component, no backslash."""
    return not name.startswith("/") and "\\" not in name and ".." not in name.split("/")


def _listing(ggufs: list[str]) -> str:
    return ", ".join(ggufs[:12]) + (f" and {len(ggufs) - 12} more" if len(ggufs) > 12 else "") if ggufs else "none"


def cut_downloads(repo: str | None = None) -> list[Path]:
    """What downloads killed midway left in the Hub cache (`blobs/<etag>.<id>.incomplete`, of `repo` or every repo)
    that no live download holds (its etag's lock is free). huggingface_hub 1.x+ writes each download to a file of
    its own and never resumes another process's, so these are only disk taken: `llgraph cache clean` and the next
    download of their repo remove them."""
    from filelock import FileLock, Timeout
    from huggingface_hub import constants

    root = Path(constants.HF_HUB_CACHE)
    pattern = f"models--{repo.replace('/', '--')}/blobs/*.incomplete" if repo else "*/blobs/*.incomplete"
    found = []
    for blob in sorted(root.glob(pattern)):
        lock = root / ".locks" / blob.parent.parent.name / f"{blob.name.split('.')[0]}.lock"
        try:
            lock.parent.mkdir(parents=True, exist_ok=True)
            with FileLock(lock, timeout=0):
                found.append(blob)
        except (Timeout, OSError):
            continue  # being written now, or not ours to judge
    return found


def remove_cut_downloads(repo: str | None = None) -> tuple[int, int]:
    """Removes cut_downloads(repo): (files, bytes)."""
    files, size = 0, 0
    for blob in cut_downloads(repo):
        try:
            size += blob.stat().st_size
            blob.unlink()
            files += 1
        except OSError:
            pass
    return files, size


def _download(repo: str, filename: str, revision: str | None, offline: bool) -> str:
    from huggingface_hub import hf_hub_download, try_to_load_from_cache

    if not isinstance(try_to_load_from_cache(repo, filename, revision=revision), str):
        if not offline:
            _clear_cut(repo)
        _say(f"{repo}: {filename}")
    return hf_hub_download(repo, filename, revision=revision, local_files_only=offline)


def _snapshot(repo: str, revision: str | None, offline: bool) -> str:
    from huggingface_hub import snapshot_download

    if not offline:
        try:
            snapshot_download(repo, revision=revision, allow_patterns=HF_FILES, local_files_only=True)
        except Exception:
            _clear_cut(repo)
            _say(f"{repo} (its safetensors, config and tokenizer files)")
    return snapshot_download(repo, revision=revision, allow_patterns=HF_FILES, local_files_only=offline)


def _clear_cut(repo: str) -> None:
    files, size = remove_cut_downloads(repo)
    if files:
        import sys

        print(f"removed {size / 2**20:,.0f} MiB that {files} cut download{'s' if files > 1 else ''} of {repo} left "
              "(huggingface_hub starts a download anew)", file=sys.stderr, flush=True)


def _say(what: str) -> None:
    """The one line before a download (huggingface_hub's bars show on a terminal only)."""
    import sys

    from huggingface_hub import constants

    print(f"fetching {what} from the Hub ({_endpoint()}) into {constants.HF_HUB_CACHE} ...", file=sys.stderr,
          flush=True)


def _unreachable(e: BaseException) -> bool:
    """A network failure (no connection, a timeout, offline mode), as opposed to an answer from the Hub."""
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    if isinstance(e, HfHubHTTPError):
        return False
    transport = any(c.__name__ == "TransportError" and c.__module__.startswith("httpx") for c in type(e).__mro__)
    return transport or isinstance(e, (OfflineModeIsEnabled, ConnectionError, TimeoutError))


def _explain(e: Exception, repo: str, revision: str | None) -> str:
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if isinstance(e, GatedRepoError):
        return (f"{repo} is a gated repo: accept its terms on its Hub page, then set HF_TOKEN to a token of that "
                "account (or run `hf auth login`)")
    if isinstance(e, RepositoryNotFoundError):
        return (f"{repo} is no local path, and no model repo of that name is on the Hub ({_endpoint()}); check the "
                "path or id, or set HF_TOKEN if the repo is private")
    if isinstance(e, RevisionNotFoundError):
        return f"{repo} has no revision {revision!r}; give a branch, tag or commit it has"
    if isinstance(e, LocalEntryNotFoundError) or _unreachable(e):
        if _offline_mode():
            return f"HF_HUB_OFFLINE is set and {repo} is not in the local cache; unset it to download the model"
        return (f"{repo} is no local path, and as a Hub id: the Hub ({_endpoint()}) cannot be reached and it is not "
                "in the local cache; connect to the network (or set HF_ENDPOINT to a mirror), or download it once "
                "and use HF_HUB_OFFLINE=1")
    if isinstance(e, EntryNotFoundError):
        return f"{repo}: {str(e).splitlines()[0][:160]}"
    return f"{repo}: the Hub download failed: {str(e).splitlines()[0][:200] if str(e) else type(e).__name__}"


def _endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT
