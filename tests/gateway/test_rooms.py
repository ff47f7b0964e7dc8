"""The gateway stays walkable: at most 12 rooms (modules and packages) at its top, each with its
layer in pyproject.toml's import-linter contract (which `lint-imports` checks: no room imports
one above it, so no circle), and no module past 500 lines."""

from __future__ import annotations

from pathlib import Path

import gateway

ROOT = Path(gateway.__file__).parent
MAX_ROOMS = 12
MAX_MODULE_LINES = 500


def _rooms() -> set[str]:
    return {p.stem for p in ROOT.iterdir() if p.suffix == ".py" and p.name != "__init__.py"} | {
        p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()}


def _contract_layers(container: str) -> set[str]:
    import tomllib  # (Python 3.11+; the tests run on the venv's)

    config = tomllib.loads((ROOT.parent / "pyproject.toml").read_text())["tool"]["importlinter"]
    [contract] = [c for c in config["contracts"] if c.get("containers") == [container]]
    assert contract["type"] == "layers" and contract.get("exhaustive") is True
    return {name.strip() for layer in contract["layers"] for name in layer.split("|")}


def test_the_gateway_has_at_most_twelve_rooms_and_the_contract_layers_them_all():
    rooms = _rooms()
    assert len(rooms) <= MAX_ROOMS, sorted(rooms)
    assert _contract_layers("gateway") == rooms


def test_every_endpoint_family_has_its_layer_in_the_contract():
    families = {p.name for p in (ROOT / "api").iterdir() if (p / "__init__.py").is_file()}
    assert _contract_layers("gateway.api") == families


def test_no_gateway_module_passes_500_lines():
    sizes = {str(p.relative_to(ROOT.parent)): len(p.read_text().splitlines()) for p in ROOT.rglob("*.py")}
    assert {path: n for path, n in sizes.items() if n > MAX_MODULE_LINES} == {}
