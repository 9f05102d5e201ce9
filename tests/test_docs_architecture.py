"""docs/architecture.md stays true: every file and folder it names exists, and it names the files
of every stage a request passes (frontend, router, flow, worker, engine step, KV tier, kernels)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "architecture.md"

# A backticked repo-relative path: a file with an extension, or a folder ending in "/".
_PATH = re.compile(
    r"`((?:[\w.-]+/)*[\w.-]+\.(?:py|md|yml|yaml|toml|cpp|h|txt|json)|(?:[\w.-]+/)+)`"
)

STAGES = (
    "server/middleware.py",
    "server/app.py",
    "server/chat_routes.py",
    "server/admission.py",
    "server/family.py",
    "engine/contract.py",
    "router/remote_engine.py",
    "router/router.py",
    "router/policies.py",
    "router/pool.py",
    "disagg/flow.py",
    "disagg/client.py",
    "disagg/protocol.py",
    "disagg/http1.py",
    "server/worker.py",
    "engine/kv_tiering.py",
    "kvcache/",
    "server/stream.py",
    "server/serve.py",
    "engine/async_engine.py",
    "engine/llm_engine.py",
    "engine/scheduler.py",
    "engine/block_manager.py",
    "engine/model_runner.py",
    "engine/cuda_graphs.py",
    "engine/models/",
    "kernels/kernel_set.py",
    "kernels/registry.py",
    "engine/sampler.py",
    "engine/structured.py",
    "engine/spec_decode/",
)


def _named_paths(text: str) -> set[str]:
    return set(_PATH.findall(text))


def test_every_named_path_exists():
    named = _named_paths(DOC.read_text())
    assert len(named) > 40, "the pattern no longer finds the document's paths"
    missing = sorted(p for p in named if not (REPO / p).exists())
    assert not missing, f"docs/architecture.md names paths that do not exist: {missing}"
    folders = [p for p in named if p.endswith("/")]
    assert all((REPO / p).is_dir() for p in folders)


def test_every_linked_page_exists():
    links = re.findall(r"\]\(([\w./-]+\.md)\)", DOC.read_text())
    assert links
    missing = [link for link in links if not (DOC.parent / link).exists()]
    assert not missing, f"docs/architecture.md links pages that do not exist: {missing}"


def test_names_the_files_of_every_stage():
    named = _named_paths(DOC.read_text())
    for stage in STAGES:
        # A folder counts when the document names it or a file in it.
        found = stage in named or (stage.endswith("/") and any(p.startswith(stage) for p in named))
        assert found, f"docs/architecture.md does not name {stage}"


def test_the_map_links_it():
    assert "architecture.md" in (REPO / "docs" / "structures.md").read_text()
