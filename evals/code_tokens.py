"""Which bytes of Python source need state from far back: the token classes of the real-text
evaluation, computed once per file with the standard `tokenize` module.

A byte-level model predicts every byte, so the classes are per byte:

- a name that appeared before: every byte of a NAME (keywords excluded) whose name occurred
  earlier in the file, in code, a comment or a string; `name_gap` is the distance in bytes
  from the start of the latest earlier occurrence to the start of this one. `classify` calls
  it `identifier_far` when that occurrence starts more than W bytes back and before the replay
  start (so that only the global read can bring it back), `identifier_far_in_replay` when it
  lies inside the replay, else `identifier_near`;
- a closer: a closing bracket `)`, `]`, `}` (its `opener` is the byte of the matching opening
  bracket), or the byte where a dedenting line stops its indentation (the line's first
  non-blank byte; its `opener` is the first token of the header line of the outermost block
  it closes, the line whose indentation the model has to reproduce). `classify` calls it
  `closer_before_replay` when the opener lies before the replay start, else
  `closer_in_replay`;
- `evidence_outside_row`: a name or closer whose evidence lies before the first byte the
  model is shown (its row), which neither the exact model nor the replay can use;
- everything else is `other`.

    ann = annotate(source_bytes)        # arrays over the file's bytes, or None (not Python)
    classify(ann, positions, replay_start=t - N, window=W, visible_from=row_start)
                                        # one class name per position
"""

from __future__ import annotations

import codecs
import io
import keyword
import re
import tokenize
from dataclasses import dataclass, field

import numpy as np

CLASSES = ("identifier_far", "identifier_far_in_replay", "identifier_near",
           "closer_before_replay", "closer_in_replay", "evidence_outside_row", "other")
# The three groups the real-text tables report, and the classes each is made of.
GROUPS = {"identifier_far": ("identifier_far",),
          "closer_before_replay": ("closer_before_replay",),
          "other": ("identifier_far_in_replay", "identifier_near", "closer_in_replay",
                    "evidence_outside_row", "other")}
_CLOSERS = {")": "(", "]": "[", "}": "{"}
_OPENERS = ("(", "[", "{")
_LAYOUT = (tokenize.NL, tokenize.COMMENT, tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING,
           tokenize.ENDMARKER)
_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# From Python 3.12 tokenize splits f-strings and reports their braces as OP: they pair like any
# other bracket. Before 3.12 an f-string is one STRING and its braces are not closers.


@dataclass
class Annotation:
    """Per-byte arrays over one file (int64, length = len(source)).

    name_gap[i]    bytes from the start of the latest earlier occurrence of the name that byte
                   i belongs to (in code, a comment or a string) to the start of this one; -1
                   for a first occurrence, -2 outside names (keywords are not names)
    name_start[i]  the first byte of the name occurrence holding byte i; -1 outside names
    opener[i]      for a closer byte, the byte offset of its opener; -1 elsewhere
    closer_kind[i] 1 closing bracket, 2 dedent, 0 elsewhere
    levels[i]      for a dedent byte, the indentation widths (bytes) of every block open before
                   the line: 0 and each open block's, outermost first (the widths it may take)
    """

    name_gap: np.ndarray
    name_start: np.ndarray
    opener: np.ndarray
    closer_kind: np.ndarray
    levels: dict = field(default_factory=dict)


def _offsets(source: bytes, encoding: str):
    """A function (row, column in characters) -> byte offset, for tokenize's positions. Lines
    are split as tokenize reads them; a UTF-8 BOM, which tokenize drops from line 1, shifts
    line 1 by its 3 bytes."""
    lines = io.BytesIO(source).readlines()
    starts, decoded, offset = [], [], 0
    codec = "utf-8" if encoding == "utf-8-sig" else encoding
    for row, line in enumerate(lines):
        skip = 3 if row == 0 and line.startswith(codecs.BOM_UTF8) else 0
        starts.append(offset + skip)
        decoded.append(line[skip:].decode(codec, errors="replace"))
        offset += len(line)
    starts.append(offset)          # tokenize's ENDMARKER row
    decoded.append("")

    def at(row: int, col: int) -> int:
        line = decoded[row - 1] if row - 1 < len(decoded) else ""
        return starts[row - 1] + len(line[:col].encode(codec, errors="replace"))
    return at


