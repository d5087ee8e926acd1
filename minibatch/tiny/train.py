"""Train the embedded "tiny" default model on CPU.

    python -m minibatch.tiny.train --out DIR [--steps N] [--corpus-size N]
                                   [--seed S] [--threads 2] [--tokenizer DIR]

Steps: generate the procedural corpus (``minibatch.tiny.corpus``), train a
byte-level BPE tokenizer on it (or reuse one with ``--tokenizer``), train a
small ``LlamaForCausalLM`` (AdamW, linear warmup + cosine decay, seq len 256),
report held-out loss/perplexity and save a Hugging Face model directory
(config.json, model.safetensors, tokenizer files, generation_config.json).

``--tokenizer-only`` stops after writing the tokenizer and config files.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import random
import shutil
import sys
import time

from minibatch.tiny import corpus as tiny_corpus

EOT, IM_START, IM_END = tiny_corpus.EOT, tiny_corpus.IM_START, tiny_corpus.IM_END
SPECIAL_TOKENS = [EOT, IM_START, IM_END]  # ids 0, 1, 2
VOCAB_SIZE = 4096

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

MODEL_CONFIG = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    hidden_size=256,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=32,
    intermediate_size=688,
    hidden_act="silu",
    vocab_size=VOCAB_SIZE,
    max_position_embeddings=1024,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    attention_bias=False,
    mlp_bias=False,
    initializer_range=0.02,
    bos_token_id=0,
    eos_token_id=0,
    pad_token_id=0,
    torch_dtype="float32",
)

TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]


# ---------------------------------------------------------------------------
# tokenizer
# ---------------------------------------------------------------------------


def train_tokenizer(texts, out_dir, vocab_size: int = VOCAB_SIZE):
    """Train a byte-level BPE tokenizer and write the HF tokenizer files."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    # Each Han character and each digit is its own pre-token: Chinese names and
    # numbers then look the same wherever they occur (a 4M-parameter model
    # learns to copy "咪咪" far more easily than to relate a merged "名叫咪咪"
    # token to a later "咪咪"), and the merges go to English words.
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\p{Han}"), behavior="isolated"),
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2]
    # The procedural corpus has only ~2.1k distinct BPE units once Han
    # characters stay single tokens; fill the rest of the fixed vocab_size
    # with reserved special tokens (as Llama 3 does) so ids stay < vocab_size.
    n = tok.get_vocab_size()
    if n < vocab_size:
        tok.add_special_tokens([AddedToken(f"<|reserved_{i}|>", special=True, normalized=False)
                                for i in range(vocab_size - n)])
    assert tok.get_vocab_size() == vocab_size
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    write_tokenizer_config(out)
    return tok


def write_tokenizer_config(out_dir) -> None:
    out = pathlib.Path(out_dir)
    added = {
        str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                 "single_word": False, "special": True}
        for i, t in enumerate(SPECIAL_TOKENS)
    }
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "additional_special_tokens": [IM_START, IM_END],
        "bos_token": None,
        "eos_token": EOT,
        "pad_token": EOT,
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MODEL_CONFIG["max_position_embeddings"],
        "padding_side": "left",
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    smap = {"eos_token": EOT, "pad_token": EOT, "additional_special_tokens": [IM_START, IM_END]}
    (out / "special_tokens_map.json").write_text(json.dumps(smap, indent=2) + "\n")


def write_model_configs(out_dir, dtype: str = "float32", **overrides) -> None:
    """Write config.json and generation_config.json (no weights)."""
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = dict(MODEL_CONFIG, **overrides, torch_dtype=dtype)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    gen = {"bos_token_id": 0, "eos_token_id": [0, 2], "pad_token_id": 0}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


# ---------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------


def encode_docs(tok, docs):
    eot = tok.token_to_id(EOT)
    return [e.ids + [eot] for e in tok.encode_batch(docs)]


