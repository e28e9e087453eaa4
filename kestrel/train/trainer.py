"""`train_eagle3(TrainConfig)`: a drafter for a target, end to end, within a time limit when one is given.

    prompts -> the target's answers (engine)      -> <output>/work/answers/<key>.jsonl, a line per prompt as it
                                                     is answered; a rerun with the same data settings reuses them
                                                     and answers only the rest (answers.py)
            -> the draft vocabulary (answer token counts; a resumed checkpoint keeps its own)
            -> the target's states per sequence (runner)  -> kept on the training device
            -> training: the training-time test, forward KL, AdamW, warmup + cosine, clipping
                         <output>/work/checkpoint.pt every checkpoint_every steps (resumed from when present)
            -> <output>/config.json + model.safetensors   (the standard EAGLE-3 format)

`time_limit_s` bounds all of it, loading included: budget.py says how it is split (answers until half of it by
default, then states, training, and a reserve for the save), so a limited run always ends with a drafter written.

Determinism: the data order of epoch e is a permutation seeded by (seed, e), the drafter's init by seed, and a
resumed run restores the model, the optimizer, the schedule and the step, so on the same data it walks the same
batches. A run that has more answers than the checkpoint's (an earlier run stopped answering at its limit) continues
from the checkpoint's step on all of them, its schedule stretched to the larger set.
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

from kestrel.errors import KestrelError
from kestrel.models.eagle3_loader import drafter_config_json, eagle3_config
from kestrel.progress import Progress
from kestrel.train.answers import FORMAT, AnswerStore, target_identity
from kestrel.train.budget import Budget, Pacer, save_reserve_s
from kestrel.train.data import Prompt, Sample, instruction_prompts, load_prompts
from kestrel.train.drafter import TrainableEagle3, ttt_loss
from kestrel.train.prompts import training_prompts
from kestrel.train.target import AnswerReport, AnswerSettings, SequenceFeatures, Target
from kestrel.train.vocab import coverage, select_draft_vocab, token_counts

logger = logging.getLogger("kestrel.train")

DRAFTER_FILE = "model.safetensors"
PROGRESS_EVERY_S = 5.0   # a progress line (rate, ETA) at most this often per phase


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
    time_limit_s: float | None = None        # the whole run, loading and answers included (budget.py)
    max_gen_time_s: float | None = None      # the answers' own cap in this run (budget.py)
    data_only: bool = False                  # answer the prompts (resuming), then return: no states, no training
    gen_batch_size: int | None = None        # prompts in the engine at once (None: 256 on a GPU, 64 on the CPU)
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
    num_sequences: int                       # trained on by this run
    num_answer_tokens: int
    draft_vocab_coverage: float
    seconds: dict[str, float]
    finished: bool   # False: stopped early (--stop-after, --time-limit, answers not all there yet); the drafter
                     # so far is written and the same command resumes
    prompts_total: int = 0                   # prompts to answer (those that fit max_len)
    answers_reused: int = 0                  # prompts answered by earlier runs
    answers_generated: int = 0               # prompts answered by this run
    answers_cut: int = 0                     # answers cut by the limit: trained on, answered again next time
    answers_file: str = ""

    @property
    def data_complete(self) -> bool:
        return self.answers_reused + self.answers_generated >= self.prompts_total


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _prompt_source(cfg: TrainConfig, target: Target) -> list[Prompt] | int:
    """The prompts, or how many openings the target samples itself (no chat template, no data)."""
    if cfg.data is not None:
        return load_prompts(cfg.data)
    if target.tokenizer.has_chat_template:
        return instruction_prompts(training_prompts(cfg.self_distill, cfg.seed))
    return cfg.self_distill


def _answer_settings(cfg: TrainConfig, target: Target, openings: bool) -> dict:
    """What decides the answers: their file's key (answers.py)."""
    engine = target.llm.config
    return {"format": FORMAT, "target": target_identity(engine.model_path), "tokenizer":
            None if engine.tokenizer is None else target_identity(Path(engine.tokenizer)),
            "dtype": str(target.runner.dtype), "quantization": engine.quantization,
            "max_new_tokens": cfg.max_new_tokens, "temperature": cfg.gen_temperature,
            "samples_per_prompt": cfg.samples_per_prompt, "openings": openings,
            # the seed decides sampled answers and sampled openings, not greedy answers to given prompts
            "seed": cfg.seed if cfg.gen_temperature > 0 or openings else None}


