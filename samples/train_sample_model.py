"""Train the sample model: a byte-level BPE and a 6-layer Llama that retrieves in layers >= 2, on CPU.

    python samples/train_sample_model.py --minutes 50            # the committed model (about 50 min, 2 cores)
    python samples/train_sample_model.py --minutes 1 --out /tmp/m # smoke run

Recipe (samples/sample-model/MODEL_CARD.md says why):
1. Tokenizer: smartgen.apps.evalsuite.tokenizer.train_tokenizer (vocab 1024, digits one per token).
2. Model: LlamaForCausalLM, 6 layers, hidden 256 (MLP 512), 8 query / 2 KV heads of dim 32, RoPE (theta
   1e12), RMSNorm, tied embeddings, started from hand-made circuits (sample_circuits.py): a frozen
   previous-token head at layer 2 and an induction head at layer 3 (--trigram-head adds a 3-gram one),
   every other output projection zero. Retrieval therefore lives in layers >= 2, above the layers SmartGen always
   sends whole.
3. Phases, each time-boxed to a share of --minutes: copy sequences at 512 tokens, then the task mix
   (evalsuite variant "train", copy and word-salad text) at 1K, 2K, and 1K/2K/4K mixed.
   Loss = mean CE on answer tokens + 0.3 x mean CE on the rest; AdamW, warmup + cosine (by elapsed share).
Threads: 2, or 1 while a step runs faster that way (ThreadTuner): with another process on the two cores,
two threads were measured 4x slower than one. Phases stop on the clock, so two runs on machines of
different speed differ; the step counts reached are saved in training_log.json and `--phase-steps`
replays them.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import sample_circuits
import torch
import torch.nn.functional as F

from smartgen.apps.evalsuite import generate_task
from smartgen.apps.evalsuite.surface import TEMPLATES, filler_sentences
from smartgen.apps.evalsuite.tokenizer import train_tokenizer

ROOT = Path(__file__).resolve().parent

# (name, share of the budget, tokens per step, {sequence length: weight}, mix or copy-only)
PHASES = (
    ("copy", 0.05, 4096, {512: 1.0}, False),
    ("mix-1k", 0.37, 4096, {1024: 1.0}, True),
    ("mix-2k", 0.26, 4096, {2048: 1.0}, True),
    ("mix-4k", 0.32, 4096, {4096: 0.6, 2048: 0.2, 1024: 0.2}, True),
)
MIX = {
    "copy": 0.2,
    "text": 0.04,
    "passkey": 0.1,
    "niah_single": 0.16,
    "niah_multikey": 0.22,
    "kv_retrieval": 0.2,
    "vt": 0.08,
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "sample-model", help="output folder")
    p.add_argument("--minutes", type=float, default=50.0, help="wall-clock budget for the training phases")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=512)
    p.add_argument("--rope-theta", type=float, default=1e12, help="large: most RoPE pairs barely turn over 8K tokens")
    p.add_argument(
        "--trigram-head",
        action="store_true",
        help="also hand-initialise a 3-gram induction head (same as --ngram-head 3)",
    )
    p.add_argument(
        "--ngram-head",
        type=int,
        choices=(0, 3, 4),
        default=0,
        help="also hand-initialise an n-gram induction head: 3, or 4 (reaches a needle's key past the space "
        "token before its value; multi-key needles need it)",
    )
    p.add_argument("--phase-steps", type=str, default=None, help="comma-separated steps per phase (replaces the clock)")
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument(
        "--mix",
        type=str,
        default=None,
        help="override task weights of the mix, e.g. niah_multikey=0.35,kv_retrieval=0.08 (others keep MIX's)",
    )
    p.add_argument(
        "--save-dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="dtype of the saved weights (bfloat16 halves the checkpoint; the runtime loads it as fp32)",
    )
    return p.parse_args(argv)


def build_model(tokenizer, args):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=args.hidden // 8,
        max_position_embeddings=16384,
        rope_theta=args.rope_theta,
        attention_bias=True,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config)


class Batcher:
    """Training sequences: (ids, weights, task); weight 1 on answer tokens, 0.3 elsewhere, 0 on unlearnable ones."""

    def __init__(self, tokenizer, seed: int, mix: dict[str, float] | None = None):
        self.tok = tokenizer
        self.mix = dict(mix or MIX)
        self.rng = random.Random(seed)
        self.counter = seed * 10_000_000
        self.content_ids = list(range(3, len(tokenizer)))
        words = set()
        for variant in ("eval", "calibration", "train"):
            for text in filler_sentences(variant):
                words.update(text.split())
            for task in TEMPLATES[variant].values():
                for choices in task.values():
                    for text in choices:
                        words.update(w for w in text.split() if "{" not in w and "}" not in w)
        self.words = sorted(words)

    def copy(self, length: int):
        ids, weights = [self.tok.bos_token_id], [0.0]
        while len(ids) < length:
            m = self.rng.randint(4, max(4, min(200, length // 2)))
            seq = [self.rng.choice(self.content_ids) for _ in range(m)]
            ids += seq + seq
            weights += [0.0] * m + [1.0] * m
        return ids[:length], weights[:length], "copy"

    def text(self, length: int):
        # word salad over every variant's vocabulary: trains the embeddings of words no train prompt uses,
        # without ever showing another variant's sentences
        words = [self.rng.choice(self.words) for _ in range(length)]
        ids = [self.tok.bos_token_id] + self.tok.encode(" ".join(words), add_special_tokens=False)
        return ids[:length], [0.3] * min(length, len(ids)), "text"

    def task(self, task: str, length: int):
        self.counter += 1
        sample = generate_task(task, length, self.counter, self.tok, variant="train", depth=self.rng.random())
        prompt = [self.tok.bos_token_id] + self.tok.encode(sample.prompt, add_special_tokens=False)
        answer = self.tok.encode(sample.answer, add_special_tokens=False) + [self.tok.eos_token_id]
        return prompt + answer, [0.3] * len(prompt) + [1.0] * len(answer), task

    def draw(self, length: int, mix: bool):
        if not mix:
            return self.copy(length)
        kind = self.rng.choices(list(self.mix), weights=list(self.mix.values()))[0]
        if kind == "copy":
            return self.copy(length)
        if kind == "text":
            return self.text(length)
        return self.task(kind, length)

    def batch(self, lengths: dict[int, float], tokens: int, mix: bool):
        length = self.rng.choices(list(lengths), weights=list(lengths.values()))[0]
        rows = [self.draw(length, mix) for _ in range(max(1, tokens // length))]
        width = max(len(r[0]) for r in rows)
        ids = torch.full((len(rows), width), self.tok.pad_token_id)
        w = torch.zeros(len(rows), width)
        for i, (row_ids, row_w, _) in enumerate(rows):
            ids[i, : len(row_ids)] = torch.tensor(row_ids)
            w[i, : len(row_w)] = torch.tensor(row_w)
        return ids, w, [r[2] for r in rows]


def loss_fn(logits, ids, weights):
    """mean CE over answer tokens (weight 1) + 0.3 x mean CE over the rest; also per-row answer exact match."""
    logits, targets, w = logits[:, :-1].float(), ids[:, 1:], weights[:, 1:]
    ce = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), reduction="none").view_as(w)
    answer, rest = w == 1.0, (w > 0) & (w < 1.0)
    loss = ce[answer].mean() if answer.any() else ce.new_zeros(())
    if rest.any():
        loss = loss + 0.3 * ce[rest].mean()
    correct = ((logits.argmax(-1) == targets) | ~answer).all(dim=1)
    exact = [bool(ok) if has else None for ok, has in zip(correct.tolist(), answer.any(dim=1).tolist())]
    return loss, ce[answer].mean().item() if answer.any() else float("nan"), exact


class ThreadTuner:
    """Picks 1 or 2 intra-op threads by measured step time: when another process shares the two cores,
    two threads spin against it and a step took 4x longer than with one (measured here)."""

    def __init__(self, choices=(2, 1), explore_every: int = 30):
        self.choices, self.explore_every = choices, explore_every
        self.seconds: dict[int, float] = {}
        self.current = choices[0]

    def reset(self) -> None:
        self.seconds.clear()

    def pick(self, step: int) -> int:
        untried = [c for c in self.choices if c not in self.seconds]
        if untried and step > 0:
            n = untried[0]
        elif step % self.explore_every == 0:
            n = next(c for c in self.choices if c != self.current)
        else:
            n = self.current
        torch.set_num_threads(n)
        return n

    def record(self, n: int, seconds: float) -> None:
        old = self.seconds.get(n)
        self.seconds[n] = seconds if old is None else 0.7 * old + 0.3 * seconds
        self.current = min(self.seconds, key=self.seconds.get)


def copy_report(model) -> str:
    accs = {n: round(sample_circuits.copy_accuracy(model, n), 2) for n in (512, 1024, 2048)}
    return "copy accuracy by distance " + " ".join(f"{n}:{a}" for n, a in accs.items())


def lr_at(args, step: int, progress: float) -> float:
    warm = min(1.0, (step + 1) / 50)
    return args.lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def parse_mix(text: str | None) -> dict[str, float]:
    """MIX with the overrides of --mix applied."""
    mix = dict(MIX)
    for item in filter(None, (text or "").split(",")):
        name, _, weight = item.partition("=")
        if name not in MIX:
            raise SystemExit(f"--mix: unknown task {name!r}; known: {', '.join(MIX)}")
        mix[name] = float(weight)
    return mix


def save(model, tokenizer, out: Path, log: dict, dtype: str = "float32") -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.config._attn_implementation = "sdpa"
    if dtype == "float32":
        model.save_pretrained(out)
    else:
        state = {k: v.detach().to(getattr(torch, dtype)) for k, v in model.state_dict().items()}
        model.config.torch_dtype = dtype
        model.save_pretrained(out, state_dict=state)
    tokenizer.save_pretrained(out)
    (out / "training_log.json").write_text(json.dumps(log, indent=1) + "\n")


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t_start = time.time()
    tokenizer = train_tokenizer(vocab_size=1024, seed=args.seed)
    model = build_model(tokenizer, args)
    ngram = args.ngram_head or (3 if args.trigram_head else 0)
    sample_circuits.install(model, seed=args.seed, ngram=ngram)
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"model: {n_params / 1e6:.2f}M parameters; positional heads' weight on their offset "
        f"{sample_circuits.positional_head_check(model, ngram=ngram)}; {copy_report(model)}",
        flush=True,
    )

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2 or "embed" in n]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )
    batcher = Batcher(tokenizer, args.seed, parse_mix(args.mix))
    tuner = ThreadTuner((args.threads, 1) if args.threads > 1 else (1,))
    fixed_steps = [int(s) for s in args.phase_steps.split(",")] if args.phase_steps else None
    total_steps = sum(fixed_steps) if fixed_steps else None
    budget = args.minutes * 60.0
    t0 = time.time()
    log = {"args": {k: str(v) for k, v in vars(args).items()}, "parameters": n_params, "phases": []}
    step = 0
    for index, (name, _share, tokens, lengths, mix) in enumerate(PHASES):
        phase_end = t0 + budget * sum(p[1] for p in PHASES[: index + 1])
        phase_steps, t_phase, seen = 0, time.time(), 0
        window: dict[str, list[bool]] = {}
        tuner.reset()
        losses: list[float] = []
        model.train()
        while True:
            if fixed_steps is not None:
                if phase_steps >= fixed_steps[index]:
                    break
                progress = step / total_steps
            else:
                if time.time() >= phase_end:
                    break
                progress = (time.time() - t0) / budget
            for group in opt.param_groups:
                group["lr"] = lr_at(args, step, progress)
            ids, weights, kinds = batcher.batch(lengths, tokens, mix)
            threads, t_step = tuner.pick(phase_steps), time.time()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(input_ids=ids).logits
            loss, answer_loss, exact = loss_fn(logits, ids, weights)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            tuner.record(threads, (time.time() - t_step) * 4096 / ids.numel())
            step += 1
            phase_steps += 1
            seen += ids.numel()
            losses.append(loss.item())
            for kind, ok in zip(kinds, exact):
                if ok is None:
                    continue
                window.setdefault(kind, []).append(ok)
                window[kind] = window[kind][-50:]
            if step % args.log_every == 0:
                elapsed = time.time() - t0
                eta = (budget - elapsed) if fixed_steps is None else elapsed / step * (total_steps - step)
                accs = " ".join(f"{k}={sum(v) / len(v):.2f}" for k, v in sorted(window.items()))
                print(
                    f"[{name}] step {step} loss {sum(losses[-args.log_every :]) / args.log_every:.3f} "
                    f"ans {answer_loss:.3f} lr {opt.param_groups[0]['lr']:.2e} "
                    f"{seen / (time.time() - t_phase):.0f} tok/s ({tuner.current} thr) "
                    f"elapsed {elapsed / 60:.1f}m ETA {max(0, eta) / 60:.1f}m "
                    f"| exact {accs}",
                    flush=True,
                )
        model.eval()
        entry = {
            "copy": copy_report(model),
            "name": name,
            "steps": phase_steps,
            "seconds": round(time.time() - t_phase, 1),
            "tokens": seen,
            "answer_exact": {k: round(sum(v) / len(v), 3) for k, v in window.items()},
        }
        log["phases"].append(entry)
        log["train_seconds"] = round(time.time() - t0, 1)
        log["total_seconds"] = round(time.time() - t_start, 1)
        save(model, tokenizer, args.out, log, args.save_dtype)
        print(f"== phase {name} done: {entry}; saved to {args.out}", flush=True)
    log["positional_head_weight_on_offset"] = sample_circuits.positional_head_check(model, ngram=ngram)
    save(model, tokenizer, args.out, log, args.save_dtype)
    print(f"done in {(time.time() - t_start) / 60:.1f} min; {log['positional_head_weight_on_offset']}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
