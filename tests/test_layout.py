"""The source tree draws the architecture: imports go one way, frontends -> engine -> native.

Every import in the package's source (dflash_local/, convert/ and tui/, which install as dflash_local.convert and
dflash_local.tui), at module level or inside a function, is read with ast and checked against the layers below.
native/'s `#include` lines are checked the same way, against a table of which file may include which (INCLUDES).
"""

import ast
import re
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


# The C++ of native/ (and the C of native/ggml/) draws the same way: every project file its `#include "..."` lines
# name (resolved against the including file's folder, then native/) must be in its row below. Rows go lowest first,
# and a row names only files of rows above it, so an include goes one way: down. A quoted name that is not a project
# file is llama.cpp's or ggml's, and must be one of EXTERNAL.
NATIVE = ROOT / "native"
INCLUDES = [
    # llama.cpp's declarations, errors, logging and decode helpers; the int8 LM head (ggml only)
    ("common.h", set()),
    ("greedy_head.h", set()),
    ("model.h", {"common.h"}),
    ("sampler.h", {"model.h"}),
    ("session.h", {"greedy_head.h", "model.h", "sampler.h"}),
    ("session_internal.h", {"session.h"}),  # what Session's .cpp files share beyond session.h
    ("common.cpp", {"common.h"}),
    ("rpc.cpp", {"common.h"}),
    ("model.cpp", {"model.h"}),
    ("greedy_head.cpp", {"greedy_head.h"}),
    ("sample_row.cpp", {"sampler.h"}),
    ("sampler.cpp", {"sampler.h"}),
    # Session's files, each by one concern
    ("session.cpp", {"session_internal.h"}),
    ("contexts.cpp", {"session.h"}),
    ("head.cpp", {"session.h"}),
    ("features.cpp", {"session_internal.h"}),
    ("drafting.cpp", {"session_internal.h"}),
    ("rows.cpp", {"session.h"}),
    # the Python module, over all of them
    ("bindings.cpp", {"common.h", "model.h", "sampler.h", "session.h"}),
    # C patched into ggml's CPU backend by patch_ggml.py and its checker, built against the installed ggml: ggml's
    # headers and their own, never the extension's
    ("ggml/batch_dot.h", set()),
    ("ggml/batch_dot.c", {"ggml/batch_dot.h"}),
    ("ggml/check_batch_dot.c", set()),
    ("ggml/check_matmul.c", set()),
    ("ggml/flash_attn.h", set()),
    ("ggml/flash_attn.c", {"ggml/flash_attn.h"}),
    ("ggml/check_flash_attn.c", set()),
]
INCLUDE_ROW = {name: i for i, (name, _) in enumerate(INCLUDES)}
EXTERNAL = {"llama.h", "ggml.h", "ggml-backend.h", "ggml-cpu.h", "gguf.h"}
# ggml-cpu's own headers, for the kernels patch_ggml.py compiles into it (flash attention's compute parameters, barrier
# and vector exp)
GGML_CPU_INTERNAL = {"ggml-cpu-impl.h", "ggml-impl.h", "vec.h"}
# pybind11: common.h brings py:: to every file, session.h the numpy arrays Session returns; the module itself and the
# type casters of pybind11/stl.h (which must not differ between files) are bindings.cpp's alone
PYBIND11 = {"common.h": {"pybind11/pybind11.h"}, "session.h": {"pybind11/numpy.h"},
            "bindings.cpp": {"pybind11/pybind11.h", "pybind11/numpy.h", "pybind11/stl.h"}}
INCLUDE_LINE = re.compile(r'^\s*#\s*include\s*([<"])([^">]+)[">]', re.M)


def native_files(root: Path):
    """native/'s C and C++ sources and headers, as paths relative to it ("session.cpp", "ggml/batch_dot.c")."""
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.suffix in (".h", ".c", ".cpp"))


