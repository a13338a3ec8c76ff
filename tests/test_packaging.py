"""The distribution lists every package, and nothing generic lands at the top of site-packages."""

from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_every_package_is_listed():
    tool = _pyproject()["tool"]["setuptools"]
    listed = set(tool["packages"])
    mapped = {name: ROOT / folder for name, folder in tool["package-dir"].items()}
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "smartgen").rglob("__init__.py")}
    for name, folder in mapped.items():
        found |= {
            name + "".join("." + part for part in p.parent.relative_to(folder).parts)
            for p in folder.rglob("__init__.py")
        }
    assert found == listed, f"packages missing from pyproject: {found - listed}; listed but absent: {listed - found}"


def test_shells_install_inside_the_smartgen_namespace():
    tool = _pyproject()["tool"]["setuptools"]
    assert all(name.startswith("smartgen") for name in tool["packages"])
    assert tool["package-dir"] == {"smartgen.cli": "cli", "smartgen.tui": "tui", "smartgen.store": "store"}
    assert _pyproject()["project"]["scripts"] == {"smartgen": "smartgen.cli.app:main"}


def test_every_lane_beyond_tcp_installs_as_an_extra_of_its_name():
    from smartgen.lanes.backends import LANES

    extras = _pyproject()["project"]["optional-dependencies"]
    assert set(LANES) - {"tcp"} <= set(extras), "pip install 'smartgen[<lane>]' must exist for every optional lane"
    assert all(extras[name] for name in set(LANES) - {"tcp"})
