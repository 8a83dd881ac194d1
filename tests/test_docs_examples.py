"""The documentation's examples run: the code blocks of docs/ marked to run are run here.

A fenced ``python`` block runs when the line right before its fence is a marker comment (the
convention is documented in docs/development.md, "Examples that run"):

- ``<!-- run -->``: on one rank;
- ``<!-- run: world_size=2 -->``: on that many gloo ranks, as ``torchrun --nproc-per-node 2``
  would run it (``RANK``, ``WORLD_SIZE`` and the default process group are in place);
- ``given=NAME`` (``<!-- run: world_size=2 given=sharded_model -->``): the names that a page's
  fragment takes from the reader's own program (``model``, ``optimizer``, ``train_step``, ...)
  are defined first by the prelude ``GIVEN[NAME]`` below.

Blocks run on the session's worker pool (harness/pool.py), in a fresh namespace as
``__main__`` and in an empty folder of their own. The pool's process group outlives each
block, so ``destroy_process_group()`` at the end of a script does nothing here.
"""

from __future__ import annotations

import os
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch.distributed as dist

from harness.pool import run_on_ranks

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"

_MARKER = re.compile(r"^(?P<indent>\s*)<!--\s*run(?::(?P<options>[^>]*))?\s*-->\s*$")
_OPTION = re.compile(r"(\w+)=([\w.]+)")

# What a fragment takes from the reader's program: a small sharded model on every rank.
GIVEN = {
    "sharded_model": """
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from shardkit.core import fully_shard

mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
blocks = [nn.Sequential(nn.Linear(16, 16), nn.ReLU()) for _ in range(3)]
model = nn.Sequential(*blocks, nn.Linear(16, 4))
for block in blocks:
    fully_shard(block, mesh=mesh)
fully_shard(model, mesh=mesh)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_step() -> None:
    model(torch.randn(8, 16)).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()


state = model  # what the checkpoint examples save: the module is DCP-Stateful
start, steps = 0, 3
""",
}


@dataclass(frozen=True, kw_only=True, slots=True)
class Example:
    """One marked block of a page."""

    where: str
    """``page:line`` of the fence, relative to docs/: the test's id and the code's file name."""
    source: str
    world_size: int = 1
    given: str | None = None


def _options(where: str, text: str | None) -> dict[str, str]:
    found = dict(_OPTION.findall(text or ""))
    unknown = set(found) - {"world_size", "given"}
    if unknown or _OPTION.sub("", text or "").strip(" ,"):
        raise ValueError(f"{where}: a run marker takes world_size=N and given=NAME, got {text!r}")
    if "given" in found and found["given"] not in GIVEN:
        raise ValueError(f"{where}: given={found['given']} is none of {sorted(GIVEN)}")
    return found


def examples_of(page: Path, root: Path = DOCS) -> list[Example]:
    """The marked blocks of one page under ``root``, each dedented to run as it stands."""
    lines = page.read_text().splitlines()
    found: list[Example] = []
    for number, line in enumerate(lines):
        marker = _MARKER.match(line)
        if marker is None:
            continue
        where = f"{page.relative_to(root)}:{number + 2}"
        fence = f"{marker['indent']}```python"
        if number + 1 >= len(lines) or lines[number + 1].rstrip() != fence:
            raise ValueError(f"{where}: a run marker must be followed by a {fence!r} fence")
        end = lines.index(f"{marker['indent']}```", number + 2)
        options = _options(where, marker["options"])
        found.append(
            Example(
                where=where,
                source=textwrap.dedent("\n".join(lines[number + 2 : end])),
                world_size=int(options.get("world_size", 1)),
                given=options.get("given"),
            )
        )
    return found


EXAMPLES = [example for page in sorted(DOCS.rglob("*.md")) for example in examples_of(page)]


def _run_example(
    rank: int, world_size: int, *, source: str, where: str, given: str | None, folder: str
) -> None:
    previous = os.getcwd()
    destroy = dist.destroy_process_group
    dist.destroy_process_group = lambda group=None: None
    namespace = {"__name__": "__main__"}
    try:
        os.chdir(folder)
        if given is not None:
            exec(compile(GIVEN[given], f"<given {given}>", "exec"), namespace)
        exec(compile(source, where, "exec"), namespace)
    finally:
        dist.destroy_process_group = destroy
        os.chdir(previous)


@pytest.mark.parametrize("example", EXAMPLES, ids=[example.where for example in EXAMPLES])
def test_example_runs(example: Example, tmp_path: Path) -> None:
    run_on_ranks(
        example.world_size,
        _run_example,
        source=example.source,
        where=example.where,
        given=example.given,
        folder=str(tmp_path),
    )


def test_the_guides_run_their_first_examples() -> None:
    # The pages whose examples a reader copies first: each has at least one that runs.
    pages = {example.where.split(":")[0] for example in EXAMPLES}
    expected = {
        "getting-started.md",
        "guide/core.md",
        "guide/legacy.md",
        "guide/tools.md",
        "checkpoints.md",
    }
    assert expected <= pages, expected - pages


def test_a_marker_without_a_python_fence_is_refused(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("<!-- run: world_size=2 -->\n```bash\ntorchrun x.py\n```\n")
    with pytest.raises(ValueError, match=r"page\.md:2: a run marker must be followed by"):
        examples_of(page, root=tmp_path)


def test_a_marker_with_an_unknown_option_is_refused(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("<!-- run: ranks=2 -->\n```python\npass\n```\n")
    with pytest.raises(ValueError, match="takes world_size=N and given=NAME"):
        examples_of(page, root=tmp_path)


def test_an_indented_block_runs_dedented(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "- a list item:\n\n  <!-- run: given=sharded_model -->\n  ```python\n  x = 1\n  ```\n"
    )
    (example,) = examples_of(page, root=tmp_path)
    assert (example.source, example.given, example.world_size) == ("x = 1", "sharded_model", 1)
