"""The training corpus's sources: English text of several kinds, each installed offline, with its licence.

Every source is text that a package registry this project reaches installs (Debian's packages, see
``scripts/install_corpus.sh``) or that CPython carries. Sources are grouped into domains; the
domains in :data:`HELD_OUT_DOMAINS` are never trained on (legal and licence texts, quotations), so
the training report measures how the surrogate generalises to kinds of text it never saw.
"""

from __future__ import annotations

import gzip
import re
import shutil
import subprocess
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvzap_export.errors import MissingDependencyError

INSTALL_HINT = "install the corpus with scripts/install_corpus.sh (Debian packages, as root)"

DOMAINS = {
    "narrative": "narrative prose",
    "expository": "expository essays (glossary entries in prose)",
    "qa": "questions and answers (FAQs)",
    "technical": "technical documentation",
    "code": "source code with its comments and docstrings",
    "legal": "legal and licence texts (held out: never trained on)",
    "quotations": "quotations, jokes and verse (held out: never trained on)",
}
HELD_OUT_DOMAINS = ("legal", "quotations")
TRAIN_DOMAINS = tuple(d for d in DOMAINS if d not in HELD_OUT_DOMAINS)

# Narrative books of the King James Version (chapter ranges as the `bible` program reads them).
KJV_BOOKS = ("gen1:1-50:26", "exo1:1-20:26", "jos1:1-24:33", "jdg1:1-21:25", "rut1:1-4:22", "1sa1:1-31:13",
             "2sa1:1-24:25", "1ki1:1-22:53", "2ki1:1-25:30", "est1:1-10:3", "dan1:1-6:28", "jon1:1-4:11",
             "mat1:1-28:20", "mar1:1-16:20", "luk1:1-24:53", "joh1:1-21:25", "act1:1-28:31")
STDLIB_MODULES = ("argparse.py", "collections/__init__.py", "dataclasses.py", "functools.py", "inspect.py", "json/decoder.py",
                  "pathlib.py", "random.py", "statistics.py", "string.py", "textwrap.py", "typing.py", "logging/__init__.py",
                  "shutil.py", "subprocess.py", "tarfile.py", "zipfile.py", "email/message.py", "http/client.py",
                  "urllib/parse.py", "csv.py", "difflib.py", "fractions.py", "heapq.py", "enum.py", "configparser.py")


@dataclass(frozen=True)
class Source:
    name: str
    domain: str
    title: str
    licence: str
    provider: str
    load: Callable[[], list[str]]


def _read_text(path: Path, package: str) -> str:
    if not path.is_file():
        raise MissingDependencyError(f"{path} is missing (Debian package {package}): {INSTALL_HINT}")
    data = path.read_bytes()
    if path.suffix in (".gz", ".dz"):
        data = gzip.decompress(data)
    return data.decode("utf-8", errors="replace")


def _kjv() -> list[str]:
    exe = shutil.which("bible")
    if exe is None:
        raise MissingDependencyError(f"the `bible` program is missing (Debian package bible-kjv): {INSTALL_HINT}")
    docs = []
    for spec in KJV_BOOKS:
        out = subprocess.run([exe, spec], capture_output=True, text=True, check=True).stdout
        chapters = re.split(r"\n(?=\S[^\n]* \d+\n)", out.strip())  # "Genesis 1" headings start chapters
        for chapter in chapters:
            heading, _, body = chapter.strip().partition("\n")
            verses = re.sub(r"^\s*\d+ ", "", body, flags=re.M)  # verse numbers
            docs.append(heading.strip() + "\n\n" + " ".join(verses.split()))
    return docs


def _dictd(path: Path, package: str) -> list[str]:
    """Entries of a dictd database (header entries ``00-database-*`` dropped), cross-reference braces removed."""
    text = _read_text(path, package)
    entries = re.split(r"\n(?=\S)", text)
    return [re.sub(r"\{\s*([^}]*)\}", r"\1", e).strip() for e in entries if e.strip() and not e.startswith("00-database")]


