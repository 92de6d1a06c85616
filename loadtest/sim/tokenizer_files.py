"""A small model tokenizer for the simulator and its tests: byte-level BPE, trained here.

    python -m loadtest.sim.tokenizer_files DIR

writes `tokenizer.json` and `tokenizer_config.json` (the chat template of the tiny Llama the
real-vLLM runs serve, loadtest/real_vllm/tiny_model.py) into DIR: what `spillgate sim
--tokenizer DIR` and a pool's `tokenizer: DIR` read, so the simulator's prompts become the ids
a real engine with this tokenizer would see, and the gateway tokenizes alike. Training is
deterministic and takes well under a second: a corpus of the filler's words and some prose.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from loadtest.real_vllm.tiny_model import CHAT_TEMPLATE, train_bpe
from loadtest.sim.tokens import _WORDS

VOCAB_SIZE = 512
_PROSE = (
    "Spillgate sits in front of fleets of inference servers and knows how many tokens each "
    "backend can hold in flight. When a spike exceeds the fleet it queues briefly, spills to "
    "an external provider, answers from cache, or degrades to a smaller model, and only then "
    "refuses, with a Retry-After that tells the truth. You are a helpful assistant for tenant "
)


def corpus() -> list[str]:
    words = " ".join(_WORDS)
    return [_PROSE * 4, words * 8, "0123456789 " * 20, "abcdefghijklmnopqrstuvwxyz " * 10]


def write(directory: str | Path) -> Path:
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    tok = train_bpe(corpus(), vocab_size=VOCAB_SIZE)
    tok.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "chat_template": CHAT_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return path


if __name__ == "__main__":
    write(sys.argv[1])
