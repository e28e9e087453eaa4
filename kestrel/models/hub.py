"""Hugging Face Hub ids (`ORG/NAME`, `ORG/NAME/FILE.gguf`) -> a snapshot directory (or file) in the HF cache.

As vLLM and SGLang take them: `huggingface_hub.snapshot_download` fetches the weights (safetensors; transformers'
pytorch_model*.bin only where a repo has no safetensors), config and tokenizer files, nothing else (no README, no
.pth/.gguf twins of the weights), into the HF cache, which huggingface_hub places and configures itself (`HF_HOME`,
`HF_HUB_CACHE`, `HF_HUB_OFFLINE`, `HF_TOKEN`); `--download-dir` is its `cache_dir`, `--revision` a branch, tag or
commit, `--hf-token` a token over HF_TOKEN.

Two entries: `fetch` (the front doors, once: asks the Hub for the revision's files and downloads what is missing,
with progress lines) and `cached` (everything after, in any process: the snapshot already on disk, no network).
Torch-free: the server process resolves names too.
"""
from __future__ import annotations

import contextlib
import fnmatch
import functools
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path

from kestrel.errors import KestrelError
from kestrel.progress import Progress

# Files a checkpoint directory needs besides its weights: config.json, generation_config.json, tokenizer.json,
# tokenizer_config.json, special_tokens_map.json, chat_template.json (all *.json); SentencePiece and tiktoken
# vocabularies; merges.txt / vocab.txt; chat_template.jinja.
CONFIG_PATTERNS = ("*.json", "*.model", "*.tiktoken", "*.txt", "*.jinja")
WEIGHT_PATTERNS = ("*.safetensors",)
# transformers' PyTorch weights (and shards), fetched only where a repo has no safetensors: training leftovers such
# as optimizer.bin or training_args.bin are no weights
BIN_WEIGHTS = "pytorch_model*.bin"
# Never: Meta's `original/` folder (consolidated .pth and its params), Mistral's consolidated.safetensors twin of
# the HF shards (the same weights again under other names).
IGNORE_PATTERNS = ("original/*", "consolidated*.safetensors")

# ORG/NAME, or ORG/NAME/FILE.gguf (one file of a GGUF repo, as vLLM names it). Hub repo names: letters, digits,
# '-', '_', '.'; huggingface_hub's validate_repo_id checks the rest (no '--' or '..', at most 96 characters).
_HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:/(?P<file>[^\s]+\.gguf))?$", re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class HubOptions:
    revision: str | None = None     # branch, tag or commit; None: main
    cache_dir: str | None = None    # None: huggingface_hub's (HF_HUB_CACHE, else HF_HOME/hub)
    token: str | None = field(default=None, repr=False)   # None: huggingface_hub's (HF_TOKEN, `hf auth login`)


@dataclass(frozen=True, slots=True)
class HubId:
    repo: str               # ORG/NAME
    filename: str | None    # a .gguf file inside it, or None for the snapshot directory


