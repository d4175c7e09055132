"""Text corpora as token streams: documents -> deterministic train/validation split ->
BOS doc EOS BOS doc EOS ... packed into one int16 tensor per split (cached in memory)."""

from __future__ import annotations

import functools
import glob
import hashlib
import itertools
import os
import sysconfig
from typing import Any, Iterable, Optional

import torch

from .tokenizer import ByteTokenizer

_TOK = ByteTokenizer()
HF_BUILDERS = ("json", "parquet", "text", "csv")
_EXTENSIONS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".txt": "text",
               ".csv": "csv"}
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}


def in_validation(identity: str, fraction: float) -> bool:
    """Stable document-level split: blake2b(identity) as a number in [0, 1) < fraction."""
    digest = hashlib.blake2b(identity.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0 ** 64 < fraction


def pack(docs: list[bytes]) -> torch.Tensor:
    """BOS doc EOS BOS doc EOS ... as int16 (ids < 259 fit). Shape [sum(len(doc) + 2)]."""
    lengths = torch.tensor([len(d) for d in docs], dtype=torch.long)
    out = torch.empty(int(lengths.sum()) + 2 * len(docs), dtype=torch.int16)
    starts = torch.cumsum(lengths + 2, 0) - (lengths + 2)
    out[starts] = _TOK.bos
    out[starts + lengths + 1] = _TOK.eos
    body = b"".join(docs)
    if body:
        doc_index = torch.repeat_interleave(torch.arange(len(docs)), lengths)
        positions = torch.arange(len(body)) + 2 * doc_index + 1
        out[positions] = torch.frombuffer(bytearray(body), dtype=torch.uint8).to(torch.int16)
    return out


def split_streams(docs: Iterable[tuple[str, bytes]], fraction: float) -> dict[str, torch.Tensor]:
    """(identity, bytes) documents -> {'train': stream, 'validation': stream}, documents in the
    given order within each split."""
    parts: dict[str, list[bytes]] = {"train": [], "validation": []}
    for identity, data in docs:
        parts["validation" if in_validation(identity, fraction) else "train"].append(data)
    return {split: pack(d) for split, d in parts.items()}


# ---- stdlib -------------------------------------------------------------------------------
def stdlib_paths() -> list[tuple[str, str]]:
    """(relative posix path, absolute path) of every .py file under sysconfig's stdlib dir,
    sorted, skipping site-packages/dist-packages and test dirs (test, tests, idle_test)."""
    root = sysconfig.get_paths()["stdlib"]
    out = []
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in _SKIP_DIRS)
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(directory, name)
                out.append((os.path.relpath(path, root).replace(os.sep, "/"), path))
    return out


@functools.lru_cache(maxsize=4)
def stdlib_streams(fraction: float) -> dict[str, torch.Tensor]:
    """The stdlib corpus split by relative path; about 12M tokens on CPython 3.11, ~0.3 s."""
    def docs():
        for rel, path in stdlib_paths():
            with open(path, "rb") as fh:
                yield rel, fh.read()
    return split_streams(docs(), fraction)


