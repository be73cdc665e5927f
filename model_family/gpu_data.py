"""What the distill and drafters steps read from data/, packed small enough to travel to a GPU machine.

Those steps need only the token streams of every domain: the train split (prompts and text windows of the
distill sets) and the test split (held-out perplexity). The corpora's text stays behind. `pack` writes both
streams of all six domains into one xz-compressed npz (about 7 MiB); `unpack` writes them where
`model_family.data.token_streams` looks for its caches, so the steps run there without the corpora.

    python -m model_family.gpu_data pack --out .gpu/data.npz.xz      # here; reads data/, writes nothing there
    python -m model_family.gpu_data unpack .gpu/data.npz.xz          # on the GPU machine, from the repo root
"""

from __future__ import annotations

import argparse
import io
import lzma
from pathlib import Path

import numpy as np

from model_family import DOMAINS
from model_family.paths import REPO_ROOT

SPLITS = ("train", "test")


def _stream(data_dir: Path, domain: str, split: str, tokenizer_dir: Path) -> np.ndarray:
    """The cached stream, or the split tokenised here (as `token_streams` would) without writing the cache."""
    cache = data_dir / domain / f"{split}.tokens.npy"
    if cache.exists():
        return np.load(cache)
    from transformers import AutoTokenizer

    from model_family.corpora import load_split
    from model_family.data import tokenize_split

    return tokenize_split(AutoTokenizer.from_pretrained(tokenizer_dir), load_split(data_dir, domain, split))


def pack(data_dir: Path, tokenizer_dir: Path, out: Path) -> int:
    """Writes `out`; returns its size in bytes."""
    arrays = {f"{d}/{s}": _stream(data_dir, d, s, tokenizer_dir) for d in DOMAINS for s in SPLITS}
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(lzma.compress(buf.getvalue(), preset=9 | lzma.PRESET_EXTREME))
    return out.stat().st_size


def unpack(src: Path, data_dir: Path) -> list[Path]:
    """Writes data_dir/<domain>/<split>.tokens.npy from a `pack` file; returns the paths written."""
    written = []
    with np.load(io.BytesIO(lzma.decompress(src.read_bytes()))) as z:
        for key in z.files:
            domain, split = key.split("/")
            path = data_dir / domain / f"{split}.tokens.npy"
            path.parent.mkdir(parents=True, exist_ok=True)
            np.save(path, z[key])
            written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m model_family.gpu_data", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    pk = sub.add_parser("pack", help="data/ -> one compressed file")
    pk.add_argument("--data-dir", default=str(REPO_ROOT / "data"))
    pk.add_argument("--tokenizer", default=str(REPO_ROOT / "models" / "tokenizer"))
    pk.add_argument("--out", default=str(REPO_ROOT / ".gpu" / "data.npz.xz"))
    un = sub.add_parser("unpack", help="a packed file -> the token caches under data/")
    un.add_argument("src")
    un.add_argument("--data-dir", default=str(REPO_ROOT / "data"))
    args = p.parse_args(argv)
    if args.command == "pack":
        size = pack(Path(args.data_dir), Path(args.tokenizer), Path(args.out))
        print(f"wrote {args.out}: {size / 2**20:.2f} MiB")
    else:
        paths = unpack(Path(args.src), Path(args.data_dir))
        print(f"wrote {len(paths)} token streams under {args.data_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
