"""A tiny random gpt-oss as a user would serve it: built by transformers, saved with a
byte-level tokenizer that has harmony's special tokens (`<|start|>`, `<|channel|>`,
`<|message|>`, `<|end|>`, `<|call|>`, `<|return|>`, `<|constrain|>`, ...) and the
checkpoint's own chat template (tests/data/gpt_oss_chat_template.jinja: the
openai/gpt-oss checkpoints' chat_template.jinja as llama.cpp keeps it,
models/templates/openai-gpt-oss-120b.jinja), then `colibri convert`ed. config.json's
`eos_token_id` is `<|return|>` alone, as the real checkpoints' is (`<|call|>` is the
server's to add)."""
from __future__ import annotations

import json
from pathlib import Path

DATA = Path(__file__).parent / "data"
TEMPLATE = (DATA / "gpt_oss_chat_template.jinja").read_text(encoding="utf-8")
SPECIALS = ("<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>",
            "<|channel|>", "<|start|>", "<|end|>", "<|message|>", "<|call|>")
VOCAB = 272                     # 256 bytes, 9 specials, padding


def tokenizer_json() -> str:
    """A byte-level BPE without merges (one token a byte: any text encodes) and the
    harmony specials as added special tokens, ids 256..264."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    alphabet = ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIALS))
    return tok.to_str()


def special_id(name: str) -> int:
    return 256 + SPECIALS.index(name)


def build(folder: Path, seed: int = 3) -> Path:
    """The converted model's directory (folder/model); folder/hf holds the checkpoint."""
    import torch
    from transformers import GptOssConfig, GptOssForCausalLM

    from colibri_core.convert import convert
    from hf_helpers import random_model
    folder = Path(folder)
    cfg = GptOssConfig(hidden_size=64, intermediate_size=64, num_local_experts=4,
                       num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, sliding_window=8,
                       max_position_embeddings=4096, eos_token_id=special_id("<|return|>"),
                       pad_token_id=special_id("<|endoftext|>"), bos_token_id=None,
                       rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                                        "beta_slow": 1.0, "truncate": False,
                                        "rope_theta": 10000.0,
                                        "original_max_position_embeddings": 1024})
    model = random_model(cfg, GptOssForCausalLM, seed)
    with torch.no_grad():
        for lyr in model.model.layers:
            lyr.self_attn.sinks.normal_(0.0, 1.0)
    hf = folder / "hf"
    model.save_pretrained(hf, safe_serialization=True)
    (hf / "tokenizer.json").write_text(tokenizer_json(), encoding="utf-8")
    (hf / "chat_template.jinja").write_text(TEMPLATE, encoding="utf-8")
    (hf / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|startoftext|>", "eos_token": "<|return|>",
        "pad_token": "<|endoftext|>", "tokenizer_class": "PreTrainedTokenizerFast"}))
    convert(hf, folder / "model")
    return folder / "model"
