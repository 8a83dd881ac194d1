"""Dependencies point one way: core imports none of the other shardkit packages, and the
others use only what the core's published modules export in ``__all__``."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from tests.import_graph import import_graph

ROOT = Path(__file__).resolve().parents[1] / "packages"
PACKAGES = {"core": "core", "tp_adapter": "tp", "legacy_fsdp_compat": "legacy", "tools": "tools"}
ALLOWED = {"core": set(), "tp": {"core"}, "legacy": {"core", "tp"}, "tools": {"core"}}
# The core's published modules: its API and the seams the other packages plug into.
SEAMS = {
    "shardkit.core",
    "shardkit.core.layout",
    "shardkit.core.extensions",
    "shardkit.core.schedule",
    "shardkit.core.conditional_schedule",
    "shardkit.core.export",
    "shardkit.core.checkpoint.local_plan.chunk_writers",
    "shardkit.core.checkpoint.local_plan.chunk_sources",
    "shardkit.core.checkpoint.local_plan.layout_record",
    "shardkit.core.checkpoint.local_plan.replica_pieces",  # the load cost times HSDP's split
    "shardkit.core.optim.owners",
    "shardkit.core.optim.newton_schulz",
    "shardkit.core.optim.blocks",
    "shardkit.core.optim.routes",
    "shardkit.core.optim",
}


def _shardkit_imports(path: Path) -> list[tuple[str, list[str]]]:
    """(module, imported names) for every ``shardkit.*`` import in a file."""
    found: list[tuple[str, list[str]]] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("shardkit."):
            found.append((node.module, [alias.name for alias in node.names]))
        elif isinstance(node, ast.Import):
            found += [(a.name, []) for a in node.names if a.name.startswith("shardkit.")]
    return found


@pytest.mark.parametrize("folder", list(PACKAGES))
def test_dependencies_point_one_way(folder: str) -> None:
    package = PACKAGES[folder]
    for path in (ROOT / folder / "src").rglob("*.py"):
        for module, names in _shardkit_imports(path):
            target = module.split(".")[1]
            if target == package:
                continue
            assert target in ALLOWED[package], f"{path}: {package} may not import {module}"
            if target == "core":
                assert module in SEAMS, f"{path}: import from {sorted(SEAMS)} only"
                public = importlib.import_module(module).__all__
                missing = set(names) - set(public)
                assert not missing, f"{path}: {missing} are not public in {module}"


# What each seam may load of the engine and the runtime, and why; any other arrow from a seam
# back into them fails. The schedule is published pure: the planner runs it on group indices.
INTERNALS = ("shardkit.core.engine", "shardkit.core.runtime")
SEAM_REACHES: dict[str, tuple[str, ...]] = {
    "shardkit.core": INTERNALS,  # the API: fully_shard builds the engine
    "shardkit.core.layout": INTERNALS,  # a read-only view of the engine's live groups
    "shardkit.core.extensions": ("shardkit.core.runtime.dtensors",),  # DTensor internals
    "shardkit.core.schedule": (),
    "shardkit.core.conditional_schedule": (),  # the conditional modules' schedule, as pure
    "shardkit.core.export": ("shardkit.core.runtime",),  # its own groups and collectives
    # A save's plan as a pure function of the state's layout: the planner predicts saves with it.
    # (and a ShardedTensor's group's ranks: FSDP1's shards are placed by group rank; and
    # torch.chunk's arithmetic, pure, which every cut of the core takes from one module)
    "shardkit.core.checkpoint.local_plan.chunk_writers": (
        "shardkit.core.runtime.chunks",
        "shardkit.core.runtime.dtensors",
        "shardkit.core.runtime.groups",
    ),
    # A restart's overlaps of held boxes with saved chunks, pure on the layout and the record:
    # the planner times a load's planning on it (shardkit-plan --checkpoint).
    "shardkit.core.checkpoint.local_plan.chunk_sources": (
        "shardkit.core.runtime.chunks",
        "shardkit.core.runtime.dtensors",
        "shardkit.core.runtime.groups",
    ),
    # The layout record's encoding, pure: the planner predicts its size (and reads it back).
    "shardkit.core.checkpoint.local_plan.layout_record": (
        "shardkit.core.runtime.chunks",
        "shardkit.core.runtime.dtensors",
        "shardkit.core.runtime.groups",
    ),
    # HSDP's split of a shard's saved items between its replicas, pure numpy: the planner
    # times it beside the overlaps (shardkit-plan --checkpoint).
    "shardkit.core.checkpoint.local_plan.replica_pieces": (),
    # Whole-matrix optimizers' owners and Newton-Schulz's cost, pure functions of shapes: the
    # planner places Muon's matrices on the ranks the optimizer will (shardkit-plan --optimizer).
    "shardkit.core.optim.owners": (),
    "shardkit.core.optim.newton_schulz": (),
    # and the exchange's routes on the blocks each rank holds, pure data: the planner sizes
    # the optimizer step's all-to-alls with them.
    "shardkit.core.optim.blocks": (),
    "shardkit.core.optim.routes": (),
    # The optimizers' API (the launch check runs Muon): their step runs the runtime's exchange.
    "shardkit.core.optim": INTERNALS,
}


def arrows_into_internals(
    graph: dict[str, set[str]], seam: str, allowed: tuple[str, ...]
) -> list[str]:
    """Each import chain by which ``seam`` loads an engine or runtime module outside ``allowed``.

    Chains follow load-time imports (``graph``) through any module of the core, so a seam that
    imports a leaf which imports the engine is caught too.
    """
    chains: dict[str, list[str]] = {seam: [seam]}
    queue = [seam]
    while queue:
        module = queue.pop(0)
        for imported in sorted(graph[module] - chains.keys()):
            chains[imported] = [*chains[module], imported]
            queue.append(imported)
    return [
        " -> ".join(chain)
        for module, chain in sorted(chains.items())
        if module.startswith(INTERNALS) and not module.startswith(allowed)
    ]


def test_no_seam_loads_the_engine_or_runtime_beyond_its_reach() -> None:
    assert set(SEAM_REACHES) == SEAMS  # a new seam says what it may reach
    graph = import_graph(CORE)
    assert graph["shardkit.core.schedule"]  # the parser sees its imports
    arrows = [
        chain
        for seam, allowed in SEAM_REACHES.items()
        for chain in arrows_into_internals(graph, seam, allowed)
    ]
    assert not arrows, "a seam loads engine or runtime code:\n" + "\n".join(arrows)


def test_the_seam_check_sees_an_arrow_through_a_leaf() -> None:
    graph = {
        "shardkit.core.schedule": {"shardkit.core.leaf"},
        "shardkit.core.leaf": {"shardkit.core.engine.state"},
        "shardkit.core.engine.state": {"shardkit.core.runtime.groups"},
        "shardkit.core.runtime.groups": set(),
    }
    assert arrows_into_internals(graph, "shardkit.core.schedule", ("shardkit.core.runtime",)) == [
        "shardkit.core.schedule -> shardkit.core.leaf -> shardkit.core.engine.state"
    ]
    assert arrows_into_internals(graph, "shardkit.core.leaf", INTERNALS) == []


def test_no_namespace_init() -> None:
    # shardkit is a namespace package: no shardkit/__init__.py in any distribution.
    assert not list(ROOT.glob("*/src/shardkit/__init__.py"))


COLLECTIVES = {
    "all_gather", "all_gather_single", "all_gather_into_tensor", "reduce_scatter",
    "reduce_scatter_single", "reduce_scatter_tensor", "all_reduce", "all_to_all",
    "all_to_all_single", "broadcast", "gather", "scatter", "isend", "irecv", "send", "recv",
    "batch_isend_irecv",
}  # fmt: skip
# Process-group calls other than collectives (who we are, groups, barriers, setup) belong to
# the runtime too: runtime/groups.py (and the export's own groups, runtime/export/).
PROCESS_GROUP_CALLS = {
    "barrier", "new_group", "get_rank", "get_world_size", "init_process_group",
    "destroy_process_group", "is_initialized", "get_backend", "get_process_group_ranks",
}  # fmt: skip
CORE = ROOT / "core" / "src" / "shardkit" / "core"


def _dist_uses(source: str, names: set[str]) -> list[tuple[int, str]]:
    """(line, name) for each of ``names`` taken from torch.distributed in ``source``.

    Finds ``dist.name`` under any alias of the module (``import torch.distributed as dist``,
    ``from torch import distributed``), ``torch.distributed.name``, and
    ``from torch.distributed import name``.
    """
    tree = ast.parse(source)
    aliases: set[str] = set()
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {a.asname for a in node.names if a.name == "torch.distributed" and a.asname}
        elif isinstance(node, ast.ImportFrom) and node.module == "torch" and node.level == 0:
            aliases |= {a.asname or a.name for a in node.names if a.name == "distributed"}
        elif isinstance(node, ast.ImportFrom) and node.module == "torch.distributed":
            found += [(node.lineno, a.name) for a in node.names if a.name in names]
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in names:
            owner = ast.unparse(node.value)
            if owner in aliases or owner == "torch.distributed":
                found.append((node.lineno, node.attr))
    return sorted(found)


def test_the_dist_check_sees_every_spelling() -> None:
    source = (
        "import torch\nimport torch.distributed as d\nfrom torch import distributed\n"
        "from torch.distributed import barrier\n"
        "d.get_rank()\ndistributed.new_group([0])\ntorch.distributed.barrier()\nd.is_initialized()\n"
    )
    assert _dist_uses(source, PROCESS_GROUP_CALLS) == [
        (4, "barrier"), (5, "get_rank"), (6, "new_group"), (7, "barrier"), (8, "is_initialized"),
    ]  # fmt: skip


# collectives.py (the step's), p2p/object_collectives.py (whole objects between steps),
# p2p/row_exchange.py (the exchange of rows that gloo's collectives and the step check's digests
# are posted through) and p2p/peer_transfer.py (memory snapshots to and from a peer) call them;
# flat_collectives.py only picks the installed torch's names for two; watch/comm_debug.py issues
# them on meta tensors, for torch's CommDebugMode to count (nothing is sent); replica_exchange.py
# broadcasts what one replica read of a checkpoint to the others; export/ holds the weight
# export's own groups and their gathers and broadcasts (the rule keeps them in the runtime);
# byte_exchange.py is the whole-matrix optimizers' one all-to-all each way (optim/).
COLLECTIVE_MODULES = {
    CORE / "runtime" / name
    for name in (
        "collectives.py",
        "flat_collectives.py",
        "replica_exchange.py",
        "byte_exchange.py",
        "p2p/object_collectives.py",
        "p2p/peer_transfer.py",
        "p2p/row_exchange.py",
        "watch/comm_debug.py",
        "export/export_groups.py",
        "export/receiver_group.py",
    )
}


def test_the_collective_modules_are_where_they_are_named() -> None:
    # A module moved out of this list's paths would leave its calls unchecked, not refused.
    missing = sorted(str(p.relative_to(CORE)) for p in COLLECTIVE_MODULES if not p.exists())
    assert not missing, f"named as collective modules, but not there: {missing}"


def test_only_the_runtime_calls_collectives() -> None:
    for path in CORE.rglob("*.py"):
        if path in COLLECTIVE_MODULES:
            continue
        for line, name in _dist_uses(path.read_text(), COLLECTIVES):
            raise AssertionError(f"{path}:{line} calls dist.{name}")


def test_only_the_runtime_talks_to_process_groups() -> None:
    calls = [
        f"{path.relative_to(CORE)}:{line} dist.{name}"
        for path in sorted(CORE.rglob("*.py"))
        if CORE / "runtime" not in path.parents
        for line, name in _dist_uses(path.read_text(), PROCESS_GROUP_CALLS)
    ]
    assert not calls, "outside runtime/:\n" + "\n".join(calls)


PRIVATE_DTENSOR = {"_local_tensor", "_spec", "DTensorSpec", "TensorMeta"}


def test_only_one_module_touches_dtensor_internals() -> None:
    found: list[str] = []
    for path in CORE.rglob("*.py"):
        if path == CORE / "runtime" / "dtensors.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "torch.distributed.tensor._"
            ):
                found.append(f"{path}:{node.lineno} imports {node.module}")
            elif isinstance(node, ast.Attribute) and node.attr in PRIVATE_DTENSOR:
                found.append(f"{path}:{node.lineno} uses .{node.attr}")
            elif isinstance(node, ast.Name) and node.id in PRIVATE_DTENSOR:
                found.append(f"{path}:{node.lineno} uses {node.id}")
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "DTensor"
            ):
                found.append(f"{path}:{node.lineno} calls DTensor(...) (private constructor)")
    assert not found, "\n".join(found)


# DeviceMesh's private methods: flattening axes, joining meshes, reaching the root mesh.
PRIVATE_MESH = {"_flatten", "_unflatten", "_concatenate", "_get_root_mesh", "_dim_group_names"}


def test_only_one_module_uses_private_device_mesh_api() -> None:
    found = [
        f"{path.relative_to(CORE)}:{node.lineno} uses .{node.attr}"
        for path in sorted(CORE.rglob("*.py"))
        if path != CORE / "runtime" / "meshes.py"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute) and node.attr in PRIVATE_MESH
    ]
    assert not found, "private DeviceMesh API outside runtime/meshes.py:\n" + "\n".join(found)


def test_the_meshes_module_is_where_the_private_mesh_api_is() -> None:
    # The check above looks for these names: the module must still be the one that uses them.
    source = (CORE / "runtime" / "meshes.py").read_text()
    used = {n.attr for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Attribute)}
    assert {"_flatten", "_concatenate"} <= used & PRIVATE_MESH


TP = ROOT / "tp_adapter" / "src" / "shardkit" / "tp"


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _own(node: ast.Attribute) -> bool:
    """Whether ``node`` reads an attribute of the object itself (``self._x``, ``cls._x``)."""
    return isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")


def _private_torch_uses(source: str) -> list[tuple[int, str]]:
    """(line, what) for each private torch name ``source`` reaches.

    A private module (``torch.distributed._shard``), a private name imported from torch, or a
    private attribute of anything but ``self`` or ``cls`` (``mesh._get_root_mesh()``).
    """
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [
                (node.lineno, f"import {a.name}")
                for a in node.names
                if a.name.split(".")[0] == "torch" and any(map(_is_private, a.name.split(".")))
            ]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            module = node.module or ""
            names = [a.name for a in node.names]
            if any(map(_is_private, module.split("."))):
                found.append((node.lineno, f"from {module} import ..."))
            found += [(node.lineno, f"from {module} import {n}") for n in names if _is_private(n)]
        elif isinstance(node, ast.Attribute) and _is_private(node.attr) and not _own(node):
            found.append((node.lineno, f".{node.attr}"))
    return sorted(found)


def test_the_private_torch_check_sees_every_spelling() -> None:
    source = (
        "import torch._dynamo\nfrom torch.distributed._shard import api\n"
        "from torch.distributed.tensor.placement_types import _StridedShard, Shard\n"
        "mesh._get_root_mesh()\nself._cache\nfrom torch.distributed.tensor import DTensor\n"
    )
    assert _private_torch_uses(source) == [
        (1, "import torch._dynamo"),
        (2, "from torch.distributed._shard import ..."),
        (3, "from torch.distributed.tensor.placement_types import _StridedShard"),
        (4, "._get_root_mesh"),
    ]


def test_only_one_module_uses_private_dynamo_api() -> None:
    # torch.compile's private names (dynamo's frame actions for the hooks) break in one file.
    found = [
        f"{path.relative_to(CORE)}:{line} {what}"
        for path in sorted(CORE.rglob("*.py"))
        if path != CORE / "runtime" / "dynamo.py"
        for line, what in _private_torch_uses(path.read_text())
        if "_dynamo" in what
    ]
    assert not found, "private dynamo API outside runtime/dynamo.py:\n" + "\n".join(found)


def test_the_dynamo_module_is_where_the_private_dynamo_api_is() -> None:
    # The check above looks for these names: the module must still be the one that uses them.
    uses = _private_torch_uses((CORE / "runtime" / "dynamo.py").read_text())
    assert any(what.startswith("from torch._C._dynamo") for _, what in uses)


LEGACY = ROOT / "legacy_fsdp_compat" / "src" / "shardkit" / "legacy"


@pytest.mark.parametrize(
    ("package", "allowed"), [(TP, "torch_internals.py"), (LEGACY, "torch_compat.py")]
)
def test_one_module_per_package_touches_private_torch(package: Path, allowed: str) -> None:
    uses = [
        f"{path.relative_to(package)}:{line} {what}"
        for path in sorted(package.rglob("*.py"))
        if path.name != allowed
        for line, what in _private_torch_uses(path.read_text())
    ]
    assert not uses, f"private torch outside {package.name}/{allowed}:\n" + "\n".join(uses)


_GROUP_STORAGE = "shardkit.core.engine.group.storage"


def _storage_reaches(path: Path) -> list[str]:
    """Where a module reaches into a group's storage (``._storage``, or its class imported)."""
    found: list[str] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr in ("storage", "_storage"):
            owner = ast.unparse(node.value)
            if owner.split(".")[-1] in ("group", "g") or owner.endswith("group"):
                found.append(f"{path.name}:{node.lineno} .{node.attr} of {owner}")
        elif (
            isinstance(node, ast.ImportFrom) and node.module == "shardkit.core.engine.group.storage"
        ):
            found.append(f"{path.name}:{node.lineno} imports group/storage")
    return found