def parse_hub_id(name: str) -> HubId | None:
    """`name` read as a Hub id, or None when it cannot be one (callers check local paths first)."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    match = _HUB_ID.match(name)
    if match is None:
        return None
    try:
        validate_repo_id(match["repo"])
    except HFValidationError:
        return None
    return HubId(match["repo"], match["file"])


def cached(hub_id: HubId, options: HubOptions, name: str) -> Path:
    """The snapshot directory (or the .gguf file) `fetch` left in the cache; no network. `name`: as the user
    wrote it, for the error."""
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(hub_id.repo, hub_id.filename or "config.json", cache_dir=options.cache_dir,
                                   revision=options.revision)
    if not isinstance(found, str):
        raise KestrelError(f"{name!r} is not a local path, and the Hugging Face cache ({_cache_dir(options)}) "
                           f"has no snapshot of it{_at(options)}; it is downloaded when `kestrel` or `LLM(...)` "
                           "is given the id")
    return Path(found) if hub_id.filename else Path(found).parent


def fetch(hub_id: HubId, options: HubOptions, name: str, weights: bool = True) -> Path:
    """Download what the cache lacks of `hub_id` at options.revision and return its snapshot directory (or the
    .gguf file). `weights=False`: config and tokenizer files only (--load-format dummy, a tokenizer).
    Offline (HF_HUB_OFFLINE=1) the cache alone answers. Every failure is one KestrelError line."""
    try:
        if hub_id.filename is not None:
            return _fetch_file(hub_id, options)
        return _fetch_snapshot(hub_id, options, name, weights)
    except KestrelError:
        raise
    except Exception as exc:  # noqa: BLE001 - huggingface_hub's errors (and httpx's) said in one line
        raise KestrelError(_explain(exc, hub_id, options, name)) from None


def _fetch_file(hub_id: HubId, options: HubOptions) -> Path:
    from huggingface_hub import hf_hub_download, is_offline_mode

    return Path(hf_hub_download(hub_id.repo, hub_id.filename, revision=options.revision, cache_dir=options.cache_dir,
                                token=options.token, local_files_only=is_offline_mode()))


def _fetch_snapshot(hub_id: HubId, options: HubOptions, name: str, weights: bool) -> Path:
    from huggingface_hub import is_offline_mode, snapshot_download

    # Online: the revision's file list (and sizes) decides what to fetch. Offline: the list huggingface_hub cached
    # with the snapshot, if any, and otherwise the snapshot as it is (local_files_only: snapshot_download would
    # otherwise ask the Hub for a commit's file list it has not cached).
    offline = is_offline_mode()
    files = _cached_files(hub_id.repo, options) if offline else _repo_files(hub_id.repo, options)
    patterns = list(CONFIG_PATTERNS) + (_weight_patterns(files, hub_id, name) if weights else [])
    watch = contextlib.nullcontext()
    if files is not None and not offline:
        wanted = [f for path, f in files.items() if _selected(path, patterns)]
        watch = _DownloadWatch(_repo_folder(hub_id.repo, options), name, wanted)
    with watch:
        path = Path(snapshot_download(hub_id.repo, revision=options.revision, cache_dir=options.cache_dir,
                                      token=options.token, allow_patterns=patterns, local_files_only=offline,
                                      ignore_patterns=list(IGNORE_PATTERNS), tqdm_class=_quiet_bar()))
    if not (path / "config.json").is_file():
        raise KestrelError(f"{name}: the snapshot {path} has no config.json (not a transformers checkpoint; "
                           "for a GGUF repo name its file, ORG/NAME/FILE.gguf)")
    if weights and not any(path.glob("*.safetensors")) and not any(path.glob(BIN_WEIGHTS)):
        hint = " (cached without them, e.g. by --load-format dummy: fetch it online once)" if offline else ""
        raise KestrelError(f"{name}: the snapshot {path} has no *.safetensors weights{hint}")
    return path


def _repo_files(repo: str, options: HubOptions) -> dict | None:
    """The revision's files (path -> RepoFile: size, blob id); None where the Hub cannot be reached
    (snapshot_download then falls back to the cache, as it does itself)."""
    import httpx
    from huggingface_hub import HfApi
    from huggingface_hub.errors import OfflineModeIsEnabled
    from huggingface_hub.hf_api import RepoFile

    try:
        tree = HfApi(token=options.token).list_repo_tree(repo, revision=options.revision, recursive=True)
        return {f.path: f for f in tree if isinstance(f, RepoFile)}
    except (httpx.ConnectError, httpx.TimeoutException, OfflineModeIsEnabled):
        return None


def _cached_files(repo: str, options: HubOptions) -> dict | None:
    """The file list huggingface_hub keeps beside a snapshot it downloaded; None where there is none."""
    from huggingface_hub import get_cached_repo_tree

    try:
        tree = get_cached_repo_tree(repo, revision=options.revision, cache_dir=options.cache_dir)
    except Exception:  # noqa: BLE001 - no cached list (CachedRepoTreeNotFoundError, an older cache): none
        return None
    return {f.path: f for f in tree}


def _selected(path: str, patterns: list[str]) -> bool:
    # the same test huggingface_hub's filter_repo_objects applies to allow_patterns / ignore_patterns
    return any(fnmatch.fnmatch(path, p) for p in patterns) and not any(fnmatch.fnmatch(path, p)
                                                                       for p in IGNORE_PATTERNS)


def _weight_patterns(files: dict | None, hub_id: HubId, name: str) -> list[str]:
    """safetensors where the repo has them, else transformers' .bin weights (loader.py reads both); refused, before
    anything is downloaded, where it has neither. `files` None (offline, no cached file list): whichever the
    snapshot holds."""
    if files is None:
        return [*WEIGHT_PATTERNS, BIN_WEIGHTS]
    if any(_selected(f, list(WEIGHT_PATTERNS)) for f in files):
        return list(WEIGHT_PATTERNS)
    if any(_selected(f, [BIN_WEIGHTS]) for f in files):
        return [BIN_WEIGHTS]
    ggufs = sorted(f for f in files if f.endswith(".gguf"))
    if ggufs:
        raise KestrelError(f"{name} is a GGUF repo: name one of its files, e.g. {hub_id.repo}/{ggufs[0]} "
                           f"({len(ggufs)} in it: {', '.join(ggufs[:4])}{', ...' if len(ggufs) > 4 else ''})")
    raise KestrelError(f"{name} has no weights Kestrel reads (*.safetensors, pytorch_model*.bin); its files: "
                       f"{', '.join(sorted(files)[:8])}")


def _explain(exc: Exception, hub_id: HubId, options: HubOptions, name: str) -> str:
    """huggingface_hub's exception -> the one line a user needs."""
    from huggingface_hub import is_offline_mode
    from huggingface_hub.errors import (GatedRepoError, IncompleteSnapshotError, LocalEntryNotFoundError,
                                        OfflineModeIsEnabled, RemoteEntryNotFoundError, RepositoryNotFoundError,
                                        RevisionNotFoundError)

    not_local = f"{name!r} is not a local path"
    if isinstance(exc, IncompleteSnapshotError):
        return f"{name}: the cached snapshot{_at(options)} is incomplete (an interrupted download); run again " \
               "with network access to finish it"
    if isinstance(exc, (LocalEntryNotFoundError, OfflineModeIsEnabled)) and is_offline_mode():
        return f"{not_local}, and the Hugging Face cache ({_cache_dir(options)}) has no snapshot of it" \
               f"{_at(options)} while HF_HUB_OFFLINE=1 (download it once online, or give a local directory)"
    if isinstance(exc, GatedRepoError):
        return f"{hub_id.repo} is gated: accept its terms on huggingface.co, then pass --hf-token or set HF_TOKEN"
    if isinstance(exc, RevisionNotFoundError):
        return f"{hub_id.repo} has no revision {options.revision!r} (expected a branch, tag or commit)"
    if isinstance(exc, RepositoryNotFoundError):
        return f"{not_local}, and {hub_id.repo} is not a model on the Hugging Face Hub (or it is private: pass " \
               "--hf-token or set HF_TOKEN)"
    if isinstance(exc, RemoteEntryNotFoundError):
        return f"{hub_id.repo}{_at(options)} has no file {hub_id.filename!r}"
    if isinstance(exc, LocalEntryNotFoundError):
        return f"{not_local}; the Hugging Face Hub could not be reached and the cache ({_cache_dir(options)}) " \
               f"has no snapshot of it{_at(options)}"
    first_line = (str(exc).strip().splitlines() or [""])[0]
    return f"{name}: fetching it from the Hugging Face Hub failed: {type(exc).__name__}: {first_line}"


