"""Bad autoscaling flags: one line naming the flag, exit 1, nothing started."""

from __future__ import annotations

import pytest

from tokenfleet.cli import main


@pytest.mark.parametrize(("flags", "needle"), [
    (["up", "--min-replicas", "3", "--max-replicas", "2"], "--max-replicas must be >="),
    (["up", "--min-replicas", "0", "--max-replicas", "2"], "up needs --min-replicas >= 1"),
    (["up", "--max-replicas", "2", "--scale-down-load", "2"], "--scale-down-load"),
    (["up", "--max-replicas", "2", "--placement-timeout-s", "0"], "--placement-timeout-s must be > 0"),
    (["up", "--max-replicas", "2", "--target-wait-s", "-1"], "--target-wait-s must be >= 0"),
    (["autoscale", "--min-replicas", "1"], "--max-replicas is required"),
    (["autoscale", "--max-replicas", "2", "--tp", "2"], "--ray-address is required"),
])
def test_bad_autoscale_flag_is_named(flags: list[str], needle: str, tmp_path, capsys) -> None:
    assert main([*flags, "--model", str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("tokenfleet: error:") and needle in err[0], err
