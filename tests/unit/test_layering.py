"""The package layout is the architecture: docs/ARCHITECTURE.md's layer table against every import in shardtrain/.

An import counts wherever it is written (top of a file or inside a function) and so does a module named in a
string constant (importlib lookups such as the CLI's command table): hiding an import does not hide a layer
violation or a circle.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "shardtrain"
ROOT = "."  # the table's name for modules at the package root (entry points)


def layer_table(doc: Path = REPO / "docs" / "ARCHITECTURE.md") -> dict[str, int]:
    """folder -> layer, from the rows `| N | `folder` | ... |` of the doc's layer table."""
    rows = re.findall(r"^\|\s*(\d+)\s*\|\s*`([^`]+)`\s*\|", doc.read_text(), flags=re.M)
    table = {}
    for layer, folder in rows:
        assert folder not in table, f"{doc.name}: folder {folder} is listed twice"
        table[folder] = int(layer)
    return table


def module_name(path: Path, package: Path) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, package: Path, modules: set[str]) -> set[str]:
    """The package's modules this file imports: statements anywhere, and module names in string constants."""
    name = module_name(path, package)
    here = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()

    def add(target: str) -> None:
        # `from pkg import name`: name is a module when it is one, else an attribute of pkg
        while target and target not in modules:
            target = target.rpartition(".")[0]
        if target and target != name:
            found.add(target)

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            for alias in node.names:
                add(f"{base}.{alias.name}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if re.fullmatch(rf"{package.name}(\.\w+)+", node.value):
                add(node.value)
    return {m for m in found if m.split(".")[0] == package.name}


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    files = sorted(package.rglob("*.py"))
    modules = {module_name(p, package) for p in files}
    return {module_name(p, package): imports_of(p, package, modules) for p in files}


def folder_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and (PACKAGE / parts[1]).is_dir()) else ROOT


def upward_imports(graph: dict[str, set[str]], table: dict[str, int], folder=folder_of) -> list[str]:
    bad = []
    for module, targets in sorted(graph.items()):
        mine = folder(module)
        for target in sorted(targets):
            theirs = folder(target)
            if theirs == mine:
                continue
            if table[theirs] > table[mine]:
                bad.append(f"{module} (layer {table[mine]}, {mine}) imports {target} (layer {table[theirs]}, {theirs})")
            elif table[theirs] == table[mine]:
                bad.append(f"{module} ({mine}) imports {target} ({theirs}), a folder of its own layer {table[mine]}")
    return bad


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), or a module importing itself."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_every_folder_is_in_the_layer_table_and_the_table_names_only_real_folders():
    table = layer_table()
    folders = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    assert folders - set(table) == set(), f"docs/ARCHITECTURE.md has no layer for {sorted(folders - set(table))}"
    assert set(table) - folders - {ROOT} == set(), (
        f"the layer table names missing folders {sorted(set(table) - folders - {ROOT})}"
    )
    assert ROOT in table


def test_no_module_imports_a_higher_layer_or_a_sibling_folder():
    assert upward_imports(import_graph(), layer_table()) == []


def test_no_import_circles_even_inside_functions():
    assert circles(import_graph()) == []


@pytest.mark.parametrize("init", sorted(PACKAGE.glob("*/__init__.py")), ids=lambda p: p.parent.name)
def test_each_folder_says_what_it_owns_in_two_lines(init):
    doc = ast.get_docstring(ast.parse(init.read_text()), clean=True)
    assert doc, f"{init.relative_to(REPO)} has no docstring"
    first_paragraph = doc.split("\n\n")[0].splitlines()
    assert 1 <= len(first_paragraph) <= 2, f"{init.relative_to(REPO)}: say what the folder owns in two lines"


def test_the_checks_find_an_upward_import_a_hidden_circle_and_a_string_lookup(tmp_path):
    pkg = tmp_path / "pkg"
    for folder in ("low", "high"):
        (pkg / folder).mkdir(parents=True)
        (pkg / folder / "__init__.py").write_text('"""x"""\n')
    (pkg / "__init__.py").write_text("")
    (pkg / "low" / "a.py").write_text("def f():\n    from pkg.high import b\n")  # upward, inside a function
    (pkg / "high" / "b.py").write_text("from pkg.low import a\n")
    (pkg / "high" / "c.py").write_text("import importlib\nM = importlib.import_module('pkg.high.d')\n")
    (pkg / "high" / "d.py").write_text("from . import c\n")  # relative import closing a circle via a string
    graph = import_graph(pkg)
    assert graph["pkg.high.c"] == {"pkg.high.d"} and graph["pkg.high.d"] == {"pkg.high.c"}
    table = {"low": 0, "high": 1, ROOT: 2}
    bad = upward_imports(graph, table, folder=lambda m: m.split(".")[1] if m.count(".") >= 2 else ROOT)
    assert bad == ["pkg.low.a (layer 0, low) imports pkg.high.b (layer 1, high)"]
    assert sorted(circles(graph)) == [["pkg.high.b", "pkg.low.a"], ["pkg.high.c", "pkg.high.d"]]


def test_the_command_table_the_commands_folder_and_the_architecture_doc_agree():
    from shardtrain.cli import COMMANDS

    modules = {module for module, _ in COMMANDS.values()}
    folder = {f"shardtrain.commands.{p.stem}" for p in (PACKAGE / "commands").glob("*.py") if p.stem != "__init__"}
    assert modules == folder, (
        f"in the table only: {sorted(modules - folder)}; in commands/ only: {sorted(folder - modules)}"
    )
    entry = re.search(r"^  commands/(.*\n(?: {10,}.*\n)*)", (REPO / "docs" / "ARCHITECTURE.md").read_text(), re.M)
    listed = set(re.findall(r"(\w+)\.py", entry.group(1)))
    assert listed == {m.rpartition(".")[2] for m in modules}, f"docs/ARCHITECTURE.md's commands/ lists {sorted(listed)}"