def _answers(cfg: TrainConfig, target: Target, work: Path, budget: Budget, progress: Progress) -> AnswerReport:
    source = _prompt_source(cfg, target)
    store = AnswerStore(work / "answers", _answer_settings(cfg, target, isinstance(source, int)))
    deadline = budget.answers_deadline(cfg.data_only)
    logger.info("%s; answers go to %s", budget.describe(deadline), store.path)
    settings = AnswerSettings(cfg.max_new_tokens, cfg.gen_temperature, cfg.samples_per_prompt, cfg.seed, cfg.max_len)
    report = target.answer(source, store, settings, Pacer(deadline, budget.clock), progress, cfg.gen_batch_size)
    if not report.complete:
        logger.info("answered %d of %d prompts (%d now, %d earlier) before the answers' deadline; %d cut answers "
                    "are trained on; the same command answers the rest", report.answered, report.total,
                    report.generated, report.reused, report.cut)
    return report


def _states(samples: list[Sample], target: Target, aux_layer_ids: tuple[int, ...], device: torch.device,
            dtype: torch.dtype, pacer: Pacer, progress: Progress) -> list[SequenceFeatures]:
    """The target's states for as many samples as the pacer allows, in order."""
    feats = []
    progress.begin("target_states", total=len(samples), unit="seqs")
    for s in samples:
        if not pacer.fits():
            logger.info("states for %d of %d sequences before their deadline: training uses those",
                        len(feats), len(samples))
            break
        pacer.start()
        feats.append(target.features(s, aux_layer_ids, device, dtype))
        pacer.stop()
        progress.update(len(feats))
    return feats


def _read_checkpoint(path: Path, cfg: TrainConfig) -> dict | None:
    if not path.is_file():
        return None
    state = torch.load(path, map_location="cpu", weights_only=False)   # the device is the target's now
    if state["config"] != _resume_key(cfg):
        raise KestrelError(f"{path} was written by a run with other settings; remove {path.parent} to start "
                           "over, or rerun with the same flags to resume")
    return state


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


