"""First contact with the command line: `--help` explains every flag once, and a bad model path ends in one clear
line and a non-zero exit before anything listens."""
from __future__ import annotations

import argparse
import re
import shutil
import socket
import subprocess
import sys

import pytest

from kestrel.cli import build_parser

# `kestrel bench` and `kestrel launch` (kestrel/bench/) format their own help
OWN_SUBCOMMANDS = ("generate", "serve", "convert")


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser, _ = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {name: sub.choices[name] for name in OWN_SUBCOMMANDS if name in sub.choices}


def _options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if not isinstance(a, argparse._HelpAction)]


@pytest.mark.parametrize("name", OWN_SUBCOMMANDS)
def test_every_flag_has_help_text(name):
    parser = _subparsers()[name]
    missing = [a.option_strings or a.dest for a in _options(parser) if not (a.help or "").strip()]
    assert missing == [], f"kestrel {name}: flags without help: {missing}"


@pytest.mark.parametrize("name", OWN_SUBCOMMANDS)
def test_each_flags_default_is_shown_at_most_once(name):
    parser = _subparsers()[name]
    formatter = parser._get_formatter()
    for action in _options(parser):
        text = formatter._expand_help(action) if action.help else ""
        assert len(re.findall(r"\(default", text)) <= 1, f"kestrel {name} {action.option_strings}: {text!r}"
    help_text = re.sub(r"\s+", " ", parser.format_help())
    assert not re.search(r"\(default: [^)]*\) \(default:", help_text)


def test_a_flag_with_a_literal_default_shows_it():
    text = re.sub(r"\s+", " ", _subparsers()["serve"].format_help())
    assert "--port PORT port to listen on (default: 8000)" in text
    assert "--block-size BLOCK_SIZE tokens per KV cache block (a power of two) (default: 16)" in text
    assert "(default: None)" not in text and "(default: False)" not in text


@pytest.mark.slow
def test_serve_with_a_missing_model_prints_one_error_line_and_exits_before_listening(tmp_path):
    missing = tmp_path / "nonexistent"
    proc = subprocess.run([sys.executable, "-m", "kestrel.cli", "serve", str(missing), "--device", "cpu",
                           "--port", "1"], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    lines = [line for line in out.splitlines() if line.strip()]
    assert lines == [f"error: model directory {missing} does not exist (Kestrel loads local HF checkpoints and "
                     ".gguf files)"], out
    assert "Traceback" not in out and "running on" not in out.lower()


@pytest.mark.slow
def test_serve_with_a_directory_that_is_not_a_checkpoint_says_so_in_one_line(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    proc = subprocess.run([sys.executable, "-m", "kestrel.cli", "serve", str(tmp_path), "--device", "cpu"],
                          capture_output=True, text=True, timeout=60)
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert proc.returncode != 0 and len(lines) == 1
    assert lines[0].startswith("error: ") and "GPT2LMHeadModel" in lines[0] and "is not supported" in lines[0]


@pytest.mark.slow
def test_serve_with_a_max_model_len_beyond_the_model_fails_before_listening(checkpoint_factory):
    proc = subprocess.run([sys.executable, "-m", "kestrel.cli", "serve", str(checkpoint_factory("llama")),
                           "--device", "cpu", "--max-model-len", "100000"], capture_output=True, text=True,
                          timeout=60)
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert proc.returncode != 0 and len(lines) == 1 and "--max-model-len 100000" in lines[0], lines


@pytest.mark.slow
def test_an_error_found_by_the_engine_is_said_once_as_the_last_line_and_exits_non_zero(checkpoint_factory, tmp_path):
    """A checkpoint without weights passes the preflight (its config.json is fine); the engine finds the problem
    after the port opened, and the server never said it was serving."""
    source = checkpoint_factory("llama")
    for f in source.iterdir():
        if f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copy(f, tmp_path / f.name)
    with socket.socket() as sock:   # a free port
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.run([sys.executable, "-m", "kestrel.cli", "serve", str(tmp_path), "--device", "cpu",
                           "--port", str(port)], capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    lines = [line for line in out.splitlines() if line.strip()]
    assert proc.returncode == 1, out
    assert lines[-1].startswith("error: the engine did not start: "), out
    reason = lines[-1].removeprefix("error: the engine did not start: ")
    assert sum(reason in line for line in lines) == 1, out
    assert "Traceback" not in out and "Uvicorn running" not in out and "ready: serving" not in out
