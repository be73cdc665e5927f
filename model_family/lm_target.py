"""A target that writes like a language model: `lm_target_config` (~29M parameters) trained on a GPU machine on
every corpus of the six domains (model_family/lm_corpora.py), in runs of minutes that resume.

The path, each step a command:

    python -m model_family.lm_corpora data/lm                       # here: fetch and split every source (once)
    python -m model_family.lm_target pack --out .gpu/lm.npz         # here: token streams, packed to travel
    python -m model_family.lm_target train --pack .gpu/lm.npz --out $OUT     # on the GPU machine, once or twice
    python -m model_family.lm_target install --parts DIR --out models/lm-target    # here: the returned model

`pack` tokenises the corpus with the family's tokenizer and keeps as much of each domain's train stream as fits the
size given (round-robin over the domains in slices, so every domain gets the same share until a small one runs
out), with a slice of each test stream for held-out perplexity; the slices are xz-compressed, so the file is the
size that travels. `train` unpacks it, trains on an equal mixture of the domains with bf16 autocast on a GPU, saves
a checkpoint (model, optimiser, data order, loss log) every `--every` steps and when this call's time budget runs
out (`--minutes`), and resumes from it when called again on the same machine: a run cut off at its budget is
continued by the next. When the last step is done it writes the report (held-out perplexity of this model and of
the shipped target on the shipped held-out passages, and the text statistics of its greedy output on the held-out
prompts the benchmarks use) and the model, fp16, as a tar cut in pieces of 15 MiB under `--out` (what a lent
machine sends back: 8 files of 16 MiB at most).
"""

from __future__ import annotations

import argparse
import io
import json
import lzma
import math
import tarfile
import time
from pathlib import Path

import numpy as np

from model_family import DOMAINS
from model_family.paths import REPO_ROOT

SLICE_TOKENS = 1 << 20  # the unit of the train streams' share-out
TEST_TOKENS = 1 << 18  # per domain: held-out perplexity of the packed test split
PIECE_BYTES = 15 << 20
ENTRY_BYTES = 512  # an array's headers in the npz (its .npy header, the zip's local and central entries)
SEQ_LEN, BATCH, LR = 512, 64, 1.5e-3
PROMPT_LEN, NEW_TOKENS, PROMPTS_PER_DOMAIN = 64, 128, 10


# ------------------------------------------------------------------------------------------------ pack / unpack
def _xz(a: np.ndarray) -> np.ndarray:
    data = a.astype(np.uint16).tobytes()
    # the dictionary no larger than the data: preset 9's 64 MiB would be allocated for every small slice
    lzma2 = {"id": lzma.FILTER_LZMA2, "preset": 9 | lzma.PRESET_EXTREME, "dict_size": max(1 << 16, len(data))}
    return np.frombuffer(lzma.compress(data, format=lzma.FORMAT_XZ, filters=[lzma2]), np.uint8)


def pack(data_dir: Path, tokenizer_dir: Path, out: Path, max_mib: float) -> dict:
    """`out`: each domain's test stream (its first TEST_TOKENS) and as many train slices as fit `max_mib`, all
    compressed; returns what was kept per domain."""
    from transformers import AutoTokenizer

    from model_family.data import token_streams

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    train, test = token_streams(data_dir, tok, "train"), token_streams(data_dir, tok, "test")
    arrays = {f"test/{d}": _xz(test[d][:TEST_TOKENS]) for d in DOMAINS}
    budget = max_mib * 2**20 - sum(a.nbytes + ENTRY_BYTES for a in arrays.values()) - ENTRY_BYTES
    if budget <= 0:
        raise ValueError(f"the test streams alone take more than {max_mib} MiB: give a larger --max-mib")
    slices = {d: [train[d][i:i + SLICE_TOKENS] for i in range(0, len(train[d]), SLICE_TOKENS)] for d in DOMAINS}
    kept = {d: 0 for d in DOMAINS}
    full = set()
    for i in range(max(map(len, slices.values()))):  # round by round: one more slice of every domain
        for d in DOMAINS:
            if d in full or i >= len(slices[d]):
                continue
            packed = _xz(slices[d][i])
            if packed.nbytes + ENTRY_BYTES > budget:
                full.add(d)
                continue
            arrays[f"train/{d}/{i}"] = packed
            budget -= packed.nbytes + ENTRY_BYTES
            kept[d] += len(slices[d][i])
    out.parent.mkdir(parents=True, exist_ok=True)
    np.savez(out, **arrays)
    report = {"bytes": out.stat().st_size, "train_tokens": kept,
              "train_tokens_available": {d: int(len(train[d])) for d in DOMAINS},
              "test_tokens": {d: int(min(len(test[d]), TEST_TOKENS)) for d in DOMAINS}}
    return report


