"""The GPU bundle's requirement closure (scripts/sglang_gpu/engine_bundle/closure.py) on synthetic wheels: markers and
extras, the image list, carried and excluded requirements, conflicts, and the re-check that a bundle's manifest uses."""

from __future__ import annotations

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from scripts.sglang_gpu.engine_bundle import closure
from tests.sglang_gpu.wheels import make_wheel

IMAGE = {"numpy": Version("2.5.2"), "transformers": Version("5.17.0"), "pyyaml": None}
EXCLUDED = {"torch": "the image's build runs"}


def test_image_list_names_are_canonical_and_versions_optional(tmp_path):
    listing = tmp_path / "image.txt"
    listing.write_text("# header\nPyYAML\ntyping_extensions==4.15.0  # comment\n\nhuggingface-hub==1.33.0\n")
    assert closure.read_image_list(listing) == {"pyyaml": None, "typing-extensions": Version("4.15.0"),
                                                "huggingface-hub": Version("1.33.0")}
    listing.write_text("numpy==two\n")
    with pytest.raises(ValueError, match=r"image.txt:1: 'numpy==two'"):
        closure.read_image_list(listing)


def test_the_committed_image_list_reads_and_says_where_it_came_from():
    path = closure.Path(closure.__file__).parents[1] / "gpu_image_packages.txt"
    image = closure.read_image_list(path)
    assert image["torch"] == Version("2.11.0") and image["transformers"] == Version("5.17.0") and "triton" in image
    assert "KINDS.md" in path.read_text().splitlines()[1] and "2026-11-17" in path.read_text().split("\n\n")[0]


@pytest.mark.parametrize("line, active", [
    ("pydantic", True),
    ('av==16.1.0; sys_platform == "linux" and platform_machine == "aarch64"', False),
    ('torchcodec; sys_platform != "linux" or platform_machine != "aarch64"', True),
    ('tomli; python_version < "3.11"', False),
    ('typing-extensions>=4.5; python_version < "3.13"', True),
    ('addict; extra == "diffusion"', False),
    ('uvloop; implementation_name == "cpython"', True),
])
def test_markers_are_evaluated_for_cpython_312_linux_x86_64_without_extras(line, active):
    assert closure.is_active(Requirement(line)) is active


def test_closure_carries_what_the_image_lacks_and_walks_their_requirements(tmp_path):
    index = tmp_path / "index"
    index.mkdir()
    make_wheel(index, "fastapi", "0.165.0", ["pydantic>=2.9", "starlette>=1.6", "typing-extensions>=4.8"])
    make_wheel(index, "pydantic", "2.14.4", ["pydantic-core==2.50.5"])
    make_wheel(index, "pydantic-core", "2.50.5", ["typing-extensions>=4.16"])
    make_wheel(index, "starlette", "1.10.0", [])
    root = make_wheel(tmp_path, "sglang", "0.5.23", [
        "fastapi", "numpy", "torch==2.14.1", "transformers==5.19.0", "PyYAML",
        'decord2; platform_machine == "aarch64"', 'pytest; extra == "test"', "pydantic"])
    image = {**IMAGE, "typing-extensions": None}
    fetched = []

    def fetch(requirement):
        fetched.append(str(requirement))
        return closure.find_cached(requirement, index)

    result = closure.compute_closure(root, image, fetch, excluded=EXCLUDED)
    assert sorted(result.carried) == ["fastapi", "pydantic", "pydantic-core", "starlette"]
    assert fetched == ["fastapi", "pydantic", "starlette>=1.6", "pydantic-core==2.50.5"]  # once each, breadth first
    verdicts = {(d.requirer, d.requirement): d.verdict for d in result.decisions}
    assert verdicts[("sglang", "torch==2.14.1")] == "excluded"
    assert verdicts[("sglang", 'decord2; platform_machine == "aarch64"')] == "inactive"
    assert verdicts[("sglang", 'pytest; extra == "test"')] == "inactive"
    assert verdicts[("sglang", "pydantic")] == "carried" and verdicts[("pydantic", "pydantic-core==2.50.5")] == "carried"
    mismatch = next(d for d in result.decisions if d.requirement == "transformers==5.19.0")
    assert mismatch.verdict == "image" and "5.17.0" in mismatch.detail  # the image's version, named, not carried
    assert result.problems() == []


def test_a_later_pin_that_the_carried_version_misses_is_a_conflict(tmp_path):
    make_wheel(tmp_path, "dill", "0.4.1", [])
    make_wheel(tmp_path, "multiprocess", "0.70.19", ["dill<0.4"])
    root = make_wheel(tmp_path, "sglang", "0.5.23", ["dill", "multiprocess"], tag="cp312-cp312-linux_x86_64")
    result = closure.compute_closure(root, {}, lambda r: closure.find_cached(r, tmp_path), excluded={})
    [problem] = result.problems()
    assert (problem.requirer, problem.requirement, problem.verdict) == ("multiprocess", "dill<0.4", "conflict")


def test_check_closure_names_each_requirement_met_in_no_way():
    wheels = [("sglang", "0.5.23", ["numpy", "fastapi", "torch==2.14.1", "mistral-common>=1.11"]),
              ("fastapi", "0.165.0", ["pydantic>=2.9", 'pytest; extra == "test"'])]
    problems = closure.check_closure(wheels, IMAGE, EXCLUDED)
    assert [(d.requirer, d.requirement, d.verdict) for d in problems] == [
        ("sglang", "mistral-common>=1.11", "missing"), ("fastapi", "pydantic>=2.9", "missing")]
    wheels.append(("pydantic", "2.14.4", []))
    assert [d.requirement for d in closure.check_closure(wheels, IMAGE, {**EXCLUDED, "mistral-common": "why"})] == []
    wheels[-1] = ("pydantic", "1.10.0", [])
    [conflict] = closure.check_closure(wheels, IMAGE, {**EXCLUDED, "mistral-common": "why"})
    assert conflict.verdict == "conflict" and "1.10.0" in conflict.detail


def test_find_cached_takes_the_newest_allowed_version(tmp_path):
    for version in ("1.2.0", "1.10.0", "2.0.0"):
        make_wheel(tmp_path, "msgspec", version, [])
    assert closure.find_cached(Requirement("msgspec<2"), tmp_path).name == "msgspec-1.10.0-py3-none-any.whl"
    assert closure.find_cached(Requirement("msgspec"), tmp_path).name == "msgspec-2.0.0-py3-none-any.whl"
    assert closure.find_cached(Requirement("msgspec>3"), tmp_path) is None
    assert closure.find_cached(Requirement("orjson"), tmp_path) is None


def test_unreadable_metadata_is_named(tmp_path):
    root = make_wheel(tmp_path, "sglang", "0.5.23", ["fastapi >>> 1"])
    with pytest.raises(ValueError, match=r"sglang: unreadable Requires-Dist 'fastapi >>> 1'"):
        closure.compute_closure(root, {}, lambda r: None, excluded={})


def test_every_exclusion_has_a_reason_and_a_canonical_name():
    from packaging.utils import canonicalize_name

    for name, reason in closure.EXCLUDED.items():
        assert name == canonicalize_name(name) and len(reason) > 20, name
