"""What the tests share and ``bench/`` does not: hand-built recordings (:mod:`.builder`, :mod:`.scenarios`,
:mod:`.step_loop`, :mod:`.schema_v1`), the rule for a test that cannot run here (:mod:`.need`) and where the
interpreters under test live (:mod:`.interpreters`). Imported as ``tests.support``: the repository root is on the
path (pyproject's ``pythonpath``), whichever test directory runs."""