def includes(root: Path, name: str):
    """(kind, target) of each #include of native file `name`: ("project", its path relative to root) for a file of
    the project (quoted, or by angle brackets), ("external", the name) for any other quoted one, ("system", the
    name) for angle brackets."""
    text = (root / name).read_text()
    for quote, target in INCLUDE_LINE.findall(text):
        here = (root / name).parent / target
        for candidate in (here, root / target):
            if candidate.is_file() and candidate.resolve().is_relative_to(root.resolve()):
                yield "project", candidate.resolve().relative_to(root.resolve()).as_posix()
                break
        else:
            yield ("external" if quote == '"' else "system"), target


def include_violations(root: Path, table=INCLUDES):
    row = {name: i for i, (name, _) in enumerate(table)}
    allowed = dict(table)
    wrong = []
    for name in native_files(root):
        if name not in row:
            wrong.append(f"{name}: no row in the include table")
            continue
        for kind, target in includes(root, name):
            if kind == "project" and target not in allowed[name]:
                how = ("a higher or equal file" if row.get(target, len(table)) >= row[name]
                       else "a lower file its row does not name")
                wrong.append(f"{name} (row {row[name]}) includes {target} (row {row.get(target)}): {how}")
            elif kind == "external" and target not in EXTERNAL and not (
                    name.startswith("ggml/") and target in GGML_CPU_INTERNAL):
                wrong.append(f'{name} includes "{target}", neither a project file nor one of llama.cpp\'s')
            elif kind == "system" and target.startswith("pybind11/") and target not in PYBIND11.get(name, set()):
                wrong.append(f"{name} includes <{target}>")
        if "PYBIND11_MODULE" in (root / name).read_text() and name != "bindings.cpp":
            wrong.append(f"{name} defines a pybind11 module: bindings.cpp is the only one")
    return wrong


def test_every_native_file_has_a_row():
    assert set(native_files(NATIVE)) == set(INCLUDE_ROW)


def test_the_include_table_goes_one_way():
    for name, allowed in INCLUDES:
        for target in allowed:
            assert INCLUDE_ROW[target] < INCLUDE_ROW[name], f"{name}'s row names {target}, not above it"
            assert target.endswith(".h"), f"{name}'s row names {target}, not a header"


def test_includes_go_one_way():
    wrong = include_violations(NATIVE)
    assert not wrong, "includes against the table:\n" + "\n".join(wrong)


def test_the_rule_catches_an_upward_include(tmp_path):
    # model.h including session.h, a ggml kernel the extension's common.h and session.h pybind11's type casters, as a
    # check that the test reads what it should
    (tmp_path / "ggml").mkdir()
    table = [("common.h", set()), ("model.h", {"common.h"}), ("session.h", {"model.h"}),
             ("ggml/batch_dot.c", set())]
    (tmp_path / "common.h").write_text('#pragma once\n#include "llama.h"\n#include <pybind11/pybind11.h>\n')
    (tmp_path / "session.h").write_text('#pragma once\n#include "model.h"\n')
    (tmp_path / "model.h").write_text('#pragma once\n#include "common.h"\n')
    (tmp_path / "ggml" / "batch_dot.c").write_text('#include "ggml.h"\n')
    assert include_violations(tmp_path, table) == []
    (tmp_path / "model.h").write_text('#pragma once\n#include "common.h"\n  #  include "session.h"\n')
    (tmp_path / "ggml" / "batch_dot.c").write_text('#include "ggml.h"\n#include "../common.h"\n')
    (tmp_path / "session.h").write_text('#pragma once\n#include "model.h"\n#include <pybind11/stl.h>\n')
    assert include_violations(tmp_path, table) == [
        "ggml/batch_dot.c (row 3) includes common.h (row 0): a lower file its row does not name",
        "model.h (row 1) includes session.h (row 2): a higher or equal file",
        "session.h includes <pybind11/stl.h>",
    ]
