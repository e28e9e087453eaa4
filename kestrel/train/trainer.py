"""`train_eagle3(TrainConfig)`: a drafter for a target, end to end.

    prompts -> the target's answers (engine)      -> <output>/work/samples.jsonl   (reused by a resumed run)
            -> the draft vocabulary (answer token counts)
            -> the target's states per sequence (runner)  -> kept on the training device
            -> training: the training-time test, forward KL, AdamW, warmup + cosine, clipping
                         <output>/work/checkpoint.pt every checkpoint_every steps (resumed from when present)
            -> <output>/config.json + model.safetensors   (the standard EAGLE-3 format)

Determinism: the data order of epoch e is a permutation seeded by (seed, e), the drafter's init by seed, and a
resumed run restores the model, the optimizer, the schedule and the step, so it walks the same batches.
"""
from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from kestrel.errors import KestrelError
from kestrel.models.eagle3 import Eagle3Config
from kestrel.models.eagle3_loader import drafter_config_json, eagle3_config
from kestrel.train.data import Prompt, Sample, instruction_prompts, load_prompts
from kestrel.train.drafter import TrainableEagle3, ttt_loss
from kestrel.train.prompts import training_prompts
from kestrel.train.target import SequenceFeatures, Target
from kestrel.train.vocab import coverage, select_draft_vocab, token_counts

logger = logging.getLogger("kestrel.train")

DRAFTER_FILE = "model.safetensors"


@dataclass(frozen=True, slots=True)
class TrainConfig:
    output: str                              # the drafter directory written (and the work files under it)
    target: str | None = None                # checkpoint, .gguf or short name; None: the default model
    data: str | None = None                  # JSONL prompts; None: self-distillation
    self_distill: int = 512                  # prompts made here when no data file is given
    max_new_tokens: int = 256                # answer length the target generates
    gen_temperature: float = 0.0             # 0: the target's greedy answers
    samples_per_prompt: int = 1
    draft_vocab_size: int = 32000            # capped at the target's vocabulary
    ttt_steps: int = 7                       # drafting steps unrolled in training
    epochs: int = 4
    max_steps: int | None = None             # the schedule's length in optimizer steps (None: all epochs)
    stop_after: int | None = None            # checkpoint and return after this step (resume with the same flags)
    time_limit_s: float | None = None        # checkpoint and return once training has run this long
    batch_size: int = 8                      # sequences per optimizer step
    max_len: int = 1024                      # tokens kept per training sequence
    lr: float = 1e-4
    warmup_ratio: float = 0.03
    weight_decay: float = 0.0
    max_grad_norm: float = 0.5
    seed: int = 0
    device: str = "auto"
    checkpoint_every: int = 200              # optimizer steps between resumable checkpoints
    engine_kwargs: dict = field(default_factory=dict)   # extra LLM(...) keywords for the target


