"""Writes the files of a tiny Llama that vLLM can load with `--load-format dummy`.

    $VLLM_VENV/bin/python loadtest/real_vllm/tiny_model.py DIR

Nothing is downloaded: the BPE tokenizer is trained here, offline and deterministically, on
Python's own standard library sources and the system's licence texts; the weights are
vLLM's random ones. Output is gibberish; everything else (scheduler, KV blocks, metrics,
SSE framing) is vLLM's own. Runs under the vLLM virtualenv, which brings `tokenizers`.
"""

from __future__ import annotations

import glob
import json
import os
import sys
import sysconfig
from collections.abc import Iterable, Iterator
from typing import Any

SPECIAL = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
VOCAB_SIZE = 4096
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['content'] is string %}{% set c = message['content'] %}"
    "{% else %}{% set c = message['content'] | map(attribute='text') | join('') %}{% endif %}"
    "{{ '<|' + message['role'] + '|>\n' + c + '<|end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def corpus_files() -> list[str]:
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))[:150]
    files += sorted(glob.glob("/usr/share/common-licenses/*"))
    return [f for f in files if os.path.isfile(f)]


def corpus(files: list[str]) -> Iterator[str]:
    for name in files:
        with open(name, encoding="utf-8", errors="ignore") as fh:
            yield fh.read()


def model_files(*, vocab: int, bos: int, eos: int) -> dict[str, dict[str, Any]]:
    return {
        "config.json": {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
            "hidden_act": "silu", "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0, "attention_bias": False, "mlp_bias": False,
            "tie_word_embeddings": False, "vocab_size": vocab, "bos_token_id": bos,
            "eos_token_id": eos, "pad_token_id": None, "initializer_range": 0.02,
            "torch_dtype": "bfloat16", "use_cache": True,
        },
        "tokenizer_config.json": {
            "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
            "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "</s>",
            "add_bos_token": False, "add_eos_token": False, "model_max_length": 4096,
            "clean_up_tokenization_spaces": False, "chat_template": CHAT_TEMPLATE,
        },
        "generation_config.json": {"bos_token_id": bos, "eos_token_id": eos},
        "special_tokens_map.json": {
            "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "</s>",
        },
    }  # fmt: skip


def train_bpe(texts: Iterable[str], *, vocab_size: int) -> Any:
    """A byte-level BPE tokenizer with SPECIAL, trained on `texts` (a `tokenizers.Tokenizer`;
    the simulator's tokenizer, loadtest/sim/tokenizer_files.py, is trained the same way)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def main(out: str) -> None:
    tok = train_bpe(corpus(corpus_files()), vocab_size=VOCAB_SIZE)
    tok.save(os.path.join(out, "tokenizer.json"))
    vocab, bos, eos = tok.get_vocab_size(), tok.token_to_id("<s>"), tok.token_to_id("</s>")
    for name, obj in model_files(vocab=vocab, bos=bos, eos=eos).items():
        with open(os.path.join(out, name), "w") as fh:
            json.dump(obj, fh, indent=2)
    print(f"[real-vllm] tokenizer vocab_size={vocab} bos={bos} eos={eos}", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1])