# ---- collectives: one place moves their tensors to the group's device -------------------------------------
COLLECTIVES = {
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "broadcast",
    "broadcast_object_list",
    "all_gather_object",
    "gather_object",
    "gather",
    "scatter",
    "scatter_object_list",
    "reduce",
    "barrier",
    "monitored_barrier",
    "all_to_all",
    "all_to_all_single",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
}
COLLECTIVE_HOMES = ("runtime", "strategies")  # shardtrain/runtime/distributed.py's helpers; the backends' own


def direct_collectives(path: Path, root: Path = REPO) -> list[str]:
    """`file:line name` for each torch.distributed collective the file calls itself: through any alias of the
    module (`import torch.distributed as dist`, `torch.distributed.x`) or a name imported from it."""
    tree = ast.parse(path.read_text(), str(path))
    aliases, names = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "torch.distributed":
                    aliases.add(a.asname or "torch.distributed")
                elif a.name == "torch" or a.name.startswith("torch."):
                    aliases.add("torch.distributed")  # `import torch` then torch.distributed.x(...)
        elif isinstance(node, ast.ImportFrom) and node.module in (
            "torch.distributed",
            "torch.distributed.distributed_c10d",
        ):
            names.update(a.asname or a.name for a in node.names if a.name in COLLECTIVES)
        elif isinstance(node, ast.ImportFrom) and node.module == "torch":
            aliases.update(a.asname or a.name for a in node.names if a.name == "distributed")

    def dotted(n) -> str:
        return f"{dotted(n.value)}.{n.attr}" if isinstance(n, ast.Attribute) else getattr(n, "id", "?")

    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Attribute) and f.attr in COLLECTIVES and dotted(f.value) in aliases:
            found.append(f"{path.relative_to(root)}:{node.lineno} {f.attr}")
        elif isinstance(f, ast.Name) and f.id in names:
            found.append(f"{path.relative_to(root)}:{node.lineno} {f.id}")
    return found


def test_only_runtime_and_strategies_call_collectives_directly():
    files = [p for p in sorted(PACKAGE.rglob("*.py")) if folder_of(module_name(p, PACKAGE)) not in COLLECTIVE_HOMES]
    files += sorted((REPO / "examples").rglob("*.py"))
    offenders = [hit for p in files for hit in direct_collectives(p)]
    assert offenders == [], (
        "call shardtrain.runtime.distributed's helpers (all_reduce_sum, all_reduce_max, "
        f"broadcast_, barrier, all_gather_object, gather_object) instead: {offenders}"
    )


def test_the_collective_check_finds_every_spelling(tmp_path):
    f = tmp_path / "x.py"
    f.write_text(
        "import torch\nimport torch.distributed as dist\nfrom torch.distributed import all_reduce as ar\n"
        "def f(t):\n    dist.all_reduce(t)\n    torch.distributed.barrier()\n    ar(t)\n"
        "    dist.get_rank()\n    dist.is_initialized()\n"
    )
    assert direct_collectives(f, tmp_path) == ["x.py:5 all_reduce", "x.py:6 barrier", "x.py:7 ar"]


# ---- the framework knows only Workload -----------------------------------------------------------------------
BUILTINS = "builtin_workloads"
# The built-ins' names, their networks', and their own settings (builtin_workloads/settings.py's sections).
BUILTIN_WORDS = re.compile(
    r"multimodal|longformer|roberta|resnet|densenet"
    r"|\b(text_model|text_config|image_model|image_weights|image_config|fusion|fusion_hidden|attention_window"
    r"|channels_last)\b",
    flags=re.I,
)


def code_words(path: Path) -> list[str]:
    """The identifiers, attribute names and strings of a module's code; docstrings and comments are prose."""
    tree = ast.parse(path.read_text(), str(path))
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    words = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            words.append(node.value)
        elif isinstance(node, ast.Name):
            words.append(node.id)
        elif isinstance(node, ast.Attribute):
            words.append(node.attr)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            words.append(node.name)
    return words


def framework_modules(skip=()) -> list[Path]:
    return [p for p in sorted(PACKAGE.rglob("*.py")) if folder_of(module_name(p, PACKAGE)) not in {BUILTINS, *skip}]


# The composition root puts the built-ins' settings in the config's slot (config/shipped.py); nothing else of
# the framework imports the built-ins, and their settings module imports only config/ (no torch on import).
SHIPPED_SETTINGS = f"shardtrain.{BUILTINS}.settings"


def test_nothing_imports_the_builtins_they_are_looked_up_by_name():
    graph = import_graph()
    importers = sorted(
        f"{module} imports {target}"
        for module, targets in graph.items()
        if folder_of(module) != BUILTINS
        for target in targets
        if folder_of(target) == BUILTINS
    )
    assert importers == [f"shardtrain imports {SHIPPED_SETTINGS}"], (
        "the built-ins come in as any user's workload does, by name (workload_class); only the package root "
        "imports their settings, to fill the config's slot"
    )
    assert {folder_of(m) for m in graph[SHIPPED_SETTINGS]} == {"config"}


@pytest.mark.parametrize("path", framework_modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_the_framework_names_no_builtin_model_or_setting(path):
    named = sorted({w[:80] for w in code_words(path) if BUILTIN_WORDS.search(w)})
    assert named == [], (
        f"{path.relative_to(REPO)} names a built-in or its settings: {named[:6]}; ask the workload (the Workload "
        f"API's optional methods) and keep the built-in's side in shardtrain/{BUILTINS}/"
    )
