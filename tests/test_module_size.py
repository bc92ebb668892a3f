"""Every Python module of the package, of scripts/ and of tests/ is small enough to read at once (DESIGN: one concept
per module): at most ``MAX_LINES`` lines. A module that grows past it is split by responsibility, each part named after
what it does."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 400


def test_no_module_of_the_package_scripts_or_tests_is_over_the_limit():
    sizes = {path.relative_to(ROOT).as_posix(): len(path.read_text().splitlines())
             for folder in ("kvzap_export", "scripts", "tests") for path in sorted((ROOT / folder).rglob("*.py"))}
    assert sizes, "no module found: the paths moved?"
    over = {name: n for name, n in sizes.items() if n > MAX_LINES}
    assert not over, f"modules over {MAX_LINES} lines (split them by responsibility): {over}"
