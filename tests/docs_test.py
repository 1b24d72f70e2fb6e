#!/usr/bin/python3
"""Documentation is code: every code block that a Markdown file marks with
<!-- excerpt: PATH --> on the line before it must be an excerpt of PATH (a file the test script
compiles and runs): each of its lines appears in PATH, in the same order. And every relative link
between the Markdown files points at a file that exists, and at a heading of it where it names one.
Usage: docs_test.py  (from the repository root). Prints "docs: N passed, N failed"."""
import glob
import os
import re

from tally import check, finish



def anchors(md):
    """The anchors GitHub makes of a Markdown file's headings."""
    out = set()
    for line in open(md):
        m = re.match(r"#+ (.*)", line)
        if m:
            out.add(re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-"))
    return out


for md in ["README.md"] + sorted(glob.glob("docs/*.md")):
    lines = open(md).read().split("\n")
    for i, line in enumerate(lines):
        m = re.match(r"<!-- excerpt: (\S+) -->", line.strip())
        if m:
            source = m.group(1)
            check(os.path.exists(source), f"{md}:{i + 1}: {source} does not exist")
            if not os.path.exists(source) or not lines[i + 1].startswith("```"):
                check(False, f"{md}:{i + 1}: no code block after the excerpt marker")
                continue
            block = []
            for l in lines[i + 2:]:
                if l.startswith("```"):
                    break
                block.append(l)
            text = [l.rstrip() for l in open(source).read().split("\n")]
            at = 0
            for l in block:
                if not l.strip() or l.strip() in ("// ...", "..."):
                    continue
                while at < len(text) and text[at].strip() != l.strip():
                    at += 1
                if at == len(text):
                    check(False, f"{md}:{i + 1}: '{l.strip()}' is not in {source} (in this order)")
                    break
                at += 1
            else:
                check(True, "")
        for target, anchor in re.findall(r"\]\(([^)#:]*\.md)?(?:#([^)]*))?\)", line):
            path = os.path.normpath(os.path.join(os.path.dirname(md), target)) if target else md
            check(os.path.exists(path), f"{md}:{i + 1}: link to {target}, which does not exist")
            if anchor and os.path.exists(path):
                check(anchor in anchors(path), f"{md}:{i + 1}: link to {target}#{anchor}, a heading it lacks")

finish("docs")
