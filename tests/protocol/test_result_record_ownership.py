"""Every field of `tf:res` is written and read through protocol/result_record.py only.

Outside protocol/, no product module (nor the gateway tests' fake scheduler) may spell a field of
the record in a way that reads or writes the hash:
- a bytes literal naming a field (`raw[b"token_ids"]`, `raw.get(b"seq")`);
- a hash command on a result key (`keys.result(...)`, or a name assigned from it) with a field
  name as a literal argument (`hget(key, "batch_n")`, `hmget(key, ["state", "seq"])`);
- a dict literal with its state and one more field as keys (a record built by hand:
  `{"state": "queued", "queued_at": ...}`; the requests API's events and timings, without a
  state, are bodies);
- a subscript by one of them (`fields["first_token_at"] = ...`).
(The Lua scripts' text names the fields it touches; it is a string, not one of these shapes.)
"""

from __future__ import annotations

import ast
from pathlib import Path

from protocol.result_record import F

REPO = Path(__file__).resolve().parents[2]
PRODUCT = ("gateway", "scheduler", "tokenfleet", "workers", "shared")
EXTRA = ("tests/gateway/fake_scheduler.py",)

FIELDS = {value for name, value in vars(F).items() if name.isupper()}
# Names no other structure of ours uses as keys (model, state, text, api, usage, error... are
# also keys of OpenAI bodies, events and heartbeats, so only the bytes and hash rules see them;
# embedding is also the key and the `object` of OpenAI's embedding object).
OWN_FIELDS = FIELDS - {"state", "model", "api", "text", "usage", "error", "logprobs", "top_logprobs",
                       "finish_reason", "tenant", "stream", "custom_id", "prompt_tokens", "scheduler",
                       "deadline", "owner", "seq", "token_ids", "prompt_logprobs", "echo", "embedding"}
# b"model" is also a field of a scheduler's heartbeat hash (gateway/fleet/tracker.py parses it).
BYTES_FIELDS = FIELDS - {"model"}
HASH_COMMANDS = {"hget", "hmget", "hset", "hsetnx", "hdel", "hexists", "hincrby", "hincrbyfloat"}


def _is_result_key(node: ast.AST, names: set[str]) -> bool:
    if isinstance(node, ast.Name):
        return node.id in names
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == "result")


def _literals(node: ast.AST):
    for sub in ast.walk(node):
        if isinstance(sub, ast.Constant) and isinstance(sub.value, (str, bytes)):
            yield sub.value.decode() if isinstance(sub.value, bytes) else sub.value


def violations(source: str) -> list[str]:
    tree = ast.parse(source)
    result_names = {target.id for node in ast.walk(tree) if isinstance(node, ast.Assign)
                    and _is_result_key(node.value, set()) for target in node.targets
                    if isinstance(target, ast.Name)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, bytes) and node.value.decode(
                errors="replace") in BYTES_FIELDS:
            found.append(f"line {node.lineno}: bytes literal {node.value!r}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in HASH_COMMANDS and node.args
              and _is_result_key(node.args[0], result_names)):
            named = [v for arg in node.args[1:] for v in _literals(arg) if v in FIELDS]
            if named:
                found.append(f"line {node.lineno}: {node.func.attr} of a result key names {named}")
        elif isinstance(node, ast.Dict):
            keys = [k.value for k in node.keys if isinstance(k, ast.Constant) and k.value in FIELDS]
            if len(keys) >= 2 and "state" in keys:
                found.append(f"line {node.lineno}: a record built by hand: {keys}")
        elif (isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant)
              and node.slice.value in OWN_FIELDS):
            found.append(f"line {node.lineno}: subscript {node.slice.value!r}")
    return found


def _modules() -> list[Path]:
    paths = [p for package in PRODUCT for p in sorted((REPO / package).rglob("*.py"))]
    return paths + [REPO / extra for extra in EXTRA]


def test_no_module_outside_protocol_spells_a_record_field():
    problems = {str(p.relative_to(REPO)): v for p in _modules() if (v := violations(p.read_text()))}
    assert problems == {}


def test_the_rule_catches_the_shapes_it_names():
    # What the writers and readers looked like before protocol/result_record.py owned the record.
    for old in ['tokens = raw[b"token_ids"]',
                'pipe.hget(self.keys.result(req_id), "batch_n")',
                'key = self.keys.result(req_id)\npipe.hset(key, "owner", self.owner)',
                'pipe.hmget(self.keys.result(r), ["queued_at", "started_at"])',
                'record = {"state": "queued", "queued_at": now, "batch_n": 2}',
                'fields["first_token_at"] = now']:
        assert violations(old), old
    assert violations('body = {"model": m, "prompt_tokens": 3}\nx = usage["prompt_tokens"]\n'
                      'timings = {"queued_at": a, "started_at": b}') == []
