"""The import graph of the installed package, read from the source with `ast` (nothing is imported).

Every `import uvic...` / `from uvic...` (and relative import) counts, including the lazy ones inside functions, and
so do the imports written as strings: a "uvic.module:Class" entry of a table (imported on first use, as
`uvic.schedulers.SAMPLER_TABLE` and `uvic.training.tasks.TASK_CLASSES` name their classes) and the module named to
`importlib.import_module`; an import whose module the source does not spell out is listed in `DYNAMIC_IMPORTS`.
kernels/ is the package `uvic.kernels` and fid/ is `uvic.fid` (pyproject `package-dir`). Layering: models,
schedulers and pipelines never import training (training builds on them), only `uvic.attention` imports
`uvic.kernels` from outside it, and `uvic.kernels` imports nothing from the rest of uvic (the benchmarks that
compare the kernel with the models live in benchmarks/). One exception: the build tool `uvic.kernels.aot`
(`python -m uvic.kernels.aot`, never imported by the op) writes its files with `uvic.io.atomic_write`.
"""

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"uvic": ROOT / "uvic", "uvic.kernels": ROOT / "kernels", "uvic.fid": ROOT / "fid"}


def _modules() -> dict[str, Path]:
    modules = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([package, *parts])] = path
    return modules


def _owner(name: str, modules: dict[str, Path]) -> str | None:
    """The module that defines `name` (a module, or an attribute of one): its longest known prefix."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules `module` imports anywhere in its source (top level or inside functions)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(parent + ([node.module] if node.module else []))
            for alias in node.names:
                # `from pkg import sub` imports the submodule; `from pkg import name` runs pkg/__init__.py.
                targets.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and (m := CLASS_PATH.match(node.value)):
            targets.add(m.group(1))
        elif _is_import_call(node) and node.args:
            name = node.args[0]
            if isinstance(name, ast.Constant) and isinstance(name.value, str):
                targets.add(name.value)
            elif (isinstance(name, ast.JoinedStr) and isinstance(name.values[0], ast.FormattedValue)
                  and ast.unparse(name.values[0].value) == "__name__"):
                # f"{__name__}.{...}": one of the package's own modules, any of them.
                targets.update(m for m in modules if m.startswith(module + "."))
    owners = {_owner(t, modules) for t in targets if t == "uvic" or t.startswith("uvic.")}
    return owners - {None, module}


# "module:Class" in a table of classes imported on first use.
CLASS_PATH = re.compile(r"^(uvic(?:\.\w+)+):\w+$")


def _is_import_call(node: ast.AST) -> bool:
    """`importlib.import_module(...)`, `import_module(...)` or `__import__(...)`."""
    return isinstance(node, ast.Call) and ast.unparse(node.func) in ("importlib.import_module", "import_module",
                                                                     "__import__")


# The imports whose module is data, not code, by module: what each one may load. A new one must be added here with
# the reason it cannot climb (the test below finds them).
DYNAMIC_IMPORTS = {
    # The module of a "module:Class" entry of the module's own table, whose strings are edges of the graph.
    "uvic.schedulers": "SAMPLER_TABLE's entries",
    "uvic.training.tasks": "TASK_CLASSES' entries",
    # A pipeline directory's model_index.json names its components' libraries (diffusers, transformers, uvic): the
    # class named there is looked up, checked against the classes the pipeline takes, and refused otherwise.
    "uvic.pipelines.sampling": "model_index.json's library of a pipeline component",
}


def _dynamic_imports() -> set[str]:
    """The modules that call an import function with a module name the source does not spell out."""
    found = set()
    for module, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if _is_import_call(node) and node.args:
                name = node.args[0]
                spelled = isinstance(name, ast.Constant) or (
                    isinstance(name, ast.JoinedStr) and isinstance(name.values[0], ast.FormattedValue)
                    and ast.unparse(name.values[0].value) == "__name__")
                if not spelled:
                    found.add(module)
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of `graph` (as a path that ends where it starts), or None."""
    state = {}  # 1 = on the current path, 2 = done

    def visit(node, path):
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt, path + [nxt])):
                return found
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start, [start])):
            return found
    return None


def test_the_graph_sees_eager_and_lazy_imports(graph):
    assert len(graph) > 40 and sum(map(len, graph.values())) > 80
    assert "uvic.kernels" in graph["uvic.attention"]  # top-level `from uvic.kernels import ...`
    assert "uvic.kernels.ops" in graph["uvic.attention"]  # inside `_attention`, on first use of the triton backend
    assert "uvic.fid.metric" in graph["uvic.fid"]  # relative import in fid/__init__.py


def test_the_graph_sees_the_imports_written_as_strings(graph):
    assert "uvic.training.tasks.lm" in graph["uvic.training.tasks"]  # TASK_CLASSES' "module:Class"
    assert "uvic.schedulers.scheduling_vpsde" in graph["uvic.schedulers"]  # SAMPLER_TABLE, and f"{__name__}.{...}"
    assert "uvic.schedulers.timesteps" in graph["uvic.schedulers"]  # only through f"{__name__}.{...}" (_EXPORTS)
    assert "uvic.fid.inception" in graph["uvic.config"]  # importlib.import_module("uvic.fid.inception")
    # A table's "module:Class" and import_module's argument are imports; a string that only names a module is not.
    source = "import importlib\nT = {'a': 'uvic.io:atomic_write', 'b': 'uvic.errors'}\nimportlib.import_module('uvic.guidance')"
    assert _imports("x", _write(source), _modules()) == {"uvic.io", "uvic.guidance"}


