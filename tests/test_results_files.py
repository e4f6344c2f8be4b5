"""Every commit a result file cites is in this repository's history (issue 32: result files
cited commits that are not in the repository).

A result in benchmarks/results/ says the commit it was made at, in three ways: a JSON field
(``commit``, ``git_head``, ``commit_in_this_repository``, with ``+dirty`` or ``+uncommitted``
where files differed from it), its file name (``NAME-DATE-HOST-<7 hex>...``), and the text of
the READMEs, tables and logs beside it (``at c1c07c5``, ranges ``0f3e53c…169167b``). In text a
commit is a word of exactly 7 or 40 lower-case hex digits with at least one letter and one digit
(git's abbreviation and full name; the 12-digit answer hashes of the cold A/B logs, and numbers,
are not commits), or 7 digits after the word ``commit``. Each must be reachable from HEAD (what a
clean clone of this branch holds), except the few in :data:`NOT_IN_THIS_REPOSITORY`, each with
why and, where one was identified, the commit in this repository that stands for it (the same
commit after a rebase; the result files say so too)."""

import json
import re
import subprocess
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
TEXT_SUFFIXES = (".md", ".txt", ".json", ".jsonl")

IN_TEXT = re.compile(r"(?<![0-9A-Za-z_])([0-9a-f]{40}|[0-9a-f]{7})(?![0-9A-Za-z_])")
AFTER_THE_WORD = re.compile(r"\bcommits? (\d{7})\b")
IN_A_NAME = re.compile(r"(?<=-)([0-9a-f]{7})(?=[-.])")
IN_A_FIELD = re.compile(r"^([0-9a-f]{7,40})(?:\+\w+)?$")
COMMIT_FIELDS = ("commit", "git_head", "commit_in_this_repository")

NOT_IN_THIS_REPOSITORY: dict[str, tuple[str | None, str]] = {
    "0b8c669": (
        "1def724",
        "cache_speed.py's run (README-cache-speed.md): the branch before its rebase onto main; "
        "1def724 after it (596db58 said so)",
    ),
    "a110f49": (
        "b82211b",
        "adapters_speed.py's runs (README-adapters-speed.md): branch blocks-adapters before its "
        "rebase onto 3f8f15b; b82211b after it (91a645b said so)",
    ),
    "771887b": (
        "8869e80",
        "programs.py's run of 2026-12-02 (README-programs.md): branch trl before its rebase onto "
        "3f8f15b; 8869e80 after it, by its dates (written 71 s before the run started, the "
        "branch's last commit before the result's)",
    ),
    "3bb263d": (
        "38a6771",
        "programs.py's LitGPT run (README-programs.md): branch litgpt before its rebase onto "
        "c88f8e6; 38a6771 after it (written the second the run started; 0f4bad5 said so)",
    ),
    "79e5d44": (
        "ecb7dc5",
        "programs.py's torchtitan run (README-programs.md): branch titan before its rebase onto "
        "38104d7; ecb7dc5 after it, by its dates (written the second the run started)",
    ),
    "2fe0292": (
        "748998f",
        "programs.py's nanoGPT run (README-programs.md): branch titan before the same rebase; "
        "748998f after it, by its dates (written 12 s before the run started)",
    ),
    "212c37b": (
        "47f22df",
        "zoo.py's vision stragglers (README-zoo.md): branch z-vision rebased onto 2a87e19, then "
        "rebased again onto c47cab2 as 47f22df; the result's package hash is 2a87e19's package "
        "with c1d9ac6 and f90d291's changes",
    ),
    "3adf61e": (None, "karpathy/nanoGPT's commit (its train.py): another repository's"),
}
"""Cited commits that are not in this repository: the 7-digit abbreviation, the commit in this
repository that stands for it (None: none does), and why."""


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)


@pytest.fixture(scope="module")
def reachable() -> set[str]:
    """Every commit reachable from HEAD, by its full name."""
    try:
        top = _git("rev-parse", "--show-toplevel")
    except FileNotFoundError:
        pytest.skip("git is not installed")
    if top.returncode != 0 or Path(top.stdout.strip()).resolve() != ROOT.resolve():
        pytest.skip("not a git checkout of this repository (an exported tree)")
    if _git("rev-parse", "--is-shallow-repository").stdout.strip() == "true":
        pytest.skip("a shallow clone: the history to look commits up in is cut short")
    listed = _git("rev-list", "HEAD")
    assert listed.returncode == 0, listed.stderr
    return set(listed.stdout.split())


def _fields(value, where: str, found: dict[str, set[str]]) -> None:
    if isinstance(value, dict):
        for key, inner in value.items():
            if key in COMMIT_FIELDS and isinstance(inner, str):
                match = IN_A_FIELD.match(inner)
                assert match, f"{where}: {key} {inner!r} is not a commit"
                found[match.group(1)].add(f"{where} ({key})")
            else:
                _fields(inner, where, found)
    elif isinstance(value, list):
        for inner in value:
            _fields(inner, where, found)


def cited() -> dict[str, set[str]]:
    """Every commit the result files cite, with where."""
    found: dict[str, set[str]] = defaultdict(set)
    for path in sorted(RESULTS.iterdir()):
        for name in IN_A_NAME.findall(path.name):
            found[name].add(f"{path.name} (its name)")
        if path.suffix not in TEXT_SUFFIXES:
            continue
        text = path.read_text()
        for word in IN_TEXT.findall(text):
            if re.search(r"[a-f]", word) and re.search(r"\d", word):
                found[word].add(path.name)
        for word in AFTER_THE_WORD.findall(text):
            found[word].add(path.name)
        if path.suffix == ".json":
            _fields(json.loads(text), path.name, found)
        elif path.suffix == ".jsonl":
            for line in text.splitlines():
                if line.strip():
                    _fields(json.loads(line), path.name, found)
    return found


def _is_reachable(commit: str, reachable: set[str]) -> bool:
    return any(full.startswith(commit) for full in reachable)


def test_every_cited_commit_is_in_this_repository(reachable):
    found = cited()
    assert len(found) > 50  # the scan reads the files (about 120 commits cited in 2026-12)
    missing = {
        commit: sorted(where)
        for commit, where in found.items()
        if commit[:7] not in NOT_IN_THIS_REPOSITORY and not _is_reachable(commit, reachable)
    }
    assert not missing, (
        "commits cited in benchmarks/results/ that are not reachable from HEAD (a typo, or a "
        "branch's commit before its rebase: cite the commit after it, or list it in "
        f"NOT_IN_THIS_REPOSITORY with why): {missing}"
    )


def test_the_commits_not_in_this_repository_are_cited_and_stood_for(reachable):
    found = {commit[:7] for commit in cited()}
    for commit, (stands_for, why) in NOT_IN_THIS_REPOSITORY.items():
        assert commit in found, f"{commit} is no longer cited: remove it from the list ({why})"
        assert not _is_reachable(commit, reachable), f"{commit} is in the history now ({why})"
        if stands_for is not None:
            assert _is_reachable(stands_for, reachable), (commit, stands_for)
