"""The README and docs/ on the CPU: the NumPy quick start runs, CI installs and tests as the README says,
and every link between the documents reaches a file and a heading that exist."""

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
DOCUMENTS = [README, *sorted((REPO / "docs").glob("*.md"))]
README_MAX_LINES = 300          # a newcomer reads it in ten minutes; the rest lives in docs/


def python_blocks(path):
    return re.findall(r"```python\n(.*?)```", path.read_text(), re.S)


def heading_anchors(path):
    """GitHub's anchors of a Markdown file's headings: lower case, punctuation dropped, spaces as '-'."""
    headings = re.findall(r"^#+ (.*)$", path.read_text(), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_the_numpy_quick_start_runs_and_matches_the_reference(capsys):
    (block,) = [b for b in python_blocks(README) if "import numpy, cupyflash" in b]
    exec(compile(block, "README.md (quick start, NumPy)", "exec"), {})
    assert float(capsys.readouterr().out) < 1e-5


def test_the_expressions_example_runs_on_the_quick_starts_arrays_and_matches_the_reference():
    """The README's score_mod/mask_mod block, after the NumPy quick start (its q, k, v), equals the
    reference with the same expressions, and its mask is causal within each document."""
    import numpy

    from cupyflash import reference

    (start,) = [b for b in python_blocks(README) if "import numpy, cupyflash" in b]
    (block,) = [b for b in python_blocks(README) if "mod_args={\"doc\": doc}" in b]
    names = {}
    exec(compile(start.replace("print(", "(") + block, "README.md (expressions)", "exec"), names)
    kw = dict(score_mod="s - 0.1f * abs(q_idx - kv_idx)", mask_mod="kv_idx <= q_idx && doc[q_idx] == doc[kv_idx]",
              mod_args={"doc": names["doc"]})
    assert "score_mod=\"s - 0.1f * abs(q_idx - kv_idx)\"" in block.replace("\n", " ")
    for got, want in zip((names["o"], names["m"], names["l"]),
                         reference.attention_forward(names["q"], names["k"], names["v"], **kw)):
        numpy.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_ci_installs_and_tests_the_way_the_readme_says():
    ci = (REPO / ".ci" / "run").read_text()
    install = re.search(r"^python -m pip install -e (\S+)$", ci, re.M)
    assert install and f"python -m pip install -e {install.group(1)}" in README.read_text()
    assert "python -m pytest -q" in ci.splitlines() and "python -m pytest -q " in README.read_text()


@pytest.mark.parametrize("path", DOCUMENTS, ids=lambda p: p.name)
def test_every_link_reaches_a_file_and_a_heading(path):
    for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
        if "://" in target:
            continue
        file, _, anchor = target.partition("#")
        linked = (path.parent / file).resolve() if file else path
        assert linked.exists(), f"{path.name} links to {target}: no such file"
        if anchor:
            assert anchor in heading_anchors(linked), f"{path.name} links to {target}: no such heading"


def test_the_readme_stays_short_and_the_documents_carry_no_issue_numbers():
    assert len(README.read_text().splitlines()) <= README_MAX_LINES
    for path in DOCUMENTS:
        assert not re.search(r"issue #\d+", path.read_text(), re.I), path.name
