"""Model configs as text: written in Triton's style, and edited in place keeping the rest of a file.

``format_fields`` / ``format_config`` write protobuf text format the way Triton's documentation
and our examples do: repeated fields as lists (``input [ { ... }, { ... } ]``, ``dims: [ 16 ]``),
maps as one block per entry (``parameters { key: "k" value { ... } }``), enums by name, fields in
field-number order, and an instance group's ``kind`` always (KIND_AUTO is the default value and
would otherwise vanish). Any text-format parser reads it back: ours (``text_format``) and Triton's.

``ConfigEditor`` changes chosen fields of an existing config text and leaves every other byte
as it was, comments included: it tokenizes the text, finds the fields' spans, and splices.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from google.protobuf import descriptor, message_factory, text_encoding
from google.protobuf.message import Message

INDENT = "  "
ALWAYS_WRITTEN = {("ModelInstanceGroup", "kind")}  # (message, field) written even at the default

# -- writing -----------------------------------------------------------------------------------------


def format_config(config: Message) -> str:
    return "".join(text + "\n" for _, text in format_fields(config))


def format_fields(config: Message) -> list[tuple[str, str]]:
    """(field name, its text) for each top-level field that is set, in field-number order."""
    return [(fd.name, "\n".join(_field_lines(fd, value, 0))) for fd, value in _fields(config)]


def _fields(message: Message) -> list[tuple[descriptor.FieldDescriptor, Any]]:
    present = dict(message.ListFields())
    for fd in message.DESCRIPTOR.fields:
        if fd not in present and (message.DESCRIPTOR.name, fd.name) in ALWAYS_WRITTEN:
            present[fd] = getattr(message, fd.name)
    return sorted(present.items(), key=lambda item: item[0].number)


def _is_map(fd: descriptor.FieldDescriptor) -> bool:
    return fd.message_type is not None and fd.message_type.GetOptions().map_entry


def _is_repeated(fd: descriptor.FieldDescriptor) -> bool:
    if hasattr(fd, "is_repeated"):  # protobuf >= 5.29 (``label`` is deprecated there)
        return bool(fd.is_repeated)
    return bool(fd.label == descriptor.FieldDescriptor.LABEL_REPEATED)


def _field_lines(fd: descriptor.FieldDescriptor, value: Any, depth: int) -> list[str]:
    pad = INDENT * depth
    if _is_map(fd):
        entry_class = message_factory.GetMessageClass(fd.message_type)
        lines = []
        for key in sorted(value):
            lines += _block(f"{pad}{fd.name}", entry_class(key=key, value=value[key]), depth)
        return lines
    if _is_repeated(fd):
        if fd.message_type is None:
            return [f"{pad}{fd.name}: [ {', '.join(_scalar(fd, v) for v in value)} ]"]
        lines = [f"{pad}{fd.name} ["]
        for index, item in enumerate(value):
            block = _block(f"{pad}{INDENT}", item, depth + 1)
            block[-1] += "," if index < len(value) - 1 else ""
            lines += block
        return [*lines, f"{pad}]"]
    if fd.message_type is not None:
        return _block(f"{pad}{fd.name}", value, depth)
    return [f"{pad}{fd.name}: {_scalar(fd, value)}"]


def _block(opening: str, message: Message, depth: int) -> list[str]:
    fields = _fields(message)
    opening = f"{opening} {{" if opening.strip() else f"{opening}{{"
    if not fields:
        return [f"{opening} }}"]
    lines = [opening]
    for fd, value in fields:
        lines += _field_lines(fd, value, depth + 1)
    return [*lines, f"{INDENT * depth}}}"]


def _scalar(fd: descriptor.FieldDescriptor, value: Any) -> str:
    if fd.type == descriptor.FieldDescriptor.TYPE_ENUM:
        enum_value = fd.enum_type.values_by_number.get(value)
        return enum_value.name if enum_value is not None else str(value)
    if fd.type == descriptor.FieldDescriptor.TYPE_STRING:
        return '"' + str(text_encoding.CEscape(value, as_utf8=True)) + '"'
    if fd.type == descriptor.FieldDescriptor.TYPE_BYTES:
        return '"' + str(text_encoding.CEscape(value, as_utf8=False)) + '"'
    if fd.type == descriptor.FieldDescriptor.TYPE_BOOL:
        return "true" if value else "false"
    if fd.type == descriptor.FieldDescriptor.TYPE_FLOAT:
        return f"{value:.7g}"
    return repr(value) if isinstance(value, float) else str(value)


# -- editing -----------------------------------------------------------------------------------------

_TOKEN = re.compile(
    r"""(?P<space>\s+)
    |(?P<comment>\#[^\n]*)
    |(?P<string>"(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*')
    |(?P<word>[-+]?0[xX][0-9a-fA-F]+|[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?[fF]?|[-+]?[A-Za-z_][\w.]*)
    |(?P<punct>[{}\[\]<>:,;/])""",
    re.VERBOSE,
)


class ConfigTextError(ValueError):
    """The text is not protobuf text format the editor understands."""


@dataclass
class Node:
    """A value in the text: a message body (``fields``), a list (``items``) or a scalar."""

    start: int
    end: int  # one past the value's last character
    fields: list[Field] | None = None  # a message: its fields
    items: list[Node] | None = None  # a list: its elements
    inner_end: int = 0  # a message: where its closing brace is (the text's end at top level)


@dataclass
class Field:
    name: str
    start: int  # the name's first character
    end: int  # one past the value (and its separator, if any)
    value: Node = field(repr=False)


@dataclass(frozen=True)
class _Token:
    kind: str
    text: str
    start: int
    end: int


def _tokenize(text: str) -> list[_Token]:
    tokens, position = [], 0
    while position < len(text):
        match = _TOKEN.match(text, position)
        if match is None:
            raise ConfigTextError(f"unexpected character {text[position]!r} at offset {position}")
        kind = match.lastgroup or ""
        if kind not in ("space", "comment"):
            tokens.append(_Token(kind, match.group(), match.start(), match.end()))
        position = match.end()
    return tokens


class _Parser:
    def __init__(self, text: str) -> None:
        self.text = text
        self.tokens = _tokenize(text)
        self.index = 0

    def peek(self) -> _Token | None:
        return self.tokens[self.index] if self.index < len(self.tokens) else None

    def take(self, expected: str | None = None) -> _Token:
        token = self.peek()
        if token is None or (expected is not None and token.text != expected):
            where = f"offset {token.start}" if token else "the end"
            raise ConfigTextError(f"expected {expected or 'more'} at {where}")
        self.index += 1
        return token

    def body(self, start: int, closer: str | None) -> Node:
        fields = []
        while (token := self.peek()) is not None and token.text != closer:
            name = self.take()
            if name.kind != "word":
                raise ConfigTextError(f"expected a field name at offset {name.start}, found {name.text!r}")
            if (colon := self.peek()) is not None and colon.text == ":":
                self.take()
            value = self.value()
            end = value.end
            if (separator := self.peek()) is not None and separator.text in (",", ";"):
                end = self.take().end
            fields.append(Field(name.text, name.start, end, value))
        if closer is None:
            return Node(start, len(self.text), fields=fields, inner_end=len(self.text))
        closing = self.take(closer)
        return Node(start, closing.end, fields=fields, inner_end=closing.start)

    def value(self) -> Node:
        token = self.take()
        if token.text in ("{", "<"):
            return self.body(token.start, "}" if token.text == "{" else ">")
        if token.text == "[":
            items = []
            while (next_token := self.peek()) is not None and next_token.text != "]":
                items.append(self.value())
                if (comma := self.peek()) is not None and comma.text == ",":
                    self.take()
            return Node(token.start, self.take("]").end, items=items)
        if token.kind == "string":
            end = token.end
            while (more := self.peek()) is not None and more.kind == "string":  # "a" "b" is one string
                end = self.take().end
            return Node(token.start, end)
        if token.kind == "word":
            return Node(token.start, token.end)
        raise ConfigTextError(f"unexpected {token.text!r} at offset {token.start}")


class ConfigEditor:
    """Edits of one config text; ``text()`` applies them. Spans come from one parse of the original."""

    def __init__(self, text: str) -> None:
        self.original = text
        self.top = _Parser(text).body(0, None)
        self._edits: list[tuple[int, int, int, str]] = []  # start, end, order, replacement

    def text(self) -> str:
        result = self.original
        for start, end, _, replacement in sorted(self._edits, reverse=True):
            result = result[:start] + replacement + result[end:]
        return result

    def fields(self, body: Node, name: str) -> list[Field]:
        return [f for f in body.fields or [] if f.name == name]

    def messages(self, body: Node, name: str) -> list[Node]:
        """The message values of field ``name``: each block, and each element of a list of blocks."""
        result = []
        for found in self.fields(body, name):
            values = found.value.items if found.value.items is not None else [found.value]
            result += [v for v in values if v.fields is not None]
        return result

    def set_scalar(self, body: Node, name: str, value: str) -> None:
        """``name: value`` in ``body``: the first occurrence's value replaced, others removed, or added."""
        self.set_value(body, name, value)

    def set_list(self, body: Node, name: str, values: list[str]) -> None:
        self.set_value(body, name, f"[ {', '.join(values)} ]")

    def set_value(self, body: Node, name: str, value: str) -> None:
        found = self.fields(body, name)
        if not found:
            self.insert(body, f"{name}: {value}")
            return
        self._splice(found[0].value.start, found[0].value.end, value)
        for extra in found[1:]:
            self.remove_field(extra)

    def remove(self, body: Node, name: str) -> None:
        for found in self.fields(body, name):
            self.remove_field(found)

    def remove_field(self, found: Field) -> None:
        start, end = found.start, found.end
        line_start = self.original.rfind("\n", 0, start) + 1
        line_end = self.original.find("\n", end)
        line_end = len(self.original) if line_end < 0 else line_end
        if not self.original[line_start:start].strip() and not self.original[end:line_end].strip():
            start, end = line_start, min(line_end + 1, len(self.original))  # the field's whole line
        else:
            while end < len(self.original) and self.original[end] in " \t":
                end += 1
        self._splice(start, end, "")

    def insert(self, body: Node, text: str) -> None:
        """Add a field (``text`` may span lines) at the end of ``body``, indented as its fields are."""
        at = body.inner_end
        line_start = self.original.rfind("\n", 0, at) + 1
        if body is self.top:
            separator = "" if not self.original or self.original.endswith("\n") else "\n"
            self._splice(at, at, separator + text + "\n")
        elif not self.original[line_start:at].strip():  # the closing brace starts its line
            closing_pad = self.original[line_start:at]
            pad = self._field_indent(body) or closing_pad + INDENT
            lines = text.split("\n")
            self._splice(line_start, line_start, "".join(pad + line + "\n" for line in lines))
        else:
            before = "" if self.original[at - 1] in " \t" else " "
            self._splice(at, at, before + " ".join(line.strip() for line in text.split("\n")) + " ")

    def _field_indent(self, body: Node) -> str:
        for found in body.fields or []:
            line_start = self.original.rfind("\n", 0, found.start) + 1
            if not self.original[line_start : found.start].strip():
                return self.original[line_start : found.start]
        return ""

    def _splice(self, start: int, end: int, replacement: str) -> None:
        for other_start, other_end, _, _ in self._edits:
            if start < other_end and other_start < end:
                raise ConfigTextError(f"overlapping edits at offsets {start}-{end}")
        self._edits.append((start, end, len(self._edits), replacement))