@dataclass(slots=True)
class TrainResult:
    output: Path
    steps: int
    final_loss: float
    step_accuracy: list[float]
    num_sequences: int
    num_answer_tokens: int
    draft_vocab_coverage: float
    seconds: dict[str, float]
    finished: bool   # False: stopped early (--stop-after, --time-limit); the drafter so far is written and the
                     # same command resumes


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _save_samples(path: Path, samples: list[Sample]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for s in samples:
            f.write(json.dumps({"token_ids": list(s.token_ids), "num_prompt_tokens": s.num_prompt_tokens}) + "\n")


def _load_samples(path: Path) -> list[Sample]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [Sample(tuple(r["token_ids"]), int(r["num_prompt_tokens"])) for r in rows]


def _prompts(cfg: TrainConfig, target: Target) -> list[Prompt]:
    if cfg.data is not None:
        return load_prompts(cfg.data)
    if target.tokenizer.has_chat_template:
        return instruction_prompts(training_prompts(cfg.self_distill, cfg.seed))
    return target.unconditional_prompts(cfg.self_distill, cfg.seed)


def _collect(cfg: TrainConfig, target: Target, work: Path, device: torch.device, dtype: torch.dtype
             ) -> tuple[list[Sample], list[SequenceFeatures], Eagle3Config, torch.Tensor, torch.Tensor, torch.Tensor,
                        float]:
    """(samples, their features, the drafter's config, the draft ids, the target's lm_head rows for them, its
    embedding, the draft vocabulary's coverage)."""
    work.mkdir(parents=True, exist_ok=True)
    samples_path = work / "samples.jsonl"
    if samples_path.is_file():
        samples = _load_samples(samples_path)
        logger.info("reusing %d answers from %s", len(samples), samples_path)
    else:
        prompts = _prompts(cfg, target)
        with tqdm(total=len(prompts), desc="target answers", unit="prompt") as bar:
            samples = target.answer(prompts, cfg.max_new_tokens, cfg.gen_temperature, cfg.samples_per_prompt,
                                    cfg.seed, cfg.max_len, bar.update)
        _save_samples(samples_path, samples)
    if not samples:
        raise KestrelError("no training sequences: every prompt was empty or too long for the target's context")
    samples = [Sample(s.token_ids[:cfg.max_len], min(s.num_prompt_tokens, cfg.max_len)) for s in samples]
    vocab = target.config.vocab_size
    counts = token_counts(samples, vocab)
    draft_ids = select_draft_vocab(counts, cfg.draft_vocab_size)
    covered = coverage(counts, draft_ids)
    logger.info("draft vocabulary: %d of %d target tokens, covering %.1f%% of the answers' tokens",
                draft_ids.numel(), vocab, 100 * covered)
    # the drafter's config, written and read back through the loader's own checks
    (work / "config.json").write_text(json.dumps(drafter_config_json(target.config, int(draft_ids.numel())),
                                                 indent=2))
    drafter_cfg = eagle3_config(work, target.config)
    feats = [target.features(s, drafter_cfg.aux_layer_ids, device, dtype)
             for s in tqdm(samples, desc="target states", unit="seq")]
    head = target.lm_head_rows(draft_ids).to(device=device, dtype=dtype)
    embedding = target.embedding().to(device=device, dtype=dtype)
    return samples, feats, drafter_cfg, draft_ids, head, embedding, covered


def _batches(feats: list[SequenceFeatures], batch_size: int, seed: int, epoch: int) -> list[list[int]]:
    order = torch.randperm(len(feats), generator=torch.Generator().manual_seed(seed * 1000 + epoch)).tolist()
    return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]


def _pad(feats: list[SequenceFeatures], head: torch.Tensor) -> dict[str, torch.Tensor]:
    """A padded batch: aux [B, T, 3 Ht], input_ids / valid / loss_mask / best [B, T], the target's draft-vocabulary
    logits [B, T, draft_vocab]."""
    t = max(f.length for f in feats)

    def stack(name: str, fill=0) -> torch.Tensor:
        rows = []
        for f in feats:
            x = getattr(f, name)
            pad = [0, 0] * (x.dim() - 1) + [0, t - x.shape[0]]
            rows.append(torch.nn.functional.pad(x, pad, value=fill))
        return torch.stack(rows)

    valid = torch.stack([torch.arange(t, device=head.device) < f.length for f in feats])
    final = stack("final")
    return {"aux": stack("aux"), "input_ids": stack("input_ids"), "valid": valid,
            "loss_mask": stack("loss_mask", False), "best": stack("best"),
            "target_logits": final @ head.T}


def _lr_at(step: int, total: int, warmup: int, peak: float) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))   # cosine down to 10%


