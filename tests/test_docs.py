"""What the user-facing docs say against the code: the keys they name, and no issue numbers
(users cannot look them up)."""

from __future__ import annotations

import re
from pathlib import Path

from protocol.keys import Keys

ROOT = Path(__file__).resolve().parents[1]
USER_DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_the_readmes_batch_example_reads_the_jobs_real_output_key():
    readme = (ROOT / "README.md").read_text()
    assert "XADD tf:batch:in '*' job_id evals-1" in readme
    assert f"XRANGE '{Keys().batch_out('evals-1')}'" in readme


def test_no_user_doc_cites_an_issue_number():
    cited = [f"{path.name}: {m.group(0)}" for path in USER_DOCS
             for m in re.finditer(r"(?i)\bissues? #?\d+", path.read_text())]
    assert cited == []