def unpack(path: Path) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(train, test) streams per domain from a `pack` file."""
    def stream(a: np.ndarray) -> np.ndarray:
        return np.frombuffer(lzma.decompress(a.tobytes()), np.uint16)

    train: dict[str, list] = {d: [] for d in DOMAINS}
    test = {}
    with np.load(path) as z:
        for key in sorted(z.files, key=lambda k: (k.split("/")[:2], int(k.split("/")[2]) if k.count("/") == 2 else 0)):
            split, domain = key.split("/")[:2]
            if split == "test":
                test[domain] = stream(z[key])
            else:
                train[domain].append(stream(z[key]))
    return {d: np.concatenate(v) for d, v in train.items() if v}, test


# ------------------------------------------------------------------------------------------------ training
def plan_steps(work: Path, steps: int | None, step_seconds: float, minutes: float, runs: int) -> int:
    """The run's total steps, fixed by its first call (the schedule depends on it) in `work`/plan.json: `steps`,
    or as many as `runs` calls of `minutes` hold at the measured `step_seconds` (a fifth kept for the rest)."""
    path = work / "plan.json"
    if path.exists():
        return json.loads(path.read_text())["steps"]
    total = steps or max(1, int(0.8 * runs * minutes * 60 / step_seconds))
    work.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"steps": total, "step_seconds": step_seconds, "minutes": minutes, "runs": runs}))
    return total


def train(pack_path: Path, work: Path, out: Path | None, *, config=None, steps: int | None = None,
          minutes: float = 6.5, runs: int = 1, batch: int = BATCH, seq_len: int = SEQ_LEN, lr: float = LR,
          seed: int = 0, every: int = 200, device: str = "cuda", report: bool = True,
          prompts_per_domain: int = PROMPTS_PER_DOMAIN, on_step=None, log=print) -> dict | None:
    """One call of the training run kept in `work` (see the module docstring). Returns the report once training
    is done (the model saved to `work`/model, its pieces under `out`; without `report`, only the training figures
    and nothing saved), None when this call's budget ran out first (its checkpoint saved: call again).
    `on_step(steps_done)` runs after every step."""
    import torch
    import torch.nn.functional as F
    from transformers import LlamaForCausalLM

    from model_family.configs import lm_target_config
    from model_family.data import sample_windows
    from model_family.train import TrainingCut, fit, set_seed

    start = time.time()
    config = config or lm_target_config()
    train_streams, test_streams = unpack(pack_path)
    domains = sorted(train_streams)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.startswith("cuda") else None
    losses_path, ckpt = work / "loss.jsonl", work / "lm-target.ckpt"
    last = {"loss": None}

    def make_model():
        set_seed(seed)
        return LlamaForCausalLM(config).to(device)

    def batch_loss(rng: np.random.Generator, model) -> torch.Tensor:
        picks = rng.integers(0, len(domains), size=batch)
        x = torch.from_numpy(np.concatenate([sample_windows(train_streams[domains[d]], 1, seq_len + 1, rng)
                                             for d in picks])).to(device)
        with autocast or _nothing():
            logits = model(input_ids=x[:, :-1]).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1))
        last["loss"] = loss
        return loss

    if not (work / "plan.json").exists() and steps is None:  # time a few steps of a throwaway copy
        step_seconds = _step_seconds(make_model(), batch_loss, lr, seed, device)
    else:
        step_seconds = 0.0
    total = plan_steps(work, steps, step_seconds, minutes, runs)
    log(f"lm target: {sum(p.numel() for p in LlamaForCausalLM(config).parameters()) / 1e6:.1f}M parameters, "
        f"{total} steps of {batch} x {seq_len} tokens on {device}")
    model = make_model()
    done_before = torch.load(ckpt, weights_only=False, map_location="cpu")["step"] if ckpt.exists() else 0
    _truncate_log(losses_path, done_before)  # steps after the checkpoint were lost with the cut-off run

    def logged(done: int) -> None:
        with losses_path.open("a") as f:
            f.write(json.dumps({"step": done, "loss": round(last["loss"].item(), 6)}) + "\n")
        if on_step is not None:
            on_step(done)

    budget = minutes * 60 - (time.time() - start)
    try:
        seconds = fit(model, total, lr, seed, "lm-target", lambda rng: batch_loss(rng, model), checkpoint=ckpt,
                      every=every, on_step=logged, budget_s=max(1.0, budget))
    except TrainingCut as cut:
        log(f"{cut} (checkpoint {ckpt})")
        return None
    figures = {"params": sum(p.numel() for p in model.parameters()), "steps": total, "batch": batch,
               "seq_len": seq_len, "tokens": total * batch * seq_len, "seconds": seconds,
               "device": _device_name(device),
               "train_tokens": {d: int(len(s)) for d, s in train_streams.items()},
               "loss": [json.loads(line) for line in losses_path.read_text().splitlines()]}
    if not report:
        return figures
    result = evaluate(model.eval(), test_streams, device, per_domain=prompts_per_domain) | figures
    result["final_loss"] = result.pop("loss")[-1]["loss"]
    save(model, work / "model", result, out)
    return result


def _step_seconds(model, batch_loss, lr: float, seed: int, device: str) -> float:
    """Seconds per training step of `model` (a throwaway copy): eight steps, the last five timed."""
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    rng = np.random.default_rng(seed)
    for i in range(8):
        if i == 3:
            _sync(device)
            t = time.perf_counter()
        batch_loss(rng, model).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    _sync(device)
    return (time.perf_counter() - t) / 5


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _device_name(device: str) -> str:
    import torch

    return torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"


def _truncate_log(path: Path, steps: int) -> None:
    if path.exists():
        lines = [line for line in path.read_text().splitlines() if json.loads(line)["step"] <= steps]
        path.write_text("".join(line + "\n" for line in lines))


# ------------------------------------------------------------------------------------------------ report
def heldout_prompts(tokenizer, per_domain: int = PROMPTS_PER_DOMAIN, length: int = PROMPT_LEN) -> dict:
    """The benchmarks' prompts: the first `length` tokens of the shipped held-out passages."""
    from model_family.samples import heldout_texts

    return {d: [tokenizer(t, add_special_tokens=False).input_ids[:length] for t in texts[:per_domain]]
            for d, texts in heldout_texts().items()}


