"""The source tree draws the architecture: imports go one way, frontends -> engine -> native.

Every import in the package's source (dflash_local/, convert/ and tui/, which install as dflash_local.convert and
dflash_local.tui), at module level or inside a function, is read with ast and checked against the layers below.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = {"dflash_local": ROOT / "dflash_local", "dflash_local.convert": ROOT / "convert",
           "dflash_local.tui": ROOT / "tui"}

# lowest first. A module imports from its own package, or from a lower layer; packages of one layer do not import
# each other (one frontend never reaches into another; only the CLI dispatches to them all).
LAYERS = [
    ["_native"],
    ["atomic", "extras", "gguf_file", "models"],
    ["validate"],
    ["chat", "convert"],
    ["engine"],
    ["llama_server"],  # upstream's llama-server as a process, and its configurations as the bench's peers
    ["peers"],
    ["server", "train", "tui", "bench", "pull", "rpc"],
    ["cli"],
    ["__main__", "__init__"],
]
LAYER = {unit: i for i, units in enumerate(LAYERS) for unit in units}


def modules():
    """(installed dotted name, path) of every source file."""
    for prefix, folder in SOURCES.items():
        for path in sorted(folder.rglob("*.py")):
            rel = path.relative_to(folder).with_suffix("").parts
            yield ".".join((prefix, *rel)), path


def unit(name: str) -> str:
    """The layer unit of a dotted name under dflash_local: its package, or the module at the top."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imports(name: str, path: Path):
    """Full dotted names under dflash_local that the file imports."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1]) if node.level else ""
            mod = ".".join(p for p in (base, node.module or "") if p)
            # `from pkg import mod` names a module when pkg is a package
            found = [f"{mod}.{a.name}" if not node.module or mod.count(".") == 0 else mod for a in node.names]
        else:
            continue
        yield from (f for f in found if f == "dflash_local" or f.startswith("dflash_local."))


def test_every_source_file_has_a_layer():
    assert {unit(name) for name, _ in modules()} <= set(LAYER)


def test_imports_go_one_way():
    wrong = []
    for name, path in modules():
        own = unit(name)
        for target in imports(name, path):
            other = unit(target)
            if other == own:
                continue
            if LAYER[other] >= LAYER[own]:
                wrong.append(f"{path.relative_to(ROOT)}: {own} (layer {LAYER[own]}) imports {target} "
                             f"(layer {LAYER[other]})")
    assert not wrong, "imports against the one-way rule:\n" + "\n".join(wrong)


def test_the_rule_catches_an_upward_import(tmp_path, monkeypatch):
    # the engine importing the server, as a check that the test reads what it should
    engine = tmp_path / "dflash_local" / "engine"
    engine.mkdir(parents=True)
    (engine / "bad.py").write_text("def f():\n    from ..server.app import create_app\n")
    found = list(imports("dflash_local.engine.bad", engine / "bad.py"))
    assert found == ["dflash_local.server.app"]
    assert LAYER[unit(found[0])] > LAYER[unit("dflash_local.engine.bad")]


def test_no_symlink_or_build_output_is_tracked():
    """A clone is the project alone: a tracked symlink (a worktree's `.wheels -> /elsewhere/.wheels`) makes setup.sh
    fail on a fresh machine, as it once did in CI."""
    import subprocess
    listed = subprocess.run(["git", "ls-files", "-s"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    links = [line.split("\t", 1)[1] for line in listed.splitlines() if line.startswith("120000 ")]
    assert links == []
    outputs = (".wheels", ".venv", ".venv-test", ".llama-server", "build")
    tracked = [line.split("\t", 1)[1] for line in listed.splitlines()]
    assert [p for p in tracked if p.split("/", 1)[0] in outputs] == []
