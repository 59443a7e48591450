"""The contract suite's tuned runs, shared by the whole directory: builds are the slow part here.

``contract_runs.get(candidate_id)`` tunes the contract model once per candidate and session (see
:class:`contract_support.ContractRuns`); a per-backend file may check something of its own on one of these
builds instead of compiling another model.
"""

import pytest

from contract_support import ContractRuns


@pytest.fixture(scope="session")
def contract_runs(tmp_path_factory) -> ContractRuns:
    return ContractRuns(tmp_path_factory)