def _write(source: str) -> Path:
    import tempfile

    path = Path(tempfile.mkdtemp()) / "x.py"
    path.write_text(source)
    return path


def test_every_import_of_a_module_named_by_data_is_listed():
    assert _dynamic_imports() == set(DYNAMIC_IMPORTS)


def test_the_cycle_finder_finds_a_lazy_circle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_no_import_circle(graph):
    assert _cycle(graph) is None, f"import circle: {' -> '.join(_cycle(graph))}"


def _rooms(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The graph of the package's rooms: each top-level module or subpackage of uvic (`uvic.config`,
    `uvic.training`, `uvic.fid`, ...) with the rooms its modules import."""
    room = lambda m: ".".join(m.split(".")[:2])  # noqa: E731
    rooms: dict[str, set[str]] = {}
    for m, ts in graph.items():
        rooms.setdefault(room(m), set()).update(room(t) for t in ts if room(t) != room(m))
    return rooms


def test_no_upward_tie_between_rooms(graph):
    """The rooms stack up in floors: no room imports (by statement or by string) one that imports it back, however
    far round, so each tie points down."""
    rooms = _rooms(graph)
    assert len(rooms) > 15
    assert _cycle(rooms) is None, f"rooms in a circle: {' -> '.join(_cycle(rooms))}"


def test_the_config_layer_names_nothing_above_it(graph):
    """Loading a config reads the tables it checks names against, never a model, a task or a pipeline; the task
    classes are named where they live (`uvic.training.tasks.TASK_CLASSES`)."""
    above = ("uvic.training", "uvic.models", "uvic.pipelines", "uvic.integrations", "uvic.compare", "uvic.lm.official")
    assert sorted(t for t in graph["uvic.config"] if t.startswith(above)) == []


def test_models_schedulers_pipelines_never_import_training(graph):
    lower = ("uvic.models", "uvic.schedulers", "uvic.pipelines")
    upward = sorted(f"{m} -> {t}" for m, ts in graph.items() if m.startswith(lower)
                    for t in ts if t == "uvic.training" or t.startswith("uvic.training."))
    assert not upward


def test_only_the_attention_op_imports_the_kernels(graph):
    importers = {m for m, ts in graph.items() if not m.startswith("uvic.kernels")
                 and any(t == "uvic.kernels" or t.startswith("uvic.kernels.") for t in ts)}
    assert importers == {"uvic.attention"}


# Modules of uvic.kernels that may import from the rest of uvic, and what: the AOT build tool's atomic writes.
KERNEL_TOOL_IMPORTS = {"uvic.kernels.aot": {"uvic.io"}}


def test_the_kernel_package_imports_nothing_from_the_rest_of_uvic(graph):
    outside = {m: {t for t in ts if not t.startswith("uvic.kernels")} for m, ts in graph.items()
               if m.startswith("uvic.kernels")}
    assert {m: ts for m, ts in outside.items() if ts} == KERNEL_TOOL_IMPORTS


def test_importing_the_kernel_modules_loads_no_other_uvic_module():
    """The same at run time, in a fresh interpreter: after `import uvic` (whose __init__ loads the public op), the
    kernel package's runtime modules add only uvic.kernels.* modules."""
    code = (
        "import sys, uvic; before = set(sys.modules);"
        "import uvic.kernels, uvic.kernels.configs, uvic.kernels.attention, uvic.kernels.ops;"
        "print(' '.join(sorted(m for m in set(sys.modules) - before if m.startswith('uvic'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    loaded = out.stdout.split()
    assert "uvic.kernels.ops" in loaded  # the check saw the imports at all
    assert [m for m in loaded if not m.startswith("uvic.kernels.")] == []


# Public names that more than one module defines, and why that is one thing under one name.
SHARED_NAMES = {
    "main": "the entry point of each `python -m` tool",
    "apply_cog_attention": "the same call for two libraries' models (uvic.integrations.diffusers / .transformers)",
    # Left as found: the datasets' VAE / CLIP feature extraction (imagenet, mscoco) and FID's Inception features.
    "extract_features": "feature extraction of a dataset (uvic.data.imagenet, uvic.data.mscoco, uvic.fid.stats)",
}


def test_distinct_things_have_distinct_names():
    """No two modules define a public class or function of one name (`uvic.fid.ImageFolder` reads a folder as it
    is, `uvic.data.ResizedImageFolder` crops and resizes; `uvic.io.quantize_uint8` quantises,
    `uvic.fid.to_uint8` also fixes the layout and the grayscale channel), apart from `SHARED_NAMES`."""
    defined: dict[str, list[str]] = {}
    for module, path in _modules().items():
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef)) and not node.name.startswith("_"):
                defined.setdefault(node.name, []).append(module)
    shared = {name: sorted(modules) for name, modules in defined.items() if len(modules) > 1}
    assert sorted(set(shared) - set(SHARED_NAMES)) == [], shared