def train_eagle3(cfg: TrainConfig, started: float | None = None) -> TrainResult:
    """`started` (time.monotonic()): where cfg.time_limit_s counts from (the CLI passes its own start)."""
    from kestrel.llm import LLM   # the engine: only when training really runs

    budget = Budget(cfg.time_limit_s, cfg.max_gen_time_s, started=time.monotonic() if started is None else started)
    progress = Progress(log_interval_s=PROGRESS_EVERY_S, log=logger)
    out = Path(cfg.output)
    work = out / "work"
    work.mkdir(parents=True, exist_ok=True)
    device = _device(cfg.device)
    use_bf16 = device.type == "cuda"
    store_dtype = torch.bfloat16 if use_bf16 else torch.float32
    seconds: dict[str, float] = {}
    torch.manual_seed(cfg.seed)
    ckpt_path = work / "checkpoint.pt"
    state = None if cfg.data_only else _read_checkpoint(ckpt_path, cfg)   # refused before the long part
    if (work / "samples.jsonl").is_file():
        logger.info("ignoring %s (an older Kestrel's answers, with no record of their settings)",
                    work / "samples.jsonl")

    mark = time.monotonic()
    if not cfg.data_only:
        # the first AdamW imports torch._dynamo (seconds, more on a busy CPU): paid here, with the loading, and
        # not as a surprise between the states' deadline and the first optimizer step
        torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])
    engine_kwargs = {"device": str(device), "seed": cfg.seed, **cfg.engine_kwargs}
    if device.type == "cuda":
        engine_kwargs.setdefault("gpu_memory_utilization", 0.4)   # the rest holds the states and the training
    llm = LLM(cfg.target, **engine_kwargs)
    try:
        target = Target(llm)
        seconds["load_target"] = time.monotonic() - mark
        mark = time.monotonic()
        report = _answers(cfg, target, work, budget, progress)
        seconds["answers"] = time.monotonic() - mark
        answers = dict(prompts_total=report.total, answers_reused=report.reused,
                       answers_generated=report.generated, answers_cut=report.cut, answers_file=str(report.path))
        if cfg.data_only:
            return TrainResult(output=out, steps=0, final_loss=float("nan"), step_accuracy=[], num_sequences=0,
                               num_answer_tokens=0, draft_vocab_coverage=0.0, seconds=seconds,
                               finished=report.complete, **answers)
        samples = [Sample(s.token_ids[:cfg.max_len], min(s.num_prompt_tokens, cfg.max_len)) for s in report.samples]
        if not samples:
            why = "every prompt was empty or too long for the target's context" if report.total == 0 else \
                f"no prompt was answered before the answers' deadline ({budget.elapsed():.0f} s into the run)"
            raise KestrelError(f"no training sequences: {why}")
        mark = time.monotonic()
        vocab = target.config.vocab_size
        counts = token_counts(samples, vocab)
        if state is not None:   # the checkpoint's drafter predicts over its own vocabulary
            d2t = state["model"]["d2t"].cpu()
            draft_ids = torch.arange(d2t.numel()) + d2t
        else:
            draft_ids = select_draft_vocab(counts, cfg.draft_vocab_size)
        covered = coverage(counts, draft_ids)
        logger.info("draft vocabulary: %d of %d target tokens, covering %.1f%% of the answers' tokens",
                    draft_ids.numel(), vocab, 100 * covered)
        # the drafter's config, written and read back through the loader's own checks
        (work / "config.json").write_text(json.dumps(drafter_config_json(target.config, int(draft_ids.numel())),
                                                     indent=2))
        drafter_cfg = eagle3_config(work, target.config)
        feats = _states(samples, target, drafter_cfg.aux_layer_ids, device, store_dtype,
                        Pacer(budget.states_deadline(), budget.clock), progress)
        head = target.lm_head_rows(draft_ids).to(device=device, dtype=store_dtype)
        embedding = target.embedding().to(device=device, dtype=store_dtype)
        seconds["states"] = time.monotonic() - mark
    finally:
        llm.shutdown()   # its KV cache and graphs go back before training allocates
    del llm, target

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
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step, losses_log = state["step"], state["losses"]
        if state.get("num_sequences", len(feats)) != len(feats):
            logger.info("the checkpoint trained on %d sequences, this run has %d: the schedule is stretched to them",
                        state["num_sequences"], len(feats))
        logger.info("resuming from step %d of %d (%s)", step, total, ckpt_path)
    del state

    mark = time.monotonic()
    reserve = save_reserve_s(sum(p.numel() for p in model.parameters()))
    pacer = Pacer(budget.train_deadline(reserve), budget.clock)
    step_losses, step_accs = [0.0] * cfg.ttt_steps, [0.0] * cfg.ttt_steps
    model.train()
    stop = total if cfg.stop_after is None else min(total, cfg.stop_after)
    progress.begin("training", total=stop, unit="steps")
    progress.update(step)
    while step < stop and pacer.fits():
        pacer.start()
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
        progress.detail = f"loss {losses_log[-1]:.3f}, accuracy " + "/".join(f"{a:.2f}" for a in step_accs[:4])
        if step % cfg.checkpoint_every == 0:
            _checkpoint(ckpt_path, model, optimizer, step, losses_log, cfg, len(feats))
        pacer.stop()
        progress.update(step)
    seconds["train"] = time.monotonic() - mark
    if step < total:
        why = f"the time limit (saving needs ~{reserve:.0f} s)" if pacer.cut else "--stop-after"
        logger.info("stopped at step %d of %d by %s: the drafter so far is written; the same command resumes",
                    step, total, why)
    mark = time.monotonic()
    progress.begin("saving_drafter")
    _checkpoint(ckpt_path, model, optimizer, step, losses_log, cfg, len(feats))
    save_drafter(model, out, work / "config.json")
    seconds["save"] = time.monotonic() - mark
    result = TrainResult(output=out, steps=step, final_loss=losses_log[-1] if losses_log else float("nan"),
                         step_accuracy=step_accs, num_sequences=len(feats),
                         num_answer_tokens=sum(s.num_response_tokens for s in samples[:len(feats)]),
                         draft_vocab_coverage=covered, seconds=seconds,
                         finished=step >= total and report.complete and len(feats) == len(samples), **answers)
    (work / "train_result.json").write_text(json.dumps({**asdict(result), "output": str(out),
                                                        "config": asdict(cfg)}, indent=2))
    logger.info("run took %.1f s%s", budget.elapsed(),
                "" if cfg.time_limit_s is None else f" of a {cfg.time_limit_s:.0f} s limit")
    return result


def _checkpoint(path: Path, model: TrainableEagle3, optimizer: torch.optim.Optimizer, step: int,
                losses: list[float], cfg: TrainConfig, num_sequences: int) -> None:
    tmp = path.with_suffix(".tmp")   # a run killed while saving keeps the previous checkpoint
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step, "losses": losses,
                "config": _resume_key(cfg), "num_sequences": num_sequences}, tmp)
    tmp.replace(path)


def _resume_key(cfg: TrainConfig) -> dict:
    """The settings a checkpoint must share with the run that resumes it (the step budget may grow)."""
    key = asdict(cfg)
    for name in ("stop_after", "time_limit_s", "max_gen_time_s", "data_only", "gen_batch_size", "checkpoint_every",
                 "output", "device"):
        key.pop(name)
    return key


def save_drafter(model: TrainableEagle3, out: Path, config_path: Path) -> None:
    """The standard EAGLE-3 directory: config.json and the tensors in bfloat16 (d2t int64, t2d bool)."""
    out.mkdir(parents=True, exist_ok=True)
    tensors = {n: (t.to(torch.bfloat16) if t.is_floating_point() else t)
               for n, t in model.checkpoint_tensors().items()}
    # written beside, then renamed: a run killed while saving leaves the previous drafter whole
    tmp = out / (DRAFTER_FILE + ".tmp")
    save_file(tensors, str(tmp))
    tmp.replace(out / DRAFTER_FILE)
    (out / "config.json").write_text(config_path.read_text())