def pack_rows(seqs, seq_len: int, seed: int):
    """First-fit pack whole documents into rows of ``seq_len`` tokens.

    Every row starts at a document start (matching inference, where prompts
    start at position 0 without a BOS token).  Documents longer than a row are
    truncated.  Returns (ids, mask) tensors; mask is 0 on padding.
    """
    import torch

    rng = random.Random(seed)
    order = list(range(len(seqs)))
    rng.shuffle(order)
    rows: list[list[int]] = []
    open_rows: list[int] = []  # indices of rows with free space
    for i in order:
        s = seqs[i][:seq_len]
        placed = False
        for j, r in enumerate(open_rows):
            if len(rows[r]) + len(s) <= seq_len:
                rows[r].extend(s)
                if seq_len - len(rows[r]) < 16:
                    open_rows.pop(j)
                placed = True
                break
        if not placed:
            rows.append(list(s))
            open_rows.append(len(rows) - 1)
            if len(open_rows) > 64:
                open_rows.pop(0)
    ids = torch.zeros(len(rows), seq_len, dtype=torch.long)
    mask = torch.zeros(len(rows), seq_len, dtype=torch.bool)
    for k, r in enumerate(rows):
        ids[k, : len(r)] = torch.tensor(r)
        mask[k, : len(r)] = True
    perm = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed))
    return ids[perm], mask[perm]


# ---------------------------------------------------------------------------
# training
# ---------------------------------------------------------------------------


def lm_loss(model, ids, mask):
    import torch.nn.functional as F

    logits = model(input_ids=ids).logits[:, :-1].float()
    tgt = ids[:, 1:].masked_fill(~mask[:, 1:], -100)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), tgt.reshape(-1), ignore_index=-100,
                           reduction="sum"), int((tgt != -100).sum())


