"""Which folders a runtime LoRA load may name: a tenant's only under the gateway's --lora-root
folders (resolved, so `..` and links cannot climb out), the operator's (no tenant, or an admin)
any folder."""

import os

import pytest

from gateway.api.models.api import _check_load_path
from gateway.tenants.access import Caller, PermissionDenied

TENANT = Caller("team-a", sees_everything=False)


def test_a_tenant_loads_only_from_under_a_root(tmp_path) -> None:
    root = tmp_path / "adapters"
    (root / "sql").mkdir(parents=True)
    roots = (os.path.realpath(root),)
    _check_load_path(TENANT, str(root / "sql"), roots)
    _check_load_path(TENANT, str(root), roots)
    for outside in (str(tmp_path), str(root / ".." / "elsewhere"), "/etc", str(tmp_path / "adapters-2")):
        with pytest.raises(PermissionDenied, match="lora_path: a tenant may load LoRA adapters only from"):
            _check_load_path(TENANT, outside, roots)


def test_a_link_out_of_the_root_is_refused(tmp_path) -> None:
    root = tmp_path / "adapters"
    root.mkdir()
    (root / "escape").symlink_to("/etc")
    with pytest.raises(PermissionDenied):
        _check_load_path(TENANT, str(root / "escape"), (os.path.realpath(root),))


def test_without_a_root_tenants_load_nothing_and_the_operator_anything(tmp_path) -> None:
    with pytest.raises(PermissionDenied, match="start it with --lora-root"):
        _check_load_path(TENANT, str(tmp_path), ())
    _check_load_path(Caller(None, sees_everything=False), "/anywhere", ())  # a plain --api-key
    _check_load_path(Caller(None, sees_everything=True), "/anywhere", ())  # no tenants at all
    _check_load_path(Caller("ops", sees_everything=True), "/anywhere", ())  # an admin tenant
