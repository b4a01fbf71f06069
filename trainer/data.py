"""Token sources: what a target producer feeds the target and the drafters.

Each source answers `batch(step, stream) -> (tokens (b, T) int64, anchors (b, A) int64 sorted)` as a pure
function of (seed, step, stream), so runs reproduce regardless of thread timing and a resumed run sees the
same data it would have seen. `stream` is the drafter index. Sources return CPU tensors; moving them to a
device is the pipeline's job. The last vocabulary id is reserved for the drafter's MASK token.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from trainer.config import Config, ConfigError


class TokenSource(Protocol):
    def batch(self, step: int, stream: int) -> tuple[torch.Tensor, torch.Tensor]: ...


def _rng(seed: int, step: int, stream: int) -> random.Random:
    return random.Random(f"{seed}/{step}/{stream}")


def _anchors(rng: random.Random, batch: int, seq_len: int, block: int, count: int) -> torch.Tensor:
    rows = [sorted(rng.sample(range(seq_len - block + 1), count)) for _ in range(batch)]
    return torch.tensor(rows, dtype=torch.int64)  # (b, A)


class SyntheticSource:
    """A seeded Markov chain: each token has one fixed successor, taken with probability `stay`.

    The chain runs over `data.markov_tokens` ids drawn at random from [0, V-1) (V-1 is MASK), or over all
    of them when that is 0. Learnable (the block's k-th token is the k-fold successor of the anchor with
    probability stay**k), so the drafter's loss falls far below uniform, as long as the chain is small
    enough to be learnt: over a large vocabulary a sample never revisits a token (see DataConfig).
    """

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.vocab = cfg.target.vocab_size - 1
        chain = random.Random(f"chain/{cfg.run.seed}")
        count = cfg.data.markov_tokens or self.vocab
        self.ids = chain.sample(range(self.vocab), count) if cfg.data.markov_tokens else None
        self.successor = list(range(count))
        chain.shuffle(self.successor)

    def _sequence(self, rng: random.Random) -> list[int]:
        count = len(self.successor)
        token = rng.randrange(count)
        sequence = [token]
        stay = self.cfg.data.markov_stay
        for _ in range(self.cfg.data.seq_len - 1):
            token = self.successor[token] if rng.random() < stay else rng.randrange(count)
            sequence.append(token)
        return sequence if self.ids is None else [self.ids[index] for index in sequence]

    def batch(self, step: int, stream: int) -> tuple[torch.Tensor, torch.Tensor]:
        rng = _rng(self.cfg.run.seed, step, stream)
        data, drafter = self.cfg.data, self.cfg.drafter
        tokens = torch.tensor([self._sequence(rng) for _ in range(data.batch)], dtype=torch.int64)  # (b, T)
        return tokens, _anchors(rng, data.batch, data.seq_len, drafter.block_size, drafter.anchors)


class TokenArraySource:
    """Random windows of a flat token array (a nanoGPT-style uint16 .bin file, or tokenized jsonl)."""

    def __init__(self, cfg: Config, tokens: np.ndarray) -> None:
        if len(tokens) <= cfg.data.seq_len:
            raise ConfigError(f"data.path: expected more than data.seq_len={cfg.data.seq_len} tokens")
        if int(tokens.max()) >= cfg.target.vocab_size - 1:
            raise ConfigError("target.vocab_size: expected more than the largest token id + 1 (MASK)")
        self.cfg, self.tokens = cfg, tokens

    def batch(self, step: int, stream: int) -> tuple[torch.Tensor, torch.Tensor]:
        rng = _rng(self.cfg.run.seed, step, stream)
        data, drafter = self.cfg.data, self.cfg.drafter
        starts = [rng.randrange(len(self.tokens) - data.seq_len) for _ in range(data.batch)]
        windows = np.stack([self.tokens[s : s + data.seq_len].astype(np.int64) for s in starts])
        anchors = _anchors(rng, data.batch, data.seq_len, drafter.block_size, drafter.anchors)
        return torch.from_numpy(windows), anchors  # (b, T), (b, A)


def _load_bin(path: str) -> np.ndarray:
    if not Path(path).is_file():
        raise ConfigError(f"data.path: expected a uint16 token file, {path!r} does not exist")
    return np.memmap(path, dtype=np.uint16, mode="r")


def _load_jsonl(cfg: Config) -> np.ndarray:
    if not Path(cfg.data.path).is_file() or not cfg.data.tokenizer:
        raise ConfigError("data.path/data.tokenizer: expected a jsonl file and a local tokenizer directory")
    from transformers import AutoTokenizer  # optional dependency, only for jsonl

    tokenizer = AutoTokenizer.from_pretrained(cfg.data.tokenizer, local_files_only=True)
    ids: list[int] = []
    with open(cfg.data.path, encoding="utf-8") as lines:
        for line in lines:
            if line.strip():
                ids.extend(tokenizer.encode(json.loads(line)[cfg.data.text_key]))
                ids.append(tokenizer.eos_token_id or 0)
    return np.asarray(ids, dtype=np.int64)


def build_source(cfg: Config) -> TokenSource:
    if cfg.data.source == "bin":
        return TokenArraySource(cfg, _load_bin(cfg.data.path))
    if cfg.data.source == "jsonl":
        return TokenArraySource(cfg, _load_jsonl(cfg))
    return SyntheticSource(cfg)