# ---- Hugging Face datasets ----------------------------------------------------------------
def offline() -> bool:
    return any(os.environ.get(v, "").upper() in ("1", "ON", "YES", "TRUE")
               for v in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"))


def absolute(path: str) -> str:
    """A path relative to the original working directory (Hydra may have chdir'ed)."""
    try:
        # lazy: Hydra costs ~0.2 s to import; only a path read inside a Hydra app needs it
        from hydra.core.hydra_config import HydraConfig
        if HydraConfig.initialized():
            from hydra.utils import to_absolute_path   # lazy: as above, inside a Hydra app only
            return to_absolute_path(path)
    except ImportError:                          # pragma: no cover - hydra is a dependency
        pass
    return os.path.abspath(path)


def resolve_files(files, key: str) -> tuple[str, ...]:
    """data.files -> sorted absolute paths; globs expanded; every entry must match a file."""
    if files is None:
        return ()
    if isinstance(files, str):
        files = [files]
    if not isinstance(files, (list, tuple)):
        raise ValueError(f"{key} must be a list of file paths, got {files!r}")
    out: list[str] = []
    for i, f in enumerate(files):
        if not isinstance(f, str) or not f:
            raise ValueError(f"{key}[{i}] must be a file path, got {f!r}")
        path = absolute(os.path.expanduser(f))
        matches = sorted(glob.glob(path)) if glob.has_magic(path) else [path]
        matches = [m for m in matches if os.path.exists(m)]
        if not matches:
            raise ValueError(f"{key}[{i}]: no such file {path!r} (relative paths are resolved "
                             f"against the original working directory)")
        out.extend(matches)
    return tuple(out)


def hf_source(name: Optional[str], files: tuple[str, ...], key: str) -> str:
    """Check data.name against data.files and the network; returns what to pass to
    load_dataset (a builder, an absolute local path or a hub name)."""
    if name is None:
        if not files:
            raise ValueError(f"{key}.name or {key}.files is required for kind=hf")
        ext = os.path.splitext(files[0])[1].lower()
        if ext not in _EXTENSIONS:
            raise ValueError(f"{key}.name: cannot infer a builder from {files[0]!r}; set "
                             f"{key}.name to one of {', '.join(HF_BUILDERS)}")
        return _EXTENSIONS[ext]
    if not isinstance(name, str) or not name:
        raise ValueError(f"{key}.name must be a dataset name or a builder, got {name!r}")
    if name in HF_BUILDERS:
        if not files:
            raise ValueError(f"{key}.files is required with {key}.name={name}: list local files, "
                             f"e.g. {key}.files=[/path/to/data.{'jsonl' if name == 'json' else name}]")
        return name
    local = absolute(os.path.expanduser(name))
    if os.path.exists(local):
        return local
    if offline():
        raise ValueError(
            f"{key}.name={name!r} is a Hugging Face Hub dataset, but this machine is offline "
            f"(HF_DATASETS_OFFLINE/HF_HUB_OFFLINE is set): pass local files instead, e.g. "
            f"{key}.name=json {key}.files=[/path/to/data.jsonl] (or text/parquet/csv)")
    return name


def hub_options(c: dict, key: str) -> tuple[tuple[str, Any], ...]:
    """data.subset / .revision / .streaming / .max_documents, checked, as hashable
    load_dataset options (subset is load_dataset's `name`)."""
    out: list[tuple[str, Any]] = []
    for field_name, arg in (("subset", "name"), ("revision", "revision")):
        value = c.get(field_name)
        if value is not None:
            if not isinstance(value, str) or not value:
                raise ValueError(f"{key}.{field_name} must be null or a non-empty string, "
                                 f"got {value!r}")
            out.append((arg, value))
    streaming, limit = c.get("streaming", False), c.get("max_documents")
    if not isinstance(streaming, bool):
        raise ValueError(f"{key}.streaming must be true or false, got {streaming!r}")
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
        raise ValueError(f"{key}.max_documents must be null or an integer >= 1, got {limit!r}")
    if streaming and limit is None:
        raise ValueError(f"{key}.max_documents: required with {key}.streaming=true (a stream "
                         f"has no end to stop at); e.g. {key}.max_documents=100000")
    if streaming:
        out.append(("streaming", True))
    if limit is not None:
        out.append(("max_documents", limit))
    return tuple(out)


@functools.lru_cache(maxsize=4)
def hf_streams(source: str, files: tuple[str, ...], text_field: str, hf_split: str,
               fraction: float, key: str,
               hub: tuple[tuple[str, Any], ...] = ()) -> dict[str, torch.Tensor]:
    """load_dataset(...)[text_field], split by a stable hash of each document's text (so
    duplicates land in the same split). `hub`: see hub_options."""
    # lazy: datasets costs ~0.6 s to import, and only a Hugging Face corpus needs it
    import datasets

    options = dict(hub)
    limit = options.pop("max_documents", None)
    kwargs = {"data_files": list(files)} if files else {}
    try:
        ds = datasets.load_dataset(source, split=hf_split, **kwargs, **options)
    except Exception as e:                   # noqa: BLE001 - re-raised with the config keys
        raise ValueError(f"{key}.name/{key}.hf_split: load_dataset({source!r}, "
                         f"split={hf_split!r}, {options}) failed: {e}") from e
    columns = ds.column_names
    if columns is None:                      # a stream may not know its columns up front
        columns = list(next(iter(ds)).keys())
    if text_field not in columns:
        raise ValueError(f"{key}.text_field={text_field!r} is not a column; columns: "
                         f"{', '.join(columns)}")

    def texts():
        if options.get("streaming"):
            for row in itertools.islice(ds, limit):
                yield row[text_field]
        else:                                # a column read is much faster than row by row
            part = ds if limit is None else ds.select(range(min(limit, len(ds))))
            yield from part[text_field]

    def docs():
        for i, text in enumerate(texts()):
            if text is None:
                continue
            if not isinstance(text, str):
                raise ValueError(f"{key}.text_field={text_field!r}: row {i} holds "
                                 f"{type(text).__name__}, not a string")
            yield text, text.encode("utf-8", "replace")
    return split_streams(docs(), fraction)
