"""Training prompts for `dflash-local train`, gathered offline from what is installed, with provenance and licence.

A drafter learns the target's own continuations of these prompts, so the prompts only need to be varied, not good:
openings of functions and classes in many languages, and opening words of prose. Sources (each optional: a machine
without one simply has fewer prompts, and each data file records its prompt):

- Python: the standard library and the installed distributions' sources (def/class lines and 0-3 lines after);
- C: /usr/include headers (function definitions, structs, enums); JavaScript: /usr/lib/node_modules (functions);
  Java: a JDK's lib/src.zip (method and class openings); Perl modules and shell scripts under /usr;
- prose: the installed Python distributions' descriptions, Debian's man pages (DESCRIPTION sections) and the READMEs
  under /usr/share/doc (the first 6-40 words of a paragraph).

Exact duplicates (after normalising whitespace) are dropped. The licence of each prompt is its package's: the
distribution's metadata for Python and npm packages, the Debian package's copyright file otherwise.
`dflash-local corpus -o FILE.jsonl` writes them with their source and licence. `--corpus FILE` replaces them: a text
file (one prompt per paragraph, paragraphs separated by a blank line) or JSONL (one object per line with "prompt" or
"text").
"""

from __future__ import annotations

import gzip
import json
import random
import re
import sysconfig
import zipfile
from dataclasses import asdict, dataclass
from functools import cache
from importlib import metadata
from pathlib import Path


@dataclass
class Prompt:
    text: str
    source: str  # the file it came from
    license: str
    kind: str  # "code" or "prose"


# a line that opens a definition, per language; the prompt is that line and 0-3 lines after it
OPENERS = {
    ".py": re.compile(r"^\s*(def|class|async def) \w+"),
    ".h": re.compile(r"^(static |extern )?(inline )?[A-Za-z_][\w \*]*\b\w+\s*\([^;]*$|"
                     r"^(typedef )?(struct|enum) \w+ \{"),
    ".js": re.compile(r"^\s*(export )?(async )?function\*? \w+\s*\(|"
                      r"^\s*(export )?(const|let) \w+ = (async )?\(.*\) =>"),
    ".java": re.compile(r"^\s+(public|private|protected|static)[\w<>\[\], ]* \w+\(.*\)\s*(throws [\w., ]+)?\s*\{$|"
                        r"^(public |abstract |final )*(class|interface|record) \w+"),
    ".pm": re.compile(r"^sub \w+"),
    ".sh": re.compile(r"^(function )?\w+\s*\(\)\s*\{"),
}


def code_snippets(path: Path, text: str, rng: random.Random, passages: bool = False) -> list[str]:
    """A definition line and 0-3 lines after it (passages: 20-60 lines after it)."""
    opener = OPENERS[path.suffix]  # a definition line, by the file's language
    lines = text.splitlines()
    lo, hi = (20, 60) if passages else (0, 3)
    return ["\n".join(lines[i : i + 1 + rng.randint(lo, hi)]) + "\n"
            for i, line in enumerate(lines) if len(line) < 120 and opener.match(line)]


def prose_snippets(text: str, rng: random.Random, passages: bool = False) -> list[str]:
    """The first 6-40 words of each paragraph that reads as prose (passages: up to 400 words of it)."""
    out = []
    for para in re.split(r"\n\s*\n", text):
        para = " ".join(para.split())
        words = para.split()
        wordy = sum(w.strip(".,;:!?'\"()").isalpha() for w in words)
        if len(para) < 120 or wordy < 0.9 * len(words) or para.startswith(("#", "|", "..", ">>>", "*", "-", "@")):
            continue
        out.append(" ".join(words[: 400 if passages else rng.randint(6, min(40, len(words)))]))
    return out


def read_text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


# -- licences ---------------------------------------------------------------------------------------------------------

@cache
def debian_owners() -> dict[str, str]:
    """File -> Debian package, from dpkg's file lists."""
    owners = {}
    for lst in sorted(Path("/var/lib/dpkg/info").glob("*.list")):
        pkg = lst.stem.split(":")[0]
        for line in (read_text(lst) or "").splitlines():
            owners[line] = pkg
    return owners


@cache
def debian_license(pkg: str) -> str:
    """The first License field of the package's copyright file, or the common licence it points to."""
    text = read_text(Path("/usr/share/doc") / pkg / "copyright") or ""
    m = re.search(r"^License: *(\S.*)$", text, re.M) or re.search(r"/usr/share/common-licenses/([\w.+-]+)", text)
    return m.group(1).strip() if m else f"see /usr/share/doc/{pkg}/copyright"


