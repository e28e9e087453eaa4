"""Models by Hub id, as vLLM and SGLang take them: `ORG/NAME` wherever a model is named (LLM, `kestrel serve`,
`generate`, the EAGLE-3 drafter, `quantize`, `convert`, the benchmark's tokenizer), resolved through huggingface_hub
and its cache.

This machine reaches no Hub, so each test writes an HF cache exactly as huggingface_hub lays one out
(tests/hub_cache.py: blobs, refs, snapshots of symlinks) from the default model's files, checks that
huggingface_hub's own readers see it, and runs offline (HF_HUB_OFFLINE=1: in a subprocess from the environment,
in this process by the library's flag, which it reads from the environment once at import)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import huggingface_hub
import openai
from huggingface_hub import constants as hf_constants
import pytest

from kestrel import LLM, SamplingParams
from kestrel.config import DEFAULT_DRAFTER_DIR, DEFAULT_MODEL_DIR, EngineConfig
from kestrel.errors import KestrelError
from kestrel.models.hub import parse_hub_id
from kestrel.models.names import resolve_model
from tests.hub_cache import add_snapshot
from tests.test_server_startup import free_port

REPO = "kestrel-test/kestrel-tiny"
DRAFTER = "kestrel-test/kestrel-tiny-eagle3"
PROMPT = "def fibonacci(n):"
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def _checkpoint_files(src: Path) -> dict[str, bytes]:
    # what a Hub repo holds: the checkpoint and its card
    return {p.name: p.read_bytes() for p in sorted(src.iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory) -> Path:
    """HF_HOME with the default model as REPO (main, and tag v1 at the same commit), a second commit of it on
    branch `short` (max_position_embeddings 64), and the default drafter as DRAFTER."""
    home = tmp_path_factory.mktemp("hf_home")
    files = _checkpoint_files(DEFAULT_MODEL_DIR)
    add_snapshot(home / "hub", REPO, files, refs=("main", "v1"))
    config = json.loads(files["config.json"])
    add_snapshot(home / "hub", REPO, {**files, "config.json": json.dumps({**config, "max_position_embeddings": 64})
                                      .encode()}, refs=("short",))
    add_snapshot(home / "hub", DRAFTER, _checkpoint_files(DEFAULT_DRAFTER_DIR))
    return home


@pytest.fixture
def offline(monkeypatch, hf_home):
    """This process offline, its cache hf_home's (passed as download_dir: huggingface_hub read HF_HOME at import)."""
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    return str(hf_home / "hub")


