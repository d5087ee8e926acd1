"""Every engine option declared once: EngineConfig's fields make the CLI; environment
variables are listed in one place; resolved values live on the engine's config; the
package layout keeps torch out of what does not need it."""

from __future__ import annotations

import argparse
import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

from minibatch.config import ENV_VARS, EngineConfig, add_engine_args, engine_kwargs, env, parse_duration_ms

ROOT = Path(__file__).resolve().parents[1]
FIELDS = [f.name for f in dataclasses.fields(EngineConfig)]


def _parser_flags(module: str) -> set[str]:
    """The long options of a subcommand's parser, by running its ``--help``."""
    out = subprocess.run([sys.executable, "-m", "minibatch", module, "--help"], capture_output=True,
                         text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    return set(re.findall(r"--[a-z][a-z0-9-]*", out.stdout))


@pytest.mark.parametrize("command", ["generate", "serve", "simulate", "profile"])
def test_every_field_is_a_flag_of_every_engine_command(command):
    flags = _parser_flags(command)
    missing = [f for f in FIELDS if f"--{f.replace('_', '-')}" not in flags]
    assert not missing, f"{command} lacks flags for {missing}"


def test_a_new_field_needs_no_edit_of_the_cli():
    """Flags come from the fields: a field added to a subclass appears without a list."""

    @dataclasses.dataclass
    class Extended(EngineConfig):
        extra_knob: int = dataclasses.field(default=3, metadata={"help": "a knob"})

    import minibatch.config as cfg

    p = argparse.ArgumentParser()
    original = cfg.EngineConfig
    cfg.EngineConfig = Extended
    try:
        add_engine_args(p)
        args = p.parse_args(["--extra-knob", "7", "--max-num-seqs", "3"])
        kw = engine_kwargs(args)
    finally:
        cfg.EngineConfig = original
    assert kw == {"extra_knob": 7, "max_num_seqs": 3}


def test_flags_parse_types_choices_and_durations():
    p = argparse.ArgumentParser()
    add_engine_args(p)
    args = p.parse_args(["--max-wait", "30ms", "--no-enable-chunked-prefill", "--scheduling-policy", "sjf",
                         "--kv-allocator", "contiguous", "--gpu-memory-utilization", "0.5"])
    assert engine_kwargs(args) == {"max_wait_ms": 30.0, "enable_chunked_prefill": False, "policy": "sjf",
                                   "kv_allocator": "contiguous", "gpu_memory_utilization": 0.5}
    assert engine_kwargs(p.parse_args([])) == {}                 # nothing typed: the fields' defaults apply
    assert engine_kwargs(p.parse_args(["--max-wait-ms", "0.5s"])) == {"max_wait_ms": 500.0}
    with pytest.raises(SystemExit):
        p.parse_args(["--kv-allocator", "buddy"])
    with pytest.raises(SystemExit):
        p.parse_args(["--policy", "no-such-policy"])
    assert parse_duration_ms("2") == 2.0 and parse_duration_ms("0.25s") == 250.0
    with pytest.raises(ValueError, match="30 minutes"):
        parse_duration_ms("30 minutes")


def test_field_choices_are_validated_in_python_too():
    for name, bad in [("kv_allocator", "buddy"), ("preemption_mode", "drop"), ("admission", "yolo"),
                      ("executor", "gpu"), ("attention_backend", "cuda"), ("dtype", "int4")]:
        with pytest.raises(ValueError, match=name):
            EngineConfig.from_kwargs(**{name: bad})
    with pytest.raises(ValueError, match="max_wait_ms"):
        EngineConfig.from_kwargs(max_wait_ms=float("nan"))


def test_every_environment_variable_read_is_listed():
    used = set()
    for path in [*ROOT.joinpath("minibatch").rglob("*.py"), *ROOT.joinpath("tests").rglob("*.py")]:
        used |= set(re.findall(r"MINIBATCH_[A-Z][A-Z_]*[A-Z]", path.read_text(encoding="utf-8")))
    used -= {"MINIBATCH_CPU_COMMON_H"}          # a C include guard, not a variable
    assert used <= set(ENV_VARS), f"not in minibatch.config.ENV_VARS: {sorted(used - set(ENV_VARS))}"
    typo = "MINIBATCH_" + "KERNEL"             # (spelled so that the scan above does not see it)
    with pytest.raises(KeyError, match=typo + "\\b"):
        env(typo)                               # a typo of MINIBATCH_KERNELS fails loudly


def test_the_engine_records_resolved_values_on_its_own_config():
    from minibatch import LLMEngine

    given = EngineConfig.from_kwargs(executor="sim", model="llama-2-7b", hardware="a100-80g")
    engine = LLMEngine(given, clock="virtual")
    assert given.max_model_len is None and given.num_kv_blocks is None       # the caller's copy is untouched
    assert engine.config.max_model_len == engine.max_model_len == 4096
    assert engine.config.num_kv_blocks == engine.kv.num_blocks > 0


def test_the_load_generator_and_the_corpus_do_not_import_torch():
    code = ("import sys, minibatch, minibatch.bench, minibatch.tiny.corpus, minibatch.workload, "
            "minibatch.results, minibatch.serving.protocol; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr
    out = subprocess.run([sys.executable, "-X", "importtime", "-m", "minibatch", "bench", "serve", "--help"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0 and "--base-url" in out.stdout
    assert not re.search(r"\|\s+torch(\.|\s|$)", out.stderr), "python -m minibatch bench imported torch"


def test_the_top_level_is_the_engine_core():
    core = {"__init__", "__main__", "config", "sampling_params", "request", "llm", "engine", "scheduler",
            "admission", "kv_cache", "radix", "swap", "clock", "executor", "sampler", "tokenizer",
            "timeline", "runner", "results", "kv_offload", "lora", "overlap", "spec_decode"}
    assert {p.stem for p in ROOT.joinpath("minibatch").glob("*.py")} == core


def test_lazy_exports_resolve():
    import minibatch

    for name in minibatch.__all__:
        assert getattr(minibatch, name) is not None
    with pytest.raises(AttributeError, match="no_such_name"):
        minibatch.no_such_name
