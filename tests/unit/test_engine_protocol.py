"""The engine interface is declared: every engine class has every member of rollout.engine_protocol, the protocols
declare exactly the members the package's code uses on an engine, and nothing outside rollout/ asks for a concrete
engine class.

Everything here reads classes and source; no engine starts and vLLM is not imported. The engine classes are found
in the source (ast): every class of the package descending from weight_sync.engine_side.WeightSyncedEngine, so a
new engine class is checked without being listed here.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import typing
from pathlib import Path

import pytest

from megatron_rl.data.batch import Rollouts
from megatron_rl.rollout.engine_protocol import RolloutEngine, ServerPoolEngine, SteppedEngine, protocol_members

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "megatron_rl"
ROOT_CLASS = "WeightSyncedEngine"
PROTOCOLS = (RolloutEngine, SteppedEngine, ServerPoolEngine)
CAPABILITIES = {"VLLMEngine": {SteppedEngine}, "VLLMServerEngine": {ServerPoolEngine}}
"""Engine class -> the capability protocols it has besides RolloutEngine (it must lack the others)."""

NOT_ROLLOUT_ENGINES = {
    "megatron_rl/plan": "`engine` is the planner's model of an engine's memory (plan.memory.EngineMemory)",
    "megatron_rl/weight_sync/vllm_transfer.py": "`engine` is one of vLLM's trainer-side weight-transfer engines",
    "megatron_rl/rollout/interrupt.py": "`self.engine` is vLLM's LLMEngine inside an in-process engine",
}
"""Source where a name `engine` holds something other than a rollout engine: left out of the scan of uses."""


def _modules(root: Path = PACKAGE) -> dict[str, ast.Module]:
    """Path relative to the package's parent -> its parsed source, for every module under `root`."""
    return {str(p.relative_to(root.parent)): ast.parse(p.read_text(encoding="utf-8")) for p in sorted(root.rglob("*.py"))}


def engine_class_sources(root: Path = PACKAGE) -> dict[str, str]:
    """Class name -> its module's path, for ROOT_CLASS and every class of the package that descends from it."""
    bases_of: dict[str, tuple[str, set[str]]] = {}
    for path, tree in _modules(root).items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                names = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases}
                bases_of[node.name] = (path, names)
    found = {ROOT_CLASS: bases_of[ROOT_CLASS][0]}
    while grown := {n: p for n, (p, bases) in bases_of.items() if n not in found and bases & set(found)}:
        found.update(grown)
    return found


def _load(name: str, path: str) -> type:
    return getattr(importlib.import_module(path.removesuffix(".py").replace("/", ".")), name)


ALL_ENGINE_CLASSES = {name: _load(name, path) for name, path in engine_class_sources().items()}
ENGINES = {name: cls for name, cls in ALL_ENGINE_CLASSES.items() if hasattr(cls, "generate")}
"""The engine classes (the bases around the push and generation, WeightSyncedEngine and ServingEngine, generate
nothing themselves)."""


def test_the_engine_classes_are_found():
    assert {"VLLMEngine", "VLLMServerEngine"} <= set(ENGINES)
    assert {"WeightSyncedEngine", "ServingEngine"} <= set(ALL_ENGINE_CLASSES) - set(ENGINES)


def _assigned_on_self(cls: type) -> set[str]:
    """Attributes the class or its bases of the package assign as `self.<name> = ...` in any method."""
    names: set[str] = set()
    for base in cls.__mro__:
        if not base.__module__.startswith("megatron_rl."):
            continue
        for node in ast.walk(ast.parse(inspect.getsource(inspect.getmodule(base)))):
            if isinstance(node, ast.ClassDef) and node.name == base.__name__:
                for target in ast.walk(node):
                    if (isinstance(target, ast.Attribute) and isinstance(target.ctx, ast.Store)
                            and isinstance(target.value, ast.Name) and target.value.id == "self"):
                        names.add(target.attr)
    return names


def _hints(obj) -> dict:
    return typing.get_type_hints(obj)


