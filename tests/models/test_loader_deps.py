"""A plain `pip install openinfer` pulls no torch and no jax: walk the installed distribution's
Requires-Dist (core, no extras) recursively through the installed packages, offline."""
from __future__ import annotations

import importlib.metadata as md
import os
import re

import pytest

FORBIDDEN = {"torch", "jax", "jaxlib", "tensorflow"}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def core_requirements(dist: str, extras: tuple[str, ...] = ()) -> list[str]:
    from packaging.requirements import Requirement
    out = []
    for line in md.requires(dist) or []:
        req = Requirement(line)
        if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in extras or ("",)):
            out.append(_norm(req.name))
    return out


def dependency_closure(root: str) -> set[str]:
    seen, todo = set(), [root]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            todo += core_requirements(name)
        except md.PackageNotFoundError:
            pass            # not installed here (platform-specific); its name is still checked
    return seen


def test_core_dependency_tree_has_no_torch_or_jax():
    try:
        md.distribution("openinfer")
    except md.PackageNotFoundError:
        pytest.skip("openinfer is not installed (pip install .)")
    closure = dependency_closure("openinfer")
    assert {"numpy", "safetensors", "tokenizers", "sanic", "jinja2", "gguf"} <= closure
    assert not closure & FORBIDDEN, sorted(closure & FORBIDDEN)


def test_pyproject_core_dependencies_match_installed_metadata():
    """The installed metadata is the project's own (not a stale install)."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        pytest.skip("tomllib needs Python 3.11")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        declared = {_norm(re.split(r"[<>=!~\[ ;]", d)[0]) for d in tomllib.load(f)["project"]["dependencies"]}
    assert not declared & FORBIDDEN
    try:
        installed = set(core_requirements("openinfer"))
    except md.PackageNotFoundError:
        pytest.skip("openinfer is not installed")
    assert declared == installed, (declared ^ installed)


def test_the_walk_would_see_torch():
    """The check can fail: the same metadata walk, asked for the `test` extra, finds torch."""
    try:
        extras = core_requirements("openinfer", ("test",))
    except md.PackageNotFoundError:
        pytest.skip("openinfer is not installed")
    assert "torch" in extras
