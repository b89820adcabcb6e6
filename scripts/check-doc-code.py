#!/usr/bin/env python3
"""Compiles every C++ block of the README and of docs/*.md against weave's headers.

A block with a main() compiles as it is; any other is a fragment of a function body, compiled
inside one. A fragment says what it assumes with an HTML comment (invisible on the page) right
before its block, one or more of:
  <!-- doc-code: context: nn::Sequential model; Tensor x; -->   declarations the block uses
  <!-- doc-code: global: struct Model { ... }; -->              declarations at file scope
  <!-- doc-code: file: examples/basics/train_lm.cpp -->         the block is that file, verbatim
#include and `using namespace` lines of a fragment move to the file's top. Every block compiles
with -fsyntax-only (nothing links or runs). Exits 1 naming each block that does not compile.

  python3 scripts/check-doc-code.py [files...]   (default: README.md docs/*.md)
"""
import concurrent.futures
import glob
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DIRECTIVE = re.compile(r"^<!-- doc-code: (context|global|file): (.*) -->$")


def blocks_of(path):
    """Yields (line, code, directives) for each ```cpp block of a markdown file."""
    lines = open(path, encoding="utf-8").read().split("\n")
    directives, i = [], 0
    while i < len(lines):
        match = DIRECTIVE.match(lines[i].strip())
        if match:
            directives.append((match.group(1), match.group(2)))
        elif lines[i].strip() == "```cpp":
            start, i = i + 1, i + 1
            while i < len(lines) and lines[i].strip() != "```":
                i += 1
            yield start + 1, "\n".join(lines[start:i]), directives
            directives = []
        elif lines[i].strip():
            directives = []  # a directive belongs to the block right after it
        i += 1


def translation_unit(code, directives):
    """The file to compile for a block (None when a directive names a file it must equal)."""
    hoisted, body = ["#include <weave/weave.h>", "using namespace weave;"], []
    for line in code.split("\n"):
        stripped = line.strip()
        if stripped.startswith("#include") or stripped.startswith("using namespace"):
            hoisted.append(stripped)
        else:
            body.append(line)
    globals_ = [text for kind, text in directives if kind == "global"]
    context = [text for kind, text in directives if kind == "context"]
    text = "\n".join(body)
    if re.search(r"\bint main\(", text) or re.match(r"\s*(struct|class|template)\b", text):
        return "\n".join(hoisted + globals_ + [text]) + "\n"
    return "\n".join(hoisted + globals_ + ["[[maybe_unused]] static void doc_block() {"] +
                     context + [text, "}"]) + "\n"


def check(path, line, code, directives):
    """An error text, or None when the block compiles (or equals the file it names)."""
    for kind, text in directives:
        if kind == "file":
            with open(os.path.join(ROOT, text), encoding="utf-8") as f:
                if f.read().rstrip("\n") != code.rstrip("\n"):
                    return f"{path}:{line}: the block is not {text} as it is; copy the file in"
            return None
    with tempfile.NamedTemporaryFile("w", suffix=".cpp", delete=False) as f:
        f.write(translation_unit(code, directives))
        source = f.name
    try:
        compiler = os.environ.get("CXX", "c++")
        result = subprocess.run([compiler, "-std=c++20", "-fsyntax-only", "-I", ROOT,
                                 "-Wno-unused-variable", "-Wno-unused-but-set-variable", source],
                                capture_output=True, text=True)
        if result.returncode == 0:
            return None
        return f"{path}:{line}: the block does not compile:\n{result.stderr.replace(source, 'block')}"
    finally:
        os.unlink(source)


def main():
    files = sys.argv[1:] or ["README.md"] + sorted(glob.glob(os.path.join("docs", "*.md")))
    jobs = [(path, line, code, directives) for path in files
            for line, code, directives in blocks_of(os.path.join(ROOT, path))]
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        errors = [e for e in pool.map(lambda job: check(*job), jobs) if e]
    for error in errors:
        print(error, file=sys.stderr)
    print(f"{len(jobs) - len(errors)} of {len(jobs)} C++ blocks in {len(files)} files compile")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