def _signature_problems(declared, provided) -> list[str]:
    """How `provided` (the class's method) fails to accept every call `declared` (the protocol's) allows."""
    want, have = inspect.signature(declared), inspect.signature(provided)
    want_hints, have_hints = _hints(declared), _hints(provided)
    want_params, have_params = list(want.parameters.values())[1:], list(have.parameters.values())[1:]
    have_by_name = {p.name: p for p in have_params}
    problems = []
    positional = [p.name for p in want_params if p.kind is p.POSITIONAL_OR_KEYWORD]
    if [p.name for p in have_params if p.kind is p.POSITIONAL_OR_KEYWORD][: len(positional)] != positional:
        problems.append(f"positional parameters {[p.name for p in have_params]}, declared {positional} first")
    for param in want_params:
        got = have_by_name.get(param.name)
        if got is None:
            problems.append(f"no parameter {param.name}")
            continue
        if param.kind is param.KEYWORD_ONLY and got.kind not in (got.KEYWORD_ONLY, got.POSITIONAL_OR_KEYWORD):
            problems.append(f"{param.name} is {got.kind.description}, declared keyword-only")
        if param.default is not param.empty and got.default != param.default:
            problems.append(f"{param.name} defaults to {got.default!r}, declared {param.default!r}")
        if param.name in want_hints and param.name in have_hints and want_hints[param.name] != have_hints[param.name]:
            problems.append(f"{param.name}: {have_hints[param.name]}, declared {want_hints[param.name]}")
    for extra in have_params:
        if (extra.name not in want.parameters and extra.default is extra.empty
                and extra.kind not in (extra.VAR_POSITIONAL, extra.VAR_KEYWORD)):
            problems.append(f"parameter {extra.name} has no default (callers do not pass it)")
    if "return" in want_hints and "return" in have_hints and want_hints["return"] != have_hints["return"]:
        problems.append(f"returns {have_hints['return']}, declared {want_hints['return']}")
    return problems


def conformance_problems(cls: type, protocol: type) -> list[str]:
    """Each member of `protocol` that `cls` lacks or provides differently, as 'member: what is wrong'."""
    declared_types = _hints(protocol)
    class_types = _hints(cls)
    assigned = _assigned_on_self(cls)
    problems = []
    for name in protocol_members(protocol):
        declared = getattr(protocol, name, None)
        provided = inspect.getattr_static(cls, name, None)
        if callable(declared):  # a method
            if not callable(provided):
                problems.append(f"{name}: not a method of {cls.__name__}")
            else:
                problems += [f"{name}: {p}" for p in _signature_problems(declared, getattr(cls, name))]
            continue
        if isinstance(provided, property):
            have = _hints(provided.fget).get("return")
        elif name in class_types:
            have = class_types[name]
        elif name in assigned or (provided is not None and not callable(provided)):
            have = None  # set on the instance, its type not declared on the class
        else:
            problems.append(f"{name}: neither an attribute {cls.__name__} sets nor a property of it")
            continue
        if callable(provided) and not isinstance(provided, property):
            problems.append(f"{name}: a method of {cls.__name__}, declared as an attribute")
        elif have is not None and have != declared_types[name]:
            problems.append(f"{name}: {have}, declared {declared_types[name]}")
    return problems


@pytest.mark.parametrize("name", sorted(ENGINES))
def test_every_engine_class_has_every_member_of_its_protocols(name):
    cls = ENGINES[name]
    wanted = {RolloutEngine} | CAPABILITIES.get(name, set())
    for protocol in wanted:
        assert conformance_problems(cls, protocol) == [], f"{name} against {protocol.__name__}"
    for protocol in set(PROTOCOLS) - wanted:  # a capability the class has but is not listed for is a test to update
        assert conformance_problems(cls, protocol), f"{name} has every member of {protocol.__name__}: list it"


def test_a_missing_or_changed_member_is_found():
    """The checker itself, on classes that break the protocol in each way it looks for."""
    server = ENGINES["VLLMServerEngine"]

    class NoSleep(server):
        sleep = None

    class Renamed(server):
        def wake_up(self, which=None) -> None: ...

    class Required(server):
        def generate(self, prompts, sampling, extra) -> None: ...

    class Typed(server):
        def restart_after(self, error: BaseException) -> int: ...

    assert conformance_problems(NoSleep, RolloutEngine) == ["sleep: not a method of NoSleep"]
    assert "wake_up: no parameter tags" in conformance_problems(Renamed, RolloutEngine)
    assert conformance_problems(Required, RolloutEngine) == [
        "generate: parameter extra has no default (callers do not pass it)",
        f"generate: returns {type(None)}, declared {Rollouts}",
    ]
    assert conformance_problems(Typed, RolloutEngine) == [f"restart_after: returns {int}, declared {bool}"]
    assert "healthy: not a method of VLLMEngine" in conformance_problems(ENGINES["VLLMEngine"], ServerPoolEngine)


# ---- the members the package uses ---------------------------------------------------------------