@dataclass
class _Scan:
    """The running state of one file's scan (see `annotate`)."""

    ann: Annotation
    codec: str
    last_seen: dict = field(default_factory=dict)     # name -> start of its latest occurrence
    brackets: list = field(default_factory=list)      # (opener, offset), innermost last
    blocks: list = field(default_factory=list)        # header offset of each open block
    widths: list = field(default_factory=list)        # ... and its body's indentation
    line_first: int | None = None                     # first token of the logical line
    last_line_first: int = 0                          # ... of the last complete one

    def layout(self, tok, begin: int) -> None:
        """INDENT, DEDENT and NEWLINE: the block stack and the dedent bytes."""
        ann, n = self.ann, len(self.ann.opener)
        if tok.type == tokenize.INDENT:
            self.blocks.append(self.last_line_first)
            self.widths.append(len(tok.string.encode(self.codec, errors="replace")))
        elif tok.type == tokenize.DEDENT and self.blocks:
            # DEDENTs sit at the dedented line's first token, innermost block first: the last
            # one written is the outermost block closed, whose indentation the line takes
            if begin < n and begin not in ann.levels:
                ann.levels[begin] = (0, *self.widths)
            header = self.blocks.pop()
            self.widths.pop()
            if begin < n:
                ann.opener[begin], ann.closer_kind[begin] = header, 2
        elif tok.type == tokenize.NEWLINE:
            self.last_line_first = self.line_first if self.line_first is not None else begin
            self.line_first = None

    def code(self, tok, begin: int, end: int) -> None:
        """A name, a bracket, or the words of a string or comment (occurrences only)."""
        ann = self.ann
        if tok.type == tokenize.NAME and not keyword.iskeyword(tok.string):
            previous = self.last_seen.get(tok.string)
            ann.name_gap[begin:end] = -1 if previous is None else begin - previous
            ann.name_start[begin:end] = begin
            self.last_seen[tok.string] = begin
        elif tok.type in (tokenize.STRING, tokenize.COMMENT):
            for match in _WORD.finditer(tok.string):
                at = begin + len(tok.string[:match.start()].encode(self.codec, errors="replace"))
                self.last_seen[match.group()] = at
        elif tok.type == tokenize.OP and tok.string in _OPENERS:
            self.brackets.append((tok.string, begin))
        elif tok.type == tokenize.OP and tok.string in _CLOSERS:
            if self.brackets and self.brackets[-1][0] == _CLOSERS[tok.string]:
                ann.opener[begin], ann.closer_kind[begin] = self.brackets.pop()[1], 1


def annotate(source: bytes) -> Annotation | None:
    """The per-byte annotation of one Python file; None when `tokenize` rejects it (a
    fragment, a syntax it does not know)."""
    try:
        tokens = list(tokenize.tokenize(io.BytesIO(source).readline))
    except (tokenize.TokenError, SyntaxError, UnicodeDecodeError):
        return None
    encoding = tokens[0].string if tokens and tokens[0].type == tokenize.ENCODING else "utf-8"
    offset = _offsets(source, encoding)
    n = len(source)
    ann = Annotation(np.full(n, -2, dtype=np.int64), np.full(n, -1, dtype=np.int64),
                     np.full(n, -1, dtype=np.int64), np.zeros(n, dtype=np.int64))
    scan = _Scan(ann, "utf-8" if encoding == "utf-8-sig" else encoding)
    for tok in tokens:
        begin = offset(*tok.start)
        if tok.type in (tokenize.INDENT, tokenize.DEDENT, tokenize.NEWLINE):
            scan.layout(tok, begin)
            continue
        if tok.type not in _LAYOUT and scan.line_first is None:
            scan.line_first = begin
        if tok.type not in _LAYOUT or tok.type == tokenize.COMMENT:
            scan.code(tok, begin, min(offset(*tok.end), n))
    return ann


def classify(ann: Annotation, positions: np.ndarray, replay_start: int | np.ndarray,
             window: int, visible_from: int | np.ndarray = 0) -> np.ndarray:
    """The class (one of CLASSES) of each byte position, for a replay that starts at byte
    `replay_start` of a model with window `window` that sees the file from byte
    `visible_from` on (its row's first byte); scalars or one per position.
    positions: int array [P] of offsets into the annotated file -> object array [P].

    identifier_far: a name whose latest earlier occurrence starts more than `window` bytes
    back and before the replay start (the replay must bring it back through the global
    read); identifier_far_in_replay: the same occurrence inside the replay; identifier_near:
    within the window; closer_before_replay / closer_in_replay: a closer whose opener lies
    before / after the replay start; evidence_outside_row: an earlier occurrence or opener
    the model never sees (before `visible_from`), which neither reading can use."""
    positions = np.asarray(positions, dtype=np.int64)
    start = np.broadcast_to(np.asarray(replay_start, dtype=np.int64), positions.shape)
    visible = np.broadcast_to(np.asarray(visible_from, dtype=np.int64), positions.shape)
    gap = ann.name_gap[positions]
    previous = ann.name_start[positions] - gap
    opener = ann.opener[positions]
    out = np.full(positions.shape, "other", dtype=object)
    named = gap >= 0
    out[named & (gap <= window)] = "identifier_near"
    far = named & (gap > window)
    out[far & (previous >= start)] = "identifier_far_in_replay"
    out[far & (previous < start)] = "identifier_far"
    out[named & (previous < visible)] = "evidence_outside_row"
    is_closer = opener >= 0
    out[is_closer] = "closer_in_replay"
    out[is_closer & (opener < start)] = "closer_before_replay"
    out[is_closer & (opener < visible)] = "evidence_outside_row"
    return out


def group_of(name: str) -> str:
    """The three-way group of a CLASSES name."""
    for group, members in GROUPS.items():
        if name in members:
            return group
    raise ValueError(f"token class: {name!r} is not one of {CLASSES}")
