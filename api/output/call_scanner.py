"""Follows a tool call's JSON body as it is generated, for api/output/parser.py (no model)."""

from __future__ import annotations

import json


class CallScanner:
    """Follows a growing `{"name": ..., "arguments": ...}` text: where the first "arguments" value
    begins and ends, and the first "name" string. Tracks strings, escapes and nesting only; the
    final text is still checked with json.loads."""

    def __init__(self) -> None:
        self.body = ""
        self.name: str | None = None
        self.args_start: int | None = None
        self.args_end: int | None = None
        self.args_object = False  # the arguments value is an object: streamable
        self.end: int | None = None  # just after the wrapper object's closing brace
        self._pos = self._depth = 0
        self._in_str = self._esc = False
        self._expect = "wrapper"  # wrapper, key, colon, value, comma, done, off
        self._key: str | None = None
        self._tok: int | None = None  # start of the depth-1 key or value being read
        self._scalar = False

    def feed(self, text: str) -> None:
        self.body += text
        for i in range(self._pos, len(self.body)):
            if self._expect in ("done", "off"):
                break
            self._char(i, self.body[i])
        self._pos = len(self.body)

    def args_so_far(self, skip: int = 0) -> str:
        """The arguments value's text scanned so far, less its first `skip` characters."""
        if self.args_start is None:
            return ""
        return self.body[self.args_start + skip:self.args_end if self.args_end is not None else len(self.body)]

    def _char(self, i: int, ch: str) -> None:
        if self._in_str:
            if self._esc:
                self._esc = False
            elif ch == "\\":
                self._esc = True
            elif ch == '"':
                self._in_str = False
                if self._depth == 1:
                    self._token_end(i + 1)
            return
        if self._expect == "wrapper":
            if ch == "{":
                self._depth, self._expect = 1, "key"
            elif not ch.isspace():
                self._expect = "off"  # not an object: parsed whole at the end
            return
        if self._scalar and (ch in ",}" or ch.isspace()):
            self._token_end(i)
        if ch == '"':
            self._in_str = True
            if self._depth == 1:
                self._token_start(i, ch)
        elif ch in "{[":
            if self._depth == 1:
                self._token_start(i, ch)
            self._depth += 1
        elif ch in "}]":
            self._depth -= 1
            if self._depth == 1:
                self._token_end(i + 1)
            elif self._depth == 0:
                self._expect, self.end = "done", i + 1
        elif self._depth == 1:
            if ch == ":" and self._expect == "colon":
                self._expect = "value"
            elif ch == "," and self._expect == "comma":
                self._expect = "key"
            elif not ch.isspace() and self._expect == "value" and not self._scalar:
                self._token_start(i, ch)

    def _token_start(self, i: int, ch: str) -> None:
        if self._expect not in ("key", "value") or (self._expect == "key" and ch != '"'):
            self._expect = "off"
            return
        self._tok, self._scalar = i, self._expect == "value" and ch not in '"{['
        if self._expect == "value" and self._key == "arguments" and self.args_start is None:
            self.args_start, self.args_object = i, ch == "{"

    def _token_end(self, end: int) -> None:
        assert self._tok is not None
        text, self._scalar = self.body[self._tok:end], False
        if self._expect == "key":
            try:
                self._key, self._expect = json.loads(text), "colon"
            except json.JSONDecodeError:  # a bad escape: leave it to the final parse
                self._expect = "off"
            return
        if self._key == "name" and self.name is None and text.startswith('"'):
            try:
                self.name = json.loads(text)
            except json.JSONDecodeError:
                self._expect = "off"
                return
        elif self._key == "arguments" and self.args_start == self._tok:
            self.args_end = end
        self._key, self._expect = None, "comma"
