"""vLLM's released Python source, read without importing it: each surface of ringflow's table
looked up in a release's files (``ast``), so a release that cannot run here is still checked.

The releases' wheels come from the package index through pip (``pip download``, a few seconds
each), once: their ``.py`` files are kept under ``RINGFLOW_VLLM_SOURCE`` (default
``~/.cache/ringflow/vllm-source/<version>``) and the wheel is deleted.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import tempfile
import zipfile
from functools import cache
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("RINGFLOW_VLLM_SOURCE")
                or Path.home() / ".cache" / "ringflow" / "vllm-source")


def released_source(version: str) -> Path:
    """A directory holding release ``version``'s ``vllm/`` Python files.

    Raises:
        RuntimeError: pip could not download the release (its output is in the message).
    """
    root = cache_root() / version
    if (root / "vllm" / "__init__.py").exists():
        return root
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
             "--platform", "manylinux_2_28_x86_64", "--python-version", "3.11", "-q",
             f"vllm=={version}", "-d", tmp], capture_output=True, text=True, timeout=600)
        wheels = list(Path(tmp).glob("vllm-*.whl"))
        if proc.returncode != 0 or not wheels:
            raise RuntimeError(f"pip download vllm=={version} failed: {proc.stderr[-2000:]}")
        partial = root.with_name(root.name + ".partial")
        with zipfile.ZipFile(wheels[0]) as wheel:
            for name in wheel.namelist():
                if name.startswith("vllm/") and name.endswith(".py"):
                    wheel.extract(name, partial)
        partial.rename(root)
    return root


def module_file(root: Path, module: str) -> Path | None:
    base = root.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.exists():
            return path
    return None


@cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"))


def _defined(root: Path, module: str, name: str, depth: int = 0):
    """The top-level ``def``/``class``/assignment of ``name`` in ``module``, following
    ``from X import name`` re-exports; None when absent."""
    path = module_file(root, module)
    if path is None or depth > 6:
        return None
    for node in _tree(path).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) \
                and node.name == name:
            return node
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return node
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.ImportFrom) and any((a.asname or a.name) == name
                                                    for a in node.names):
            source = node.module or ""
            if node.level:
                package = module.split(".")
                if path.name != "__init__.py":
                    package = package[:-1]
                package = package[: len(package) - node.level + 1]
                source = ".".join(package + ([node.module] if node.module else []))
            real = next(a.name for a in node.names if (a.asname or a.name) == name)
            found = _defined(root, source, real, depth + 1)
            if found is not None:
                return found
    return None


def _params(node) -> list[str]:
    a = node.args
    names = [x.arg for x in a.posonlyargs + a.args]
    if a.vararg is not None:
        names.append("*" + a.vararg.arg)
    return names + [":" + x.arg for x in a.kwonlyargs]  # as compat.params_of spells them


def _member(root: Path, module: str, cls: ast.ClassDef, name: str, depth: int = 0):
    """``name`` defined in class ``cls``'s body or assigned as ``self.name``, or in a base
    class ringflow can find (a name of the same module or imported into it)."""
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return node
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) \
                and node.target.id == name:
            return node
    for node in ast.walk(cls):
        if isinstance(node, ast.Attribute) and node.attr == name and \
                isinstance(node.value, ast.Name) and node.value.id == "self" and \
                isinstance(node.ctx, ast.Store):
            return node
    if depth > 6:
        return None
    for base in cls.bases:
        base_name = base.id if isinstance(base, ast.Name) else \
            base.value.id if isinstance(base, ast.Subscript) and isinstance(base.value, ast.Name) \
            else None
        parent = _defined(root, module, base_name) if base_name else None
        if isinstance(parent, ast.ClassDef):
            found = _member(root, module, parent, name, depth + 1)
            if found is not None:
                return found
    return None


def lookup(root: Path, module: str, path: str):
    """``(found, params)``: whether ``module``'s ``path`` exists in the release at ``root``,
    and its parameter names when it is a function (None otherwise)."""
    first, *rest = path.split(".")
    node = _defined(root, module, first)
    if node is None:
        return False, None
    for part in rest:
        if not isinstance(node, ast.ClassDef):
            return False, None
        node = _member(root, module, node, part)
        if node is None:
            return False, None
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return True, _params(node)
    return True, None