def train_eagle3(cfg: TrainConfig) -> TrainResult:
    from kestrel.llm import LLM   # the engine: only when training really runs

    out = Path(cfg.output)
    work = out / "work"
    device = _device(cfg.device)
    use_bf16 = device.type == "cuda"
    store_dtype = torch.bfloat16 if use_bf16 else torch.float32
    seconds: dict[str, float] = {}
    torch.manual_seed(cfg.seed)

    started = time.monotonic()
    engine_kwargs = {"device": str(device), "seed": cfg.seed, **cfg.engine_kwargs}
    if device.type == "cuda":
        engine_kwargs.setdefault("gpu_memory_utilization", 0.4)   # the rest holds the states and the training
    llm = LLM(cfg.target, **engine_kwargs)
    target = Target(llm)
    seconds["load_target"] = time.monotonic() - started
    started = time.monotonic()
    samples, feats, drafter_cfg, draft_ids, head, embedding, covered = _collect(cfg, target, work, device,
                                                                                 store_dtype)
    llm.shutdown()   # its KV cache and graphs go back before training allocates
    del llm, target
    seconds["data"] = time.monotonic() - started

    torch.manual_seed(cfg.seed)
    model = TrainableEagle3(drafter_cfg, embedding.float(), draft_ids).to(device)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))
    per_epoch = -(-len(feats) // cfg.batch_size)
    total = min(cfg.max_steps or per_epoch * cfg.epochs, per_epoch * cfg.epochs)
    warmup = max(1, int(cfg.warmup_ratio * total))
    step, losses_log = 0, []
    ckpt_path = work / "checkpoint.pt"
    if ckpt_path.is_file():
        state = torch.load(ckpt_path, map_location=device, weights_only=False)
        if state["config"] != _resume_key(cfg):
            raise KestrelError(f"{ckpt_path} was written by a run with other settings; remove {work} to start "
                               "over, or rerun with the same flags to resume")
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step, losses_log = state["step"], state["losses"]
        logger.info("resuming from step %d of %d (%s)", step, total, ckpt_path)

    started = time.monotonic()
    step_losses, step_accs = [0.0] * cfg.ttt_steps, [0.0] * cfg.ttt_steps
    model.train()
    stop = total if cfg.stop_after is None else min(total, cfg.stop_after)
    with tqdm(total=total, initial=step, desc="training", unit="step") as bar:
        while step < stop and (cfg.time_limit_s is None or time.monotonic() - started < cfg.time_limit_s):
            epoch, index = divmod(step, per_epoch)
            batch = _pad([feats[i] for i in _batches(feats, cfg.batch_size, cfg.seed, epoch)[index]], head)
            for group in optimizer.param_groups:
                group["lr"] = _lr_at(step, total, warmup, cfg.lr)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_bf16):
                logits = model.unroll(batch["aux"], batch["input_ids"], batch["valid"], cfg.ttt_steps)
            loss, step_losses, step_accs = ttt_loss(logits, batch["target_logits"], batch["best"],
                                                    batch["loss_mask"], model.t2d, model.draft_ids)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
            optimizer.step()
            step += 1
            losses_log.append(float(loss.detach()))
            bar.update(1)
            bar.set_postfix(loss=f"{losses_log[-1]:.3f}", acc="/".join(f"{a:.2f}" for a in step_accs[:4]))
            if step % cfg.checkpoint_every == 0:
                _checkpoint(ckpt_path, model, optimizer, step, losses_log, cfg)
    _checkpoint(ckpt_path, model, optimizer, step, losses_log, cfg)
    seconds["train"] = time.monotonic() - started
    if step < total:
        logger.info("stopped at step %d of %d: the drafter so far is written; the same command resumes", step,
                    total)
    save_drafter(model, out, work / "config.json")
    result = TrainResult(output=out, steps=step, final_loss=losses_log[-1] if losses_log else float("nan"),
                         step_accuracy=step_accs, num_sequences=len(samples),
                         num_answer_tokens=sum(s.num_response_tokens for s in samples),
                         draft_vocab_coverage=covered, seconds=seconds, finished=step >= total)
    (work / "train_result.json").write_text(json.dumps({**asdict(result), "output": str(out),
                                                        "config": asdict(cfg)}, indent=2))
    return result


def _checkpoint(path: Path, model: TrainableEagle3, optimizer: torch.optim.Optimizer, step: int,
                losses: list[float], cfg: TrainConfig) -> None:
    tmp = path.with_suffix(".tmp")   # a run killed while saving keeps the previous checkpoint
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step, "losses": losses,
                "config": _resume_key(cfg)}, tmp)
    tmp.replace(path)


def _resume_key(cfg: TrainConfig) -> dict:
    """The settings a checkpoint must share with the run that resumes it (the step budget may grow)."""
    key = asdict(cfg)
    for name in ("stop_after", "time_limit_s", "checkpoint_every", "output", "device"):
        key.pop(name)
    return key


def save_drafter(model: TrainableEagle3, out: Path, config_path: Path) -> None:
    """The standard EAGLE-3 directory: config.json and the tensors in bfloat16 (d2t int64, t2d bool)."""
    out.mkdir(parents=True, exist_ok=True)
    tensors = {n: (t.to(torch.bfloat16) if t.is_floating_point() else t)
               for n, t in model.checkpoint_tensors().items()}
    save_file(tensors, str(out / DRAFTER_FILE))
    (out / "config.json").write_text(config_path.read_text())