def _at(options: HubOptions) -> str:
    return f" at revision {options.revision!r}" if options.revision else ""


def _cache_dir(options: HubOptions) -> str:
    from huggingface_hub import constants

    return options.cache_dir or constants.HF_HUB_CACHE


def _repo_folder(repo: str, options: HubOptions) -> Path:
    from huggingface_hub.file_download import repo_folder_name

    return Path(_cache_dir(options)).expanduser() / repo_folder_name(repo_id=repo, repo_type="model")


@functools.cache
def _quiet_bar() -> type:
    from huggingface_hub.utils import tqdm

    class QuietBar(tqdm):
        """huggingface_hub's bars, silenced: _DownloadWatch says the same in log lines, which `kestrel launch`
        and log files read (a tqdm bar redraws one line with carriage returns)."""

        def __init__(self, *args, **kwargs) -> None:
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

    return QuietBar


class _DownloadWatch:
    """While snapshot_download runs, the bytes landing in the repo's blobs/ folder as Progress lines ("downloading
    ORG/NAME 1.20 GB/16.06 GB, 95.3 MB/s, ETA 156 s"), once a second; nothing when everything is cached."""

    def __init__(self, repo_folder: Path, name: str, wanted: list) -> None:
        self.blobs = repo_folder / "blobs"
        self.name = name
        self.start_bytes = self._blob_bytes()
        # what is left to fetch: the wanted files whose blob is not cached yet (blobs/ names a file by its ETag:
        # the sha256 of an LFS file, the git blob id of the others)
        missing = [f for f in wanted if not (self.blobs / (f.lfs.sha256 if f.lfs else f.blob_id)).exists()]
        self.total = sum(f.size or 0 for f in missing) or None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hub-download-watch", daemon=True)
        self.progress = Progress()

    def _blob_bytes(self) -> int:
        try:
            return sum(f.stat().st_size for f in self.blobs.iterdir() if f.is_file())
        except OSError:   # not there yet, or a file renamed meanwhile
            return 0

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            self._report()
        self._report()   # the last bytes, once the download is over

    def _report(self) -> None:
        done = self._blob_bytes() - self.start_bytes
        if done <= 0:
            return
        if self.progress.phase == "starting":   # only a real download says anything
            self.progress.begin(f"downloading {self.name}", self.total, "B")
        self.progress.update(done)

    def __enter__(self) -> "_DownloadWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