def file_license(path: Path) -> str | None:
    pkg = debian_owners().get(str(path))
    return debian_license(pkg) if pkg else None


def dist_license(dist) -> str:
    md = dist.metadata
    expr = md.get("License-Expression")
    if expr:
        return expr
    classifiers = [c.split(" :: ")[-1] for c in md.get_all("Classifier") or [] if c.startswith("License ::")]
    lic = md.get("License") or ""
    return classifiers[0] if classifiers else (lic if 0 < len(lic) < 60 else "UNKNOWN")


@cache
def npm_license(folder: Path) -> str:
    """The license field of the nearest package.json at or above folder."""
    for d in [folder, *folder.parents]:
        pj = d / "package.json"
        if pj.exists():
            try:
                lic = json.loads(pj.read_text(encoding="utf-8")).get("license")
            except (ValueError, OSError):
                return "UNKNOWN"
            return lic if isinstance(lic, str) else "UNKNOWN"
    return "UNKNOWN"


# -- sources: each lists its files (name, reader) and turns one file's text into prompts ----------------------------

def stdlib_files():
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        if "test" not in path.parts and "site-packages" not in path.parts:
            yield path, lambda path=path: (read_text(path), "PSF-2.0")


def installed_distributions() -> list:
    seen, out = set(), []
    for dist in sorted(metadata.distributions(), key=lambda d: d.metadata.get("Name") or ""):
        name = (dist.metadata.get("Name") or "").lower()
        if name and name not in seen and name != "dflash-local":  # not our own, ever-changing package
            seen.add(name)
            out.append(dist)
    return out


def package_files():
    for dist in installed_distributions():
        for f in sorted(dist.files or [], key=str):
            if f.suffix == ".py" and "test" not in str(f) and ".." not in f.parts:
                yield (Path(dist.locate_file(f)),
                       lambda dist=dist, f=f: (read_text(Path(dist.locate_file(f))), dist_license(dist)))


def system_code_files():
    """C headers, shell scripts and Perl modules of Debian packages, and JavaScript of global npm packages."""
    roots = [("/usr/include", ".h"), ("/usr/share/perl", ".pm"), ("/usr/share/perl5", ".pm"), ("/usr/bin", ".sh"),
             ("/usr/share", ".sh"), ("/usr/lib/node_modules", ".js")]
    for root, suffix in roots:
        for path in sorted(Path(root).rglob(f"*{suffix}")):
            if suffix != ".js":
                yield path, lambda path=path: (read_text(path), file_license(path))
            elif ".min." not in path.name and "test" not in path.parts:
                yield path, lambda path=path: (read_text(path), npm_license(path.parent))


def java_files():
    for src in sorted(Path("/usr/lib/jvm").glob("*/lib/src.zip"))[:1]:
        try:
            z = zipfile.ZipFile(src)
        except (OSError, zipfile.BadZipFile):
            return
        for name in sorted(n for n in z.namelist() if n.endswith(".java")):
            yield (Path(f"{src}/{name}"), lambda name=name, z=z:
                   (z.read(name).decode("utf-8", "replace"), "GPL-2.0-only WITH Classpath-exception-2.0"))


def description_files():
    for dist in installed_distributions():
        md = dist.metadata
        yield (Path(f"{md['Name']}/METADATA"), lambda md=md, dist=dist:
               ((md.get_payload() if hasattr(md, "get_payload") else None) or md.get("Description") or "",
                dist_license(dist)))


def man_text(path: Path) -> str | None:
    """The DESCRIPTION section of a man page, its roff markup stripped."""
    try:
        text = gzip.decompress(path.read_bytes()).decode("utf-8", "replace")
    except (OSError, EOFError):
        return None
    m = re.search(r'^\.SH\s+"?DESCRIPTION"?\s*$(.*?)^\.SH', text, re.M | re.S)
    if not m:
        return None
    lines = []
    for line in m.group(1).splitlines():
        if line.startswith((".PP", ".P ", ".LP", ".TP", ".IP", ".SS", ".sp")) or line == ".P":
            lines.append("")  # a paragraph break
        elif line.startswith((".B ", ".I ", ".BR ", ".IR ", ".BI ", ".RB ", ".RI ")):
            lines.append(line.split(" ", 1)[1].replace('"', ""))
        elif not line.startswith((".", "'")):
            lines.append(line)
    return re.sub(r"\\f[BIRP]|\\f\(\w\w|\\&|\\\(\w\w|\\e", "", "\n".join(lines)).replace("\\-", "-")


