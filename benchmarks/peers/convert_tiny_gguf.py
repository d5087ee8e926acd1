"""Convert minibatch's embedded ``tiny`` checkpoint to an f32 GGUF file for llama.cpp.

    python convert_tiny_gguf.py LLAMA_CPP_SRC OUT.gguf

Runs llama.cpp's own ``convert_hf_to_gguf.py`` (from the source tree ``LLAMA_CPP_SRC``, with
its vendored ``gguf-py``; needs torch, transformers, numpy and sentencepiece, all in the vLLM
environment that ``setup_vllm.sh`` builds) with one change: ``tiny``'s byte-level BPE
pre-tokenizer hashes to no entry of ``TextModel.get_vocab_base_pre`` (llama.cpp's table of
known tokenizers, ``conversion/base.py``), which raises ``NotImplementedError``; it is
recorded as ``gpt-2`` instead (byte-level BPE with GPT-2's split regex). The benchmarks
send llama.cpp token ids, never text, so the pre-tokenizer only matters for the
``/tokenize`` endpoint (``peers_serving.py`` compares llama-server's ``/tokenize`` with the
HF tokenizer on a few texts and prints the result).
"""

from __future__ import annotations

import sys
from pathlib import Path


def main() -> int:
    src, out = Path(sys.argv[1]).resolve(), Path(sys.argv[2]).resolve()
    sys.path[:0] = [str(src), str(src / "gguf-py")]
    from conversion import base

    original = base.TextModel.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer) -> str:
        try:
            return original(self, tokenizer)
        except NotImplementedError:
            print("convert_tiny_gguf: unknown BPE pre-tokenizer, recorded as 'gpt-2'", file=sys.stderr)
            return "gpt-2"

    base.TextModel.get_vocab_base_pre = get_vocab_base_pre
    tiny = Path(__file__).resolve().parents[2] / "minibatch" / "assets" / "tiny"
    sys.argv = ["convert_hf_to_gguf.py", str(tiny), "--outtype", "f32", "--outfile", str(out)]
    import runpy

    runpy.run_path(str(src / "convert_hf_to_gguf.py"), run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
