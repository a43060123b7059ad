"""The tiny policy folder: loadable by Hugging Face, untied, one token per character."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from trainer.tiny import ALPHABET, write_tiny_policy


def test_tiny_policy_folder_loads_with_auto_classes(tmp_path):
    folder = write_tiny_policy(tmp_path / "tiny")
    model = AutoModelForCausalLM.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    config = model.config
    assert config.vocab_size == 64 == len(tokenizer)
    assert config.hidden_size // config.num_attention_heads == 64  # vLLM's CPU kernel needs 64
    assert config.tie_word_embeddings is False
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()


def test_tokenizer_is_one_token_per_character_and_round_trips(tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(write_tiny_policy(tmp_path / "tiny"))
    text = "12+34=46"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text)
    assert len(set(ids)) == len(set(text))
    assert tokenizer.decode(ids) == text
    unknown = tokenizer("~", add_special_tokens=False)["input_ids"]
    assert unknown == [tokenizer.unk_token_id]
    assert "~" not in ALPHABET


def test_existing_folder_is_kept_so_engine_and_trainer_share_weights(tmp_path):
    folder = write_tiny_policy(tmp_path / "tiny", seed=1)
    first = AutoModelForCausalLM.from_pretrained(folder).lm_head.weight.clone()
    write_tiny_policy(folder, seed=2)
    again = AutoModelForCausalLM.from_pretrained(folder).lm_head.weight
    assert torch.equal(first, again)
    other = AutoModelForCausalLM.from_pretrained(write_tiny_policy(tmp_path / "b", seed=2))
    assert not torch.equal(first, other.lm_head.weight)
    assert not list(tmp_path.glob(".tiny-*"))  # no staging folder left behind
