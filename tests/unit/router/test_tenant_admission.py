"""Tenants at the router: whose a request is, the config's checks, the caps, and who is shed when saturated."""
from __future__ import annotations

import grpc
import pytest

from base.errors import StatusError
from base.telemetry import TenantLabels
from router.limits import OverLimit
from router.tenant_admission import TenantAdmission
from router.tenants import TenantDirectory, TenantPolicy, parse_tenant_config, tenant_directory

KEYS = {"sk-a": "alpha", "sk-gw": "*"}


def test_a_keys_tenant_is_its_key_files_and_a_key_without_one_is_the_defaults():
    tenants = tenant_directory('{"tenants": {"alpha": {"weight": 3}}}', KEYS, keys_required=True)
    assert tenants.resolve("sk-a", "").name == "alpha" and tenants.resolve("sk-a", "").policy.weight == 3
    assert tenants.resolve("sk-other", "").name == "default"


def test_only_a_gateway_or_an_open_router_takes_the_header():
    keyed = tenant_directory("", KEYS, keys_required=True)
    assert keyed.resolve("sk-gw", "team-b").name == "team-b"
    with pytest.raises(StatusError) as refused:
        keyed.resolve("sk-a", "team-b")
    assert refused.value.code == grpc.StatusCode.PERMISSION_DENIED
    assert TenantDirectory().resolve("", "team-b").name == "team-b"   # no keys: every caller is trusted
    with pytest.raises(StatusError) as bad:
        TenantDirectory().resolve("", "a b")
    assert bad.value.code == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize("config, error", [
    ("{", "not JSON"),
    ('{"tenant": {}}', '"tenants" and "default"'),
    ('{"tenants": {"a": {"weight": 0}}}', "weight must be positive"),
    ('{"tenants": {"a": {"priority": [3, 1]}}}', "low <= high"),
    ('{"tenants": {"a": {"priority": 1}}}', "[low, high]"),
    ('{"tenants": {"a": {"max_streams": 1}}}', "unknown key 'max_streams'"),
    ('{"tenants": {"a b": {}}}', "tenant name"),
    ("/no/such/file", "cannot read"),
])
def test_a_bad_tenant_config_names_what_is_wrong(config, error):
    with pytest.raises(ValueError) as raised:
        parse_tenant_config(config)
    assert error in str(raised.value)


def test_a_priority_outside_the_range_is_refused():
    policy = TenantPolicy(priority=(1, 5))
    policy.check_priority("t", 5)
    with pytest.raises(StatusError, match=r"\[1, 5\]"):
        policy.check_priority("t", 0)


def tenant(name: str, **policy) -> object:
    return TenantDirectory({name: TenantPolicy(**policy)}).tenant(name)


def test_concurrency_and_queued_token_caps_refuse_and_free_again():
    admission = TenantAdmission()
    capped, queued = tenant("c", max_concurrent_requests=1), tenant("q", max_queued_tokens=100)
    first = admission.ticket(capped)
    first.admit(10)
    with pytest.raises(OverLimit, match="limit of 1 concurrent"):
        admission.ticket(capped).admit(10)
    first.release()
    admission.ticket(capped).admit(10)
    waiting = admission.ticket(queued)
    waiting.admit(80)
    with pytest.raises(OverLimit, match="prompt tokens queued"):
        admission.ticket(queued).admit(30)
    waiting.started()   # its first token: no longer queued
    admission.ticket(queued).admit(30)


def test_saturated_the_tenant_over_its_share_is_shed_and_one_under_it_admitted():
    admission = TenantAdmission(shed_queued_requests=4)
    flood, light, heavy = tenant("flood"), tenant("light"), tenant("heavy", weight=3.0)
    for _ in range(4):
        admission.ticket(flood).admit(100)
    with pytest.raises(OverLimit, match="saturated"):
        admission.ticket(flood).admit(100)   # it holds the whole queue, its share is all of it
    admission.ticket(light).admit(10)        # holds 0 of 4, share 4 x 1/2
    admission.ticket(heavy).admit(10)        # holds 0 of 5, share 5 x 3/5
    admission.ticket(heavy).admit(10)        # holds 1 of 6, share 6 x 3/5
    admission.ticket(light).admit(10)        # holds 1 of 7, share 7 x 1/5 = 1.4
    with pytest.raises(OverLimit):
        admission.ticket(light).admit(10)    # holds 2 of 8, share 1.6
    assert [admission.loads[t].queued for t in ("flood", "light", "heavy")] == [4, 2, 2]


def test_loads_of_idle_tenants_are_forgotten():
    admission = TenantAdmission()
    ticket = admission.ticket(tenant("t"))
    ticket.admit(5)
    ticket.release()
    ticket.release()   # once only
    assert not admission.loads


def test_metric_labels_stay_bounded():
    labels = TenantLabels(limit=3, named=frozenset({"paid"}))
    assert [labels.label(t) for t in ("a", "b", "c", "paid", "a")] == ["a", "b", "other", "paid", "a"]
