"""The tiny policy: a small random Llama and a character tokenizer, built here (no hub).

One architecture for the trainer's `--model tiny` and for the folder `rolloutlake engine
--model tiny` serves, so engine and trainer agree on weights and tokens. Its shape is set
by what vLLM's CPU build accepts: head_dim 64 (its attention kernel rejects 16), and an
untied LM head, because a weight reload in place keeps a tied head's old weights. Llama
rather than Qwen2: for a `qwen2` folder transformers' AutoTokenizer swaps in its own
byte-level BPE pipeline and would not load the character tokenizer saved beside it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)
# Arithmetic and short English prompts; with the 4 special tokens exactly 64 ids.
ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyz +-*/=()<>.,:;?!'\"#%&_[]"
TINY_POLICY_VOCAB_SIZE = len(SPECIAL_TOKENS) + len(ALPHABET)
MAX_POSITIONS = 4096


def tiny_config(vocab_size: int) -> LlamaConfig:
    """2 layers, hidden 128, 2 heads of 64, untied LM head."""
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=False,
        pad_token_id=SPECIAL_TOKENS.index(PAD),
        bos_token_id=SPECIAL_TOKENS.index(BOS),
        eos_token_id=SPECIAL_TOKENS.index(EOS),
    )


def tiny_model(vocab_size: int, seed: int, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    # transformers' wrapper of PreTrainedModel.to types `self` as its first argument.
    return LlamaForCausalLM(tiny_config(vocab_size)).to(dtype)  # type: ignore[arg-type]


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character of `ALPHABET`; anything else is `<unk>`."""
    vocab = {token: i for i, token in enumerate((*SPECIAL_TOKENS, *ALPHABET))}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token=PAD, bos_token=BOS, eos_token=EOS, unk_token=UNK,
        model_max_length=MAX_POSITIONS,
    )


def write_tiny_policy(directory: Path, seed: int = 1234) -> Path:
    """Save the tiny policy (weights, config, tokenizer) as a Hugging Face folder.

    An existing folder is kept as it is: engine and trainer started one after the other
    must load the same weights. Written to a temporary folder first and renamed, so a
    killed writer never leaves half a model behind.
    """
    directory = Path(directory)
    if (directory / "config.json").is_file():
        return directory
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".tiny-", dir=directory.parent))
    try:
        tiny_model(TINY_POLICY_VOCAB_SIZE, seed).save_pretrained(staging)
        tiny_tokenizer().save_pretrained(staging)
        os.replace(staging, directory)
    except OSError:
        if not (directory / "config.json").is_file():  # not a concurrent writer that won
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return directory
