"""Train kestrel-tiny, the embedded default model: a small Llama on the Python standard library.

Data: the ``.py`` files of the running interpreter's stdlib, minus every test directory; ``Lib/test`` is the
held-out evaluation set. The tokenizer (byte-level BPE) is trained here too, on the training split only.

    python scripts/train_default_model.py --device cuda --minutes 6 --out models/kestrel-tiny
    python scripts/train_default_model.py --device cpu --max-steps 20 --batch-size 2 --out /tmp/kt   # smoke run

With ``--minutes`` the number of steps is calibrated from the speed of the warm-up steps; the model card records
it, and ``--max-steps N`` replays exactly that schedule.
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/ is not a package
from eval_default_model import (  # noqa: E402
    BOS_TOKEN, WINDOW, hf_heldout_perplexity, path_hash, stdlib_root)

EOS_TOKEN = "<|eos|>"
PAD_TOKEN = "<|pad|>"
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>"]
VOCAB_SIZE = 4096
VAL_EVERY = 20            # 1 in VAL_EVERY non-test files (by path hash) is the validation split
HELDOUT_FILES = 64        # Lib/test files scored for the model card
SAMPLE_PROMPT = "def fibonacci(n):"
# Role-tagged turns, each closed by EOS so one stop token serves base and chat use alike.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n"
    "{{ message['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
# Directories whose files are tests (held out or not ours to learn from) or third-party code.
EXCLUDED_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}


@dataclass(frozen=True, slots=True)
class Corpus:
    root: Path
    train_files: list[Path]
    val_files: list[Path]


def collect_corpus(root: Path) -> Corpus:
    train, val = [], []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if EXCLUDED_DIRS & set(relative.parts[:-1]) or path.stat().st_size == 0:
            continue
        (val if path_hash(relative.as_posix()) % VAL_EVERY == 0 else train).append(path)
    return Corpus(root, train, val)


def read_texts(files: list[Path]) -> list[str]:
    return [p.read_text(encoding="utf-8", errors="replace") for p in files]


def train_tokenizer(texts: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, min_frequency=2, show_progress=False,
        special_tokens=[BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, *ROLE_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(texts, trainer)
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    # Like Llama: encoding with special tokens prepends BOS.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B", special_tokens=[(BOS_TOKEN, bos_id)])
    return tokenizer


def hf_tokenizer(tokenizer):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=BOS_TOKEN, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN,
        model_max_length=2048, chat_template=CHAT_TEMPLATE, clean_up_tokenization_spaces=False)


def save_tokenizer(tokenizer, out: Path) -> None:
    hf_tokenizer(tokenizer).save_pretrained(out)
    # transformers 5 keeps the template in chat_template.jinja; readers of tokenizer_config.json find it there too.
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    config["tokenizer_class"] = "PreTrainedTokenizerFast"  # the name transformers 4.x and 5.x both resolve
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def encode_documents(tokenizer, texts: list[str]) -> list[torch.Tensor]:
    """One document per file: BOS + tokens + EOS."""
    bos, eos = tokenizer.token_to_id(BOS_TOKEN), tokenizer.token_to_id(EOS_TOKEN)
    encodings = tokenizer.encode_batch(texts, add_special_tokens=False)
    return [torch.tensor([bos, *e.ids, eos], dtype=torch.long) for e in encodings]


def pack(documents: list[torch.Tensor], seq_len: int, generator: torch.Generator | None) -> torch.Tensor:
    """[num_seqs, seq_len]: documents concatenated (shuffled when a generator is given), tail dropped."""
    order = torch.randperm(len(documents), generator=generator) if generator is not None else range(len(documents))
    stream = torch.cat([documents[i] for i in order])
    usable = stream.numel() // seq_len * seq_len
    return stream[:usable].view(-1, seq_len)


def model_config(tokenizer):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=256, intermediate_size=768, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=2048,
        rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=True, hidden_act="silu",
        attention_bias=False, mlp_bias=False, initializer_range=0.02,
        bos_token_id=tokenizer.token_to_id(BOS_TOKEN), eos_token_id=tokenizer.token_to_id(EOS_TOKEN),
        pad_token_id=tokenizer.token_to_id(PAD_TOKEN),
    )


def warmup_steps(args: argparse.Namespace) -> int:
    # Short (smoke) runs still decay; any run of 2 * --warmup-steps or more warms up identically.
    return max(1, min(args.warmup_steps, args.max_steps // 2)) if args.max_steps else args.warmup_steps


def eval_interval(total: int) -> int:
    # About 25 validation passes per run, at most one per 10 steps.
    return max(total // 25, min(total, 10))


def lr_at(step: int, warmup: int, total: int, peak: float) -> float:
    """Linear warm-up, then cosine decay to 10% of peak at ``total``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def mean_loss(model, sequences: torch.Tensor, batch_size: int, device: torch.device, autocast) -> float:
    model.eval()
    losses = []
    for start in range(0, sequences.shape[0], batch_size):
        batch = sequences[start:start + batch_size].to(device)
        with autocast():
            losses.append(model(input_ids=batch, labels=batch).loss.float() * batch.shape[0])
    model.train()
    return (torch.stack(losses).sum() / sequences.shape[0]).item()


