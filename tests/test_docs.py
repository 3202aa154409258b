"""The README and docs/: the README stays a short page for users that starts with the two commands, and
every link, anchor and file path the pages name exists."""

import re

import pytest

from .helpers import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
README_LINES = 200
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE_SPAN = re.compile(r"`([^`\n]+)`")
# a repository path in a code span: folders and files of this repository, no spaces or options
REPO_PATH = re.compile(r"(?:resadapt_eval|docs|tests|benchmarks|configs|model_cards|tasks|envs|results)/[\w./*-]*")
GENERATED = ("fixtures/", "runs/", "demo_out/", "out/", "results/runs/", "results/gpu/")  # written by commands


def anchors(page) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation but `-` and `_` dropped, spaces to `-`."""
    found = set()
    for line in page.read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            found.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return found


def targets(page):
    """(what the page names, the path it resolves to, the anchor or None) for each link and repository path."""
    text = page.read_text()
    for link in LINK.findall(text):
        if link.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, anchor = link.partition("#")
        yield link, (page.parent / path).resolve() if path else page, anchor or None
    for span in CODE_SPAN.findall(text) + [line for line in text.splitlines() if line.startswith("    ")]:
        for path in REPO_PATH.findall(span):
            if not path.startswith(GENERATED) and "<" not in span:
                yield path, REPO / path.rstrip("."), None


def test_the_readme_is_short_and_starts_with_the_two_commands():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= README_LINES
    first_code = lines.index("```bash")
    assert [line.split()[:2] for line in lines[first_code + 1 : first_code + 3]] == [["make", "demo"], ["make", "test"]]
    assert all(not line.startswith("## ") for line in lines[:first_code])  # nothing comes before them


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_link_anchor_and_path_a_page_names_exists(page):
    named = list(targets(page))
    assert named  # every page names something
    missing = [name for name, path, _ in named if not (any(REPO.glob(name)) if "*" in name else path.exists())]
    assert missing == [], f"{page.name} names what does not exist: {missing}"
    bad_anchors = [name for name, path, anchor in named if anchor and anchor not in anchors(path)]
    assert bad_anchors == [], f"{page.name} links to headings that do not exist: {bad_anchors}"


def test_the_model_table_lists_every_lmms_eval_name_and_its_class():
    """docs/models.md is where a reader finds the classes made from the registry (no class statement
    names them): its table is the entry point's names, each with the class lmms-eval loads."""
    import importlib

    from resadapt_eval.lmms.manifests import model_names

    expected = []
    for name, (path, aliases) in model_names().items():
        module, cls = path.rsplit(".", 1)
        method = getattr(getattr(importlib.import_module(module), cls), "fixed_method", None)
        shown = f"`{method}`" if method else "any (`method=`)"
        expected.append(f"| `{name}` | {', '.join(f'`{a}`' for a in aliases)} | `{path}` | {shown} |")
    rows = [line for line in (REPO / "docs" / "models.md").read_text().splitlines() if line.startswith("| `")]
    assert len(expected) > 30
    assert rows == expected, "docs/models.md's table, as the registry gives it:\n" + "\n".join(expected)
