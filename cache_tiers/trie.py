"""A token trie: which stored entries share how long a prefix with a prompt.

Why our own and not mlx-lm's `PromptTrie`: its `search` reports only the deepest stored prefix
and the shortest stored extension, but the store must skip entries it cannot use (a rotated
`RotatingKVCache` serves only its exact length, so an exact match or an extension may be useless
while a shorter entry is not). This trie returns every stored prefix on the path and lets the
caller search the subtree with its own predicate. Walking token by token in Python costs about
0.1 us per token, which is negligible next to restoring even one layer of KV state.
"""

from __future__ import annotations

from typing import Callable, Generic, Sequence, TypeVar

V = TypeVar("V")


class _Node(Generic[V]):
    __slots__ = ("children", "value")

    def __init__(self) -> None:
        self.children: dict[int, _Node[V]] = {}
        self.value: V | None = None


class TokenTrie(Generic[V]):
    def __init__(self) -> None:
        self._root: _Node[V] = _Node()

    def add(self, tokens: Sequence[int], value: V) -> V | None:
        """Store `value` at `tokens`; returns the value it replaced, if any."""
        node = self._root
        for t in tokens:
            node = node.children.setdefault(t, _Node())
        prev, node.value = node.value, value
        return prev

    def remove(self, tokens: Sequence[int]) -> V | None:
        """Drop the value at `tokens` and prune branches left without values."""
        path = [self._root]
        for t in tokens:
            nxt = path[-1].children.get(t)
            if nxt is None:
                return None
            path.append(nxt)
        value, path[-1].value = path[-1].value, None
        for depth in range(len(tokens), 0, -1):
            node = path[depth]
            if node.value is not None or node.children:
                break
            del path[depth - 1].children[tokens[depth - 1]]
        return value

    def walk(self, tokens: Sequence[int]) -> tuple[list[tuple[int, V]], int, _Node[V]]:
        """Values stored at prefixes of `tokens` (shallow to deep), the depth the walk reached
        (the common prefix with anything stored), and the node there."""
        found: list[tuple[int, V]] = []
        node = self._root
        depth = 0
        for t in tokens:
            nxt = node.children.get(t)
            if nxt is None:
                break
            node, depth = nxt, depth + 1
            if node.value is not None:
                found.append((depth, node.value))
        return found, depth, node

    @staticmethod
    def find_below(node: _Node[V], accept: Callable[[V], bool]) -> V | None:
        """Any accepted value at `node` or beneath it (depth first: finds a leaf fast)."""
        stack = [node]
        while stack:
            cur = stack.pop()
            if cur.value is not None and accept(cur.value):
                return cur.value
            stack.extend(cur.children.values())
        return None

    def clear(self) -> None:
        self._root = _Node()
