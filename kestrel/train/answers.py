"""The target's answers on disk, written as they come and reused by the next run with the same data settings.

    <output>/work/answers/<key>.jsonl
        {"kestrel_answers": 1, "key": KEY, "settings": {...}}                      the header: what made them
        {"i": 17, "p": "9c1e...", "prompt": [ids], "answers": [[ids], ...]}        one line per answered prompt

KEY hashes the settings that decide an answer: the target's identity (config, tokenizer and generation files in
full, each weight file's size and three sampled MiB of it), its dtype and quantization, --max-new-tokens,
--gen-temperature, --samples-per-prompt and, where it changes the answers (a temperature above 0, or openings the
target samples itself), --seed. Other settings write another file (the old one stays, so going back resumes it).
Within a file a line counts for prompt i only while "p", the hash of prompt i's token ids, still matches: an edited
data file or chat template regenerates the prompts it changed. The prompt count (--self-distill N, a longer file)
may grow: the prompts already answered are kept.

Each line is written and flushed when its prompt is answered (a SIGKILL loses only the answers in flight) and
fsynced at least every FSYNC_EVERY_S (a power cut loses at most that much). Reading tolerates what a kill leaves: a
partial last line is cut off before appending, an unreadable line is skipped (its prompt is answered again).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger("kestrel.train")

FORMAT = 1
FSYNC_EVERY_S = 2.0
SAMPLE_BYTES = 1 << 20          # a weight file's fingerprint: its size and three MiB (start, middle, end)
FULL_HASH_SUFFIXES = (".json", ".jinja", ".model", ".txt")   # configs and tokenizers: small, hashed whole
WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt", ".pth")


@dataclass(frozen=True, slots=True)
class Answered:
    """One prompt's line: its token ids and the target's answers to it."""
    index: int
    prompt_hash: str
    prompt: tuple[int, ...]
    answers: tuple[tuple[int, ...], ...]


def prompt_hash(token_ids: list[int] | tuple[int, ...]) -> str:
    return hashlib.sha256(json.dumps(list(token_ids)).encode()).hexdigest()[:16]


def _sampled_digest(path: Path) -> str:
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with path.open("rb") as f:
        for offset in sorted({0, max(0, size // 2 - SAMPLE_BYTES // 2), max(0, size - SAMPLE_BYTES)}):
            f.seek(offset)
            h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()[:16]


def target_identity(model_path: Path) -> dict[str, str]:
    """{file name: digest} for the files that decide what the target answers (not its path: a moved or copied
    checkpoint keeps its answers)."""
    files = [model_path] if model_path.is_file() else sorted(p for p in model_path.iterdir() if p.is_file())
    out = {}
    for p in files:
        if p.suffix in FULL_HASH_SUFFIXES and p.stat().st_size < 64 << 20:
            out[p.name] = hashlib.sha256(p.read_bytes()).hexdigest()[:16]
        elif p.suffix in WEIGHT_SUFFIXES:
            out[p.name] = _sampled_digest(p)
    return out


def settings_key(settings: dict) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


class AnswerStore:
    def __init__(self, directory: Path, settings: dict) -> None:
        self.settings = settings
        self.key = settings_key(settings)
        self.path = directory / f"{self.key}.jsonl"
        self._file = None
        self._synced_at = 0.0
        self.written = 0   # lines appended by this run

    def load(self) -> dict[int, Answered]:
        """The lines on disk, by prompt index (the last line of an index wins); {} when there are none."""
        if not self.path.is_file():
            return {}
        found: dict[int, Answered] = {}
        bad = 0
        lines = self.path.read_bytes().split(b"\n")
        if lines and lines[-1]:   # no newline at the end: a line cut by a kill, removed by _open
            logger.warning("%s: ignoring a partial last line (the run writing it was stopped)", self.path)
        for n, line in enumerate(lines[:-1]):
            try:
                row = json.loads(line)
                if n == 0:
                    if row.get("key") != self.key:
                        raise ValueError("header")
                    continue
                found[int(row["i"])] = Answered(int(row["i"]), str(row["p"]), tuple(int(t) for t in row["prompt"]),
                                                tuple(tuple(int(t) for t in a) for a in row["answers"]))
            except (ValueError, KeyError, TypeError, AttributeError):
                if n == 0:   # not our header: never trust the rest
                    logger.warning("%s does not start with this run's settings; answering again", self.path)
                    self.path.replace(self.path.with_suffix(".unreadable"))
                    return {}
                bad += 1
        if bad:
            logger.warning("%s: skipped %d unreadable line(s); those prompts are answered again", self.path, bad)
        return found

    def append(self, answered: Answered) -> None:
        if self._file is None:
            self._open()
        self._file.write(json.dumps({"i": answered.index, "p": answered.prompt_hash, "prompt": list(answered.prompt),
                                     "answers": [list(a) for a in answered.answers]}) + "\n")
        self._file.flush()   # in the kernel now: a killed process loses nothing written
        self.written += 1
        if time.monotonic() - self._synced_at >= FSYNC_EVERY_S:
            self._sync()

    def close(self) -> None:
        if self._file is not None:
            self._sync()
            self._file.close()
            self._file = None

    def _open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.is_file():
            data = self.path.read_bytes()
            keep = data.rfind(b"\n") + 1   # cut a partial last line, so the next line starts clean
            if keep < len(data):
                with self.path.open("r+b") as f:
                    f.truncate(keep)
            if keep == 0:
                self.path.unlink()
        fresh = not self.path.is_file()
        self._file = self.path.open("a")
        if fresh:
            self._file.write(json.dumps({"kestrel_answers": FORMAT, "key": self.key,
                                         "settings": self.settings}) + "\n")
        self._sync()

    def _sync(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())
        self._synced_at = time.monotonic()