def _env(hf_home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    return {**env, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"}


def _snapshot(hf_home: Path, repo: str, ref: str = "main") -> Path:
    folder = hf_home / "hub" / ("models--" + repo.replace("/", "--"))
    return folder / "snapshots" / (folder / "refs" / ref).read_text()


def test_the_cache_these_tests_write_is_one_huggingface_hub_reads(hf_home):
    info = huggingface_hub.scan_cache_dir(hf_home / "hub")
    repos = {r.repo_id: r for r in info.repos}
    assert set(repos) == {REPO, DRAFTER} and not info.warnings
    assert {ref for rev in repos[REPO].revisions for ref in rev.refs} == {"main", "v1", "short"}
    found = huggingface_hub.try_to_load_from_cache(REPO, "model.safetensors", cache_dir=hf_home / "hub")
    assert Path(found).read_bytes() == (DEFAULT_MODEL_DIR / "model.safetensors").read_bytes()


@pytest.mark.parametrize("name, repo, filename", [
    ("HuggingFaceTB/SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct", None),
    ("yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", None),
    ("bartowski/SmolLM2-135M-Instruct-GGUF/SmolLM2-135M-Instruct-Q4_K_M.gguf", "bartowski/SmolLM2-135M-Instruct-GGUF",
     "SmolLM2-135M-Instruct-Q4_K_M.gguf"),
])
def test_hub_ids_are_read_as_a_repo_and_an_optional_gguf_file(name, repo, filename):
    hub_id = parse_hub_id(name)
    assert (hub_id.repo, hub_id.filename) == (repo, filename)


@pytest.mark.parametrize("name", ["/abs/path", "./rel/dir", "~/models/x", "smollm2", "gpt2", "a/b/c", "a--b/c",
                                  "org/na..me", "org/name/file.safetensors", ""])
def test_paths_and_other_names_are_not_hub_ids(name):
    assert parse_hub_id(name) is None


def test_llm_loads_a_hub_id_from_the_cache_and_generates_what_the_directory_does(offline, hf_home):
    want = LLM(model=str(DEFAULT_MODEL_DIR), device="cpu").generate([PROMPT], GREEDY)[0].outputs[0].token_ids
    llm = LLM(REPO, device="cpu", download_dir=offline)
    assert llm.config.model_path == _snapshot(hf_home, REPO)
    assert llm.config.model_name == REPO   # served under the id, as vLLM does
    assert llm.generate([PROMPT], GREEDY)[0].outputs[0].token_ids == want


@pytest.mark.parametrize("revision", ["short", "commit"])
def test_revision_picks_a_branch_or_a_commit(offline, hf_home, revision):
    snapshot = _snapshot(hf_home, REPO, "short")
    config = EngineConfig.from_kwargs(model=REPO, revision=snapshot.name if revision == "commit" else revision,
                                      download_dir=offline)
    assert config.model_path == snapshot
    assert json.loads((config.model_path / "config.json").read_text())["max_position_embeddings"] == 64
    assert EngineConfig.from_kwargs(model=REPO, revision="v1", download_dir=offline).model_path == \
        _snapshot(hf_home, REPO)


def test_a_revision_the_cache_lacks_offline_is_one_clear_error(offline):
    with pytest.raises(KestrelError, match=r"no snapshot of it at revision 'nope' while HF_HUB_OFFLINE=1"):
        EngineConfig.from_kwargs(model=REPO, revision="nope", download_dir=offline)


@pytest.mark.parametrize("form", ["sglang", "vllm"])
def test_an_eagle3_drafter_by_hub_id(offline, hf_home, form):
    spec = {"speculative_algorithm": "EAGLE3", "speculative_draft_model_path": DRAFTER} if form == "sglang" else \
        {"speculative_config": json.dumps({"method": "eagle3", "model": DRAFTER, "num_speculative_tokens": 3})}
    config = EngineConfig.from_kwargs(model=REPO, download_dir=offline, **spec)
    assert Path(config.speculative.model) == _snapshot(hf_home, DRAFTER)


@pytest.mark.slow
def test_generation_with_a_drafter_by_hub_id_is_the_targets_greedy_output(offline):
    want = LLM(REPO, device="cpu", download_dir=offline).generate([PROMPT], GREEDY)[0].outputs[0].token_ids
    llm = LLM(REPO, device="cpu", download_dir=offline, speculative_algorithm="EAGLE3",
              speculative_draft_model_path=DRAFTER)
    assert llm.generate([PROMPT], GREEDY)[0].outputs[0].token_ids == want
    assert llm.engine.spec.counters.num_draft_tokens > 0   # the drafter did draft


def test_a_published_drafter_with_pytorch_bin_weights_loads_by_hub_id(offline, hf_home):
    """The EAGLE authors publish their EAGLE-3 drafters as config.json + pytorch_model.bin (no safetensors)."""
    add_snapshot(hf_home / "hub", "kestrel-test/eagle3-bin", {
        "config.json": (DEFAULT_DRAFTER_DIR / "config.json").read_bytes(), "pytorch_model.bin": _pickled_drafter()})
    want = LLM(REPO, device="cpu", download_dir=offline).generate([PROMPT], GREEDY)[0].outputs[0].token_ids
    llm = LLM(REPO, device="cpu", download_dir=offline,
              speculative_config={"method": "eagle3", "model": "kestrel-test/eagle3-bin"})
    assert llm.generate([PROMPT], GREEDY)[0].outputs[0].token_ids == want


def test_a_tokenizer_by_hub_id(offline, hf_home):
    config = EngineConfig.from_kwargs(model=str(DEFAULT_MODEL_DIR), tokenizer=REPO, download_dir=offline)
    assert config.tokenizer_path == _snapshot(hf_home, REPO)


def test_a_local_directory_wins_over_the_hub_id_it_spells(offline, tmp_path, monkeypatch):
    local = tmp_path / REPO
    local.mkdir(parents=True)
    for name, data in _checkpoint_files(DEFAULT_MODEL_DIR).items():
        (local / name).write_bytes(data)
    monkeypatch.chdir(tmp_path)
    config = EngineConfig.from_kwargs(model=REPO, download_dir=offline)
    assert config.model_path == Path(REPO) and config.model_name == "kestrel-tiny"


def test_a_missing_path_that_is_no_hub_id_keeps_its_error(tmp_path):
    missing = tmp_path / "nonexistent"
    assert resolve_model(str(missing), fetch=True) == missing   # the caller's "does not exist" error names it


def test_a_gguf_repo_named_without_its_file_says_to_name_it(offline, hf_home):
    add_snapshot(hf_home / "hub", "kestrel-test/only-gguf", {"model.Q4_0.gguf": b"GGUF", "README.md": b"#"})
    with pytest.raises(KestrelError, match="no config.json .*ORG/NAME/FILE.gguf"):
        EngineConfig.from_kwargs(model="kestrel-test/only-gguf", download_dir=offline)


def test_a_snapshot_cached_without_weights_says_so(offline, hf_home):
    files = {k: v for k, v in _checkpoint_files(DEFAULT_MODEL_DIR).items() if not k.endswith(".safetensors")}
    add_snapshot(hf_home / "hub", "kestrel-test/no-weights", files)
    with pytest.raises(KestrelError, match=r"has no \*.safetensors weights"):
        EngineConfig.from_kwargs(model="kestrel-test/no-weights", download_dir=offline)
    # --load-format dummy needs config and tokenizer only
    config = EngineConfig.from_kwargs(model="kestrel-test/no-weights", download_dir=offline, load_format="dummy")
    assert (config.model_path / "config.json").is_file()


def test_bench_tokenizer_by_hub_id(offline, hf_home, monkeypatch):
    from kestrel.bench.tokenizer import load_tokenizer

    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", offline)
    tok = load_tokenizer(REPO)
    assert Path(tok.path) == _snapshot(hf_home, REPO) / "tokenizer.json"
    # the served id, when no local directory is there
    assert Path(load_tokenizer(None, ("/nowhere", REPO)).path) == _snapshot(hf_home, REPO) / "tokenizer.json"


def test_a_download_in_progress_is_told_in_log_lines(tmp_path, caplog):
    """Bytes landing in the repo's blobs/ are logged once a second with the total, rate and ETA (huggingface_hub's
    own bars are silenced: a bar redraws one line, which `kestrel launch` and log files do not see move)."""
    import logging
    import threading

    from kestrel.models.hub import _DownloadWatch

    (tmp_path / "blobs").mkdir()
    caplog.set_level(logging.INFO, logger="kestrel.startup")

    def write() -> None:
        with open(tmp_path / "blobs" / "abc.incomplete", "wb") as f:
            for _ in range(6):
                f.write(b"x" * 500_000)
                f.flush()
                time.sleep(0.2)

    from huggingface_hub.hf_api import RepoFile

    wanted = [RepoFile(path="model.safetensors", size=3_000_000, oid="abc", lfs={"size": 3_000_000, "oid": "abc",
                                                                                 "pointerSize": 130})]
    with _DownloadWatch(tmp_path, "acme/model", wanted):
        writer = threading.Thread(target=write)
        writer.start()
        writer.join()
    lines = [r.getMessage() for r in caplog.records if r.name == "kestrel.startup"]
    assert lines[0] == "phase: downloading acme/model (3.0 MB)"
    assert all(line.startswith("downloading acme/model ") for line in lines[1:])
    assert lines[-1].startswith("downloading acme/model 3.0 MB/3.0 MB, ")   # the last poll, when it is over


def _kestrel(args: list[str], hf_home: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kestrel.cli", *args], capture_output=True, text=True,
                          env=_env(hf_home), timeout=timeout)


@pytest.mark.parametrize("command", ["generate", "serve"])
@pytest.mark.slow
def test_an_unknown_id_offline_is_one_error_line_and_exit_2(hf_home, command):
    args = ["generate", "--model", "nobody/nothing", "--prompt", "x"] if command == "generate" else \
        ["serve", "nobody/nothing", "--port", "1"]
    proc = _kestrel([*args, "--device", "cpu"], hf_home)
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert proc.returncode == 2
    assert lines == [f"error: 'nobody/nothing' is not a local path, and the Hugging Face cache ({hf_home}/hub) "
                     "has no snapshot of it while HF_HUB_OFFLINE=1 (download it once online, or give a local "
                     "directory)"], lines


@pytest.mark.slow
def test_kestrel_generate_by_hub_id(hf_home):
    proc = _kestrel(["generate", "--model", REPO, "--prompt", PROMPT, "--max-tokens", "4", "--device", "cpu"],
                    hf_home)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(PROMPT)


@pytest.mark.slow
def test_kestrel_quantize_and_convert_take_hub_ids(hf_home, tmp_path):
    from tests.gguf_files import write_llama_gguf

    proc = _kestrel(["quantize", REPO, str(tmp_path / "fp8"), "--device", "cpu", "--format", "compressed-tensors"],
                    hf_home)
    assert proc.returncode == 0, proc.stderr
    assert json.loads((tmp_path / "fp8" / "config.json").read_text())["quantization_config"]
    write_llama_gguf(tmp_path / "tiny.gguf")
    add_snapshot(hf_home / "hub", "kestrel-test/tiny-gguf", {"tiny.gguf": (tmp_path / "tiny.gguf").read_bytes()})
    proc = _kestrel(["convert", "kestrel-test/tiny-gguf/tiny.gguf", str(tmp_path / "hf")], hf_home)
    assert proc.returncode == 0, proc.stderr
    assert any((tmp_path / "hf").glob("*.safetensors"))


@pytest.mark.slow
def test_kestrel_serve_by_hub_id_answers_the_official_client(hf_home):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kestrel.cli", "serve", REPO, "--device", "cpu", "--port",
                             str(port), "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path",
                             DRAFTER], env=_env(hf_home), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
        models = client.models.list().data
        assert [m.id for m in models] == [REPO]
        assert models[0].root == str(_snapshot(hf_home, REPO).resolve())
        reply = client.chat.completions.create(model=REPO, messages=[{"role": "user", "content": "def add(a, b):"}],
                                               max_tokens=8, temperature=0)
        assert reply.model == REPO and reply.usage.completion_tokens > 0
    finally:
        proc.terminate()
        proc.wait(timeout=60)


# The online road, against tests/fake_hub.py (huggingface.co's routes on loopback, HF_ENDPOINT): what is listed,
# chosen and downloaded, then the same id offline from the cache that download left.

def _online_env(home: Path, hub) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    return {**env, "HF_HOME": str(home), "HF_ENDPOINT": hub.url}


def _config_in_subprocess(env: dict[str, str], **kwargs) -> subprocess.CompletedProcess:
    code = ("import json, sys; from kestrel.config import EngineConfig; from kestrel.errors import KestrelError\n"
            "try:\n    c = EngineConfig.from_kwargs(**json.loads(sys.argv[1]))\n"
            "except KestrelError as e:\n    sys.exit(f'error: {e}')\n"
            "print(json.dumps([str(c.model_path), c.speculative and c.speculative.model]))")
    return subprocess.run([sys.executable, "-c", code, json.dumps(kwargs)], capture_output=True, text=True, env=env,
                          timeout=120)


@pytest.mark.slow
def test_online_a_hub_id_fetches_weights_config_and_tokenizer_only_then_loads_offline(tmp_path):
    from tests.fake_hub import FakeHub

    files = _checkpoint_files(DEFAULT_MODEL_DIR)
    extra = {"README.md": b"# card", "pytorch_model.bin": b"pickled twin", "original/consolidated.00.pth": b"meta",
             "training_args.bin": b"pickle"}
    drafter = {"config.json": (DEFAULT_DRAFTER_DIR / "config.json").read_bytes(),
               "pytorch_model.bin": _pickled_drafter(), "optimizer.bin": b"state"}
    repos = {REPO: {"main": {**files, **extra}}, "kestrel-test/eagle3-bin": {"main": drafter},
             "kestrel-test/gguf-only": {"main": {"a.Q4_0.gguf": b"GGUF", "b.Q8_0.gguf": b"GGUF"}}}
    with FakeHub(repos) as hub:
        env = _online_env(tmp_path, hub)
        proc = _config_in_subprocess(env, model=REPO, speculative_config={"method": "eagle3",
                                                                          "model": "kestrel-test/eagle3-bin"})
        assert proc.returncode == 0, proc.stderr
        model_dir, drafter_dir = map(Path, json.loads(proc.stdout))
        fetched = {path.rsplit("/resolve/", 1)[1].split("/", 1)[1] for method, path in hub.requests
                   if method == "GET" and "/resolve/" in path}
        # the model card, README, the .bin twin, original/ and training leftovers stay on the Hub
        assert fetched == (set(files) - {"MODEL_CARD.md"}) | {"config.json", "pytorch_model.bin"}
        assert {p.name for p in model_dir.iterdir()} == set(files) - {"MODEL_CARD.md"}
        assert {p.name for p in drafter_dir.iterdir()} == {"config.json", "pytorch_model.bin"}
        assert model_dir.parent.parent.name == "models--kestrel-test--kestrel-tiny"

        # a GGUF repo is refused before anything is downloaded, naming its files
        hub.requests.clear()
        proc = _config_in_subprocess(env, model="kestrel-test/gguf-only")
        assert proc.returncode != 0 and "name one of its files, e.g. kestrel-test/gguf-only/a.Q4_0.gguf" in \
            proc.stderr
        assert not [path for method, path in hub.requests if method == "GET" and "/resolve/" in path]

        # the Hub's answers for a missing repo and revision, as one line each (the CLI: exit 2)
        for args, message in ((["--model", "acme/nope"], "acme/nope is not a model on the Hugging Face Hub"),
                              (["--model", REPO, "--revision", "v9"], f"{REPO} has no revision 'v9'")):
            proc = subprocess.run([sys.executable, "-m", "kestrel.cli", "generate", *args, "--prompt", "x"],
                                  capture_output=True, text=True, env=env, timeout=120)
            lines = [line for line in proc.stderr.splitlines() if line.strip()]
            assert proc.returncode == 2 and len(lines) == 1 and message in lines[0], proc.stderr

    # the Hub gone: offline, the cache that download left answers (huggingface_hub checks it against the file list
    # it cached, with the patterns Kestrel chose online)
    offline_env = {**env, "HF_HUB_OFFLINE": "1"}
    proc = _config_in_subprocess(offline_env, model=REPO, speculative_config={"method": "eagle3",
                                                                              "model": "kestrel-test/eagle3-bin"})
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == [str(model_dir), str(drafter_dir)]


def _pickled_drafter() -> bytes:
    import io

    import torch
    from safetensors.torch import load_file

    buffer = io.BytesIO()
    torch.save(load_file(DEFAULT_DRAFTER_DIR / "model.safetensors"), buffer)
    return buffer.getvalue()
