"""Tests for minibatch.workload.traces: Azure, Mooncake, BurstGPT and our own JSONL."""
import gzip
import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from minibatch.workload import (SHIPPED_TRACES, TRACE_FORMATS, RequestSpec, TraceFormatError, Workload,
                                load_shipped_trace, load_trace, shipped_trace_path, sniff_format, synthetic)

SHIPPED = Path(__file__).resolve().parents[1] / "datasets" / "traces"

AZURE = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:17:04.0319600,3180,8
2023-11-16 18:17:03.9799600,4808,10
2023-11-16 18:17:05.0000001,110,27
"""


def write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_azure_parses_sorts_and_rebases(tmp_path):
    w = load_trace(write(tmp_path, "az.csv", AZURE))
    assert [r.prompt_len for r in w] == [4808, 3180, 110]      # sorted by time
    assert [r.max_tokens for r in w] == [10, 8, 27]
    assert w[0].arrival_time == 0.0
    assert w[1].arrival_time == pytest.approx(0.052, abs=1e-9)     # all 7 digits kept
    assert w[2].arrival_time == pytest.approx(1.0200401, abs=1e-9)
    assert w[0].request_id == "az-1" and w.name == "az"
    assert w.meta["format"] == "azure"


def test_azure_midnight_and_timezones(tmp_path):
    text = ("TIMESTAMP,ContextTokens,GeneratedTokens\n"
            "2023-12-31 23:59:59.5,1,1\n2024-01-01T00:00:00.25Z,2,2\n")
    w = load_trace(write(tmp_path, "az.csv", text))
    assert w[1].arrival_time == pytest.approx(0.75)


def test_sniffing_is_by_content_not_extension(tmp_path):
    assert sniff_format(write(tmp_path, "a.txt", AZURE)) == "azure"
    assert sniff_format(write(tmp_path, "m.csv", '{"timestamp": 0, "input_length": 5, '
                              '"output_length": 2, "hash_ids": [1]}\n')) == "mooncake"
    assert sniff_format(write(tmp_path, "b.jsonl", BURSTGPT)) == "burstgpt"
    p = tmp_path / "own.data"
    synthetic(3, 1.0).to_jsonl(p)
    assert sniff_format(p) == "jsonl"


def test_unknown_format_lists_known_ones(tmp_path):
    p = write(tmp_path, "x.csv", "a,b,c\n1,2,3\n")
    with pytest.raises(TraceFormatError) as e:
        load_trace(p)
    for fmt in TRACE_FORMATS:
        assert fmt in str(e.value)
    with pytest.raises(ValueError, match="known formats: azure"):
        load_trace(write(tmp_path, "y.csv", AZURE), format="excel")


def test_gzip_is_transparent(tmp_path):
    p = tmp_path / "az.csv.gz"
    with gzip.open(p, "wt") as f:
        f.write(AZURE)
    w = load_trace(p)
    assert len(w) == 3 and w.name == "az"


# --- malformed files: the message names file, line and field --------------------------

@pytest.mark.parametrize("body,line,field,needle", [
    ("2023-11-16 18:17:03.9799600,abc,10\n", 2, "ContextTokens", "non-negative integer, got 'abc'"),
    ("2023-11-16 18:17:03.9799600,10,-3\n", 2, "GeneratedTokens", "got '-3'"),
    ("2023-11-16 18:17:03.9799600,10,5\n2023-11-16 25:17:03.1,10,5\n", 3, "TIMESTAMP", "date-time"),
    ("2023-13-16 18:17:03.1,10,5\n", 2, "TIMESTAMP", "2023-13-16"),
    ("2023-11-16 18:17:03.1,10\n", 2, "GeneratedTokens", "missing value"),
])
def test_azure_malformed_rows(tmp_path, body, line, field, needle):
    p = write(tmp_path, "trace.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n" + body)
    with pytest.raises(TraceFormatError) as e:
        load_trace(p, format="azure")
    msg = str(e.value)
    assert f"trace.csv line {line}: field '{field}'" in msg and needle in msg
    assert e.value.line == line and e.value.field == field and isinstance(e.value, ValueError)


def test_exact_message_from_the_spec(tmp_path):
    rows = "".join(f"2023-11-16 18:17:{i:02d}.0,1,1\n" for i in range(15))
    p = write(tmp_path, "trace.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n" + rows
              + "2023-11-16 18:17:20.0,abc,1\n")
    with pytest.raises(TraceFormatError, match="trace.csv line 17: field 'ContextTokens': "
                       "expected a non-negative integer, got 'abc'"):
        load_trace(p)


def test_missing_column(tmp_path):
    p = write(tmp_path, "trace.csv", "TIMESTAMP,ContextTokens,Other\n2023-11-16 18:17:03.1,1,1\n")
    with pytest.raises(TraceFormatError) as e:
        load_trace(p, format="azure")
    assert "trace.csv line 1: field 'GeneratedTokens': missing column" in str(e.value)


@pytest.mark.parametrize("fmt", [None, "azure", "mooncake", "burstgpt", "jsonl"])
def test_empty_file(tmp_path, fmt):
    p = write(tmp_path, "empty.csv", "")
    with pytest.raises(TraceFormatError, match="empty.csv line 1: empty file"):
        load_trace(p, format=fmt)


def test_header_only_is_an_empty_workload(tmp_path):
    w = load_trace(write(tmp_path, "h.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n"))
    assert len(w) == 0


# --- Mooncake ------------------------------------------------------------------------

def mooncake_file(tmp_path, rows, name="mc.jsonl"):
    return write(tmp_path, name, "\n".join(json.dumps(r) for r in rows) + "\n")


def test_mooncake_fields_and_times(tmp_path):
    p = mooncake_file(tmp_path, [
        {"timestamp": 2500, "input_length": 700, "output_length": 3, "hash_ids": [0, 1]},
        {"timestamp": 1000, "input_length": 100, "output_length": 9, "hash_ids": [7]},
    ])
    w = load_trace(p)
    assert [r.arrival_time for r in w] == [0.0, 1.5]   # ms -> s, rebased
    assert w[0].prompt_len == 100 and w[0].max_tokens == 9 and w[1].hash_ids == [0, 1]
    assert all(len(r.prompt_token_ids) == r.prompt_len for r in w)


def test_mooncake_prefix_reuse_survives_into_token_space(tmp_path):
    p = mooncake_file(tmp_path, [
        {"timestamp": 0, "input_length": 1500, "output_length": 5, "hash_ids": [10, 11, 12]},
        {"timestamp": 5, "input_length": 1400, "output_length": 5, "hash_ids": [10, 11, 13]},
        {"timestamp": 9, "input_length": 600, "output_length": 5, "hash_ids": [20, 11]},
    ])
    a, b, c = load_trace(p, vocab_size=1000, reserved_ids=range(3))
    ta, tb, tc = a.prompt_token_ids, b.prompt_token_ids, c.prompt_token_ids
    assert ta[:1024] == tb[:1024]                 # blocks 10 and 11 shared exactly
    assert ta[1024:1400] != tb[1024:1400]         # then they differ
    assert tc[:512] != ta[:512]                   # different first block
    assert tc[512:600] == ta[512:600]             # same id at a position: same content
    for t in (ta, tb, tc):
        assert min(t) >= 3 and max(t) < 1000
    # Reproducible, and re-materialisable for a smaller vocabulary.
    again = load_trace(p, vocab_size=1000, reserved_ids=range(3))
    assert [r.prompt_token_ids for r in again] == [ta, tb, tc]
    small = load_trace(p, materialize=False)
    assert all(r.prompt_token_ids is None for r in small)
    small = small.materialize(64, overwrite=True)
    x, y, _ = small
    assert x.prompt_token_ids[:1024] == y.prompt_token_ids[:1024] and max(x.prompt_token_ids) < 64


def test_mooncake_prompt_longer_than_blocks_is_padded(tmp_path):
    p = mooncake_file(tmp_path, [{"timestamp": 0, "input_length": 600, "output_length": 1,
                                  "hash_ids": [1]}])
    (r,) = load_trace(p)
    assert len(r.prompt_token_ids) == 600


@pytest.mark.parametrize("text,line,needle", [
    ('{"timestamp": 0, "input_length": 5, "output_length": 2}\n{"timestamp": 1, "input_length": 5,',
     2, "invalid JSON"),
    ('{"timestamp": 0, "input_length": 5, "output_length": 2}\n\n{"timestamp": 1, "output_length": 2}\n',
     3, "field 'input_length': missing"),
    ('{"timestamp": "soon", "input_length": 5, "output_length": 2}\n', 1,
     "field 'timestamp': expected a non-negative number"),
    ('{"timestamp": 0, "input_length": 5, "output_length": 2.5}\n', 1, "field 'output_length'"),
    ('{"timestamp": 0, "input_length": 5, "output_length": 2, "hash_ids": [1, "x"]}\n', 1,
     "field 'hash_ids'"),
    ('{"timestamp": 0, "input_length": 5, "output_length": 2}\n[1, 2]\n', 2, "expected a JSON object"),
])
def test_mooncake_malformed(tmp_path, text, line, needle):
    p = write(tmp_path, "mc.jsonl", text)
    with pytest.raises(TraceFormatError) as e:
        load_trace(p, format="mooncake")
    assert f"mc.jsonl line {line}: " in str(e.value) and needle in str(e.value)


# --- BurstGPT -------------------------------------------------------------------------

BURSTGPT = """Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type
5,ChatGPT,472,18,490,Conversation log
45,ChatGPT,1087,0,1087,Conversation log
118,GPT-4,417,276,693,API log
"""


def test_burstgpt_skips_and_counts_failures(tmp_path):
    p = write(tmp_path, "BurstGPT_1.csv", BURSTGPT)
    w = load_trace(p)
    assert len(w) == 2 and w.meta["skipped_failures"] == 1
    assert [r.arrival_time for r in w] == [0.0, 113.0]
    assert [r.tenant for r in w] == ["ChatGPT", "GPT-4"]
    kept = load_trace(p, keep_failures=True)
    assert len(kept) == 3 and kept[1].max_tokens == 1 and kept.meta["failures"] == 1


def test_burstgpt_v3_columns_and_errors(tmp_path):
    v3 = ("Timestamp,Session ID,Elapsed time,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
          "0.5,s1,1.2,ChatGPT,10,3,13,Conversation log\n"
          "1.5,s1,1.1,ChatGPT,x10,3,13,Conversation log\n")
    p = write(tmp_path, "b3.csv", v3)
    with pytest.raises(TraceFormatError, match="b3.csv line 3: field 'Request tokens'"):
        load_trace(p)
    p = write(tmp_path, "b4.csv", v3.replace("x10", "10").replace("1.5,", "later,"))
    with pytest.raises(TraceFormatError, match="b4.csv line 3: field 'Timestamp'"):
        load_trace(p)


# --- our own JSONL -------------------------------------------------------------------

def test_own_jsonl_roundtrip(tmp_path):
    w = synthetic(50, 3.0, priorities=[0, 2], tenants=["a", "b"], seed=1).materialize(100)
    p = tmp_path / "w.jsonl"
    w.to_jsonl(p)
    back = Workload.from_jsonl(p)
    assert back == w and back.name == w.name
    w.to_jsonl(p, token_ids=False)
    assert all(r.prompt_token_ids is None for r in Workload.from_jsonl(p))


def test_own_jsonl_errors(tmp_path):
    p = write(tmp_path, "own.jsonl", '{"minibatch_workload": 1, "name": "x"}\n'
              '{"arrival_time": 0, "prompt_len": 5, "max_tokens": 1}\n'
              '{"arrival_time": 1, "prompt_len": 5, "max_tokens": 1, "colour": "red"}\n')
    with pytest.raises(TraceFormatError, match="own.jsonl line 3: field 'colour': unknown field"):
        load_trace(p)
    p = write(tmp_path, "own2.jsonl", '{"arrival_time": 0, "prompt_len": "many", "max_tokens": 1}\n')
    with pytest.raises(TraceFormatError, match="own2.jsonl line 1: field 'prompt_len'"):
        load_trace(p)
    p = write(tmp_path, "own3.jsonl", '{"arrival_time": 0, "prompt_len": 5, "max_tokens": 1}\n{oops}\n')
    with pytest.raises(TraceFormatError, match="own3.jsonl line 2: invalid JSON"):
        load_trace(p)


spec_strategy = st.builds(
    RequestSpec,
    arrival_time=st.floats(0, 1e6, allow_nan=False, allow_infinity=False),
    prompt_len=st.integers(1, 10**6), max_tokens=st.integers(1, 10**5),
    priority=st.integers(-5, 5), tenant=st.one_of(st.none(), st.text(max_size=8)),
    request_id=st.one_of(st.none(), st.text(max_size=12)),
    prefix_id=st.one_of(st.none(), st.integers(0, 100)),
    hash_ids=st.one_of(st.none(), st.lists(st.integers(0, 2**40), min_size=1, max_size=4)))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(specs=st.lists(spec_strategy, max_size=20), name=st.text(min_size=1, max_size=10))
def test_own_jsonl_roundtrip_property(tmp_path, specs, name):
    w = Workload(specs, name=name, meta={"k": [1, "two"]})
    p = tmp_path / "prop.jsonl"
    w.to_jsonl(p)
    back = Workload.from_jsonl(p)
    assert back == w and back.meta == w.meta


# --- the real traces, shipped in datasets/traces -------------------------------------------------

def test_shipped_traces_are_the_published_files():
    import hashlib

    sources = (SHIPPED / "SOURCES.md").read_text(encoding="utf-8")
    for name in SHIPPED_TRACES.values():
        digest = hashlib.sha256((SHIPPED / name).read_bytes()).hexdigest()
        assert f"{digest}  {name}" in sources, f"{name} differs from the file SOURCES.md describes"
    with pytest.raises(ValueError, match="unknown shipped trace"):
        shipped_trace_path("azure")


def test_real_azure_conv_trace_matches_published_stats():
    w = load_shipped_trace("azure_conv")
    s = w.stats()
    assert s["n"] == 19366
    assert s["cv"] == pytest.approx(1.09, abs=0.005)
    assert s["duration"] == pytest.approx(3501.7, abs=0.05)
    assert s["iod_1s"] == pytest.approx(1.39, abs=0.005)
    assert (s["input_p50"], s["output_p50"], s["input_max"]) == (1020, 129, 14050)
