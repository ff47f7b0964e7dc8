"""The fleet's Lua scripts, one `<name>.lua` file each with its KEYS and ARGV named in a header
comment, and the one loader that reads them. (Moving the remaining scripts here is issue 26's
open part: gateway/limits.py, gateway/requests/store.py, gateway/batch/jobs.py,
service/replica_streams.py still hold theirs inline.)
"""

from __future__ import annotations

import functools
import re
from importlib import resources


@functools.cache
def _source(name: str) -> str:
    return resources.files(__name__).joinpath(f"{name}.lua").read_text()


def load(name: str, **values: str) -> str:
    """The script `name`, its `{PLACEHOLDER}`s filled in (a constant shared with Python, such as
    the consumer group's name, is written once, in Python)."""
    source = _source(name)
    for key, value in values.items():
        source = source.replace("{" + key + "}", value)
    left = re.findall(r"\{[A-Z_]+\}", source)
    if left:
        raise ValueError(f"{name}.lua has placeholders left unfilled: {left}")
    return source
