"""Builds corpus.txt: real English prose from the Python standard library's own
documentation (module, class and function docstrings), available offline in
every Python installation. Deterministic for a given interpreter; the committed
corpus.txt was built with CPython 3.11 and is what train.py reads.

    python examples/tinylm/make_corpus.py [--max-bytes N]
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import os
import re

MODULES = [
    "abc", "argparse", "ast", "asyncio", "base64", "bisect", "calendar", "collections",
    "contextlib", "copy", "csv", "dataclasses", "datetime", "decimal", "difflib", "email",
    "enum", "fractions", "functools", "glob", "gzip", "hashlib", "heapq", "hmac", "html",
    "http.client", "inspect", "io", "ipaddress", "itertools", "json", "logging", "math",
    "mimetypes", "operator", "os", "pathlib", "pickle", "pprint", "queue", "random", "re",
    "sched", "secrets", "selectors", "shlex", "shutil", "socket", "sqlite3", "statistics",
    "string", "struct", "subprocess", "tarfile", "tempfile", "textwrap", "threading",
    "time", "timeit", "tokenize", "traceback", "typing", "unittest", "urllib.parse",
    "uuid", "warnings", "weakref", "zipfile", "zlib",
]


def _clean(doc: str) -> str:
    doc = inspect.cleandoc(doc)
    doc = re.sub(r"[^\x20-\x7e\n]", "", doc)  # printable ASCII only: a small vocabulary
    return doc.strip()


def docstrings() -> list[str]:
    out: list[str] = []
    seen: set[str] = set()
    for name in MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        objs = [module] + [getattr(module, a) for a in sorted(dir(module)) if not a.startswith("_")]
        for obj in objs:
            doc = getattr(obj, "__doc__", None)
            if not isinstance(doc, str) or len(doc) < 200:
                continue
            text = _clean(doc)
            if text in seen:
                continue
            seen.add(text)
            out.append(text)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--max-bytes", type=int, default=400_000)
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "corpus.txt"))
    args = p.parse_args()
    text = "\n\n".join(docstrings())[: args.max_bytes]
    with open(args.out, "w", encoding="ascii") as f:
        f.write(text)
    print(f"wrote {len(text)} bytes to {args.out}")


if __name__ == "__main__":
    main()