@dataclass
class TrainResult:
    steps: int
    planned_steps: int
    best_step: int
    best_val_loss: float
    train_loss_at_best: float
    final_train_loss: float
    tokens_seen: int
    seconds: float
    curve: list[tuple[int, float, float]]  # (step, mean train loss since last eval, val loss)


def train(model, train_docs, val_seqs, args, device: torch.device) -> TrainResult:
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if device.type == "cuda" \
        else (lambda: torch.autocast("cpu", enabled=False))
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")
    generator = torch.Generator().manual_seed(args.seed)
    total = args.max_steps  # None until calibrated from the warm-up's speed
    warmup = warmup_steps(args)
    eval_every = eval_interval(total) if total else None
    budget_s = args.minutes * 60.0
    steps_per_epoch = sum(d.numel() for d in train_docs) // args.seq_len // args.batch_size

    best = (float("inf"), 0, float("nan"), None)  # val loss, step, train loss, cpu state dict
    curve, window_losses, recent = [], [], []
    tokens_seen, step, epoch = 0, 0, 0
    start = time.perf_counter()
    model.train()
    overran = False
    while (total is None or step < total) and not overran:
        epoch_seqs = pack(train_docs, args.seq_len, generator)
        for first in range(0, epoch_seqs.shape[0] - args.batch_size + 1, args.batch_size):
            if step >= (total or float("inf")):
                break
            if args.max_steps is None and time.perf_counter() - start > budget_s * 1.15:
                print(f"time budget overrun: stopping at step {step} of {total}", flush=True)
                overran = True
                break
            batch = epoch_seqs[first:first + args.batch_size].to(device, non_blocking=True)
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, warmup, total or 10**9, args.lr)
            with autocast():
                loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            window_losses.append(loss.detach())
            step += 1
            tokens_seen += batch.numel()

            if total is None and step == warmup:
                if device.type == "cuda":
                    torch.cuda.synchronize()
                per_step = (time.perf_counter() - start) / step
                # 8% of the budget is kept for validation passes and the slower first steps' noise.
                total = max(warmup + 1, int(budget_s * 0.92 / per_step))
                if args.max_epochs:
                    total = max(warmup + 1, min(total, int(args.max_epochs * steps_per_epoch)))
                eval_every = eval_interval(total)
                print(f"calibrated: {per_step * 1000:.1f} ms/step -> {total} steps "
                      f"({total / steps_per_epoch:.1f} epochs) within {args.minutes} min", flush=True)
            if eval_every and (step % eval_every == 0 or step == total):
                train_loss = torch.stack(window_losses).float().mean().item()
                recent.append(train_loss)
                window_losses = []
                val_loss = mean_loss(model, val_seqs, args.batch_size, device, autocast)
                curve.append((step, train_loss, val_loss))
                elapsed = time.perf_counter() - start
                print(f"step {step}/{total} epoch {epoch} lr {lr_at(step - 1, warmup, total, args.lr):.2e} "
                      f"train {train_loss:.4f} val {val_loss:.4f} tokens {tokens_seen / 1e6:.1f}M "
                      f"{elapsed:.0f}s", flush=True)
                if val_loss < best[0]:
                    state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
                    best = (val_loss, step, train_loss, state)
        epoch += 1
    if overran:
        print(f"the saved model is from a schedule of {total} steps cut at step {step}", flush=True)
    seconds = time.perf_counter() - start
    model.load_state_dict(best[3])
    return TrainResult(steps=step, planned_steps=total, best_step=best[1], best_val_loss=best[0],
                       train_loss_at_best=best[2], final_train_loss=recent[-1], tokens_seen=tokens_seen,
                       seconds=seconds, curve=curve)


@torch.no_grad()
def greedy_completion(model_dir: Path, prompt: str, device: str, new_tokens: int = 64) -> str:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    input_ids = tokenizer(prompt, return_tensors="pt").input_ids.to(device)
    output = model.generate(input_ids, max_new_tokens=new_tokens, do_sample=False)
    return tokenizer.decode(output[0, input_ids.shape[1]:], skip_special_tokens=True)


