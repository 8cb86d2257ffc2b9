"""Light reStructuredText -> prose. Drops literal/code blocks, markup-only directives (code-block,
autoclass, toctree, image, comments, targets...), section underlines, tables and interactive
prompts; keeps the bodies of admonitions (note, warning, versionadded...); unwraps inline roles
and links. Files named on argv are read in that order; plain text goes to stdout."""
import re
import sys

KEEP = {"note", "warning", "seealso", "admonition", "tip", "important", "attention", "caution",
        "danger", "hint", "versionadded", "versionchanged", "deprecated", "topic", "sidebar"}
UNDERLINE = re.compile(r"^\s*([=\-~^\"'`#*+:.])\1{2,}\s*$")
TABLE = re.compile(r"^\s*[+|]?[=\-+]{3,}[ =\-+|]*$")
DIRECTIVE = re.compile(r"^\s*\.\.\s+(?:\|[^|]+\|\s+)?([\w:-]+)::(.*)$")
ROLE = re.compile(r":[\w:+-]+:`([^`]*)`")
LINK = re.compile(r"`([^`<]*?)\s*<[^>]*>`_{1,2}")


def role_text(m):
    t = m.group(1)
    mm = re.match(r"(.*?)\s*<[^>]*>$", t, re.S)
    if mm and mm.group(1):
        return mm.group(1)
    t = t.lstrip("!")
    return t[1:].rsplit(".", 1)[-1] if t.startswith("~") else t


def inline(s):
    s = ROLE.sub(role_text, s)
    s = LINK.sub(r"\1", s)
    s = re.sub(r"``([^`]+)``", r"\1", s)
    s = re.sub(r"`([^`]+)`_{0,2}", r"\1", s)
    s = re.sub(r"\*\*([^*]+)\*\*", r"\1", s)
    s = re.sub(r"(?<![\w*])\*([^*\s][^*]*)\*", r"\1", s)
    s = re.sub(r"\b(\w+)_\b", r"\1", s)
    return s


def ind(line):
    return len(line) - len(line.lstrip(" "))


def block(lines, i, base):
    """Index past the block indented deeper than base that starts at i (blank lines included)."""
    while i < len(lines) and (not lines[i].strip() or ind(lines[i]) > base):
        i += 1
    return i


def clean(lines):
    out, i, n = [], 0, len(lines)
    while i < n:
        line = lines[i]
        st = line.strip()
        m = DIRECTIVE.match(line)
        if m or (st.startswith("..") and not st.startswith("...")):
            end = block(lines, i + 1, ind(line))
            if m and m.group(1) in KEEP:
                if m.group(1) in ("note", "warning", "seealso", "tip", "hint", "important",
                                  "caution", "danger", "attention", "admonition", "topic",
                                  "sidebar") and m.group(2).strip():
                    out.append(m.group(2).strip())
                body = [l for l in lines[i + 1:end] if not l.strip().startswith(":")]
                depth = min((ind(l) for l in body if l.strip()), default=0)
                out += [""] + clean([l[depth:] for l in body]) + [""]
            i = end
            continue
        if UNDERLINE.match(line) or TABLE.match(line) or (st.startswith("|") and st.endswith("|")) \
                or st.startswith((">>> ", "$ ", "... ")):
            i += 1
            continue
        if st.endswith("::"):
            text = st[:-2].rstrip()
            if text:
                out.append(" " * ind(line) + text + ":")
            out.append("")
            i = block(lines, i + 1, ind(line))
            continue
        out.append(line)
        i += 1
    return out


paras = []
for path in sys.argv[1:]:
    with open(path, encoding="utf-8") as f:
        lines = clean([l.rstrip("\n").expandtabs(4) for l in f])
    text = inline("\n".join(l.strip() for l in lines))
    paras += [re.sub(r"[ \t]+", " ", p).strip() for p in re.split(r"\n\s*\n", text) if p.strip()]
sys.stdout.write("\n\n".join(paras) + "\n")
