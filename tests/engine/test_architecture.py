"""The package's layout as a map: the engine at the top, every other room named for what it is,
and dependencies that run one way (read from the source with ``ast``; nothing is imported).

    train (the reference job) -> launch (starting ranks) -> engine
    public (miniddp.ddp: the public class) -> compat (torch's compatibility) -> options
                                          -> options (DDP's options), checks -> engine
    baselines -> public -> engine

The engine (the modules at the top of ``miniddp/`` but ``ddp``) imports nothing of the other
rooms: no option, no check, nothing that starts processes and nothing of the job. They attach
to the reducer (each option at the line of the step it changes) and to its event stream;
``miniddp.ddp`` composes the public class from the engine's, the options, torch's compatibility
and the checks. No module imports another that imports it back, however long the way round.
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "miniddp"

ROOMS = {"options", "compat", "checks", "baselines", "launch", "train", "optim", "run", "fsdp"}
#: The module that composes the public class: a room of one, at the top of the package.
PUBLIC = "miniddp.ddp"
#: What the engine must never import: every other room.
ENGINE_MUST_NOT_IMPORT = {"options", "compat", "public", "checks", "launch", "train",
                          "baselines", "optim", "run", "fsdp"}
#: Who may import whom, room by room ("engine" is the top of the package; the façade
#: ``miniddp/__init__.py`` exports from every room and is left out).
MAY_IMPORT = {
    "engine": {"engine"},
    "options": {"engine", "options"},
    "compat": {"engine", "options", "compat"},
    "checks": {"engine", "checks"},
    "public": {"engine", "options", "compat", "checks"},
    "baselines": {"engine", "public", "baselines"},
    "optim": {"engine", "optim"},
    "fsdp": {"engine", "fsdp"},
    "launch": {"engine", "launch"},
    "run": {"engine", "public", "fsdp", "launch", "run"},
    "train": {"engine", "public", "baselines", "launch", "train", "optim", "run"},
}


def module_name(path: pathlib.Path, package: pathlib.Path = PACKAGE) -> str:
    parts = ["miniddp", *path.relative_to(package).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(package: pathlib.Path = PACKAGE) -> dict[str, pathlib.Path]:
    return {module_name(p, package): p for p in sorted(package.rglob("*.py"))}


def imported(path: pathlib.Path, known: set[str], name: str) -> set[str]:
    """The miniddp modules ``path`` imports anywhere in it (in functions too). ``from miniddp
    import x`` counts as importing ``miniddp.x`` when that is a module; a package imported by
    being the parent of a module is not counted (Python runs it first, but that is not a
    dependency the code chose)."""
    found = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                found.add(full if full in known else base)
    return {m for m in found if m in known and m != name}


def import_graph(package: pathlib.Path = PACKAGE) -> dict[str, set[str]]:
    found = modules(package)
    return {name: imported(path, set(found), name) for name, path in found.items()}


def room(name: str) -> str:
    parts = name.split(".")
    if len(parts) > 1 and parts[1] in ROOMS:
        return parts[1]
    if name == PUBLIC:
        return "public"
    return "engine" if name != "miniddp" else "facade"


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1 or v in graph[v]:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return groups


def forbidden_imports(graph: dict[str, set[str]]) -> list[str]:
    wrong = []
    for name, targets in sorted(graph.items()):
        source = room(name)
        if source == "facade":
            continue
        for target in sorted(targets):
            if room(target) == "facade":
                wrong.append(f"{name} imports the package façade (import the module itself)")
            elif room(target) not in MAY_IMPORT[source]:
                wrong.append(f"{name} ({source}) imports {target} ({room(target)})")
    return wrong


def test_the_engine_sits_at_the_top_and_is_small():
    engine = sorted(n for n in modules() if room(n) == "engine")
    assert engine == ["miniddp.buckets", "miniddp.core", "miniddp.errors", "miniddp.events",
                      "miniddp.profiling", "miniddp.reducer", "miniddp.reducer_layout",
                      "miniddp.sampler", "miniddp.sync", "miniddp.torch_versions"]
    lines = sum(len(modules()[n].read_text().splitlines()) for n in engine)
    # (1675: the one copy of the reducer's steps, options included, where a second copy of 218
    # lines once lived in options/; and the public methods the options act through)
    assert lines < 1675, f"the engine has grown to {lines} lines: does something belong in a room?"


def test_every_module_lives_in_a_room_named_for_what_it_is():
    rooms = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert rooms <= ROOMS, f"a subpackage the map does not know: {rooms - ROOMS}"


def test_dependencies_run_one_way():
    assert forbidden_imports(import_graph()) == []


def test_the_engine_imports_no_check_no_launcher_and_nothing_of_the_job():
    graph = import_graph()
    for name, targets in graph.items():
        if room(name) == "engine":
            assert not {room(t) for t in targets} & ENGINE_MUST_NOT_IMPORT, (name, targets)


def test_no_two_modules_import_each_other():
    assert cycles(import_graph()) == []


# ----- the checks above can fail: a small package with each mistake in it -----

def write_package(tmp_path, files: dict[str, str]) -> pathlib.Path:
    root = tmp_path / "miniddp"
    for name, text in {"__init__.py": "", **files}.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        for parent in path.relative_to(root).parents:
            (root / parent / "__init__.py").touch()
        path.write_text(text)
    return root


def test_an_engine_importing_an_option_is_caught(tmp_path):
    root = write_package(tmp_path, {
        "reducer.py": "from miniddp.options.unused import UnusedParameters\n",
        "options/unused.py": "import torch\n",
    })
    assert forbidden_imports(import_graph(root)) == [
        "miniddp.reducer (engine) imports miniddp.options.unused (options)"]


def test_an_engine_importing_a_check_is_caught(tmp_path):
    root = write_package(tmp_path, {
        "reducer.py": "from miniddp.checks.consistency import late_gradient\n",
        "checks/consistency.py": "import torch\n",
    })
    graph = import_graph(root)
    assert forbidden_imports(graph) == [
        "miniddp.reducer (engine) imports miniddp.checks.consistency (checks)"]


def test_a_late_import_in_a_function_is_caught(tmp_path):
    root = write_package(tmp_path, {
        "core.py": "def trace(self):\n    from miniddp.checks import trace\n",
        "checks/trace.py": "",
    })
    assert forbidden_imports(import_graph(root)) == [
        "miniddp.core (engine) imports miniddp.checks.trace (checks)"]


def test_two_modules_importing_each_other_are_caught(tmp_path):
    root = write_package(tmp_path, {
        "launch/launcher.py": "from miniddp.launch.rank_group import RankGroup\n",
        "launch/rank_group.py": "def f():\n    from miniddp.launch import launcher\n",
    })
    assert cycles(import_graph(root)) == [["miniddp.launch.launcher",
                                           "miniddp.launch.rank_group"]]


def test_a_relative_import_is_read_like_an_absolute_one(tmp_path):
    root = write_package(tmp_path, {
        "options/join.py": "from ..launch import launcher\n",
        "launch/launcher.py": "",
    })
    assert forbidden_imports(import_graph(root)) == [
        "miniddp.options.join (options) imports miniddp.launch.launcher (launch)"]


@pytest.mark.parametrize("text", ["from miniddp import checks\n", "import miniddp.checks\n",
                                  "from miniddp import options\n", "from miniddp import ddp\n"])
def test_the_real_engine_with_a_check_import_added_fails(text):
    """Shown failing on the package itself: the real reducer with one line added (a check,
    an option, the public class)."""
    graph = import_graph()
    reducer = PACKAGE / "reducer.py"
    added = ast.parse(text).body[0]
    names = [a.name for a in added.names]
    target = names[0] if isinstance(added, ast.Import) else f"miniddp.{names[0]}"
    graph["miniddp.reducer"] = graph["miniddp.reducer"] | {target}
    assert reducer.exists()
    assert any("miniddp.reducer (engine)" in w for w in forbidden_imports(graph))


#: What of the engine ZeRO and FSDP may use: how miniddp holds a process group, and their
#: spans in the profiler's trace. Their collectives are their own, built on torch's.
OPTIM_MAY_USE_OF_THE_ENGINE = {"miniddp.sync", "miniddp.profiling"}
FSDP_MAY_USE_OF_THE_ENGINE = {"miniddp.profiling"}


def engine_imports(graph: dict[str, set[str]], of_room: str) -> set[str]:
    return {t for name, targets in graph.items() if room(name) == of_room
            for t in targets if room(t) == "engine"}


def test_fsdp_and_zero_stand_apart_from_the_ddp_engine():
    graph = import_graph()
    assert engine_imports(graph, "fsdp") <= FSDP_MAY_USE_OF_THE_ENGINE
    assert engine_imports(graph, "optim") <= OPTIM_MAY_USE_OF_THE_ENGINE


def test_fsdp_importing_the_reducer_is_caught():
    graph = import_graph()
    graph["miniddp.fsdp.param_group"] = graph["miniddp.fsdp.param_group"] | {"miniddp.reducer"}
    assert not engine_imports(graph, "fsdp") <= FSDP_MAY_USE_OF_THE_ENGINE


# ----- one copy of the reducer's steps, each option named where it acts -----

#: The reducer's options, and the module each comes from.
OPTIONS = {"views": "gradient_views", "unused": "unused", "static_graph": "static_graph",
           "graph_gradients": "create_graph"}


def unnamed_options(sources: dict[str, str]) -> list[str]:
    """The steps that read an option without naming its module (``options/<module>.py``)."""
    return [f"{step} reads self.{option} without naming options/{module}.py"
            for step, source in sorted(sources.items())
            for option, module in OPTIONS.items()
            if f"self.{option}" in source and f"options/{module}.py" not in source]


def reducer_steps() -> dict[str, str]:
    import inspect

    from miniddp.reducer import Reducer
    from miniddp.reducer_layout import ReducerLayout

    members = {**vars(ReducerLayout), **vars(Reducer)}  # the base's too: attach, the layout
    return {name: inspect.getsource(member) for name, member in members.items()
            if inspect.isfunction(member) and name != "__init__"}


def test_each_option_is_named_where_it_changes_a_step():
    steps = reducer_steps()
    assert {"_hook", "_mark_ready", "_finalize", "_copy_into_bucket"} <= set(steps)
    assert unnamed_options(steps) == []


def test_a_step_reading_an_option_silently_is_caught():
    """Negative control: a step that checks for gradient views without saying where they
    come from is named."""
    planted = {"_launch": "        if self.views is not None:\n            pass\n"}
    assert unnamed_options(planted) == [
        "_launch reads self.views without naming options/gradient_views.py"]


def class_assignments(package: pathlib.Path = PACKAGE) -> list[str]:
    """Every ``x.__class__ = ...`` in the engine: an object changing its class at run time.
    (``fully_shard`` gives a module FSDP's class as torch's does: that is its API.)"""
    found = []
    for path in sorted(package.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Assign) and any(
                    isinstance(t, ast.Attribute) and t.attr == "__class__" for t in node.targets):
                found.append(f"{path.relative_to(package)}:{node.lineno}")
    return found


def test_no_object_changes_its_class_at_run_time(tmp_path):
    assert class_assignments() == []
    root = write_package(tmp_path, {"reducer.py": "def route(r):\n    r.__class__ = int\n"})
    assert class_assignments(root) == ["reducer.py:2"]


def class_attributes_set_from_outside(package: pathlib.Path = PACKAGE) -> list[str]:
    """Module-level assignments to another module's class (``Reducer.x = ...``): an import
    that changes a class for everyone."""
    found = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.parse(path.read_text(), str(path)).body:
            if isinstance(node, ast.Assign) and any(
                    isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                    and t.value.id[:1].isupper() for t in node.targets):
                found.append(f"{path.relative_to(package)}:{node.lineno}")
    return found


def test_no_import_sets_a_class_attribute(tmp_path):
    assert class_attributes_set_from_outside() == []
    root = write_package(tmp_path, {"checks/__init__.py":
                                    "from miniddp.ddp import DDP\nDDP.checks = object()\n"})
    assert class_attributes_set_from_outside(root) == ["checks/__init__.py:2"]


@pytest.mark.slow
def test_importing_miniddp_and_sharding_leave_torchs_lists_alone():
    """``import miniddp`` changes nothing of torch's, and neither does ``fully_shard``: its shards
    are DTensors, which torch's foreach lists hold already (a fresh interpreter: this one has
    sharded already). (miniddp imports ``torch.distributed.fsdp``, for torch's ``FSDPModule``,
    and torch's import of it lists torch's DTensor: imported first, that is torch's.)"""
    import subprocess
    import sys

    script = (
        "import torch, torch.distributed as dist, torch.optim.optimizer as o\n"
        "import torch.distributed.fsdp  # torch puts its DTensor on the list itself\n"
        "before = list(o._foreach_supported_types)\n"
        "import miniddp\n"
        "assert o._foreach_supported_types == before, o._foreach_supported_types\n"
        "dist.init_process_group('gloo', store=dist.HashStore(), rank=0, world_size=1)\n"
        "miniddp.fully_shard(torch.nn.Linear(2, 2))\n"
        "assert o._foreach_supported_types == before, o._foreach_supported_types\n"
        "dist.destroy_process_group()\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, cwd=PACKAGE.parent)
    assert done.returncode == 0, done.stderr[-2000:]


# ----- one way in for the options: the reducer's and a bucket's insides stay home -----

REDUCER_HOME = {"reducer.py": "Reducer", "reducer_layout.py": "ReducerLayout",
                "events.py": "EventStream"}


def members_of(path: pathlib.Path, class_name: str) -> set[str]:
    """What class ``class_name`` of ``path`` defines: methods, class and ``self`` attributes."""
    cls = next(n for n in ast.parse(path.read_text()).body
               if isinstance(n, ast.ClassDef) and n.name == class_name)
    found = {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}
    found |= {t.id for n in cls.body if isinstance(n, ast.Assign) for t in n.targets
              if isinstance(t, ast.Name)}
    found |= {n.attr for n in ast.walk(cls) if isinstance(n, ast.Attribute)
              and isinstance(n.ctx, ast.Store) and getattr(n.value, "id", "") == "self"}
    return {name for name in found if not name.endswith("__")}


def reaches(paths, names: set[str], owner: str, store_only: bool = False) -> list[str]:
    """Each ``x.name`` (only assigned, with ``store_only``) in ``paths``, ``x`` neither ``self``
    nor the class ``owner`` (lesson 06 names the reducer's steps to print their sources)."""
    return [f"{path.parent.name}/{path.name}:{node.lineno} {node.attr}"
            for path in paths for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Attribute) and node.attr in names
            and getattr(node.value, "id", "") not in ("self", owner)
            and (not store_only or isinstance(node.ctx, ast.Store))]


def reducer_privates_reached(package: pathlib.Path = PACKAGE) -> list[str]:
    """Code of the package or the lessons, outside the reducer's files, reaching a private
    member of the reducer (an option comes in by ``Reducer.attach``, then uses public ones)."""
    private = {name for file, cls in REDUCER_HOME.items() if (package / file).exists()
               for name in members_of(package / file, cls) if name.startswith("_")}
    paths = [p for p in [*package.rglob("*.py"), *(package.parent / "lessons").rglob("*.py")]
             if p.name not in REDUCER_HOME or p.parent != package]
    return reaches(sorted(paths), private, "Reducer")


def bucket_fields_set_from_outside(package: pathlib.Path = PACKAGE) -> list[str]:
    """A ``Bucket``'s fields set outside ``buckets.py``: a bucket sets its own, from what it is
    given when built (``Bucket(...)``) or rebuilt (``Bucket.choose_copy``)."""
    paths = sorted(p for p in package.rglob("*.py") if p != package / "buckets.py")
    return reaches(paths, members_of(package / "buckets.py", "Bucket"), "Bucket", True)


def test_the_reducer_and_its_buckets_are_reached_through_public_methods_only():
    assert {"_mark_ready", "_copy_into_bucket", "_lock", "_listeners"} <= set().union(
        *(members_of(PACKAGE / file, cls) for file, cls in REDUCER_HOME.items()))
    assert reducer_privates_reached() == []
    assert {"scales_whole", "copies_at_end", "pending"} <= members_of(PACKAGE / "buckets.py",
                                                                      "Bucket")
    assert bucket_fields_set_from_outside() == []


def test_an_option_reaching_into_the_reducer_or_a_bucket_is_caught(tmp_path):
    """Negative control: an option taking the reducer's lock and marking a gradient ready, the
    reducer setting a bucket's mode; not the names on ``self``, off the class, or read."""
    root = write_package(tmp_path, {
        "reducer.py": "class Reducer:\n    def __init__(self, buckets):\n        self._lock = 0\n"
                      "        for b in buckets:\n            b.waits = b.waits or True\n"
                      "    def _mark_ready(self, i):\n        self.waits = 0\n",
        "buckets.py": "class Bucket:\n    def __init__(self):\n        self.waits = False\n",
        "options/static.py": "def first_backward(reducer):\n    with reducer._lock:\n"
                             "        reducer._mark_ready(0)\n",
        "options/fine.py": "from miniddp.reducer import Reducer\nSTEP = Reducer._mark_ready\n"
                           "class Own:\n    def go(self):\n        self._mark_ready(0)\n"})
    assert reducer_privates_reached(root) == ["options/static.py:2 _lock",
                                              "options/static.py:3 _mark_ready"]
    assert bucket_fields_set_from_outside(root) == ["miniddp/reducer.py:5 waits"]


# ----- a module over 300 lines says why it is one -----

#: A module over this many lines holds two ideas, unless a line of its docstring opens with
#: ``ONE_MODULE_BECAUSE`` and says why it is one (picotron, and ``fsdp/``, keep under it).
LONG_MODULE_LINES, ONE_MODULE_BECAUSE = 300, "One module because"


def long_modules_without_a_reason(package: pathlib.Path = PACKAGE) -> list[str]:
    texts = {path: path.read_text() for path in sorted(package.rglob("*.py"))}
    return [f"{path.relative_to(package)} ({len(text.splitlines())} lines)"
            for path, text in texts.items() if len(text.splitlines()) > LONG_MODULE_LINES
            and not any(line.startswith(ONE_MODULE_BECAUSE)
                        for line in (ast.get_docstring(ast.parse(text)) or "").splitlines())]


def test_every_long_module_says_why_it_is_one_and_fsdp_has_none():
    assert long_modules_without_a_reason() == []  # split it, or say why in its docstring
    fsdp = {p.name: len(p.read_text().splitlines()) for p in (PACKAGE / "fsdp").rglob("*.py")}
    assert max(fsdp.values()) <= LONG_MODULE_LINES, fsdp


def test_a_long_module_without_a_reason_is_caught(tmp_path):
    """Negative control: 301 lines without the reason in the docstring (a comment is not)."""
    body = "x = 1\n" * 300
    root = write_package(tmp_path, {
        "long.py": '"""Two things."""\n' + body,
        "comment_only.py": f'"""Two things."""\n# {ONE_MODULE_BECAUSE} they are one.\n' + body,
        "said.py": f'"""Two things.\n\n{ONE_MODULE_BECAUSE} they are one.\n"""\n' + body})
    assert long_modules_without_a_reason(root) == ["comment_only.py (302 lines)",
                                                   "long.py (301 lines)"]


# ----- the map: docs/code.md names every module -----

MAP = PACKAGE.parent / "docs" / "code.md"


def unmapped(package: pathlib.Path, text: str) -> list[str]:
    """The modules of ``package`` that the map does not name: an engine module as ``name.py``,
    a room's as `` `name` `` (its package files aside)."""
    missing = []
    for path in sorted(package.rglob("*.py")):
        if path.name == "__init__.py" and path.parent != package:
            continue
        rel = path.relative_to(package)
        named = f"`{rel.name}`" if len(rel.parts) == 1 else f"`{path.stem}`"
        if named not in text and f"{rel.name}" not in text:
            missing.append(str(rel))
    return missing


def test_the_map_names_every_module(tmp_path):
    assert unmapped(PACKAGE, MAP.read_text()) == []
    root = write_package(tmp_path, {"fsdp/__init__.py": "", "fsdp/planted.py": ""})
    assert unmapped(root, MAP.read_text()) == ["fsdp/planted.py"]


# ----- no machine's own paths in the repository -----

MACHINE_PATH = re.compile(r"(?<![\w.~])/(?:work|root|home|Users)/[\w.-]+")


def machine_paths(files: dict[str, str]) -> list[str]:
    """``file:line`` of every absolute path of one machine (a work tree, a home directory)."""
    return [f"{name}:{number}" for name, text in files.items()
            for number, line in enumerate(text.splitlines(), 1) if MACHINE_PATH.search(line)]


def test_no_tracked_file_holds_a_path_of_the_machine_it_was_made_on():
    import subprocess

    root = PACKAGE.parent
    listed = subprocess.run(["git", "-C", str(root), "ls-files"], capture_output=True,
                            text=True)
    if listed.returncode != 0:
        pytest.skip("not a git checkout")
    files = {}
    for name in listed.stdout.split():
        try:
            files[name] = (root / name).read_text()
        except (UnicodeDecodeError, FileNotFoundError, IsADirectoryError):
            continue  # images and the like
    assert machine_paths(files) == []
    planted = '{\n "before": "' + "/".join(("", "work", "wt-before")) + '"\n}'
    assert machine_paths({"planted.json": planted}) == ["planted.json:2"]


# ----- tests/: a folder per room, helpers in support/ -----

TESTS = PACKAGE.parent / "tests"
TEST_ROOMS = {"engine", "options", "compat", "fsdp", "optim", "operations", "course",
              "torch_suites"}


def misplaced_tests(tests: pathlib.Path) -> list[str]:
    """What breaks the layout: a test file at the top, a folder no room is named for, a test
    file among the helpers."""
    wrong = [p.name for p in tests.glob("test_*.py")]
    folders = {p.name for p in tests.iterdir() if p.is_dir() and p.name != "__pycache__"}
    wrong += sorted(f"{name}/" for name in folders - TEST_ROOMS - {"support"})
    wrong += [f"support/{p.name}" for p in (tests / "support").rglob("test_*.py")]
    return wrong


def test_tests_sit_in_the_room_they_prove(tmp_path):
    assert misplaced_tests(TESTS) == []
    planted = tmp_path / "tests"
    for folder in ("engine", "support", "misc"):
        (planted / folder).mkdir(parents=True)
    (planted / "test_loose.py").write_text("")
    (planted / "support" / "test_helper.py").write_text("")
    assert misplaced_tests(planted) == ["test_loose.py", "misc/", "support/test_helper.py"]


# ----- one home per helper: "same bits?" in checks/bits.py; lessons' printing and data in course/

BITS_HOME = "miniddp/checks/bits.py"  # what the tests, the benchmarks and the course import
LESSONS_TEACHING_BITS: set[str] = set()  # lessons keeping a visible copy to teach it: none today
BIT_EQUALITY = re.compile(r"same_bits|bits_equal|bit_difference")
JOB_MODULES = {"miniddp.train.report", "miniddp.train.data"}  # lessons take these from course/


def trees(root: pathlib.Path, folders=("miniddp", "course", "lessons", "benchmarks", "tests")):
    for path in sorted(p for folder in folders for p in (root / folder).rglob("*.py")):
        yield path.relative_to(root).as_posix(), ast.walk(ast.parse(path.read_text()))


def bit_equality_outside_its_home(root: pathlib.Path = PACKAGE.parent) -> list[str]:
    """Functions (or names assigned) called like ``same_bits`` outside their home (tests aside)."""
    return [f"{rel}:{node.lineno} {name}" for rel, nodes in trees(root)
            if rel != BITS_HOME and rel not in LESSONS_TEACHING_BITS for node in nodes
            for name in ([node.name] if isinstance(node, ast.FunctionDef) else
                         [t.id for t in node.targets if isinstance(t, ast.Name)]
                         if isinstance(node, ast.Assign) else [])
            if BIT_EQUALITY.search(name) and not name.startswith("test_")]


def lessons_importing_the_jobs_helpers(root: pathlib.Path = PACKAGE.parent) -> list[str]:
    return [f"{rel}:{node.lineno} {name}" for rel, nodes in trees(root, ("lessons",))
            for node in nodes if isinstance(node, (ast.Import, ast.ImportFrom))
            for name in sorted(JOB_MODULES & ({a.name for a in node.names} if isinstance(
                node, ast.Import) else {node.module, *(f"{node.module}.{a.name}"
                                                       for a in node.names)}))]


def test_bit_equality_has_one_home_and_lessons_print_with_the_course(tmp_path):
    assert bit_equality_outside_its_home() == []
    assert lessons_importing_the_jobs_helpers() == []
    for rel, text in {BITS_HOME: "def same_bits(a, b): pass\n",
                      "benchmarks/harness.py": "def bits_equal(x, y): pass\n",
                      "lessons/10_mixed.py": "import torch\nsame_bits = torch.equal\n"
                      "from miniddp.train.report import ok\nfrom miniddp.train import data\n",
                      "tests/support/bits.py": "def all_same_bits(xs, ys): pass\n"}.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert bit_equality_outside_its_home(tmp_path) == [
        "benchmarks/harness.py:1 bits_equal", "lessons/10_mixed.py:2 same_bits",
        "tests/support/bits.py:1 all_same_bits"]
    assert lessons_importing_the_jobs_helpers(tmp_path) == [
        "lessons/10_mixed.py:3 miniddp.train.report", "lessons/10_mixed.py:4 miniddp.train.data"]


# ----- the front doors stay short -----

#: file -> (most lines, most bytes): read in five minutes; reference material goes to docs/
FRONT_DOORS = {"README.md": (250, 16_384), "benchmarks/README.md": (400, None)}


def over_budget(root: pathlib.Path, budgets: dict) -> list[str]:
    found = []
    for name, (most_lines, most_bytes) in budgets.items():
        text = (root / name).read_text()
        if len(text.splitlines()) > most_lines:
            found.append(f"{name}: {len(text.splitlines())} lines, budget {most_lines}")
        if most_bytes is not None and len(text.encode()) > most_bytes:
            found.append(f"{name}: {len(text.encode())} bytes, budget {most_bytes}")
    return found


def test_the_front_doors_stay_within_their_budgets(tmp_path):
    assert over_budget(PACKAGE.parent, FRONT_DOORS) == []
    (tmp_path / "README.md").write_text("line\n" * 251)
    assert over_budget(tmp_path, {"README.md": (250, 16_384)}) == [
        "README.md: 251 lines, budget 250"]