def greedy_outputs(model, prompts: list[list[int]], new_tokens: int = NEW_TOKENS) -> list[list[int]]:
    """Greedy continuations of `new_tokens` tokens each, EOS treated as any token (as the benchmarks' ignore_eos);
    prompts of one length run as one batch."""
    import torch

    device = next(model.parameters()).device
    model.generation_config.eos_token_id = None
    outs: dict[int, list[int]] = {}
    with torch.no_grad():
        for n in sorted({len(p) for p in prompts}):
            group = [i for i, p in enumerate(prompts) if len(p) == n]
            ids = torch.tensor([prompts[i] for i in group], device=device)
            out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
            outs |= {i: row[n:].tolist() for i, row in zip(group, out)}
    return [outs[i] for i in range(len(prompts))]


def evaluate(model, test_streams: dict[str, np.ndarray], device: str, shipped: Path | None = None,
             per_domain: int = PROMPTS_PER_DOMAIN) -> dict:
    """Held-out perplexity (the packed test split; the shipped held-out passages, for this model and the shipped
    target) and the text statistics of greedy outputs on the held-out prompts, per domain and over all."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from model_family.paths import model_path
    from model_family.samples import heldout_streams
    from model_family.text_stats import text_stats
    from model_family.train import perplexity

    tok = AutoTokenizer.from_pretrained(model_path("tokenizer"))
    shipped = shipped or model_path("target")
    old = AutoModelForCausalLM.from_pretrained(shipped, dtype=torch.float32).eval().to(device)
    passages = heldout_streams(shipped.parent, tok)
    prompts = heldout_prompts(tok, per_domain)
    outputs = {d: greedy_outputs(model, prompts[d]) for d in DOMAINS}
    old_outputs = {d: greedy_outputs(old, prompts[d]) for d in DOMAINS}
    seq = min(256, model.config.max_position_embeddings)
    report = {
        "held_out_ppl": {d: round(perplexity(model, s, seq), 2) for d, s in test_streams.items()},
        "shipped_held_out_ppl": {d: round(perplexity(model, passages[d], seq), 2) for d in DOMAINS},
        "shipped_held_out_ppl_of_the_shipped_target": {d: round(perplexity(old, passages[d], seq), 2)
                                                       for d in DOMAINS},
        "greedy_text": {d: text_stats(outputs[d]) for d in DOMAINS}
        | {"all": text_stats([o for d in DOMAINS for o in outputs[d]])},
        "greedy_text_of_the_shipped_target": text_stats([o for d in DOMAINS for o in old_outputs[d]]),
        "greedy_prompts": {"per_domain": per_domain, "prompt_len": PROMPT_LEN, "new_tokens": NEW_TOKENS},
    }
    report["goals"] = {
        "held_out_ppl_2x_lower_in_every_domain": all(
            2 * report["shipped_held_out_ppl"][d] <= report["shipped_held_out_ppl_of_the_shipped_target"][d]
            for d in DOMAINS),
        "greedy_median_repeated_4gram_share_under_0.3":
            report["greedy_text"]["all"]["repeated_4gram_share"]["median"] < 0.3}
    return report


# ------------------------------------------------------------------------------------------------ the model's trip
def save(model, model_dir: Path, report: dict, out: Path | None) -> list[Path]:
    """The model (fp16, with the family's tokenizer) in `model_dir`, and as a tar in pieces of PIECE_BYTES under
    `out`; returns the pieces."""
    from transformers import AutoTokenizer

    from model_family.paths import model_path
    from model_family.train import save_model

    save_model(model, model_dir, AutoTokenizer.from_pretrained(model_path("tokenizer")),
               {"role": "lm-target", **report})
    if out is None:
        return []
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.add(model_dir, arcname="lm-target")
    data = buf.getvalue()
    out.mkdir(parents=True, exist_ok=True)
    pieces = []
    for i in range(math.ceil(len(data) / PIECE_BYTES)):
        pieces.append(out / f"lm-target.tar.{i:02d}")
        pieces[-1].write_bytes(data[i * PIECE_BYTES:(i + 1) * PIECE_BYTES])
    (out / "lm-target-report.json").write_text(json.dumps(report, indent=2))
    return pieces


def install(parts: Path, dest: Path) -> Path:
    """The model from the pieces `save` wrote (in `parts`), unpacked as `dest`."""
    data = b"".join(p.read_bytes() for p in sorted(parts.glob("lm-target.tar.[0-9][0-9]")))
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(dest.parent / ".lm-target-unpack", filter="data")
    (dest.parent / ".lm-target-unpack" / "lm-target").replace(dest)
    (dest.parent / ".lm-target-unpack").rmdir()
    return dest


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m model_family.lm_target", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    pk = sub.add_parser("pack", help="data/lm -> one file of token streams that travels")
    pk.add_argument("--data-dir", default=str(REPO_ROOT / "data" / "lm"))
    pk.add_argument("--tokenizer", default=str(REPO_ROOT / "models" / "tokenizer"))
    pk.add_argument("--out", default=str(REPO_ROOT / ".gpu" / "lm.npz"))
    pk.add_argument("--max-mib", type=float, default=12.0, help="its size at most (the working tree and what it "
                    "carries travel to a lent machine within 64 MiB)")
    tr = sub.add_parser("train", help="train (or go on training) the larger target")
    tr.add_argument("--pack", default=str(REPO_ROOT / ".gpu" / "lm.npz"))
    tr.add_argument("--work", default=str(REPO_ROOT / "data" / "lm-target"), help="checkpoint, plan and loss log")
    tr.add_argument("--out", help="where the finished model's pieces and report go ($OUT on a lent machine)")
    tr.add_argument("--minutes", type=float, default=6.5, help="this call's time budget")
    tr.add_argument("--runs", type=int, default=1, help="calls the first one plans the steps for")
    tr.add_argument("--steps", type=int, help="total steps (default: as many as --runs calls of --minutes hold)")
    tr.add_argument("--every", type=int, default=200, help="checkpoint every this many steps")
    tr.add_argument("--device", default="cuda")
    ins = sub.add_parser("install", help="the returned pieces -> a model directory")
    ins.add_argument("--parts", required=True)
    ins.add_argument("--out", default=str(REPO_ROOT / "models" / "lm-target"))
    args = p.parse_args(argv)
    if args.command == "pack":
        report = pack(Path(args.data_dir), Path(args.tokenizer), Path(args.out), args.max_mib)
        print(json.dumps(report, indent=2))
        print(f"wrote {args.out}: {report['bytes'] / 2**20:.2f} MiB")
    elif args.command == "train":
        report = train(Path(args.pack), Path(args.work), Path(args.out) if args.out else None, steps=args.steps,
                       minutes=args.minutes, runs=args.runs, every=args.every, device=args.device)
        print("cut at its time budget: run the same command again" if report is None else json.dumps(report, indent=2))
    else:
        print(f"installed {install(Path(args.parts), Path(args.out))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
