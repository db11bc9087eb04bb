"""Every fault of `tests/faults.py` still applies to today's sources: each edit's snippet
occurs exactly once in its file. A refactor that moves the code a fault edits fails here,
in CI, instead of leaving the fault unchecked until someone runs the script (which then
also checks that the tests catch it: `python tests/faults.py`)."""

import faults
import pytest


@pytest.mark.parametrize("name", list(faults.FAULTS))
def test_fault_applies_to_the_sources(name):
  for path, old, new in faults.FAULTS[name].edits:
    text = (faults.REPO / path).read_text()
    assert text.count(old) == 1, (
      f"fault {name}: {path} holds its snippet {text.count(old)} times: {old!r}"
    )
    assert old != new, f"fault {name}: an edit of {path} changes nothing"
