"""The mutation audit's mutants (tests/mutants.py) still apply: each one's text occurs once in its file."""
import pytest

from mutants import MUTANTS, stale


@pytest.mark.parametrize("mutant", MUTANTS, ids=[m.name for m in MUTANTS])
def test_the_mutant_applies(mutant):
    assert stale(mutant) is None, f"{mutant.name}: {stale(mutant)}; update tests/mutants.py"
    assert mutant.find != mutant.replace