def test_nothing_outside_the_group_reaches_into_its_storage() -> None:
    # A group's storage (its buffers) is the group's own: others ask the group's accessors
    # and its plan. Only the group itself holds it (group/upkeep.py: the GroupUpkeep the
    # group holds, its re-planning, is given it when the group is made).
    group = CORE / "engine" / "group"
    owners = {group / "param_group.py", group / "upkeep.py", group / "storage.py"}
    reaches = [
        reach
        for path in sorted(CORE.rglob("*.py"))
        if path not in owners
        for reach in _storage_reaches(path)
    ]
    assert not reaches, "\n".join(reaches)


def test_the_storage_check_sees_a_reach(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(
        "from shardkit.core.engine.group.storage import GroupStorage\n"
        "def f(group, state):\n    return group.storage.x, state.group._storage\n"
    )
    assert len(_storage_reaches(probe)) == 3


_REDUCE = "shardkit.core.engine.reduce"


def _reduce_reaches(path: Path, exports: set[str]) -> list[str]:
    """Where a module imports past the reduce folder's door.

    That is a module inside the folder, or a name its ``__init__`` does not export (``exports``).
    """
    found: list[str] = []
    for module, names in _shardkit_imports(path):
        if module.startswith(f"{_REDUCE}."):
            found.append(f"{path.name} imports {module}")
        elif module == _REDUCE and set(names) - exports:
            found.append(f"{path.name} imports {sorted(set(names) - exports)} from {module}")
    return found


def test_the_core_enters_the_reduce_folder_by_its_door() -> None:
    # engine/reduce/ is one room: the rest of the core imports only what its __init__ exports
    # (its docstring says why each export is there), so the room's modules may change alone.
    room = CORE / "engine" / "reduce"
    exports = set(importlib.import_module(_REDUCE).__all__)
    reaches = [
        reach
        for path in sorted(CORE.rglob("*.py"))
        if room not in path.parents
        for reach in _reduce_reaches(path, exports)
    ]
    assert not reaches, "\n".join(reaches)


def test_the_reduce_door_check_sees_a_reach(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(
        "from shardkit.core.engine.reduce import GroupReducer, assign\n"
        "from shardkit.core.engine.reduce.assign import take_sharded_grad\n"
        "def f():\n    import shardkit.core.engine.reduce.packing\n"
    )
    assert len(_reduce_reaches(probe, {"GroupReducer"})) == 3


def _imports_of(path: Path) -> set[str]:
    """Every ``shardkit.*`` module a file names in an import, at load or inside a function."""
    return {module for module, _ in _shardkit_imports(path)}


def test_the_engine_and_runtime_never_import_the_torch_facing_view() -> None:
    # The view answers torch's private names from the engine; the engine knows nothing of it
    # (see [Note: torch-facing view]), so a change to what torch reads stays in torch_facing/.
    reaches = [
        f"{path.relative_to(CORE)} imports {module}"
        for folder in ("engine", "runtime")
        for path in sorted((CORE / folder).rglob("*.py"))
        for module in sorted(_imports_of(path))
        if module.startswith("shardkit.core.torch_facing")
    ]
    assert not reaches, "\n".join(reaches)


def test_memory_snapshots_load_nothing_of_the_engine() -> None:
    # A snapshot is of a state dict: the snapshots' wing loads the runtime (peer transfers,
    # agreement) and the checkpoint manager, never the engine.
    graph = import_graph(CORE)
    wing = sorted(m for m in graph if m.startswith("shardkit.core.snapshots"))
    assert len(wing) > 10  # the walk sees the wing's modules
    arrows = [
        chain
        for module in wing
        for chain in arrows_into_internals(graph, module, ("shardkit.core.runtime",))
    ]
    assert not arrows, "\n".join(arrows)
