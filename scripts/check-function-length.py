#!/usr/bin/env python3
"""Reports every function in weave/ longer than the limit (80 lines, from the first line of its
signature to its closing brace). The files are clang-formatted C++; the scan strips comments and
literals, then follows braces: a brace opened at namespace or class scope after a parameter list
is a function body, and everything inside it (lambdas, nested blocks) counts toward that
function. Usage: check-function-length.py [--limit N] FILE..."""
import re
import sys

KEYWORDS_BEFORE_BODY = {"const", "override", "final", "noexcept", "mutable", "&", "&&"}


def strip(text):
    """Blanks preprocessor lines, comments and string/char literals, keeping every newline."""
    text = re.sub(r"(?m)^[ \t]*#(?:[^\n]*\\\n)*[^\n]*", lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i)); i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append(re.sub(r"[^\n]", " ", text[i:j])); i = j
        elif c == 'R' and text.startswith('R"', i):
            m = re.match(r'R"([^(]*)\(', text[i:])
            end = text.find(")" + m.group(1) + '"', i) + len(m.group(1)) + 2
            out.append('""' + re.sub(r"[^\n]", " ", text[i + 2:end])); i = end
        elif c in "\"'" and not (c == "'" and i > 0 and text[i - 1].isalnum()):
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            out.append(c + " " * (j - i - 1) + c); i = j + 1
        else:
            out.append(c); i += 1
    return "".join(out)


def last_token(header):
    tokens = re.findall(r"[A-Za-z_]\w*|&&|->|\S", header)
    return tokens[-1] if tokens else ""


def classify(header):
    h = re.sub(r"\s+", " ", header).strip()
    h_no_template = re.sub(r"^template ?<.*?> ?", "", h)
    if re.match(r"(inline )?namespace\b", h) or h.startswith('extern ""') or h == "":
        return "scope"
    if re.match(r"(\[\[.*?\]\] )?(struct|class|union)\b", h_no_template) and "(" not in h_no_template.split("{")[0].split(":")[0]:
        return "scope"
    if re.match(r"(enum)\b", h_no_template) or h.endswith("="):
        return "other"
    if "(" in h:
        tail = h[h.rfind(")"):] if ")" in h else ""
        if last_token(h) == ")" or last_token(h) in KEYWORDS_BEFORE_BODY or "->" in tail:
            return "function"
    return "other"


def functions(text):
    """Yields (first line, last line, signature) of each function body at namespace/class scope."""
    text = strip(text)
    stack = []            # kinds of the open braces
    header, header_line = "", None
    paren = 0
    line = 1
    for c in text:
        if c == "\n":
            line += 1
        in_function = any(k[0] == "function" for k in stack)
        if in_function:
            if c == "{":
                stack.append(("nested",))
            elif c == "}":
                kind = stack.pop()
                if kind[0] == "function":
                    yield kind[1], line, kind[2]
                    header, header_line = "", None
            continue
        if c == "(":
            paren += 1
        elif c == ")":
            paren -= 1
        if c == "{" and paren == 0:
            init_list = re.search(r"\)\s*:(?!:)", header) is not None
            before = header.rstrip()[-1:] if header.strip() else ""
            if init_list and (before.isalnum() or before in "_>"):
                stack.append(("member-init",))
                header += c
                continue
            kind = classify(header)
            if kind == "function":
                stack.append(("function", header_line, re.sub(r"\s+", " ", header).strip()[:90]))
            else:
                stack.append((kind,))
                if kind == "scope":
                    header, header_line = "", None
                else:
                    header += c
            continue
        if c == "}" and paren == 0 and stack:
            kind = stack.pop()
            if kind[0] == "scope":
                header, header_line = "", None
            else:
                header += c
            continue
        if c == ";" and paren == 0:
            header, header_line = "", None
            continue
        if not c.isspace() and header_line is None:
            header_line = line
        header += c


def main(argv):
    limit = 80
    if argv[:1] == ["--limit"]:
        limit, argv = int(argv[1]), argv[2:]
    bad = 0
    for path in argv:
        with open(path, encoding="utf-8") as f:
            for first, last, signature in functions(f.read()):
                length = last - first + 1
                if length > limit:
                    print(f"{path}:{first}: {length} lines (limit {limit}): {signature}")
                    bad += 1
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