def evaluate(model, ids, mask, batch_size: int = 32) -> float:
    import torch

    model.eval()
    tot, n = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(ids), batch_size):
            l, k = lm_loss(model, ids[i:i + batch_size], mask[i:i + batch_size])
            tot += float(l)
            n += k
    model.train()
    return tot / max(n, 1)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output model directory")
    ap.add_argument("--steps", type=int, default=1800)
    ap.add_argument("--corpus-size", type=int, default=60_000, help="number of training documents")
    ap.add_argument("--heldout-size", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokenizer", default=None, help="reuse the tokenizer in this directory")
    ap.add_argument("--tokenizer-only", action="store_true", help="only write tokenizer + configs")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.05)
    ap.add_argument("--warmup", type=int, default=None, help="warmup steps (default: 5%% of steps)")
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--amp", choices=["bf16", "none"], default="bf16",
                    help="bfloat16 autocast for the matmuls (fp32 master weights); ~1.5x faster on CPUs with "
                         "AVX512-BF16/AMX")
    # architecture overrides: only for quick experiments and tests, the shipped model uses MODEL_CONFIG
    ap.add_argument("--hidden-size", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--layers", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--intermediate-size", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="dtype of the saved weights")
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()

    docs = tiny_corpus.generate(args.corpus_size, args.seed, "train")
    held = tiny_corpus.generate(args.heldout_size, args.seed + 1, "heldout")
    print(f"corpus: {len(docs)} train docs, {len(held)} held-out docs ({time.time() - t0:.1f}s)", flush=True)

    from tokenizers import Tokenizer

    if args.tokenizer:
        tok = Tokenizer.from_file(str(pathlib.Path(args.tokenizer) / "tokenizer.json"))
        if pathlib.Path(args.tokenizer).resolve() != out.resolve():
            for f in TOKENIZER_FILES:
                src = pathlib.Path(args.tokenizer) / f
                if src.exists():
                    shutil.copy(src, out / f)
    else:
        tok = train_tokenizer(docs, out)
        print(f"tokenizer: trained, vocab {tok.get_vocab_size()} ({time.time() - t0:.1f}s)", flush=True)
    overrides = {}
    if args.hidden_size:
        overrides.update(hidden_size=args.hidden_size, head_dim=args.hidden_size // MODEL_CONFIG["num_attention_heads"])
    if args.layers:
        overrides["num_hidden_layers"] = args.layers
    if args.intermediate_size:
        overrides["intermediate_size"] = args.intermediate_size
    write_model_configs(out, args.dtype, **overrides)
    if args.tokenizer_only:
        return {}

    from transformers import LlamaConfig, LlamaForCausalLM

    train_seqs = encode_docs(tok, docs)
    held_seqs = encode_docs(tok, held)
    ids, mask = pack_rows(train_seqs, args.seq_len, args.seed)
    hids, hmask = pack_rows(held_seqs, args.seq_len, args.seed + 1)
    ntok = int(mask.sum())
    print(f"data: {ntok} train tokens in {len(ids)} rows (fill {ntok / ids.numel():.1%}), "
          f"{int(hmask.sum())} held-out tokens ({time.time() - t0:.1f}s)", flush=True)

    cfg_d = {k: v for k, v in dict(MODEL_CONFIG, **overrides).items()
             if k not in ("architectures", "model_type", "torch_dtype")}
    config = LlamaConfig(**cfg_d)
    model = LlamaForCausalLM(config)
    model.train()
    nparams = sum(p.numel() for p in model.parameters())
    print(f"model: {nparams / 1e6:.2f}M parameters", flush=True)

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    warmup = args.warmup if args.warmup is not None else max(1, int(0.05 * args.steps))

    def lr_at(step: int) -> float:
        if step < warmup:
            return args.lr * (step + 1) / warmup
        prog = (step - warmup) / max(1, args.steps - warmup)
        return args.lr * (args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * prog)))

    g = torch.Generator().manual_seed(args.seed)
    order = torch.randperm(len(ids), generator=g)
    pos = 0
    losses: list[float] = []
    t_train = time.time()
    win_loss, win_n = 0.0, 0
    for step in range(args.steps):
        if pos + args.batch_size > len(order):
            order = torch.randperm(len(ids), generator=g)
            pos = 0
        idx = order[pos:pos + args.batch_size]
        pos += args.batch_size
        for grp in opt.param_groups:
            grp["lr"] = lr_at(step)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.amp == "bf16"):
            loss_sum, n = lm_loss(model, ids[idx], mask[idx])
        loss = loss_sum / n
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        lv = loss.item()
        losses.append(lv)
        win_loss += lv
        win_n += 1
        if (step + 1) % args.log_every == 0 or step == 0 or step + 1 == args.steps:
            el = time.time() - t_train
            print(f"step {step + 1:5d}/{args.steps}  loss {win_loss / win_n:.4f}  lr {lr_at(step):.2e}  "
                  f"{(step + 1) / el:.2f} steps/s  {el:.0f}s", flush=True)
            win_loss, win_n = 0.0, 0
    train_time = time.time() - t_train
    tail = losses[-min(len(losses), 50):]
    final_train = sum(tail) / len(tail)
    held_loss = evaluate(model, hids, hmask)
    print(f"done: {args.steps} steps in {train_time:.0f}s; final train loss (last {len(tail)} steps) "
          f"{final_train:.4f}; held-out loss {held_loss:.4f}, perplexity {math.exp(held_loss):.3f}", flush=True)

    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    model.to(dtype)
    model.save_pretrained(out, safe_serialization=True)
    write_model_configs(out, args.dtype, **overrides)  # overwrite with our canonical configs
    stats = {"steps": args.steps, "train_time_s": round(train_time, 1), "final_train_loss": round(final_train, 4),
             "first_train_loss": round(losses[0], 4), "heldout_loss": round(held_loss, 4),
             "heldout_perplexity": round(math.exp(held_loss), 4), "train_tokens": ntok,
             "seed": args.seed, "corpus_size": args.corpus_size, "params": nparams}
    stats["args"] = {k: v for k, v in vars(args).items() if k not in ("out", "tokenizer")}
    (out / "training_stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    print(json.dumps(stats), flush=True)
    return stats


if __name__ == "__main__":
    sys.exit(0 if main() is not None else 1)
