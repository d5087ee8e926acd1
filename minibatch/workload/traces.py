"""Loaders for real request traces.

``load_trace(path)`` sniffs the format from the file's first line (not its
extension) and returns a ``Workload`` sorted by arrival, times rebased so the
first request arrives at 0 (except our own JSONL, which is read as written).

| format     | first line / fields                                                         |
|------------|-----------------------------------------------------------------------------|
| `azure`    | CSV `TIMESTAMP,ContextTokens,GeneratedTokens`; absolute datetimes such as    |
|            | `2023-11-16 18:17:03.9799600` (Azure LLM inference traces 2023/2024)        |
| `mooncake` | JSONL `{"timestamp": ms, "input_length", "output_length", "hash_ids": [...]}` |
|            | hash_ids name 512-token prompt blocks; equal ids at a position = equal content |
| `burstgpt` | CSV `Timestamp` (s), `Model`, `Request tokens`, `Response tokens`,           |
|            | `Total tokens`, `Log Type` [, `Session ID`, `Elapsed time`]                  |
| `jsonl`    | ours (`Workload.to_jsonl`): a header line, then one RequestSpec per line     |

Conventions: ``request_id`` is ``"{file stem}-{row}"`` (row = 0-based data row in
file order). A zero length cannot be served, so a zero prompt length becomes 1,
and so does a zero output length in Azure/Mooncake (counted in ``meta``). In
BurstGPT a zero response marks a failed request: those rows are skipped and
counted (``meta["skipped_failures"]``), or kept with ``keep_failures=True`` as
requests generating 1 token. BurstGPT's ``Model`` becomes the ``tenant``.

Malformed input raises ``TraceFormatError`` naming the file, line and field:
``trace.csv line 17: field 'ContextTokens': expected a non-negative integer, got 'abc'``.
"""
from __future__ import annotations

import csv
import datetime as _dt
import gzip
import io
import json
import math
import re
from pathlib import Path
from typing import Callable, Iterable

from .spec import FIELDS, RequestSpec, Workload

__all__ = ["TraceFormatError", "TRACE_FORMATS", "load_trace", "sniff_format"]

TRACE_FORMATS = ("azure", "mooncake", "burstgpt", "jsonl")


class TraceFormatError(ValueError):
    """A trace file that cannot be read; ``path``, ``line`` and ``field`` say where."""

    def __init__(self, path, line: int | None, message: str, field: str | None = None):
        self.path, self.line, self.field = str(path), line, field
        where = f"{path} line {line}" if line is not None else f"{path}"
        what = f"field '{field}': {message}" if field is not None else message
        super().__init__(f"{where}: {what}")


# --- opening and sniffing ---------------------------------------------------------

def _open_text(path) -> io.TextIOBase:
    """Open as text, transparently gunzipping; a UTF-8 BOM is dropped."""
    with open(path, "rb") as f:
        magic = f.read(2)
    if magic == b"\x1f\x8b":
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8-sig", newline="")
    return open(path, encoding="utf-8-sig", newline="")


def _first_line(path) -> tuple[int, str]:
    with _open_text(path) as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                return lineno, line.strip()
    raise TraceFormatError(path, 1, "empty file")


_CSV_SIGNATURES = {  # format: columns that must all be in the header (lower case)
    "azure": {"timestamp", "contexttokens", "generatedtokens"},
    "burstgpt": {"timestamp", "request tokens", "response tokens"},
}


def sniff_format(path) -> str:
    """The trace format of ``path``, judged by its first non-blank line."""
    lineno, line = _first_line(path)
    if line.startswith("{"):
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise TraceFormatError(path, lineno, f"invalid JSON ({e.msg}, column {e.colno})")
        if isinstance(obj, dict):
            if "minibatch_workload" in obj or {"arrival_time", "prompt_len"} <= obj.keys():
                return "jsonl"
            if {"timestamp", "input_length"} <= obj.keys():
                return "mooncake"
    else:
        header = {h.strip().lower() for h in next(csv.reader([line]))}
        for fmt, needed in _CSV_SIGNATURES.items():
            if needed <= header:
                return fmt
    raise TraceFormatError(path, lineno, "unknown trace format; known formats: "
                           + ", ".join(TRACE_FORMATS) + f" (first line: {line[:80]!r})")