def man_files():
    for path in sorted(Path("/usr/share/man").glob("man[1-8]/*.gz")):
        yield path, lambda path=path: (man_text(path), file_license(path))


def readme_files():
    for path in sorted(Path("/usr/share/doc").glob("*/README*")):
        def read(path=path):
            raw = path.read_bytes()
            try:
                return (gzip.decompress(raw) if path.suffix == ".gz" else raw).decode("utf-8"), file_license(path)
            except (OSError, EOFError, UnicodeDecodeError):
                return None, None
        yield path, read


CODE_SOURCES = (stdlib_files, package_files, system_code_files, java_files)
PROSE_SOURCES = (description_files, man_files, readme_files)
PER_SOURCE = 20000  # prompts taken from each source at most: a sample of its files, read in shuffled order


def gather(files, kind: str, seed: int, seen: set[str], passages: bool = False) -> list[Prompt]:
    files = list(files)
    random.Random(seed).shuffle(files)
    rng, out = random.Random(seed), []
    for path, read in files:
        text, lic = read()
        if not text or lic is None:  # unreadable, or not from a package whose licence we know
            continue
        found = code_snippets(path, text, rng, passages) if kind == "code" else prose_snippets(text, rng, passages)
        for s in found:
            key = " ".join(s.split())
            if key not in seen:
                seen.add(key)
                out.append(Prompt(s, str(path), lic, kind))
        if len(out) >= PER_SOURCE:
            break
    random.Random(seed).shuffle(out)
    return out[:PER_SOURCE]


def default_corpus(seed: int = 0, passages: bool = False) -> list[Prompt]:
    """Each source's prompts, deduplicated, interleaved: code and prose alternate, and within each the sources take
    turns, so any prefix of the list mixes them all. passages: longer texts from the same files (20-60 lines of code
    after a definition line, whole paragraphs of prose), which the target reads rather than continues."""
    seen: set[str] = set()
    code = interleave([gather(f(), "code", seed + i, seen, passages) for i, f in enumerate(CODE_SOURCES)])
    prose = interleave([gather(f(), "prose", seed + i, seen, passages) for i, f in enumerate(PROSE_SOURCES)])
    return interleave([code, prose])


def interleave(lists: list[list[Prompt]]) -> list[Prompt]:
    """One from each list in turn, going on while any list has some left."""
    return [x[i] for i in range(max((len(x) for x in lists), default=0)) for x in lists if i < len(x)]


def read_corpus(path: str | Path) -> list[str]:
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".jsonl":
        prompts = []
        for i, line in enumerate(text.splitlines(), 1):
            if line.strip():
                row = json.loads(line)
                if not isinstance(row, dict) or not isinstance(row.get("prompt", row.get("text")), str):
                    raise ValueError(f"{path}:{i}: each line needs a string 'prompt' or 'text'")
                prompts.append(row.get("prompt", row.get("text")))
    else:
        prompts = [p.strip() for p in re.split(r"\n\s*\n", text) if p.strip()]
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


def training_prompts(corpus: str | Path | None = None, seed: int = 0, passages: bool = False,
                     chat: bool = False) -> list[str]:
    """The prompts (or passages) in a fixed shuffled order (so that a resumed run continues where it stopped). A
    --corpus file's texts serve as both. chat: the default chat corpus's user messages (chat_corpus.py)."""
    if corpus is not None:
        prompts = read_corpus(corpus)
        random.Random(seed + passages).shuffle(prompts)
        return prompts
    if chat and not passages:
        from .chat_corpus import chat_corpus

        return [p.text for p in chat_corpus(seed)]
    return [p.text for p in default_corpus(seed, passages)]


def write_corpus(path: str | Path, seed: int = 0, chat: bool = False, n: int | None = None) -> list[Prompt]:
    """The default corpus (chat: the chat corpus; n: its first n) as JSONL (prompt, source, license, kind), in
    training order."""
    from ..atomic import atomic_output

    if chat:
        from .chat_corpus import chat_corpus

        rows = chat_corpus(seed, n)
    else:
        rows = default_corpus(seed)[:n]
    with atomic_output(Path(path)) as tmp:
        tmp.write_text("".join(json.dumps({"prompt": p.text} | {k: v for k, v in asdict(p).items() if k != "text"})
                               + "\n" for p in rows))
    return rows
