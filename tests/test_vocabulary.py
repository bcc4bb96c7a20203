"""One offload vocabulary (docs/glossary.md): no class name is defined in both training's runtime/storage/ and
inference's runtime/inference/, the names that gave a word two meanings do not come back, one Timeline serves both,
and every class named after a glossary word is listed in the glossary under its meaning."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUBSYSTEMS = ("runtime/storage", "runtime/inference")
GLOSSARY = ROOT / "docs" / "glossary.md"
WORDS = ("Tier", "Home", "Store", "Cache", "Slot", "Timeline")
"""The glossary's words as they appear in class names."""
RETIRED = {
    "StepTimeline": "Timeline (runtime/host/timeline.py), one class for both",
    "HostTier": "HostExperts: a pinned host copy without a byte budget is not a tier",
    "SlotOffloader": "LayerSlotOffloader: a slot's name says its unit",
    "SlotExperts": "LayerSlotExperts: a slot's name says its unit",
    "CachedCopy": "CachedStore: the store cache holds layer stores",
    "ScratchCopy": "ScratchStore: the store cache holds layer stores",
}
"""Names that gave a word two meanings, and what replaced them."""


def classes(folder: str) -> dict[str, list[str]]:
    """Class name -> the modules under `folder` (relative to the repository) that define it at any depth."""
    found: dict[str, list[str]] = {}
    for path in sorted((ROOT / folder).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                found.setdefault(node.name, []).append(str(path.relative_to(ROOT)))
    return found


def test_no_class_name_is_defined_in_both_subsystems():
    training, inference = (classes(folder) for folder in SUBSYSTEMS)
    both = {name: training[name] + inference[name] for name in set(training) & set(inference)}
    assert not both, f"defined in both storage/ and inference/ (give each its own name, docs/glossary.md): {both}"


def test_the_retired_names_are_gone_from_runtime():
    defined = classes("runtime")
    used = set()
    for path in (ROOT / "runtime").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Name, ast.Attribute, ast.alias)):  # a use, an attribute, an import
                used.add(node.id if isinstance(node, ast.Name) else getattr(node, "attr", getattr(node, "name", "")))
    back = {name: why for name, why in RETIRED.items() if name in defined or name in used}
    assert not back, f"retired names are back (use the replacement): {back}"


def test_one_timeline_class_serves_training_and_inference():
    timelines = {name: where for name, where in classes("runtime").items() if "Timeline" in name}
    assert timelines == {"Timeline": ["runtime/host/timeline.py"]}


def test_every_class_named_after_a_glossary_word_is_in_the_glossary():
    text = GLOSSARY.read_text()
    listed = set(re.findall(r"`(\w+)`", text))
    named = sorted(name for folder in SUBSYSTEMS for name in classes(folder)
                   if any(word in name for word in WORDS) and not name.startswith("_"))
    assert named, "no class is named after a glossary word: the parse found nothing"
    missing = [name for name in named if name not in listed]
    assert not missing, f"named after a glossary word but not in docs/glossary.md (say what they are): {missing}"