# --- field parsers: each raises TraceFormatError with file, line and field ----------

def _int(path, line, field, text) -> int:
    """A non-negative integer from CSV text ("12", also "12.0") or a JSON number."""
    value = None
    if isinstance(text, str):
        s = text.strip()
        if s.isascii() and s.isdigit():
            value = int(s)
        else:
            try:
                f = float(s)
                value = int(f) if f.is_integer() else None
            except (ValueError, OverflowError):
                pass
    elif isinstance(text, int) and not isinstance(text, bool):
        value = text
    elif isinstance(text, float) and text.is_integer():
        value = int(text)
    if value is None or value < 0:
        raise TraceFormatError(path, line, f"expected a non-negative integer, got {text!r}", field)
    return value


def _number(path, line, field, text) -> float:
    try:
        if isinstance(text, bool):
            raise ValueError
        v = float(text.strip() if isinstance(text, str) else text)
    except (TypeError, ValueError):
        v = math.nan
    if not (math.isfinite(v) and v >= 0):
        raise TraceFormatError(path, line, f"expected a non-negative number, got {text!r}", field)
    return v


_DATETIME = re.compile(
    r"(\d{4})-(\d{1,2})-(\d{1,2})[ T](\d{1,2}):(\d{2}):(\d{2})(?:\.(\d{1,9}))?"
    r"\s*(Z|[+-]\d{2}:?\d{2})?")


def _datetime_ns(path, line, field, text: str) -> int:
    """``YYYY-MM-DD HH:MM:SS[.fffffffff][Z|+HH:MM]`` as integer nanoseconds since
    the epoch (integers keep all 7 fractional digits exact)."""
    m = _DATETIME.fullmatch(text.strip())
    try:
        if not m:
            raise ValueError
        y, mo, d, h, mi, s = (int(g) for g in m.groups()[:6])
        frac = (m.group(7) or "").ljust(9, "0")
        day = _dt.date(y, mo, d).toordinal()  # validates the date
        if h > 23 or mi > 59 or s > 60:
            raise ValueError
        secs = (day * 24 + h) * 3600 + mi * 60 + s
        tz = m.group(8)
        if tz and tz != "Z":
            sign = -1 if tz[0] == "-" else 1
            secs -= sign * (int(tz[1:3]) * 3600 + int(tz[-2:]) * 60)
        return secs * 1_000_000_000 + int(frac)
    except ValueError:
        raise TraceFormatError(path, line, "expected a date-time like "
                               f"'2023-11-16 18:17:03.9799600', got {text!r}", field) from None


# --- readers ------------------------------------------------------------------------

class _Rows:
    """Collects (time, prompt, output, extra) rows and counts fixes and skips."""

    def __init__(self):
        self.rows: list[tuple] = []
        self.meta: dict[str, int] = {}

    def count(self, key: str):
        self.meta[key] = self.meta.get(key, 0) + 1

    def add(self, t, prompt: int, output: int, **extra):
        if prompt == 0:
            prompt = 1
            self.count("zero_prompt_len_set_to_1")
        if output == 0:
            output = 1
            self.count("zero_output_len_set_to_1")
        self.rows.append((t, prompt, output, extra))


def _csv_rows(path, f, required: dict[str, str], optional: dict[str, str] = {}):
    """Yield (line number, {canonical name: text}) from a CSV with a header;
    column names match case-insensitively. ``required``/``optional`` map a
    canonical name to its lower-case form."""
    reader = csv.reader(f)
    header = None
    for header in reader:
        if any(c.strip() for c in header):
            break
    if not header or not any(c.strip() for c in header):
        raise TraceFormatError(path, 1, "empty file")
    hline = reader.line_num
    index = {c.strip().lower(): i for i, c in enumerate(header)}
    for name, low in required.items():
        if low not in index:
            raise TraceFormatError(path, hline, f"missing column (header has: "
                                   f"{', '.join(c.strip() for c in header)})", name)
    cols = {name: index[low] for name, low in {**required, **optional}.items() if low in index}
    for row in reader:
        if not any(c.strip() for c in row):
            continue
        rec = {}
        for name, i in cols.items():
            if i >= len(row):
                raise TraceFormatError(path, reader.line_num,
                                       f"missing value (row has {len(row)} fields)", name)
            rec[name] = row[i]
        yield reader.line_num, rec


