"""The one shape every kernel family has (CONTRIBUTING.md), checked so that it stays that way."""
import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2] / "warpforge"
OPS = ROOT / "ops"
FAMILIES = sorted(p.name for p in OPS.iterdir() if p.is_dir() and not p.name.startswith("_") and any(p.glob("*.py")))


def _imports(path: pathlib.Path) -> list[str]:
    """Modules a file imports, resolved to dotted names inside the package."""
    tree = ast.parse(path.read_text())
    pkg = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts[:-1])
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            out.append(mod)
            out += [f"{mod}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            out += [a.name for a in node.names]
    return out


def test_there_are_families():
    assert {"attention", "mla", "moe", "norm", "rope", "swiglu", "linear_ce"} <= set(FAMILIES)


@pytest.mark.parametrize("family", FAMILIES)
def test_family_has_the_files(family):
    folder = OPS / family
    for name in ("reference.py", "configs.py", "api.py", "__init__.py"):
        assert (folder / name).exists(), f"ops/{family}/{name}"
    assert list(folder.glob("*_kernel.py")), f"ops/{family} has no <name>_kernel.py"
    assert len((folder / "__init__.py").read_text().splitlines()) <= 40


@pytest.mark.parametrize("family", FAMILIES)
def test_no_import_from_another_family(family):
    for path in (OPS / family).glob("*.py"):
        for mod in _imports(path):
            m = re.match(r"warpforge\.ops\.(\w+)", mod)
            if m and not m.group(1).startswith("_") and m.group(1) != "shared_kernels":
                assert m.group(1) == family, f"{path.relative_to(ROOT)} imports {mod}"


def test_kernel_files_import_only_triton_torch_and_below():
    """A kernel file imports torch, Triton, runtime, shared_kernels, the Gluon compile-only checks (ops/_gluon.py)
    and its own family's kernel files."""
    for path in OPS.glob("*/*_kernel.py"):
        own = rf"warpforge\.ops\.{path.parent.name}\.\w+_kernel(\.\w+)?$"
        for mod in _imports(path):
            if mod.startswith("warpforge."):
                assert mod.startswith(("warpforge.runtime", "warpforge.ops.shared_kernels", "warpforge.ops._gluon")) or \
                    re.match(own, mod), f"{path.relative_to(ROOT)} imports {mod}"


def test_custom_ops_only_in_the_toolkit():
    for path in ROOT.rglob("*.py"):
        if path.name != "_op.py":
            assert "torch.library.custom_op" not in path.read_text(), path.relative_to(ROOT)


def test_imports_flow_downward():
    """cli -> bench -> serve -> models / compat / hf -> distributed -> nn -> ops -> runtime -> errors: no layer
    imports one above it (the bench times the GPT, the server runs it, the GPT's trainer shards over ranks)."""
    rank = {"cli": 8, "bench": 7, "serve": 6, "models": 5, "compat": 5, "hf": 5, "distributed": 4, "nn": 3, "ops": 2,
            "runtime": 1, "quant": 1, "testing": 1, "profiling": 1, "errors": 0}
    for path in ROOT.rglob("*.py"):
        layer = path.relative_to(ROOT).parts[0].removesuffix(".py")
        if layer not in rank:
            continue
        for mod in _imports(path):
            parts = mod.split(".")
            if parts[0] == "warpforge" and len(parts) > 1 and parts[1] in rank and parts[1] != layer:
                assert rank[parts[1]] < rank[layer], f"{path.relative_to(ROOT)} ({layer}) imports {mod}"


def test_gpt_functions_are_short():
    for path in (ROOT / "models" / "gpt").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                assert length <= 80, f"{path.name}:{node.name} has {length} lines"
