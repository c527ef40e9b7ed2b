"""A growing conversation costs the SSD its new tokens, not its length (issue 31).

One conversation grows by 40 tokens a turn (20 of user message, 20 of reply) for 10 turns; each
turn offers its prompt after prefill and prompt + reply when finished, as the engine does. The
bytes the SSD writer wrote, and the bytes the directory holds, stay within 1.5x the final
conversation's KV bytes plus a fixed overhead:

- `empty`: the directory's bytes before anything is written (diskcache's SQLite database: its
  schema and settings pages), which any store pays once;
- per block, the safetensors header (JSON: digest, parent, layout, CRC: ~470 bytes) and its SQLite
  index row: ~2 % of a 32 KiB block here, inside the 1.5x.

The same body run on the whole-entry store (8416f76, before the block store; adapted: no tick,
the same kv_for rows, a diskcache storage counting the bytes handed to `set`) measured, after 10
turns: bytes written 4,452,590 = 5.41x the final KV (822,400 bytes), directory 4,480,768 = 5.45x,
and growing every turn (1.41x after 2 turns, 2.89x after 5; each turn rewrote its conversation).
This store: written 834,168 = 1.01x, directory 866,936 = 1.05x (1.01x without the empty 32 KiB
database), flat from turn 2 on. With each finished turn's tail on the SSD too (a turn ending inside a
block writes its last < 16 tokens, and the next turn's block deletes that row): written 918,728 =
1.12x, directory the same 866,936 (no tail is left once the conversation ends on a block boundary).
"""

from __future__ import annotations

from typing import Any

from test_cache_support import FlakyStorage, entry_bytes, kv_for, settle, store

TURNS, USER, REPLY, DIM = 10, 20, 20, 64  # dim 64: 32 KiB blocks of 16 tokens (2 layers, 2 heads)


class CountingStorage(FlakyStorage):
    def __init__(self, directory: str) -> None:
        super().__init__(directory)
        self.written = 0

    def set(self, key: str, value: bytes) -> None:
        super().set(key, value)
        self.written += len(value)


def _conversation(s: Any, storage: CountingStorage) -> list[tuple[int, int, int]]:
    """(tokens, bytes written, directory bytes) after each turn."""
    conv: list[int] = []
    out = []
    for turn in range(TURNS):
        prompt = conv + [1000 + turn * 100 + i for i in range(USER)]
        s.offer(prompt, kv_for(prompt, dim=DIM), "prompt")
        s.tick()  # decode steps
        s.tick()
        conv = prompt + [5000 + turn * 100 + i for i in range(REPLY)]
        s.offer(conv, kv_for(conv, dim=DIM), "finished")
        settle(s)
        out.append((len(conv), storage.written, s.stats()["ssd"]["bytes"]))
    return out


def test_ssd_bytes_grow_with_new_tokens_not_with_length(tmp_path):
    storage = CountingStorage(str(tmp_path / "ssd"))
    s = store(storage=storage)
    empty = s.stats()["ssd"]["bytes"]
    turns = _conversation(s, storage)
    final_tokens = TURNS * (USER + REPLY)
    final_kv = entry_bytes(final_tokens, dim=DIM)
    st = s.stats()["ssd"]
    assert st["bytes_written"] == storage.written  # the stat is what reached the disk
    # every block once, and each finished turn's tail (turns ending inside a block: the odd ones)
    assert st["writes"] == final_tokens // 16 + sum(1 for t in range(1, TURNS + 1) if t * (USER + REPLY) % 16)
    assert st["keys"] == final_tokens // 16  # each tail deleted once the next turn's block covered it
    assert storage.written <= 1.5 * final_kv
    assert st["bytes"] <= 1.5 * final_kv + empty
    # per turn: what a turn writes is its own new blocks (at most 40 tokens + a block of carry-over)
    for (n0, w0, _), (n1, w1, _) in zip(turns, turns[1:]):
        assert w1 - w0 <= 1.5 * entry_bytes(n1 - n0 + 16, dim=DIM)
    s.close()


def test_two_conversations_sharing_a_system_prompt_write_it_once(tmp_path):
    storage = CountingStorage(str(tmp_path / "ssd"))
    s = store(storage=storage)
    system = list(range(64))  # 4 blocks
    for conv in (system + list(range(1000, 1032)), system + list(range(2000, 2032))):
        s.offer(conv, kv_for(conv, dim=DIM), "finished")
    settle(s)
    assert s.stats()["ssd"]["writes"] == 4 + 2 + 2
    assert storage.written <= 1.1 * entry_bytes(64 + 32 + 32, dim=DIM)
    s.close()
