"""The mutation audit's mutants (tests/mutants.py) still apply: each one's text occurs once in its file."""
import pytest

from mutants import MUTANTS, stale


@pytest.mark.parametrize("mutant", MUTANTS, ids=[m.name for m in MUTANTS])
def test_the_mutant_applies(mutant):
    assert stale(mutant) is None, f"{mutant.name}: {stale(mutant)}; update tests/mutants.py"
    assert mutant.find != mutant.replace


def test_a_checkpoint_save_without_its_fsync_is_a_mutant():
    """Removing the temporary file's fsync must stay among the mutants (tests/test_durability.py kills it)."""
    mutant = next(m for m in MUTANTS if m.name == "checkpoint-fsync")
    assert "os.fsync(f.fileno())" in mutant.find and "os.fsync" not in mutant.replace