def _read_azure(path, f, rows: _Rows, **_):
    req = {"TIMESTAMP": "timestamp", "ContextTokens": "contexttokens",
           "GeneratedTokens": "generatedtokens"}
    for line, r in _csv_rows(path, f, req):
        rows.add(_datetime_ns(path, line, "TIMESTAMP", r["TIMESTAMP"]),
                 _int(path, line, "ContextTokens", r["ContextTokens"]),
                 _int(path, line, "GeneratedTokens", r["GeneratedTokens"]))
    return 1e-9  # time unit: ns


def _read_burstgpt(path, f, rows: _Rows, keep_failures: bool = False, **_):
    req = {"Timestamp": "timestamp", "Request tokens": "request tokens",
           "Response tokens": "response tokens"}
    opt = {"Model": "model"}
    for line, r in _csv_rows(path, f, req, opt):
        t = _number(path, line, "Timestamp", r["Timestamp"])
        prompt = _int(path, line, "Request tokens", r["Request tokens"])
        output = _int(path, line, "Response tokens", r["Response tokens"])
        if output == 0:
            rows.count("failures")
            if not keep_failures:
                rows.count("skipped_failures")
                continue
            output = 1
        model = r.get("Model", "").strip() or None
        rows.add(t, prompt, output, tenant=model)
    return 1.0


def _json_lines(path, f):
    """Yield (line number, dict) for each non-blank line; a file with none is an error."""
    seen = False
    for line, text in enumerate(f, 1):
        if not text.strip():
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise TraceFormatError(path, line, f"invalid JSON ({e.msg}, column {e.colno})") from None
        if not isinstance(obj, dict):
            raise TraceFormatError(path, line, f"expected a JSON object, got {type(obj).__name__}")
        seen = True
        yield line, obj
    if not seen:
        raise TraceFormatError(path, 1, "empty file")


def _get(path, line, obj: dict, field: str):
    if field not in obj:
        raise TraceFormatError(path, line, "missing", field)
    return obj[field]


def _read_mooncake(path, f, rows: _Rows, **_):
    for line, obj in _json_lines(path, f):
        t = _number(path, line, "timestamp", _get(path, line, obj, "timestamp"))
        prompt = _int(path, line, "input_length", _get(path, line, obj, "input_length"))
        output = _int(path, line, "output_length", _get(path, line, obj, "output_length"))
        hash_ids = obj.get("hash_ids")
        if hash_ids is not None:
            if not isinstance(hash_ids, list):
                raise TraceFormatError(path, line, f"expected a list of integers, got {hash_ids!r}",
                                       "hash_ids")
            hash_ids = [_int(path, line, "hash_ids", h) for h in hash_ids] or None
        rows.add(t, prompt, output, hash_ids=hash_ids)
    return 1e-3  # ms


def _read_jsonl(path, f, rows: _Rows, **_):
    """Our own format: read as written (no rebasing, no renaming)."""
    name, meta, reqs = None, {}, []
    for line, obj in _json_lines(path, f):
        if "minibatch_workload" in obj:
            name, meta = obj.get("name"), obj.get("meta") or {}
            continue
        for k in obj:
            if k not in FIELDS:
                raise TraceFormatError(path, line, "unknown field", k)
        for k in ("arrival_time", "prompt_len", "max_tokens"):
            _get(path, line, obj, k)
        _number(path, line, "arrival_time", obj["arrival_time"])
        for k in ("prompt_len", "max_tokens", "prefix_len"):
            if k in obj:
                _int(path, line, k, obj[k])
        try:
            reqs.append(RequestSpec(**obj))
        except (TypeError, ValueError) as e:
            raise TraceFormatError(path, line, str(e)) from None
    return Workload(reqs, name=name or _stem(path), meta=meta)


