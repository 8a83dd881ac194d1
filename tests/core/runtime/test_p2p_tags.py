"""One table of point-to-point tags (``runtime/p2p/p2p_tags.py``), one owner for each tag.

gloo pairs messages by sender and tag alone, so two kinds of message that share a tag can pair
with each other (tag 3 was once claimed by the step check and the object transfers both). These
checks read the core's source: no two blocks of the table overlap, each block is named by its
owner alone, and no module passes a tag it spelled as a number (``tag=3``, a ``_TAG = 3`` of its
own, or no tag at all, which is c10d's 0). Each check is also run on a made-up case it must
refuse, so that a check that sees nothing cannot pass.
"""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

from shardkit.core.runtime.p2p import p2p_tags
from shardkit.core.runtime.p2p.p2p_tags import TagBlock

CORE = Path(__file__).resolve().parents[3] / "packages" / "core" / "src" / "shardkit" / "core"
RUNTIME = CORE / "runtime"
TABLE_MODULE = RUNTIME / "p2p" / "p2p_tags.py"
_POINT_TO_POINT = {"isend", "irecv", "send", "recv"}
_EXCHANGE = "post_row_exchange"  # takes its tag as its second argument
_LARGEST_TAG = 2**31 - 1  # c10d takes a tag as a signed 32-bit int


def overlapping(blocks: dict[str, TagBlock]) -> list[str]:
    """Each pair of blocks that share a tag, and each block outside 1 .. 2**31 - 1.

    Tag 0 is c10d's default: a message sent with no tag must never meet one of the table's.
    """
    found = [
        f"{name}: tags {b.first}..{b.first + b.count - 1} outside 1..{_LARGEST_TAG}"
        for name, b in blocks.items()
        if b.count < 1 or b.first < 1 or b.first + b.count - 1 > _LARGEST_TAG
    ]
    ordered = sorted(blocks.items(), key=lambda item: item[1].first)
    for (name, block), (next_name, next_block) in itertools.pairwise(ordered):
        if block.first + block.count > next_block.first:
            found.append(f"{name} ({block.owner}) and {next_name} ({next_block.owner}) share tags")
    return found


def _names_used(source: str) -> set[str]:
    """Every name a module's code spells: variables, attributes and imported names."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Name):
            found.add(node.id)
        elif isinstance(node, ast.Attribute):
            found.add(node.attr)
        elif isinstance(node, ast.ImportFrom):
            found |= {alias.name for alias in node.names}
    return found


def foreign_uses(sources: dict[str, str], blocks: dict[str, TagBlock]) -> list[str]:
    """Each block that a module other than its owner names, or that its owner never names.

    ``sources``: each runtime module's source, by its name (``collectives``, ``desync``).
    """
    used = {module: _names_used(source) for module, source in sources.items()}
    found = [
        f"{name}: its owner {block.owner} does not use it"
        for name, block in blocks.items()
        if name not in used.get(block.owner, set())
    ]
    for module, names in sorted(used.items()):
        for name in sorted(names & blocks.keys()):
            if blocks[name].owner != module:
                found.append(f"{module} uses {name}, owned by {blocks[name].owner}")
    return found


def _has_number(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Constant) and type(n.value) is int for n in ast.walk(node))


def _names_a_tag(target: ast.expr) -> bool:
    """Whether an assignment's target is named as a tag: ``_STATE_TAG``, ``self.tag``."""
    name = target.attr if isinstance(target, ast.Attribute) else ast.unparse(target)
    return bool({"tag", "tags"} & set(name.lower().split("_")))


def _called_name(call: ast.Call) -> str:
    """The called function's name, for c10d's calls: ``dist.isend``, a process group's
    ``group.send``, or a name imported from c10d. A method of anything else (a
    multiprocessing ``connection.send`` between a rank and its own writer process) is not
    c10d's and has no tag: ''."""
    func = call.func
    if isinstance(func, ast.Attribute):
        owner = ast.unparse(func.value).lower()
        c10d = owner in {"dist", "torch.distributed", "c10d"} or "group" in owner or "pg" in owner
        return func.attr if c10d else ""
    return func.id if isinstance(func, ast.Name) else ""


def _tag_of(call: ast.Call, name: str) -> ast.expr | None:
    """The tag a call passes: by keyword, or by position (4th of c10d's, 2nd of the helper's)."""
    for keyword in call.keywords:
        if keyword.arg == "tag":
            return keyword.value
    position = 1 if name == _EXCHANGE else 3
    return call.args[position] if len(call.args) > position else None