def _python_doc(*parts: str) -> list[str]:
    root = Path("/usr/share/doc/python3-doc/html/_sources")
    if not root.is_dir():
        found = sorted(Path("/usr/share/doc").glob("python3.*/html/_sources"))
        root = found[-1] if found else root
    folder = root.joinpath(*parts)
    files = sorted(folder.glob("*.rst.txt")) if folder.is_dir() else []
    if not files:
        raise MissingDependencyError(f"{folder} has no documentation sources (Debian package python3-doc): {INSTALL_HINT}")
    return [f.read_text(errors="replace") for f in files if f.name != "index.rst.txt"]


def _pydoc_topics() -> list[str]:
    from kvzap_export.texts import training_topics

    return training_topics()


def _stdlib_code() -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return [(stdlib / name).read_text(errors="replace") for name in STDLIB_MODULES if (stdlib / name).is_file()]


def _licences() -> list[str]:
    folder = Path("/usr/share/common-licenses")
    if not folder.is_dir():
        raise MissingDependencyError(f"{folder} is missing (Debian package base-files): {INSTALL_HINT}")
    seen, docs = set(), []
    for path in sorted(folder.iterdir()):  # GPL -> GPL-3 and similar links: each text once
        real = path.resolve()
        if real.is_file() and real not in seen:
            seen.add(real)
            docs.append(real.read_text(errors="replace"))
    python_licence = Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt"
    if python_licence.is_file():
        docs.append(python_licence.read_text(errors="replace"))
    return docs


def _fortunes() -> list[str]:
    folder = Path("/usr/share/games/fortunes")
    files = sorted(p for p in folder.glob("*") if p.is_file() and not p.suffix and p.name != "ascii-art") if folder.is_dir() else []
    if not files:
        raise MissingDependencyError(f"{folder} has no fortune files (Debian package fortunes): {INSTALL_HINT}")
    return ["\n\n".join(c.strip() for c in f.read_text(errors="replace").split("\n%\n") if c.strip()) for f in files]


SOURCES = (
    Source("kjv-narrative", "narrative", "King James Version, narrative books (Genesis to Acts)", "public domain",
           "Debian bible-kjv / bible-kjv-text", _kjv),
    Source("jargon-file", "expository", "The Jargon File 4.4.7", "public domain", "Debian dict-jargon",
           lambda: _dictd(Path("/usr/share/dictd/jargon.dict.dz"), "dict-jargon")),
    Source("debian-faq", "qa", "The Debian GNU/Linux FAQ", "verbatim and modified copies permitted (SPI notice)",
           "Debian debian-faq", lambda: [_read_text(Path("/usr/share/doc/debian/FAQ/debian-faq.en.txt.gz"), "debian-faq")]),
    Source("python-faq", "qa", "Python Frequently Asked Questions", "PSF-2.0", "Debian python3-doc",
           lambda: _python_doc("faq")),
    Source("debian-reference", "technical", "Debian Reference (English)", "GPL-2+", "Debian debian-reference-en",
           lambda: [_read_text(Path("/usr/share/debian-reference/debian-reference.en.txt.gz"), "debian-reference-en")]),
    Source("pydoc-topics", "technical", "Python's pydoc topics (less the ones validation reserves)", "PSF-2.0",
           "CPython (pydoc_data)", _pydoc_topics),
    Source("python-stdlib", "code", "CPython standard-library modules", "PSF-2.0", "CPython", _stdlib_code),
    Source("licences", "legal", "Licence texts of /usr/share/common-licenses and CPython's LICENSE.txt",
           "each licence's own terms (verbatim copying permitted)", "Debian base-files, CPython", _licences),
    Source("fortunes", "quotations", "fortune(6) cookie files", "BSD (fortune-mod), collected quotations",
           "Debian fortunes", _fortunes),
)


def domain_sources(domain: str) -> list[Source]:
    return [s for s in SOURCES if s.domain == domain]
