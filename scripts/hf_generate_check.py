#!/usr/bin/env python3
"""An exported model directory, as `transformers` sees it: `AutoTokenizer` and
`AutoModelForCausalLM` load it as it is, and a greedy text-generation pipeline continues a
prompt with the same text as `meshtrain generate --temperature 0` from the checkpoint it was
exported from (issue 40: the tokenizer travels with the model).

    python3 scripts/hf_generate_check.py MESHTRAIN_BINARY CHECKPOINT EXPORTED_DIR \
        [--prompt "ROMEO:"] [--max-tokens 40]

Prints both continuations and "ok" or "DIFFER"; exits 1 when they differ. Run where
transformers is installed (CI keeps the pure-Rust checks: tests/hf_interop.rs and the
tokenizer's ids against tiktoken in tokenizer_export.rs).
"""
import argparse
import subprocess
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline


def main():
    p = argparse.ArgumentParser()
    p.add_argument("meshtrain")
    p.add_argument("checkpoint")
    p.add_argument("exported")
    p.add_argument("--prompt", default="ROMEO:")
    p.add_argument("--max-tokens", type=int, default=40)
    a = p.parse_args()
    ours = subprocess.run(
        [a.meshtrain, "generate", "--checkpoint", a.checkpoint, "--prompt", a.prompt,
         "--max-tokens", str(a.max_tokens), "--temperature", "0"],
        capture_output=True, text=True, check=True).stdout
    ours = ours[:-1] if ours.endswith("\n") else ours  # the newline generate ends with
    tokenizer = AutoTokenizer.from_pretrained(a.exported)
    model = AutoModelForCausalLM.from_pretrained(a.exported, dtype=torch.float32)
    generate = pipeline("text-generation", model=model, tokenizer=tokenizer, device="cpu")
    theirs = generate(a.prompt, max_new_tokens=a.max_tokens, do_sample=False,
                      return_full_text=True)[0]["generated_text"]
    print("meshtrain:   ", repr(ours))
    print("transformers:", repr(theirs))
    # meshtrain stops at the end of text and prints what it decoded; compare the common part.
    same = ours.startswith(theirs) or theirs.startswith(ours)
    print("ok" if same else "DIFFER")
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
