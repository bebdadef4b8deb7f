"""Token files from texts in memory: a list of documents, or the built-in corpus every machine has."""

from __future__ import annotations

import ast
import sysconfig
from collections.abc import Iterable
from pathlib import Path

from ethpipe.errors import UserError
from ethpipe.tokens.prepare import Doc, write_tokens


def prepare_tokens(texts: Iterable[str], out: str | Path, tokenizer: str | Path | None = None) -> int:
    """Tokenize texts into a ``.bin`` (+ ``.json`` sidecar); returns the token count.

    The same as ``ethpipe data prepare`` (``tokens/prepare.write_tokens``), with each text a
    document: byte-level (vocab 256, a blank line between documents) by default; with
    ``tokenizer`` a Hugging Face tokenizer, its EOS between documents.
    """
    docs = (Doc(text, True, len(text.encode("utf-8"))) for text in texts)
    return write_tokens(docs, out, tokenizer)


def builtin_text(max_bytes: int = 4_000_000) -> list[str]:
    """Real English text present on every machine: docstrings of Python's standard library.

    Read with ``ast`` from the source files (nothing is imported, so no side effects), in
    sorted path order, so the same Python version always yields the same corpus.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idlelib", "site-packages", "dist-packages", "lib2to3", "__pycache__"}
    docs: list[str] = []
    total = 0
    for path in sorted(root.rglob("*.py")):
        if skip & set(path.relative_to(root).parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) >= 40:
                    docs.append(doc)
                    total += len(doc) + 2
                    if total >= max_bytes:
                        return docs
    if not docs:
        raise UserError(f"no standard-library sources found under '{root}': use --text FILE instead")
    return docs
