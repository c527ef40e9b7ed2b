"""SSD-tier faults, graceful shutdown and SSD safety, through the real server (Ray Serve, HTTP, tiny models).

The app "/ssd" keeps its prefix cache in `<sandbox>/ssd`; tests damage that directory behind the
server's back (corrupt files, pickled rows, deletion), fill it (SQLite page limit: the same
"database or disk is full" error a full disk gives) or make it unwritable, and check the server
keeps answering with the same text, counting what went wrong. Apps are deployed one after another
on one cluster, so only one or two engines run at a time.
"""

from __future__ import annotations

import os
import pickle
import shutil
import sqlite3
import threading
from pathlib import Path

import diskcache
import httpx
import pytest

from e2e_helpers import tiny_args, wait_healthy
from reliability_helpers import admin, cache_stats, deploy, own_cluster, token_prompt, undeploy, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]
CACHE = {"enabled": True, "ram_bytes": 64 * 2**20, "min_restore_tokens": 16, "block_size": 16}


def ssd_args(model: Path, ssd_dir: Path | str, **kw) -> dict:
    return tiny_args(model, drain_s=10, engine={"cache": {**CACHE, "ssd_dir": str(ssd_dir)}}, **kw)


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("ssd-sandbox")


@pytest.fixture(scope="module")
def base(tiny_model_dir, sandbox):
    with own_cluster({"/ssd": ssd_args(tiny_model_dir, sandbox / "ssd")}, apple_silicon=2) as url:
        wait_healthy(f"{url}/ssd")
        yield url


