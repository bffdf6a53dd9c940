"""Check that every relative link (and #anchor) in README.md and docs/*.md resolves.

    python3 docs/check_links.py        # exit status 1 and one line per broken link

A target must be a file or folder git knows (tracked, or untracked and not ignored); an
anchor must be a heading of the target page, slugged the way GitHub does. Links inside
fenced code blocks and http(s) links are not checked.
"""
import re, sys, pathlib, subprocess
root = pathlib.Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else pathlib.Path(__file__).resolve().parent.parent
files = [root / "README.md"] + sorted((root / "docs").glob("*.md"))
tracked = set(subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=root, capture_output=True, text=True).stdout.split())

def slug(h):
    h = h.strip().lower()
    h = re.sub(r"[^\w\- ]", "", h)   # GitHub: drop punctuation, keep letters, digits, _, -, space
    return h.replace(" ", "-")

def anchors(md):
    out, fence = set(), False
    for line in md.read_text().splitlines():
        if line.startswith("```"):
            fence = not fence
        if not fence and (m := re.match(r"#{1,6} (.*)", line)):
            out.add(slug(m.group(1)))
    return out

bad = n = 0
link = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
for f in files:
    text, fence = [], False
    for line in f.read_text().splitlines():
        if line.startswith("```"):
            fence = not fence; continue
        if not fence:
            text.append(line)
    for target in link.findall("\n".join(text)):
        if re.match(r"[a-z]+://|mailto:", target):
            continue
        n += 1
        path, _, frag = target.partition("#")
        dest = (f.parent / path).resolve() if path else f
        rel = dest.relative_to(root).as_posix() if dest.is_relative_to(root) else None
        ok = dest.exists() and (rel in tracked or any(t.startswith(rel + "/") for t in tracked))
        if ok and frag:
            ok = dest.suffix == ".md" and frag in anchors(dest)
        if not ok:
            bad += 1
            print(f"BROKEN {f.relative_to(root)}: {target}")
print(f"{n} relative links checked, {bad} broken")
sys.exit(1 if bad else 0)
