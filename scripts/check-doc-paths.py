#!/usr/bin/env python3
"""Every path the documents name exists: the README and docs/*.md name files and folders of the
repository (`weave/parallel/core/placement.h`, `examples/gpt/`, `scripts/test.sh`), and a name
left behind by a move or a deletion is an error that names the document and its line.

A path is a word that starts with one of the repository's top folders and holds a slash; a
wildcard (`*`), a placeholder (`<arch>`) or a build output (`build/...`) is not checked. A bare
source name (`fsdp_unit.cpp`, `gpu-check.sh`) must be the name of some file of the repository.
    python3 scripts/check-doc-paths.py          # exits 1 and lists what is missing
"""
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
# Names the documents give of files outside the repository: a system header, a user's file.
OUTSIDE = {"cudnn.h", "app.cpp"}
TOPS = ("weave", "tests", "scripts", "examples", "tools", "bench", "docs", "cmake", "fuzz", ".ci")
SOURCE = re.compile(r"(?<![\w/.-])([\w.-]+\.(?:cpp|h|cu|cuh|sh|py))\b")
WORD = re.compile(r"(?<![\w./-])((?:%s)/[\w./+-]*)" % "|".join(re.escape(t) for t in TOPS))


def paths_in(line):
    for match in WORD.finditer(line):
        path = match.group(1).rstrip(".,:;)")
        if any(c in path for c in "*<>{}") or path.endswith("/."):
            continue
        yield path


def main():
    documents = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                            cwd=ROOT, capture_output=True, text=True, check=True).stdout
    names = {pathlib.PurePath(f).name for f in listed.split()} | OUTSIDE
    missing = []
    checked = 0
    for doc in documents:
        for number, line in enumerate(doc.read_text().splitlines(), 1):
            for path in paths_in(line):
                checked += 1
                if not (ROOT / path).exists():
                    missing.append(f"{doc.relative_to(ROOT)}:{number}: {path} does not exist")
            for name in SOURCE.findall(line):
                checked += 1
                if name not in names:
                    missing.append(f"{doc.relative_to(ROOT)}:{number}: no file is named {name}")
    for line in missing:
        print(line)
    print(f"{checked} paths in {len(documents)} documents, {len(missing)} missing")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