def _stem(path) -> str:
    """File name without its extension(s): ``trace.csv.gz`` -> ``trace``."""
    n = Path(path).name
    n = n[:-3] if n.endswith(".gz") else n
    return Path(n).stem


_READERS: dict[str, Callable] = {"azure": _read_azure, "mooncake": _read_mooncake,
                                 "burstgpt": _read_burstgpt, "jsonl": _read_jsonl}


def load_trace(path, format: str | None = None, *, name: str | None = None,
               vocab_size: int = 32000, reserved_ids: Iterable[int] = (),
               materialize: bool = True, keep_failures: bool = False, seed: int = 0) -> Workload:
    """Load a request trace as a ``Workload``.

    format: one of ``TRACE_FORMATS``, or None to sniff it from the first line.
    name: the workload's name (default: the file's stem).
    vocab_size, reserved_ids, seed, materialize: Mooncake only. Each ``hash_ids``
        block becomes a deterministic block of 512 token ids in
        ``[0, vocab_size)`` minus ``reserved_ids``, so prefix reuse survives into
        token space. ``materialize=False`` keeps only ``hash_ids`` (for big traces;
        call ``Workload.materialize`` later, e.g. with a smaller vocabulary and
        ``overwrite=True``).
    keep_failures: BurstGPT only: keep zero-response rows (as 1-token outputs).
    """
    if format is None:
        format = sniff_format(path)
    elif format not in _READERS:
        raise ValueError(f"unknown trace format {format!r}; known formats: {', '.join(TRACE_FORMATS)}")
    with _open_text(path) as f:
        if format == "jsonl":
            wl = _read_jsonl(path, f, None)
            wl.name = name or wl.name
            return wl
        rows = _Rows()
        unit = _READERS[format](path, f, rows, keep_failures=keep_failures)
    stem = _stem(path)
    t0 = min((r[0] for r in rows.rows), default=0)
    reqs = [RequestSpec(arrival_time=(t - t0) * unit, prompt_len=p, max_tokens=o,
                        request_id=f"{stem}-{i}", **extra)
            for i, (t, p, o, extra) in enumerate(rows.rows)]
    meta = {"source": str(path), "format": format, **rows.meta}
    wl = Workload(reqs, name=name or stem, meta=meta)
    if format == "mooncake" and materialize:
        wl = wl.materialize(vocab_size, seed=seed, reserved_ids=reserved_ids)
    return wl


# -- the traces shipped with the course (datasets/traces/, with their licences) ------------------
SHIPPED_TRACES = {
    "azure_code": "AzureLLMInferenceTrace_code.csv",
    "azure_conv": "AzureLLMInferenceTrace_conv.csv",
    "mooncake": "mooncake_synthetic_trace.jsonl",
    "sharegpt_8k_stats": "sharegpt_8k_filtered_stats_llama2_tokenizer.csv",
}


def traces_dir() -> Path:
    """The checkout's ``datasets/traces`` (origin, licences and statistics in its ``SOURCES.md``)."""
    return Path(__file__).resolve().parents[2] / "datasets" / "traces"


def shipped_trace_path(name: str) -> Path:
    """The path of a shipped trace by short name (:data:`SHIPPED_TRACES`); fails loudly, never
    silently: a chapter that needs a trace must not skip its experiment."""
    if name not in SHIPPED_TRACES:
        raise ValueError(f"unknown shipped trace {name!r}; shipped: {sorted(SHIPPED_TRACES)}")
    path = traces_dir() / SHIPPED_TRACES[name]
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: the course's traces ship in datasets/traces/ of the "
                                "repository (a git checkout); see datasets/traces/SOURCES.md")
    return path


def load_shipped_trace(name: str, **kwargs) -> Workload:
    """``load_trace`` of a shipped trace: ``"azure_code"``, ``"azure_conv"``, ``"mooncake"``."""
    if name == "sharegpt_8k_stats":
        raise ValueError("sharegpt_8k_stats has lengths only (no arrival times); read it with "
                         "minibatch.workload.empirical.from_csv(shipped_trace_path(...), column)")
    return load_trace(shipped_trace_path(name), **kwargs)

