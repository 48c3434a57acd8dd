"""constraints.txt pins the whole tested dependency set, and every install goes through it.

The set is the dependency closure of ``springback[test,hf,lightning]`` as this
venv holds it (deploy/local/setup.sh built it), read from the installed
distributions' own metadata: each one must be pinned at exactly the release
the suite runs with, so a new release of any dependency, direct or transitive,
reaches no install until it is pinned and tested (issue 44, supply chain).
Offline: nothing is downloaded.
"""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

import dockerfile
import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]
CONSTRAINTS = ROOT / "constraints.txt"
SETUP = ROOT / "deploy" / "local" / "setup.sh"
EXTRAS = frozenset({"test", "hf", "lightning"})  # the extras setup.sh installs


def pins() -> dict[str, str]:
    """constraints.txt as {canonical name: the line's version text}."""
    pinned: dict[str, str] = {}
    for line in CONSTRAINTS.read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        name, sep, version = line.partition("==")
        assert sep, f"constraints.txt: {line!r} is not name==version"
        pinned[canonicalize_name(name)] = version
    return pinned


def installed_closure() -> dict[str, Version]:
    """Every distribution springback[test,hf,lightning] needs, transitively,
    with the version installed here (markers evaluated for this Python)."""
    installed: dict[str, Version] = {}
    todo = [("springback", EXTRAS)]
    seen: set[tuple[str, frozenset[str]]] = set()
    while todo:
        name, extras = todo.pop()
        key = (canonicalize_name(name), frozenset(extras))
        if key in seen:
            continue
        seen.add(key)
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            pytest.fail(f"{name} is required but not installed: run deploy/local/setup.sh")
        if key[0] != "springback":
            installed[key[0]] = Version(dist.version)
        environments = [{"extra": e} for e in extras] or [{"extra": ""}]
        for text in dist.requires or []:
            requirement = Requirement(text)
            if requirement.marker and not any(requirement.marker.evaluate(e)
                                              for e in environments):
                continue
            todo.append((requirement.name, frozenset(requirement.extras)))
    return installed


class TestTheConstraintsFile:
    def test_it_pins_every_tested_distribution_at_the_release_installed_here(self):
        pinned = pins()
        closure = installed_closure()
        assert "springback" not in pinned, "the project itself is not a constraint"
        missing = sorted(set(closure) - set(pinned))
        assert not missing, f"installed for the suite but not pinned: {missing}"
        # a local label (torch's +cpu) is the same release: `torch==2.13.0` takes it
        differ = {name: (pinned[name], str(version)) for name, version in closure.items()
                  if Version(pinned[name]) != Version(version.public)}
        assert not differ, f"pinned != installed: {differ}"
        # pip itself is pinned too (setup.sh upgrades it through the file); nothing stale
        stale = sorted(set(pinned) - set(closure) - {"pip"})
        assert not stale, f"pinned but no longer a dependency: {stale}"

    def test_every_pin_is_an_exact_public_release(self):
        # no local label (+cpu), URL or editable: a fresh machine resolves it from PyPI
        for name, version in pins().items():
            assert re.fullmatch(r"[0-9][0-9A-Za-z.]*", version), f"{name}=={version}"


class TestEveryInstallGoesThroughIt:
    def test_each_pip_install_of_setup_takes_the_constraints(self):
        installs = [line for line in SETUP.read_text().splitlines()
                    if "pip install" in line and not line.lstrip().startswith("#")]
        assert len(installs) >= 3, installs  # pip, torch, the package with its extras
        for line in installs:
            assert "pip install -q -c constraints.txt " in line, line

    def test_setup_reinstalls_when_the_constraints_change(self):
        assert '[ constraints.txt -nt "$stamp" ]' in SETUP.read_text()

    def test_torch_is_pinned_alike_in_setup_the_dockerfile_and_the_constraints(self):
        (setup_pin,) = re.findall(r'"torch==([\d.]+)"', SETUP.read_text())
        args = dict(c.value[0].split("=", 1)
                    for c in dockerfile.parse_file(str(ROOT / "Dockerfile")) if c.cmd == "ARG")
        assert pins()["torch"] == setup_pin == args["TORCH_VERSION"]