def device_description(device: torch.device) -> str:
    if device.type == "cuda":
        return f"1x {torch.cuda.get_device_name(device)} (CUDA {torch.version.cuda})"
    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def write_model_card(out: Path, facts: dict) -> None:
    f = facts
    schedule_note = (f" The step count was calibrated to the time budget and capped at {f['max_epochs']:g} epochs."
                     if f["max_epochs"] and f["invocation"].count("--max-steps") == 0 else "")
    curve = "\n".join(f"| {s} | {t:.3f} | {v:.3f} |" for s, t, v in f["curve"])
    text = f"""# kestrel-tiny

The default model of Kestrel, used when no `--model` is given. A {f['params'] / 1e6:.2f}M-parameter
`LlamaForCausalLM` trained from scratch on the Python {f['python']} standard library. It completes Python code
in the style of the stdlib; it is not an assistant, and its chat template exists so chat endpoints work end to end.

## Model
| | |
| --- | --- |
| architecture | LlamaForCausalLM, {f['layers']} layers, hidden {f['hidden']}, {f['heads']} query heads / {f['kv_heads']} KV heads (GQA), head_dim {f['head_dim']}, SwiGLU intermediate {f['intermediate']} |
| parameters | {f['params']:,} (tied input/output embeddings) |
| context | trained on packed sequences of {f['seq_len']} tokens; `max_position_embeddings` {f['max_pos']}, RoPE theta {f['rope_theta']:g} |
| weights | bf16 safetensors ({f['weights_mb']:.1f} MB) |
| tokenizer | byte-level BPE, vocab {f['vocab']}, trained with `tokenizers` on the training split; BOS `{BOS_TOKEN}` (prepended on encode), EOS `{EOS_TOKEN}`, PAD `{PAD_TOKEN}`, role tokens {', '.join(f'`{t}`' for t in ROLE_TOKENS)} |
| chat template | `{BOS_TOKEN}<|role|>\\ncontent{EOS_TOKEN}\\n` per turn, `<|assistant|>\\n` as generation prompt |

## Data
- Source: every `.py` file under `{f['stdlib']}` (Python {f['python_full']}), in sorted path order, skipping
  directories named {', '.join(f'`{d}`' for d in sorted(EXCLUDED_DIRS))} and empty files. Each file is one
  document, `{BOS_TOKEN}` + tokens + `{EOS_TOKEN}`; documents are shuffled and packed into {f['seq_len']}-token
  sequences anew each epoch.
- Split by SHA-1 of the path relative to the stdlib: 1 file in {VAL_EVERY} is validation.
  Train: {f['train_files']} files, {f['train_tokens']:,} tokens. Validation: {f['val_files']} files,
  {f['val_tokens']:,} tokens.
- Held out: `Lib/test` (never trained on, not used for model selection).

## Training
- {f['device']}, torch {f['torch']}, transformers {f['transformers']}; {f['precision']}.
- AdamW (betas 0.9/0.95, weight decay {f['weight_decay']} on matrices), peak LR {f['lr']:g}, {f['warmup']} warm-up
  steps, cosine decay to 10% over {f['planned_steps']} steps, grad clip 1.0, batch {f['batch_size']} x
  {f['seq_len']} tokens, seed {f['seed']}.{schedule_note}
- {f['steps']} steps ({f['epochs']:.1f} epochs), {f['tokens_seen']:,} tokens seen, {f['train_seconds'] / 60:.1f} min in the
  training loop ({f['total_seconds'] / 60:.1f} min in all, tokenizer and evaluation included).
- The saved weights are those of the step with the lowest validation loss: step {f['best_step']}.

## Results
| | |
| --- | --- |
| final train loss (mean over the last eval interval) | {f['final_train_loss']:.4f} |
| train loss at the saved step | {f['train_loss_at_best']:.4f} |
| validation loss at the saved step | {f['best_val_loss']:.4f} (perplexity {math.exp(f['best_val_loss']):.2f}) |
| held-out perplexity, `Lib/test` of Python {f['python']} | **{f['heldout_ppl']:.2f}** over {f['heldout_tokens']:,} tokens |

Held-out set: the first {HELDOUT_FILES} non-empty `Lib/test/**/*.py` files ordered by SHA-1 of their path relative
to `Lib/test`, each scored on its first {WINDOW} tokens (BOS included), with the saved bf16 weights loaded in
float32 by HF transformers. Recompute it with
`python scripts/eval_default_model.py models/kestrel-tiny --files {HELDOUT_FILES}` (other Python versions ship
other test files, so the number moves a little).

Greedy completion of `{SAMPLE_PROMPT}` (64 new tokens, HF `generate`, float32):
```python
{SAMPLE_PROMPT}{f['sample']}
```

Learning curve:

| step | train loss | val loss |
| --- | --- | --- |
{curve}

## Reproduce
```
{f['command']}
```
The run above was started as `{f['invocation']}`; `--max-steps {f['planned_steps']}` replays its calibrated
schedule. GPU kernels are not bitwise deterministic, so a rerun matches closely, not exactly. Use the same
Python minor version ({f['python']}): its stdlib is the data.
"""
    (out / "MODEL_CARD.md").write_text(text)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="output directory (HF format)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--minutes", type=float, default=6.0,
                        help="training-loop time budget (ignored with --max-steps)")
    parser.add_argument("--max-steps", type=int, default=None, help="exact number of optimizer steps")
    parser.add_argument("--max-epochs", type=float, default=None,
                        help="cap the calibrated schedule at this many epochs (ignored with --max-steps)")
    parser.add_argument("--batch-size", type=int, default=32, help="sequences per step")
    parser.add_argument("--seq-len", type=int, default=WINDOW)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup-steps", type=int, default=100)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="CPU threads for torch")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    import transformers
    from transformers import GenerationConfig, LlamaForCausalLM

    if args.threads:
        torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    corpus = collect_corpus(stdlib_root())
    train_texts, val_texts = read_texts(corpus.train_files), read_texts(corpus.val_files)
    print(f"stdlib {corpus.root}: {len(train_texts)} train / {len(val_texts)} val files", flush=True)
    tokenizer = train_tokenizer(train_texts)
    train_docs, val_docs = encode_documents(tokenizer, train_texts), encode_documents(tokenizer, val_texts)
    train_tokens, val_tokens = sum(d.numel() for d in train_docs), sum(d.numel() for d in val_docs)
    val_seqs = pack(val_docs, args.seq_len, None)
    print(f"tokenizer trained ({time.perf_counter() - t0:.0f}s): {train_tokens:,} train / {val_tokens:,} val tokens",
          flush=True)

    config = model_config(tokenizer)
    model = LlamaForCausalLM(config).to(device)
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {params:,} parameters on {device_description(device)}", flush=True)
    result = train(model, train_docs, val_seqs, args, device)

    args.out.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id,
        do_sample=False)
    model.to(torch.bfloat16).save_pretrained(args.out)
    save_tokenizer(tokenizer, args.out)
    torch.backends.cuda.matmul.allow_tf32 = False  # score in true float32
    ppl, scored = hf_heldout_perplexity(args.out, HELDOUT_FILES, WINDOW, device=args.device)
    print(f"held-out perplexity {ppl:.3f} over {scored} tokens", flush=True)
    sample = greedy_completion(args.out, SAMPLE_PROMPT, args.device)
    print(f"greedy sample: {sample!r}", flush=True)

    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    write_model_card(args.out, dict(
        params=params, layers=config.num_hidden_layers, hidden=config.hidden_size, heads=config.num_attention_heads,
        kv_heads=config.num_key_value_heads, head_dim=config.head_dim, intermediate=config.intermediate_size,
        seq_len=args.seq_len, max_pos=config.max_position_embeddings, rope_theta=10000.0, vocab=VOCAB_SIZE,
        weights_mb=(args.out / "model.safetensors").stat().st_size / 1e6,
        python=python, python_full=platform.python_version(), stdlib=corpus.root,
        train_files=len(train_texts), val_files=len(val_texts), train_tokens=train_tokens, val_tokens=val_tokens,
        device=device_description(device), torch=torch.__version__, transformers=transformers.__version__,
        precision="bf16 autocast with fp32 master weights" if device.type == "cuda" else "fp32",
        weight_decay=args.weight_decay, lr=args.lr, warmup=warmup_steps(args), planned_steps=result.planned_steps,
        batch_size=args.batch_size, seed=args.seed, max_epochs=args.max_epochs,
        steps=result.steps, epochs=result.tokens_seen / train_tokens, tokens_seen=result.tokens_seen,
        train_seconds=result.seconds, total_seconds=time.perf_counter() - t0, best_step=result.best_step,
        final_train_loss=result.final_train_loss, train_loss_at_best=result.train_loss_at_best,
        best_val_loss=result.best_val_loss, heldout_ppl=ppl, heldout_tokens=scored, curve=result.curve,
        sample=sample,
        command=(f"python{python} scripts/train_default_model.py --device {device.type} --seed {args.seed} "
                 f"--batch-size {args.batch_size} --lr {args.lr:g} --max-steps {result.planned_steps} "
                 f"--out models/kestrel-tiny"),
        invocation="python scripts/train_default_model.py " + " ".join(sys.argv[1:] if argv is None else argv),
    ))
    print(f"RESULT best_val_loss={result.best_val_loss:.6f} heldout_ppl={ppl:.4f} steps={result.steps}", flush=True)
    sizes = sum(p.stat().st_size for p in args.out.iterdir())
    print(f"wrote {args.out} ({sizes / 1e6:.1f} MB, {len(list(args.out.iterdir()))} files) "
          f"in {(time.perf_counter() - t0) / 60:.1f} min", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
