"""Which bytes of Python source need state from far back: the token classes of the real-text
evaluation (issue 32), computed once per file with the standard `tokenize` module.

A byte-level model predicts every byte, so the classes are per byte:

- an identifier that appeared before: every byte of a NAME (keywords excluded) whose name
  occurred earlier in the file; `name_gap` is the distance in bytes from the start of the
  latest earlier occurrence to the start of this one. `classify` calls it `identifier_far` when
  that gap exceeds the window W (no earlier occurrence starts within W bytes), else
  `identifier_near`;
- a closer: a closing bracket `)`, `]`, `}` (its `opener` is the byte of the matching opening
  bracket), or the byte where a dedenting line stops its indentation (the line's first
  non-blank byte; its `opener` is the start of the header line of the outermost block it
  closes, the line whose indentation the model has to reproduce). `classify` calls it
  `closer_before_replay` when the opener lies before the replay start, else `closer_in_replay`;
- everything else is `other`.

    ann = annotate(source_bytes)        # arrays over the file's bytes, or None (not Python)
    classify(ann, positions, replay_start=t - N, window=W)  -> one class name per position
"""

from __future__ import annotations

import io
import keyword
import tokenize
from dataclasses import dataclass, field

import numpy as np

CLASSES = ("identifier_far", "identifier_near", "closer_before_replay", "closer_in_replay",
           "other")
# The three the issue asks for, and the classes each is made of.
GROUPS = {"identifier_far": ("identifier_far",),
          "closer_before_replay": ("closer_before_replay",),
          "other": ("identifier_near", "closer_in_replay", "other")}
_CLOSERS = {")": "(", "]": "[", "}": "{"}
_OPENERS = ("(", "[", "{")
_LAYOUT = (tokenize.NL, tokenize.COMMENT, tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING,
           tokenize.ENDMARKER)
# From Python 3.12 tokenize splits f-strings and reports their braces as OP: they pair like any
# other bracket. Before 3.12 an f-string is one STRING and its braces are not closers.


@dataclass
class Annotation:
    """Per-byte arrays over one file (int64, length = len(source)).

    name_gap[i]  bytes from the start of the latest earlier occurrence of the name that byte i
                 belongs to, to the start of this occurrence; -1 for a first occurrence, -2
                 outside identifiers
    opener[i]    for a closer byte, the byte offset of its opener; -1 elsewhere
    closer_kind[i]  1 closing bracket, 2 dedent, 0 elsewhere
    levels[i]    for a dedent byte, the indentation widths (bytes) of every block open before
                 the line: 0 and each open block's, outermost first (the widths it may take)
    """

    name_gap: np.ndarray
    opener: np.ndarray
    closer_kind: np.ndarray
    levels: dict = field(default_factory=dict)


def _byte_offsets(source: bytes, encoding: str) -> tuple[list[int], list[str]]:
    """Start offset in bytes of every line (1-based row r at index r - 1) and the decoded lines,
    so that a tokenize (row, column-in-characters) position maps to a byte offset."""
    lines = io.BytesIO(source).readlines()      # split exactly as tokenize reads them
    starts, decoded, offset = [], [], 0
    for line in lines:
        starts.append(offset)
        decoded.append(line.decode(encoding, errors="replace"))
        offset += len(line)
    starts.append(offset)          # tokenize's ENDMARKER row
    decoded.append("")
    return starts, decoded


def annotate(source: bytes) -> Annotation | None:
    """The per-byte annotation of one Python file; None when `tokenize` rejects it (a
    fragment, a syntax it does not know)."""
    try:
        tokens = list(tokenize.tokenize(io.BytesIO(source).readline))
    except (tokenize.TokenError, SyntaxError, UnicodeDecodeError):
        return None
    encoding = tokens[0].string if tokens and tokens[0].type == tokenize.ENCODING else "utf-8"
    starts, lines = _byte_offsets(source, encoding)

    def offset(row: int, col: int) -> int:
        line = lines[row - 1] if row - 1 < len(lines) else ""
        return starts[row - 1] + len(line[:col].encode(encoding, errors="replace"))

    n = len(source)
    name_gap = np.full(n, -2, dtype=np.int64)
    opener = np.full(n, -1, dtype=np.int64)
    closer_kind = np.zeros(n, dtype=np.int64)
    last_seen: dict[str, int] = {}
    levels: dict[int, tuple[int, ...]] = {}
    brackets: list[tuple[str, int]] = []
    blocks: list[int] = []          # first-token offset of each open block's header line
    widths: list[int] = []          # ... and the indentation width of its body
    line_first: int | None = None   # first token of the logical line being read
    last_line_first = 0             # ... of the last complete logical line (a header at INDENT)
    for tok in tokens:
        begin = offset(*tok.start)
        kind = tok.type
        if kind == tokenize.INDENT:
            blocks.append(last_line_first)
            widths.append(len(tok.string.encode(encoding, errors="replace")))
        elif kind == tokenize.DEDENT:
            # DEDENTs sit at the dedented line's first token, innermost block first: the last
            # one written is the outermost block closed, whose indentation the line takes
            if blocks:
                if begin < n and begin not in levels:      # the first DEDENT of the line
                    levels[begin] = (0, *widths)
                header = blocks.pop()
                widths.pop()
                if begin < n:
                    opener[begin], closer_kind[begin] = header, 2
        elif kind == tokenize.NEWLINE:
            last_line_first = line_first if line_first is not None else begin
            line_first = None
        elif kind not in _LAYOUT:
            if line_first is None:
                line_first = begin
            if kind == tokenize.NAME and not keyword.iskeyword(tok.string):
                end = min(offset(*tok.end), n)
                previous = last_seen.get(tok.string)
                name_gap[begin:end] = -1 if previous is None else begin - previous
                last_seen[tok.string] = begin
            elif kind == tokenize.OP and tok.string in _OPENERS:
                brackets.append((tok.string, begin))
            elif kind == tokenize.OP and tok.string in _CLOSERS:
                if brackets and brackets[-1][0] == _CLOSERS[tok.string]:
                    opener[begin], closer_kind[begin] = brackets.pop()[1], 1
    return Annotation(name_gap, opener, closer_kind, levels)


def classify(ann: Annotation, positions: np.ndarray, replay_start: int | np.ndarray,
             window: int) -> np.ndarray:
    """The class (one of CLASSES) of each byte position, for a replay that starts at byte
    `replay_start` (a scalar, or one per position) of a model with window `window`.
    positions: int array [P] of offsets into the annotated file -> object array [P]."""
    positions = np.asarray(positions, dtype=np.int64)
    start = np.broadcast_to(np.asarray(replay_start, dtype=np.int64), positions.shape)
    gap = ann.name_gap[positions]
    opener = ann.opener[positions]
    out = np.full(positions.shape, "other", dtype=object)
    out[gap >= 0] = "identifier_near"
    out[gap > window] = "identifier_far"
    is_closer = opener >= 0
    out[is_closer] = "closer_in_replay"
    out[is_closer & (opener < start)] = "closer_before_replay"
    return out


def group_of(name: str) -> str:
    """The issue's three-way class of a CLASSES name."""
    for group, members in GROUPS.items():
        if name in members:
            return group
    raise ValueError(f"token class: {name!r} is not one of {CLASSES}")
