"""Training prompts: 750-1250-token windows cut from each domain's text, or from the user's own files.

Each domain's sources are tokenized and cut into consecutive windows (lengths deterministic in the
seed); a domain's prompts are picked evenly across its windows, its sources taking turns. Prompts of
the held-out domains are all for evaluation; in a training domain every ``HOLDOUT_EVERY``-th prompt
is kept for in-domain evaluation and never trained on.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path

from kvzap_export.errors import InputError, MissingDependencyError

HOLDOUT_EVERY = 8
MIN_TOKENS, MAX_TOKENS = 750, 1250
USER_DOMAIN = "data"
TEXT_SUFFIXES = (".txt", ".text", ".md", ".rst")


@dataclass(frozen=True)
class Prompt:
    domain: str
    index: int
    text: str
    test: bool  # evaluation only, never trained on

    @property
    def key(self) -> str:
        """The cache file's name: by content, so a prompt keeps its targets when a larger run re-numbers it."""
        return f"{self.domain}_{self.digest[:16]}"

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()


def windows(tokenizer, docs: list[str], rng: random.Random) -> list[str]:
    """Consecutive windows of MIN_TOKENS-MAX_TOKENS tokens over the documents joined by blank lines."""
    text = "\n\n".join(d.strip() for d in docs if d.strip())
    ids = tokenizer(text, add_special_tokens=False).input_ids if text else []
    out, start = [], 0
    while start + MIN_TOKENS <= len(ids):
        length = rng.randint(MIN_TOKENS, MAX_TOKENS)
        out.append(tokenizer.decode(ids[start : start + length]))
        start += length
    return out


def spread(items: list, count: int) -> list:
    """``count`` items evenly spaced over the list (all of them if it is shorter)."""
    if count >= len(items):
        return list(items)
    return [items[(i * len(items)) // count] for i in range(count)]


def domain_prompts(tokenizer, domain: str, per_source_docs: list[list[str]], count: int, seed: int, test: bool) -> list[Prompt]:
    """``count`` prompts of one domain, its sources taking turns; ``test`` marks them all for evaluation.

    In a training domain every HOLDOUT_EVERY-th prompt of each source (the first included) is kept for
    evaluation, so every source is evaluated.
    """
    rng = random.Random(f"{seed}:{domain}")
    per_source = [windows(tokenizer, docs, rng) for docs in per_source_docs]
    shares = [count // len(per_source) + (i < count % len(per_source)) for i in range(len(per_source))] if per_source else []
    picked = [[(t, test or i % HOLDOUT_EVERY == 0) for i, t in enumerate(spread(w, n))] for w, n in zip(per_source, shares, strict=True)]
    chosen = [p[turn] for turn in range(max(map(len, picked), default=0)) for p in picked if turn < len(p)]
    if not chosen:
        raise InputError(f"the {domain} text has fewer than {MIN_TOKENS} tokens, not one prompt; give more text")
    return [Prompt(domain, i, t, is_test) for i, (t, is_test) in enumerate(chosen)]


Corpus = dict[str, list[list[str]]]  # domain -> each source's documents


def load_corpus(data: list[str] | None = None, notes: list[str] | None = None) -> Corpus:
    """The built-in training domains (or the user's data as one domain) and the held-out domains' documents.

    Without ``data`` every source must be installed (a MissingDependencyError says how). With it, a held-out
    domain whose sources are not installed is skipped with a note. Cheap next to loading a model: call it first.
    """
    from kvzap_export.train.sources import HELD_OUT_DOMAINS, TRAIN_DOMAINS, domain_sources

    corpus: Corpus = {}
    if data:
        corpus[USER_DOMAIN] = [read_user_data(data)]
    else:
        for domain in TRAIN_DOMAINS:
            corpus[domain] = [s.load() for s in domain_sources(domain)]
    for domain in HELD_OUT_DOMAINS:
        try:
            docs = [s.load() for s in domain_sources(domain)]
        except MissingDependencyError as exc:
            if not data:
                raise
            if notes is not None:
                notes.append(f"held-out domain {domain} skipped: {exc}")
            continue
        if docs:
            corpus[domain] = docs
    return corpus


def corpus_prompts(tokenizer, corpus: Corpus, prompts_per_domain: int, held_out_prompts: int, seed: int = 0) -> list[Prompt]:
    """Every domain's prompts: training domains' (1 in HOLDOUT_EVERY kept for evaluation), then held-out domains'."""
    from kvzap_export.train.sources import HELD_OUT_DOMAINS

    prompts: list[Prompt] = []
    for domain, docs in corpus.items():
        held = domain in HELD_OUT_DOMAINS
        chosen = domain_prompts(tokenizer, domain, docs, held_out_prompts if held else prompts_per_domain, seed, test=held)
        seen: set[str] = set()  # a text repeated in the corpus: one prompt (its cache file is named by the text)
        prompts += [p for p in chosen if not (p.digest in seen or seen.add(p.digest))]
    if not any(not p.test for p in prompts):
        raise InputError(f"the training text makes {sum(p.domain not in HELD_OUT_DOMAINS for p in prompts)} prompt(s) of "
                         f"{MIN_TOKENS}-{MAX_TOKENS} tokens, all kept for evaluation (1 in {HOLDOUT_EVERY}); give more text")
    return prompts


def read_user_data(paths: list[str]) -> list[str]:
    """Documents from text files (one each) and JSONL files (one per line, its ``text`` field); folders are searched."""
    files: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in (*TEXT_SUFFIXES, ".jsonl"))
            if not found:
                raise InputError(f"--data {raw}: the folder has no .txt/.md/.rst/.jsonl files")
            files += found
        elif path.is_file():
            if path.suffix.lower() not in (*TEXT_SUFFIXES, ".jsonl"):
                raise InputError(f"--data {raw}: unsupported file type {path.suffix or '(none)'}; give .txt/.md/.rst text or .jsonl")
            files.append(path)
        else:
            raise InputError(f"--data {raw}: no such file or folder")
    docs = []
    for path in files:
        try:
            raw_text = path.read_text(encoding="utf-8-sig")
        except UnicodeDecodeError as exc:
            raise InputError(f"--data {path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
        except OSError as exc:
            raise InputError(f"--data {path}: cannot be read ({exc.strerror})") from None
        if path.suffix.lower() != ".jsonl":
            docs.append(raw_text)
            continue
        for number, line in enumerate(raw_text.split("\n"), 1):  # not splitlines: JSON strings may hold U+2028
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise InputError(f"--data {path}:{number}: not JSON ({exc.msg}); each line must be an object with a \"text\" string") from None
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise InputError(f"--data {path}:{number}: each line must be an object with a \"text\" string")
            docs.append(record["text"])
    if not any(d.strip() for d in docs):
        raise InputError(f"--data {' '.join(paths)}: no text found")
    return docs