def _holds_engine(node: ast.expr) -> bool:
    """`engine` or `<anything>.engine` (self.engine)."""
    return (isinstance(node, ast.Name) and node.id == "engine") or (isinstance(node, ast.Attribute) and node.attr == "engine")


def engine_member_uses(root: Path = PACKAGE) -> dict[str, list[str]]:
    """Member -> where the package's code uses it on an engine (`engine.x`, `self.engine.x`, getattr(engine, "x")),
    outside the engine classes' own modules and NOT_ROLLOUT_ENGINES."""
    skip = set(engine_class_sources(root).values())
    uses: dict[str, list[str]] = {}
    for path, tree in _modules(root).items():
        if path in skip or any(path.startswith(prefix) for prefix in NOT_ROLLOUT_ENGINES):
            continue
        for node in ast.walk(tree):
            name = None
            if isinstance(node, ast.Attribute) and _holds_engine(node.value):
                name = node.attr
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
                    and len(node.args) >= 2 and _holds_engine(node.args[0]) and isinstance(node.args[1], ast.Constant)):
                name = node.args[1].value
            if name is not None:
                uses.setdefault(name, []).append(f"{path}:{node.lineno}")
    return uses


def test_the_protocols_declare_exactly_the_members_the_package_uses():
    declared = set().union(*(protocol_members(p) for p in PROTOCOLS))
    uses = engine_member_uses()
    undeclared = {name: where for name, where in uses.items() if name not in declared}
    assert undeclared == {}, "used on an engine but declared by no protocol of rollout.engine_protocol"
    assert sorted(declared - set(uses)) == [], "declared but used nowhere in the package"


def test_protocol_members_match_typing():
    """protocol_members (the trainer's check of an engine it is given) lists what typing takes as the protocol."""
    for protocol in PROTOCOLS:
        assert protocol_members(protocol) == sorted(typing._get_protocol_attrs(protocol))  # noqa: SLF001


# ---- no concrete engine class outside rollout/ ----------------------------------------------------

def concrete_engine_checks(root: Path = PACKAGE) -> list[str]:
    """isinstance / issubclass on an engine class, or `type(x) is/== EngineClass`, outside rollout/: 'path:line'."""
    names = set(engine_class_sources(root))

    def names_engine(node: ast.expr) -> bool:
        parts = node.elts if isinstance(node, ast.Tuple) else [node]
        return any((isinstance(p, ast.Name) and p.id in names) or (isinstance(p, ast.Attribute) and p.attr in names)
                   for p in parts)

    found = []
    for path, tree in _modules(root).items():
        if path.startswith("megatron_rl/rollout/"):
            continue
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("isinstance", "issubclass")
                    and len(node.args) == 2 and names_engine(node.args[1])):
                found.append((path, node.lineno))
            elif (isinstance(node, ast.Compare) and isinstance(node.left, ast.Call) and getattr(node.left.func, "id", "") == "type"
                    and any(names_engine(c) for c in node.comparators)):
                found.append((path, node.lineno))
    return [f"{path}:{line}" for path, line in sorted(found)]


def test_no_code_outside_rollout_asks_for_a_concrete_engine_class():
    assert concrete_engine_checks() == [], "ask for a member of rollout.engine_protocol instead"


def test_the_scan_finds_a_concrete_engine_check(tmp_path):
    """The scan on a package that has one of each form it looks for."""
    (tmp_path / "megatron_rl" / "weight_sync").mkdir(parents=True)
    (tmp_path / "megatron_rl" / "weight_sync" / "engine_side.py").write_text("class WeightSyncedEngine:\n    pass\n")
    (tmp_path / "megatron_rl" / "rollout").mkdir()
    (tmp_path / "megatron_rl" / "rollout" / "vllm_engine.py").write_text(
        "from megatron_rl.weight_sync import engine_side\n\nclass VLLMEngine(engine_side.WeightSyncedEngine):\n    pass\n"
        "\nok = isinstance(object(), VLLMEngine)\n")
    (tmp_path / "megatron_rl" / "trainer.py").write_text(
        "a = isinstance(e, VLLMEngine)\nb = isinstance(e, (int, rollout.VLLMEngine))\nc = type(e) is WeightSyncedEngine\n"
        "d = isinstance(e, RolloutEngine)\n")
    assert concrete_engine_checks(tmp_path / "megatron_rl") == [
        "megatron_rl/trainer.py:1", "megatron_rl/trainer.py:2", "megatron_rl/trainer.py:3",
    ]
