"""Models by Hugging Face id (modelio/hub.py, `pomona models pull`): huggingface_hub's real download and
cache code against a loopback hub (tests/hub_server.py) serving a tiny model made here.

Each case runs in a fresh Python process: huggingface_hub reads HF_ENDPOINT, HF_HOME and HF_HUB_OFFLINE
once, at import, exactly as a replica or the CLI does.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest

from e2e_helpers import ROOT, free_port
from hub_server import Hub, serve_hub

RESOLVE = ("import logging, sys; from modelio.models import resolve_model; from modelio.hub import HubModelError\n"
           "logging.basicConfig(level=logging.INFO)  # as in a replica, whose log shows the progress\n"
           "try:\n    print(resolve_model(sys.argv[1]))\n"
           "except HubModelError as exc:\n    print('ERROR', exc); sys.exit(3)\n")


@pytest.fixture(scope="module")
def hub(tiny_model_dir: Path) -> Iterator[Hub]:
    hub = Hub()
    hub.add_dir("test-org/tiny", tiny_model_dir)
    hub.add_dir("test-org/gated", tiny_model_dir, gated=True)
    hub.add("test-org/gguf-only", {"README.md": b"# q4", "tiny-Q4_K_M.gguf": b"GGUF" + bytes(64)})
    hub.add("test-org/torch-only", {"config.json": b"{}", "pytorch_model.bin": bytes(64), "tokenizer.json": b"{}"})
    yield from serve_hub(hub)


def _env(hub_url: str, home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_ENDPOINT=hub_url, HF_HOME=str(home / "hf"), POMONA_CACHE_DIR=str(home / "pomona"),
               HF_HUB_DISABLE_TELEMETRY="1", PYTHONPATH=str(ROOT), **extra)
    return env


def _run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)


def _resolve(name: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return _run(["-c", RESOLVE, name], env)


def _digests(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in directory.iterdir() if p.is_file()}


def _downloads(hub: Hub, repo: str) -> list[str]:
    return [r for r in hub.requests if r.startswith(f"GET /{repo}/resolve/")]


def test_first_use_downloads_then_the_cache_serves_even_offline(hub: Hub, tmp_path: Path,
                                                                tiny_model_dir: Path) -> None:
    env = _env(hub.url, tmp_path)
    first = _resolve("test-org/tiny", env)
    assert first.returncode == 0, first.stderr
    path = Path(first.stdout.strip())
    assert path.is_relative_to(tmp_path / "hf" / "hub") and "models--test-org--tiny" in str(path)
    assert _digests(path) == _digests(tiny_model_dir)  # every mlx-lm file, byte for byte
    assert "downloading test-org/tiny" in first.stderr and "(100%)" in first.stderr  # progress in the log
    fetched = len(_downloads(hub, "test-org/tiny"))
    assert fetched == len(_digests(tiny_model_dir))

    again = _resolve("test-org/tiny", env)
    offline = _resolve("test-org/tiny", {**env, "HF_HUB_OFFLINE": "1", "HF_ENDPOINT": f"http://127.0.0.1:{free_port()}"})
    assert Path(again.stdout.strip()) == path == Path(offline.stdout.strip()), offline.stderr
    assert len(_downloads(hub, "test-org/tiny")) == fetched  # both from the cache, nothing fetched again


def test_offline_and_not_cached_says_what_to_do(hub: Hub, tmp_path: Path) -> None:
    before = len(hub.requests)
    out = _resolve("test-org/tiny", _env(hub.url, tmp_path, HF_HUB_OFFLINE="1"))
    assert out.returncode == 3, out.stderr
    assert "HF_HUB_OFFLINE" in out.stdout and "pomona models pull test-org/tiny" in out.stdout
    assert len(hub.requests) == before  # offline means no request at all


def test_pull_shows_a_progress_bar_and_pins_revisions(hub: Hub, tmp_path: Path, tiny_model_dir: Path) -> None:
    env = _env(hub.url, tmp_path)
    sha = hub.repos["test-org/tiny"].sha
    out = _run(["-m", "deployments.cli", "models", "pull", "test-org/tiny", "--revision", sha], env)
    assert out.returncode == 0, out.stderr
    assert Path(out.stdout.strip()).name == sha
    assert "test-org/tiny" in out.stderr and "100%" in out.stderr  # tqdm's bar, drawn on stderr
    pinned = _resolve(f"test-org/tiny@{sha}", {**env, "HF_HUB_OFFLINE": "1"})
    assert Path(pinned.stdout.strip()) == Path(out.stdout.strip()), pinned.stderr
    missing = _run(["-m", "deployments.cli", "models", "pull", "test-org/tiny@v9"], env)
    assert missing.returncode == 1 and "has no revision 'v9'" in missing.stderr


@pytest.mark.parametrize("name, extra, expect", [
    ("test-org/nope", {}, ["was not found on http://127.0.0.1", "HF_TOKEN"]),
    ("test-org/gated", {}, ["is gated", "accept its terms", "HF_TOKEN"]),
    ("test-org/gated", {"HF_TOKEN": "hf_wrong"}, ["is gated", "HF_TOKEN"]),
    ("test-org/gguf-only", {}, ["only GGUF files", "mlx_lm.convert", "mlx-community"]),
    ("test-org/torch-only", {}, ["PyTorch-only", "mlx_lm.convert"]),
    ("bad id!", {}, ["valid Hugging Face repo id", "'default'"]),
])
def test_refusals_say_what_to_do(hub: Hub, tmp_path: Path, name: str, extra: dict[str, str],
                                 expect: list[str]) -> None:
    out = _resolve(name, _env(hub.url, tmp_path, **extra))
    assert out.returncode == 3, out.stderr[-2000:]
    for text in expect:
        assert text in out.stdout, out.stdout
    assert not _downloads(hub, name) or name == "test-org/gated"  # refused before any weights moved
    assert not [r for r in hub.requests if r.startswith(f"GET /{name}/resolve/") and "safetensors" in r]


def test_gated_with_token_downloads(hub: Hub, tmp_path: Path, tiny_model_dir: Path) -> None:
    out = _resolve("test-org/gated", _env(hub.url, tmp_path, HF_TOKEN=hub.repos["test-org/gated"].token))
    assert out.returncode == 0, out.stdout + out.stderr[-2000:]
    assert _digests(Path(out.stdout.strip())) == _digests(tiny_model_dir)


def test_no_network_says_so(tmp_path: Path) -> None:
    out = _resolve("test-org/tiny", _env(f"http://127.0.0.1:{free_port()}", tmp_path))  # nothing listens
    assert out.returncode == 3, out.stderr[-2000:]
    assert "could not download 'test-org/tiny'" in out.stdout and "network" in out.stdout
    assert "pomona models pull test-org/tiny" in out.stdout


def test_tokenizer_only_leaves_the_weights(hub: Hub, tmp_path: Path) -> None:
    code = ("import sys; from modelio.models import resolve_model\n"
            "print(resolve_model(sys.argv[1], weights=False))")
    out = _run(["-c", code, "test-org/tiny"], _env(hub.url, tmp_path))
    assert out.returncode == 0, out.stderr[-2000:]
    names = {p.name for p in Path(out.stdout.strip()).iterdir()}
    assert "config.json" in names and "tokenizer.json" in names and "model.safetensors" not in names


def test_two_replicas_of_one_host_download_once(tiny_model_dir: Path, tmp_path: Path) -> None:
    hub = Hub(hold=threading.Event())  # the first download stops halfway until released
    hub.add_dir("test-org/tiny", tiny_model_dir)
    run = serve_hub(hub)
    next(run)
    try:
        env = _env(hub.url, tmp_path)
        code = "import sys; print('start', file=sys.stderr, flush=True)\n" + RESOLVE
        procs = [subprocess.Popen([sys.executable, "-c", code, "test-org/tiny"], env=env, cwd=ROOT, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
        for p in procs:
            assert p.stderr is not None and p.stderr.readline().strip() == "start"
        while not any("model.safetensors" in r for r in _downloads(hub, "test-org/tiny")):
            time.sleep(0.05)  # one process is downloading; the other is at the host's lock by now
        time.sleep(1.0)
        hub.hold.set()  # type: ignore[union-attr]
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        hub.hold.set()  # type: ignore[union-attr]
        with contextlib.suppress(StopIteration):
            next(run)
    assert [p.returncode for p in procs] == [0, 0], outs
    assert outs[0][0] == outs[1][0]  # one snapshot directory
    assert len([r for r in _downloads(hub, "test-org/tiny") if "model.safetensors" in r]) == 1
    assert len([r for r in hub.requests if r.startswith("GET /api/models/test-org/tiny")]) == 3  # one process asked