def complete(app: str, prompt, max_tokens: int = 3) -> dict:
    r = httpx.post(f"{app}/v1/completions", timeout=60, json={"model": "tiny", "prompt": prompt,
                                                                "max_tokens": max_tokens, "temperature": 0,
                                                                "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()


def cached(out: dict) -> int:
    return out["usage"]["prompt_tokens_details"]["cached_tokens"]


def stored_then_from_ssd(app: str, prompt) -> tuple[dict, dict]:
    """Store `prompt`'s prefix on the SSD, drop the RAM copy: the next request must go to the disk."""
    first = complete(app, prompt)
    admin(app, "cache/flush", method="POST")
    admin(app, "cache/clear", method="POST", tier="ram")
    return first, cache_stats(app)["ssd"]


FAULTS = ("corrupt", "read_errors", "write_errors", "lost_files")


def faults_since(before: dict, after: dict) -> dict[str, int]:
    """How much each fault counter grew: every test names the one it expects, the rest stay 0."""
    return {name: after[name] - before[name] for name in FAULTS}


def only(**counts: int) -> dict[str, int]:
    return {name: counts.get(name, 0) for name in FAULTS}


def served_from_ssd_again(app: str, prompt, text: str) -> None:
    """The fault's row is gone and the recomputed entry was written: the disk serves the prompt again."""
    before = cache_stats(app)["ssd"]
    admin(app, "cache/flush", method="POST")
    admin(app, "cache/clear", method="POST", tier="ram")
    again = complete(app, prompt)
    after = cache_stats(app)["ssd"]
    assert cached(again) > 0 and again["choices"][0]["text"] == text
    assert after["hits"] == before["hits"] + 1 and faults_since(before, after) == only()


def _block_rows(db: sqlite3.Connection) -> list[tuple[str, bytes | None, str | None]]:
    return db.execute("SELECT key, value, filename FROM Cache WHERE key LIKE 'b/%'").fetchall()


def test_corrupted_blocks_are_counted_and_recomputed(base, sandbox):
    """Every stored block damaged (small blocks live in SQLite, large ones in files): the first one
    read is corrupt, counted once, deleted; the prompt is recomputed with the same output."""
    app, prompt = f"{base}/ssd", token_prompt(200, salt=21)
    first, before = stored_then_from_ssd(app, prompt)
    with sqlite3.connect(sandbox / "ssd" / "cache.db", timeout=10) as db:
        rows = _block_rows(db)
        assert rows, "no block was written"
        for key, value, filename in rows:
            if filename:
                path = sandbox / "ssd" / filename
                path.write_bytes(os.urandom(path.stat().st_size))
            else:
                db.execute("UPDATE Cache SET value = ? WHERE key = ?", (os.urandom(len(value)), key))
    again = complete(app, prompt)
    after = cache_stats(app)["ssd"]
    assert again["choices"][0]["text"] == first["choices"][0]["text"] and cached(again) == 0
    assert faults_since(before, after) == only(corrupt=1)
    served_from_ssd_again(app, prompt, first["choices"][0]["text"])


def test_a_block_stored_under_another_key_is_corrupt_removed_and_rewritten(base, sandbox):
    """Rows swapped (every block's row holds the first block's bytes): the first block reads fine,
    the second names another digest and is a corrupt row, not a disk error; the prefix before it
    is served, and the recomputed blocks are written again."""
    app, prompt = f"{base}/ssd", token_prompt(200, salt=24)
    admin(app, "cache/clear", method="POST", tier="ssd")  # only this prompt's blocks, in write order
    first, before = stored_then_from_ssd(app, prompt)
    with sqlite3.connect(sandbox / "ssd" / "cache.db", timeout=10) as db:
        rows = db.execute("SELECT key, value FROM Cache WHERE key LIKE 'b/%' AND filename IS NULL "
                          "ORDER BY rowid").fetchall()
        assert len(rows) > 2
        db.execute("UPDATE Cache SET value = ? WHERE key LIKE 'b/%' AND key != ?", (rows[0][1], rows[0][0]))
    again = complete(app, prompt)
    after = cache_stats(app)["ssd"]
    assert again["choices"][0]["text"] == first["choices"][0]["text"] and cached(again) == 16  # one block
    assert faults_since(before, after) == only(corrupt=1)  # not read_errors: the row is bad, not the disk
    served_from_ssd_again(app, prompt, first["choices"][0]["text"])


def test_pickled_rows_are_never_unpickled(base, sandbox):
    app, prompt = f"{base}/ssd", token_prompt(200, salt=22)
    first, before = stored_then_from_ssd(app, prompt)
    canary = sandbox / "unpickled"
    payload = pickle.dumps(_Canary(str(canary)))
    with sqlite3.connect(sandbox / "ssd" / "cache.db", timeout=10) as db:
        db.execute("UPDATE Cache SET mode = 4, value = ?, filename = NULL", (payload,))  # 4: MODE_PICKLE
    again = complete(app, prompt)
    assert again["choices"][0]["text"] == first["choices"][0]["text"] and cached(again) == 0
    assert not canary.exists(), "the SSD tier unpickled a row"
    assert faults_since(before, cache_stats(app)["ssd"]) == only(corrupt=1)  # the top marker, deleted


class _Canary:
    """Unpickling this creates a directory: proof that a pickle was executed."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return os.mkdir, (self.path,)


def test_nothing_is_written_outside_the_ssd_dir(base, sandbox):
    app = f"{base}/ssd"
    hostile = ["../../../../tmp/pomona-escape", "/etc/passwd", "..\\..\\x", "%2e%2e%2f" * 30, "\u0000 nul",
               "a" * 3000, "cache.db", "../ssd/../../escape"]
    for text in hostile:
        for route, body in [("completions", {"model": "tiny", "prompt": text * 3}),
                            ("chat/completions", {"model": "tiny", "user": text,
                                                  "messages": [{"role": "user", "content": text}]}),
                            ("completions", {"model": text, "prompt": text})]:
            r = httpx.post(f"{app}/v1/{route}", timeout=60, json={"max_tokens": 2, **body})
            assert r.status_code in (200, 400, 404), r.text  # served, or refused (too long, unknown model)
    admin(app, "cache/flush", method="POST")
    assert sorted(p.name for p in sandbox.iterdir() if p.name != "unpickled") == ["ssd"]
    assert not Path("/tmp/pomona-escape").exists()
    for path in (sandbox / "ssd").rglob("*"):  # diskcache's own names only: hex dirs, random .val files
        assert path.name.startswith("cache.db") or all(c in "0123456789abcdef." for c in path.name.replace("val", "")), path


def test_deleted_directory_keeps_serving(base, sandbox):
    app, prompt = f"{base}/ssd", token_prompt(200, salt=23)
    first, before = stored_then_from_ssd(app, prompt)
    shutil.rmtree(sandbox / "ssd")
    for salt in range(3):  # new prompts (writes) and the stored one (reads): all served
        complete(app, token_prompt(150, salt=30 + salt))
    assert complete(app, prompt)["choices"][0]["text"] == first["choices"][0]["text"]
    stats = admin(app, "cache/flush", method="POST")["data"][0]["cache"]["ssd"]
    print(f"deleted SSD dir: ssd counters {stats}")
    # Blocks over 32 KiB are files (gone: one lost file, then the load stops); this tiny model's
    # blocks are SQLite rows, still read through the open handle of the unlinked database.
    assert faults_since(before, stats) in (only(), only(lost_files=1))
    assert stats["writes"] >= before["writes"] + 3  # diskcache recreates the directory for new files
    assert httpx.get(f"{app}/health").status_code == 200
    served_from_ssd_again(app, prompt, first["choices"][0]["text"])


def test_full_disk_disables_writes_and_keeps_serving(base, tiny_model_dir, sandbox):
    full = sandbox.parent / f"{sandbox.name}-full"
    diskcache.Cache(str(full)).close()
    with sqlite3.connect(full / "cache.db") as db:
        pages = db.execute("PRAGMA page_count").fetchone()[0]
    diskcache.Cache(str(full), sqlite_max_page_count=pages + 1).close()  # kept in the db's settings
    deploy("/full", ssd_args(tiny_model_dir, full))
    try:
        app = f"{base}/full"
        wait_healthy(app)
        outs = [complete(app, token_prompt(300, salt=40 + i)) for i in range(3)]
        stats = admin(app, "cache/flush", method="POST")["data"][0]["cache"]["ssd"]
        assert stats["writes_enabled"] is False and faults_since({k: 0 for k in FAULTS}, stats) == only(
            write_errors=1), stats  # the first failed write turns writing off: no more attempts
        assert all(o["usage"]["completion_tokens"] == 3 for o in outs)
        assert cached(complete(app, token_prompt(300, salt=40))) > 0  # the RAM tier still serves
    finally:
        undeploy("/full")


def test_unwritable_directory_runs_ram_only(base, tiny_model_dir, sandbox):
    if os.geteuid() == 0:  # root ignores permission bits: use a directory no one can create
        if not Path("/proc/self").is_dir():
            pytest.skip("running as root without /proc (Linux's): no directory root cannot create")
        ssd_dir = "/proc/pomona-ssd/prefix"
    else:
        parent = sandbox.parent / f"{sandbox.name}-ro"
        parent.mkdir(mode=0o555)
        ssd_dir = str(parent / "prefix")
    deploy("/ro", ssd_args(tiny_model_dir, ssd_dir))
    try:
        app = f"{base}/ro"
        wait_healthy(app)
        prompt = token_prompt(200, salt=50)
        complete(app, prompt)
        assert cached(complete(app, prompt)) > 0
        ssd = cache_stats(app)["ssd"]
        assert ssd["enabled"] is False and ssd["error"], ssd
    finally:
        undeploy("/ro")


def test_graceful_shutdown_drains_and_flushes_and_fingerprints_stay_apart(base, tiny_model_dir, sandbox,
                                                                        tmp_path_factory):
    from tiny_model import build_tiny_model

    app, ssd_dir = f"{base}/ssd", sandbox / "ssd-restart"
    deploy("/ssd", ssd_args(tiny_model_dir, ssd_dir))
    wait_healthy(app)
    prompts = [token_prompt(300, salt=60 + i) for i in range(4)]
    firsts = [complete(app, p) for p in prompts]  # acknowledged: their entries are queued for the SSD
    lines: list[str] = []
    body = {"model": "tiny", "prompt": "drain me", "max_tokens": 400, "ignore_eos": True, "stream": True}

    def stream() -> None:
        with httpx.stream("POST", f"{app}/v1/completions", json=body, timeout=120) as resp:
            for line in resp.iter_lines():
                if line:
                    lines.append(line)
    reader = threading.Thread(target=stream)
    reader.start()
    wait_until_streaming(lines)
    undeploy("/ssd")  # graceful: Serve waits for the stream, then the engine drains and flushes
    reader.join(60)
    assert lines[-1] == "data: [DONE]" and '"finish_reason":"length"' in lines[-2], lines[-2:]

    other = build_tiny_model(tmp_path_factory.mktemp("other-model"), seed=7)
    deploy("/ssd", ssd_args(other, ssd_dir))  # another model on the same directory: never served
    wait_healthy(app)
    assert all(cached(complete(app, p)) == 0 for p in prompts)
    deploy("/ssd", ssd_args(tiny_model_dir, ssd_dir))  # replaces the app (graceful again)
    wait_healthy(app)
    agains = [complete(app, p) for p in prompts]
    assert all(cached(a) >= 288 for a in agains), [cached(a) for a in agains]
    assert [a["choices"][0]["text"] for a in agains] == [f["choices"][0]["text"] for f in firsts]
    assert cache_stats(app)["ssd"]["hits"] == len(prompts)


def wait_until_streaming(lines: list[str]) -> None:
    wait_for(lambda: len(lines) >= 2, 60)
