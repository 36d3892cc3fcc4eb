#!/usr/bin/env python3
"""Hugging Face references for crates/meshtrain/tests/hf_interop.rs, from `transformers` itself.

Writes into crates/meshtrain/tests/refs/hf/:
  meshtrain-*/logits.json  transformers' logits for models meshtrain exported (run first:
                           MESHTRAIN_HF_WRITE=1 cargo test --release -p meshtrain
                           --test hf_interop -- write)
  hf-*/                    models transformers initialised at random and saved
                           (config.json + model.safetensors), with their logits.json
All logits are for the token ids in ids.json, in fp32 on the CPU, with the attention
implementation "eager" (plain softmax(QK^T)V).

And into crates/meshtrain/tests/refs/tokenizers/ (for tests/hf_tokenizer.rs): two small
tokenizer.json files trained on the corpus with Hugging Face's `tokenizers` (byte-level BPE as
GPT-2 / Llama 3; SentencePiece-style BPE with byte fallback as Llama 2), each with the ids and
decoding of a sample text (encoded.json).

Setup (PyPI only; the default Linux wheel of torch is the CUDA build, which runs on a CPU):
  python3 -m venv /tmp/hfvenv && /tmp/hfvenv/bin/pip install torch transformers safetensors
  /tmp/hfvenv/bin/python scripts/hf_reference.py
"""
import argparse
import json
import pathlib

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import (AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaConfig,
                          LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

ROOT = pathlib.Path(__file__).resolve().parent.parent
REFS = ROOT / "crates/meshtrain/tests/refs/hf"


def logits(model, ids):
    model.eval()
    with torch.no_grad():
        out = model(torch.tensor(ids, dtype=torch.long)).logits
    return out.float().tolist()


def write_logits(directory, values):
    (directory / "logits.json").write_text(json.dumps(values) + "\n")


TOKENIZER_TEXT = ("ROMEO:\nBut soft, what light through yonder window breaks? Café naïve — "
                  "東京 ☃\n\nJULIET:\n  O Romeo!")


def byte_level_tokenizer(lines):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(lines, trainer)
    return tok


def sentencepiece_tokenizer(lines):
    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence(
        [normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tok.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=700, special_tokens=specials))
    return tok


def tokenizer_references():
    out = REFS.parent / "tokenizers"
    lines = (ROOT / "data/shakespeare/input.txt").read_text().splitlines()
    for name, make in [("bytelevel", byte_level_tokenizer),
                       ("sentencepiece", sentencepiece_tokenizer)]:
        directory = out / name
        directory.mkdir(parents=True, exist_ok=True)
        make(lines).save(str(directory / "tokenizer.json"))
        tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
        ids = tok.encode(TOKENIZER_TEXT, add_special_tokens=False).ids
        record = {"text": TOKENIZER_TEXT, "ids": ids,
                  "decoded": tok.decode(ids, skip_special_tokens=False),
                  "vocab": tok.get_vocab_size(True)}
        (directory / "encoded.json").write_text(json.dumps(record, ensure_ascii=False) + "\n")
        print(f"tokenizer {name}: vocabulary {record['vocab']}, {len(ids)} ids")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="*", help="write only these references (new ones: hf-* "
                        "models, or meshtrain-* logits), leaving the others and the tokenizers "
                        "as they are")
    args = parser.parse_args()
    torch.manual_seed(0)
    ids = json.loads((REFS / "ids.json").read_text())
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")

    exported = [d for d in sorted(REFS.glob("meshtrain-*")) if not args.only or d.name in args.only]
    for directory in exported:
        model = AutoModelForCausalLM.from_pretrained(
            directory, torch_dtype=torch.float32, attn_implementation="eager")
        write_logits(directory, logits(model, ids))
        print(f"{directory.name}: {type(model).__name__} logits written")

    # Models transformers initialises itself. Wider than the usual 0.02 so that every layer
    # moves the logits; GPT-2 with its own default GELU, the tanh approximation ("gelu_new"),
    # as the downloaded GPT-2 weights have it (meshtrain: model.gelu = "tanh").
    made = {
        "hf-gpt2": GPT2LMHeadModel(GPT2Config(
            vocab_size=256, n_positions=16, n_embd=32, n_layer=2, n_head=4,
            initializer_range=0.2,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
        "hf-llama": LlamaForCausalLM(LlamaConfig(
            vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
            rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
            initializer_range=0.2)),
        # Llama 3.1's rotary rescaling (as tests/hf_interop.rs's LLAMA3_SCALED).
        "hf-llama3-scaled": LlamaForCausalLM(LlamaConfig(
            vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
            rms_norm_eps=1e-5, tie_word_embeddings=False, initializer_range=0.2,
            rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 256})),
        # Mistral: the Llama block with a sliding window, here no shorter than the context
        # (then it is full causal attention); untied.
        "hf-mistral": MistralForCausalLM(MistralConfig(
            vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=16,
            rms_norm_eps=1e-5, rope_theta=1000000.0, sliding_window=16,
            tie_word_embeddings=False, initializer_range=0.2)),
        # Mistral with a window that binds: each of the 16 positions sees at most the last 5
        # (meshtrain: model.sliding_window = 5).
        "hf-mistral-window": MistralForCausalLM(MistralConfig(
            vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
            rms_norm_eps=1e-5, rope_theta=10000.0, sliding_window=5,
            tie_word_embeddings=False, initializer_range=0.2)),
        # Qwen2 (Qwen2.5's small models): the Llama block with biases on q, k and v, tied.
        "hf-qwen2": Qwen2ForCausalLM(Qwen2Config(
            vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
            rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
            use_sliding_window=False, initializer_range=0.2)),
        # Qwen3: the Llama block with RMS norms on each query and key head and its own head
        # size (12 here, over a width of 32, as Qwen3-0.6B's 128 over 1,024), tied.
        "hf-qwen3": Qwen3ForCausalLM(Qwen3Config(
            vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=12,
            max_position_embeddings=16, rms_norm_eps=1e-6, rope_theta=1000000.0,
            tie_word_embeddings=True, use_sliding_window=False, initializer_range=0.2)),
        # SmolLM2's shape of Llama: tied embeddings, θ = 100000, heads of 8 over 3 key/value
        # heads.
        "hf-smollm": LlamaForCausalLM(LlamaConfig(
            vocab_size=256, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=6, num_key_value_heads=3, max_position_embeddings=16,
            rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True,
            initializer_range=0.2)),
    }
    if args.only:
        made = {name: model for name, model in made.items() if name in args.only}
    for name, model in made.items():
        # Norm weights start at one; move them so a swapped or ignored norm weight shows.
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if "norm" in pname or "ln_" in pname:
                    p.add_(0.3 * torch.randn_like(p))
        directory = REFS / name
        model.save_pretrained(directory, safe_serialization=True)
        model = AutoModelForCausalLM.from_pretrained(
            directory, torch_dtype=torch.float32, attn_implementation="eager")
        write_logits(directory, logits(model, ids))
        print(f"{name}: saved with its logits")

    if not args.only:
        tokenizer_references()


if __name__ == "__main__":
    main()
