"""The README and the pages in docs/ name only what exists: every repository path they mention, every function or
class they name beside its file, and a layout that lists every package and module of the product code."""

import glob
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md", *sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))]
# The repository's own top-level entries: a path in the text that starts with one of them is the repository's (a
# run folder's `checkpoints/`, torch's `torch/distributed/run.py` or SGLang's `srt/...` are not).
TOP = sorted(
    name
    for name in os.listdir(ROOT)
    if not name.startswith(".") and name not in ("runs", "__pycache__") and not name.endswith(".egg-info")
)
PATH = re.compile(r"(?<![\w./<>-])(?:" + "|".join(map(re.escape, TOP)) + r")(?:/[\w.<>*-]+)*/?(?![\w-])")
PLACEHOLDER = re.compile(r"<[^>/]*>|\bN_\*|\bN\b")
# The product's packages (bench/ and tests/ are listed as folders, their files are not).
PACKAGES = sorted({os.path.dirname(p) for p in glob.glob("*/__init__.py", root_dir=ROOT)} - {"bench", "tests"})


def read(page: str) -> str:
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        return f.read()


def mentioned_paths(text: str) -> set[str]:
    """Every path in `text` under a top-level entry of the repository, as written (placeholders included)."""
    found = set()
    for match in PATH.finditer(text):
        path = match.group(0).rstrip(".")
        if "/" in path or os.path.splitext(path)[1]:  # `configs/x.toml`, `train.py`; not the word "bench" alone
            found.add(path)
    return found


def exists(path: str) -> bool:
    """Whether `path` (with `<name>`, `N_*` and `*` as placeholders) names something in the repository."""
    pattern = PLACEHOLDER.sub("*", path.rstrip("/"))
    return bool(glob.glob(pattern, root_dir=ROOT))


@pytest.mark.parametrize("page", PAGES)
def test_every_path_a_page_mentions_exists(page):
    text = read(page)
    paths = mentioned_paths(text)
    assert "train.py" in paths or page != "README.md"  # the pattern finds paths at all
    missing = sorted(p for p in paths if not exists(p))
    assert not missing, f"{page} names paths that do not exist: {missing}"


def test_the_path_pattern_reads_paths_and_leaves_others_alone():
    text = (
        "`rl/loss.py` `token_mean`, configs/probes/<probe>/N_*.toml, (bench/RESULTS.md) and docs/gpu.md; not the"
        " run folder's `checkpoints/step-<N>/`, torch/distributed/run.py, srt/managers/scheduler.py or hf/"
    )
    assert mentioned_paths(text) == {"rl/loss.py", "configs/probes/<probe>/N_*.toml", "bench/RESULTS.md", "docs/gpu.md"}
    assert exists("configs/probes/<probe>/N_*.toml") and exists("rl/") and not exists("rl/nonexistent.py")


# `file.py` `name` or `file.py` (`name`...: the name is defined in that file (`Class.method`: both).
NAMED = re.compile(r"`([\w/]+\.py)` \(?`([A-Za-z_][\w.]*)`")


@pytest.mark.parametrize("page", PAGES)
def test_every_function_or_class_named_beside_its_file_is_defined_there(page):
    pairs = NAMED.findall(read(page))
    assert pairs or page != "README.md"  # the paper-to-file table names them
    undefined = []
    for file, name in pairs:
        source = read(file)
        for part in name.split("."):
            if not re.search(rf"^\s*(?:def|class|async def) {part}\b|^{part}\s*[:=]", source, re.MULTILINE):
                undefined.append(f"{file} {name}")
    assert not undefined, f"{page} names what its file does not define: {undefined}"


def without_parentheses(text: str) -> str:
    """`text` without what it says in parentheses (descriptions, which may name other files), newlines kept."""
    out, depth = [], 0
    for char in text:
        depth += char == "("
        if depth == 0 or char == "\n":
            out.append(char)
        depth -= char == ")" and depth > 0
    return "".join(out)


def layout_entries() -> dict[str, set[str]]:
    """The README's layout block: {folder ('' for the root): the files and folders it lists there}. A line is a
    folder (or a root file) at its start, then its entries: those before the first run of two spaces (a
    description follows them), outside parentheses."""
    readme = read("README.md")
    block = readme[readme.index("## Layout") :].split("```")[1]
    listed: dict[str, set[str]] = {}
    folder = ""
    for line, cleaned in zip(block.splitlines(), without_parentheses(block).splitlines()):
        if not line.strip():
            continue
        if not line.startswith(" "):
            head, _, cleaned = cleaned.partition(" ")
            folder = head.rstrip("/") if head.endswith("/") else ""
            listed.setdefault(folder, set())
            if not folder:
                listed[""].add(head)
                continue
        entries = re.split(r"\s{2,}", cleaned.strip())[0]
        listed[folder].update(re.findall(r"[\w.-]+\.(?:py|toml|md)\b|[\w-]+/", entries))
    return listed


def test_the_layout_lists_every_package_and_module_and_nothing_else():
    listed = layout_entries()
    assert {"rl", "trainer", "model", "configs"} <= set(listed) and "loss.py" in listed["rl"]  # the block was read
    for folder, names in listed.items():
        absent = sorted(n for n in names if not os.path.exists(os.path.join(ROOT, folder, n)))
        assert not absent, f"the README's layout lists {folder or 'the root'}/{absent}, which do not exist"
    unlisted = sorted(set(PACKAGES) - set(listed))
    assert not unlisted, f"the README's layout does not list the packages {unlisted}"
    for package in PACKAGES:
        modules = {os.path.basename(p) for p in glob.glob(os.path.join(ROOT, package, "*.py"))} - {"__init__.py"}
        left_out = sorted(modules - listed[package])
        assert not left_out, f"the README's layout leaves out {package}/{left_out}"
    root_scripts = {os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "*.py"))}
    assert root_scripts <= listed[""], f"the README's layout leaves out {sorted(root_scripts - listed[''])}"


@pytest.mark.parametrize("page", PAGES)
def test_every_link_to_a_page_or_its_section_resolves(page):
    text = read(page)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if "://" in target:
            continue
        file, _, anchor = target.partition("#")
        path = os.path.normpath(os.path.join(os.path.dirname(page), file)) if file else page
        if not os.path.exists(os.path.join(ROOT, path)):
            broken.append(target)
        elif anchor:
            headings = re.findall(r"^#+ (.+)$", read(path), re.MULTILINE)
            slugs = {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}
            if anchor not in slugs:
                broken.append(target)
    assert not broken, f"{page} links to what does not exist: {broken}"