def literal_tags(source: str) -> list[str]:
    """``"line N: ..."`` for each tag a module spells as a number, or leaves out.

    Point-to-point calls (c10d's and the row exchange's) must pass a tag with no number in it,
    and no name with "tag" in it may be bound to an expression with a number in it.
    """
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            name = _called_name(node)
            if name not in _POINT_TO_POINT and name != _EXCHANGE:
                continue
            tag = _tag_of(node, name)
            if tag is None:
                found.append((node.lineno, f"{name} without a tag (c10d's 0)"))
            elif _has_number(tag):
                found.append((node.lineno, f"{name} with tag {ast.unparse(tag)}"))
        elif isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            named = [t for t in targets if _names_a_tag(t)]
            if named and _has_number(node.value):
                found.append((node.lineno, f"{ast.unparse(named[0])} = a number"))
    return [f"line {line}: {what}" for line, what in sorted(found)]


def _table_blocks() -> dict[str, TagBlock]:
    return {name: v for name, v in vars(p2p_tags).items() if isinstance(v, TagBlock)}


def test_no_two_owners_share_a_tag() -> None:
    blocks = _table_blocks()
    assert set(p2p_tags.TABLE) == set(blocks.values()), "a block missing from TABLE"
    assert [b.first for b in p2p_tags.TABLE] == sorted(b.first for b in p2p_tags.TABLE)
    assert not overlapping(blocks), overlapping(blocks)


def test_each_block_is_used_by_its_owner_alone() -> None:
    modules = [
        path
        for path in sorted(RUNTIME.rglob("*.py"))
        if path != TABLE_MODULE and path.name != "__init__.py"
    ]
    sources = {path.stem: path.read_text() for path in modules}  # an owner is a module's name
    assert len(sources) == len(modules), "two runtime modules share a name"
    outside = [
        str(path.relative_to(CORE))
        for path in sorted(CORE.rglob("*.py"))
        if RUNTIME not in path.parents and _names_used(path.read_text()) & _table_blocks().keys()
    ]
    assert not outside, f"tags used outside the runtime: {outside}"
    problems = foreign_uses(sources, _table_blocks())
    assert not problems, problems


def test_no_module_spells_a_tag_as_a_number() -> None:
    found = [
        f"{path.relative_to(CORE)} {line}"
        for path in sorted(CORE.rglob("*.py"))
        if path != TABLE_MODULE
        for line in literal_tags(path.read_text())
    ]
    assert not found, "tags not from runtime/p2p/p2p_tags.py:\n" + "\n".join(found)


# --- the checks refuse what they are there to refuse ----------------------------------------


def test_the_overlap_check_sees_a_shared_tag() -> None:
    blocks = {
        "A": TagBlock("one", 3),
        "B": TagBlock("two", 1, 3),  # 1, 2, 3
        "C": TagBlock("three", 0),
    }
    assert overlapping(blocks) == [
        "C: tags 0..0 outside 1..2147483647",
        "B (two) and A (one) share tags",
    ]
    assert overlapping({"A": TagBlock("one", 3), "B": TagBlock("two", 1, 2)}) == []


def test_the_owner_check_sees_a_borrowed_block() -> None:
    blocks = {"GATHERS": TagBlock("collectives", 1), "CHECKS": TagBlock("step_check", 3)}
    sources = {
        "collectives": "from p2p_tags import GATHERS\nGATHERS.tag()\n",
        "object_collectives": "import p2p_tags\np2p_tags.CHECKS.tag()\n",
    }
    assert foreign_uses(sources, blocks) == [
        "CHECKS: its owner step_check does not use it",
        "object_collectives uses CHECKS, owned by step_check",
    ]


def test_the_literal_check_sees_every_spelling() -> None:
    source = (
        "import torch.distributed as dist\n"
        "dist.isend(t, group=g, group_dst=1, tag=3)\n"  # 2
        "dist.irecv(t, src=0)\n"  # 3: c10d's tag 0
        "dist.isend(t, 1, g, 4)\n"  # 4: by position
        "_STATE_TAG = 3\n"  # 5
        "self._staged = 3\n"  # fine: a word that holds "tag"
        "post_row_exchange(g, BLOCK.first + 1, send=t, receive_into=r)\n"  # 7
        "dist.irecv(t, group=g, group_src=1, tag=BLOCK.tag(part))\n"  # fine
        "post_row_exchange(g, tag, send=t, receive_into=r)\n"  # fine
        "tag = BLOCK.tag() if gloo else None\n"  # fine
    )
    assert literal_tags(source) == [
        "line 2: isend with tag 3",
        "line 3: irecv without a tag (c10d's 0)",
        "line 4: isend with tag 4",
        "line 5: _STATE_TAG = a number",
        "line 7: post_row_exchange with tag BLOCK.first + 1",
    ]
