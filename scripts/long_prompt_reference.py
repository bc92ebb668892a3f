"""kvpress's greedy tokens on long prompts, as a bundle the engine level validates against (issue 42: 4k and 7k tokens).

    python scripts/long_prompt_reference.py BUNDLE OUT --model DIR [--tokens 4096,7168 | --radix] [--new-tokens 32]
    kvzap-export validate OUT --engine sglang --engine-mode ragged --model DIR

Copies BUNDLE to OUT (a new directory) and replaces OUT's ``report/reference.json`` with kvpress's masked runs
(``DMSPress(KVzapPress)`` with the bundle's surrogate and settings, ``decoding=False`` and ``True``, float32, on the main
environment's transformers) on one prompt per length in ``--tokens``: the opening tokens of Python's own
documentation (pydoc topics), each length from its own part of the text. The engine level then runs exactly those
prompt ids through SGLang (its default chunked prefill splits the longer ones) and compares the tokens. BUNDLE is not
changed. Needs kvpress (``pip install -e ".[reference]"``) and the model as an HF directory
(``kvzap-export export-model``).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path


def long_prompts(tokenizer, lengths: list[int]) -> list[list[int]]:
    """One prompt per length, each from its own stretch of the pydoc topics text."""
    from pydoc_data.topics import topics

    ids = tokenizer("\n\n".join(topics[k] for k in sorted(topics)))["input_ids"]
    if len(ids) < sum(lengths):
        raise SystemExit(f"error: the pydoc text has {len(ids)} tokens, fewer than the {sum(lengths)} asked for")
    out, start = [], 0
    for n in lengths:
        out.append(ids[start:start + n])
        start += n
    return out


def radix_prompts(tokenizer) -> list[list[int]]:
    """Prompts built to hit SGLang's radix cache when run in order (issue 42), from stretches of the pydoc text: a
    300-token "system prompt" shared by prompts 1 and 2, its first 40 tokens shared by prompt 3, prompt 1 less its
    last 5 tokens (a match ending inside prompt 1's window) for prompt 4. Prompt 5 (prompt 1, its answer, a new
    question) is added by ``main`` once prompt 1's answer is known."""
    from pydoc_data.topics import topics

    ids = tokenizer("\n\n".join(topics[k] for k in sorted(topics)))["input_ids"]
    system, parts = ids[:300], [ids[1000 + 200 * i: 1000 + 200 * i + 60] for i in range(5)]
    first = system + parts[0]
    return [first, system + parts[1], system[:40] + parts[2], first[:-5] + parts[3][:20], parts[4][:20]]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description="kvpress's greedy tokens on long prompts, as a copy of a bundle "
                                                 "for `validate --engine sglang`.")
    parser.add_argument("bundle", help="a float32 bundle with its surrogate (the README's main command makes one)")
    parser.add_argument("out", help="where the copy goes (must not exist)")
    parser.add_argument("--model", required=True, help="the HF model directory (kvzap-export export-model)")
    parser.add_argument("--tokens", default="4096,7168", help="prompt lengths, comma-separated (default 4096,7168)")
    parser.add_argument("--new-tokens", type=int, default=32, help="greedy tokens per prompt (default 32)")
    parser.add_argument("--radix", action="store_true",
                        help="instead of --tokens: prompts that share prefixes, for SGLang's radix cache (shared prefixes "
                             "of 300 and 40 tokens, a match ending inside an earlier prompt's window, a prompt that "
                             "extends an earlier prompt and its answer)")
    args = parser.parse_args(argv)
    try:
        lengths = [int(t) for t in args.tokens.split(",") if t.strip()]
    except ValueError:
        parser.exit(2, f"error: --tokens {args.tokens}: give comma-separated positive integers\n")
    if not lengths or min(lengths) < 1 or args.new_tokens < 1:
        parser.exit(2, f"error: --tokens {args.tokens} / --new-tokens {args.new_tokens}: give positive integers\n")
    out = Path(args.out)
    if out.exists():
        parser.exit(2, f"error: {out} exists; give a new directory (the bundle is copied there)\n")

    import torch

    from kvzap_export.bundle.manifest import read_manifest
    from kvzap_export.llm import load_llm
    from kvzap_export.validate import reference as ref

    manifest = read_manifest(Path(args.bundle))
    llm, tokenizer = load_llm(args.model, dtype="float32")
    context = int(getattr(llm.config, "max_position_embeddings", 0) or 0)
    if context and max(lengths) + args.new_tokens > context:
        parser.exit(2, f"error: --tokens {args.tokens}: {max(lengths)} + {args.new_tokens} new tokens exceeds the model's "
                       f"context of {context}\n")
    prompts = radix_prompts(tokenizer) if args.radix else long_prompts(tokenizer, lengths)
    tail = prompts.pop() if args.radix else None  # prompt 5's new question, after prompt 1 and its answer
    reference = ref.new_reference(manifest, args.model, "float32", args.new_tokens)
    answers = []
    while prompts:
        ids = prompts.pop(0)
        runs = {}
        for decoding in (False, True):
            started = time.perf_counter()
            press = ref.kvpress_press(Path(args.bundle), manifest, llm, decoding)
            run = ref.generate_kvpress(llm, torch.tensor([ids]), Path(args.bundle), manifest, args.new_tokens, decoding,
                                       press=press)
            runs[decoding] = run.tokens
            print(f"kvpress, {len(ids)}-token prompt, decoding={decoding}: {time.perf_counter() - started:.0f} s",
                  file=sys.stderr, flush=True)
        ref.add_prompt(reference, f"pydoc topics, {len(ids)} tokens", torch.tensor([ids]), runs)
        answers.append(torch.as_tensor(runs[False]).reshape(-1).tolist())
        if tail is not None and len(answers) == 1:  # prompt 1, kvpress's answer to it, a new question
            prompts.append(ids + answers[0] + tail)
    shutil.copytree(args.bundle, out)
    print(ref.write_reference(out, reference))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
