"""A scheduler's registration in Redis (protos/registration.py): its LoRA adapter lists round-trip, a registration
written before them still parses (as no adapters), a malformed list is refused, and the signature covers them."""
from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from protos.registration import SchedulerInfo, registration_signature, signed_registration, verified_registration

TOKEN = "cluster-secret"


def info(**adapters: list[str]) -> SchedulerInfo:
    return SchedulerInfo("s0", "10.0.0.1:50061", "m", "/m", 16, 4096, 50_000, **adapters)


def test_the_adapters_loaded_and_resident_round_trip_signed_and_unsigned():
    published = info(lora_adapters=["sql", "chat"], resident_lora_adapters=["sql"])
    for token in ("", TOKEN):
        assert verified_registration(signed_registration(published, token), token) == published


def test_a_registration_written_before_adapters_existed_parses_as_no_adapters_and_its_signature_holds():
    old = {name: value for name, value in asdict(info()).items()
           if name not in ("lora_adapters", "resident_lora_adapters")}
    signed = json.dumps({**old, "signature": registration_signature(old, TOKEN)})
    parsed = verified_registration(signed, TOKEN)
    assert parsed.lora_adapters == [] and parsed.resident_lora_adapters == []


@pytest.mark.parametrize("value, reason", [("sql", "not list"), (["sql", 3], "not str"), ([None], "not str")])
def test_an_adapter_list_of_the_wrong_type_is_refused_naming_the_field(value, reason: str):
    fields = {**asdict(info()), "lora_adapters": value}
    with pytest.raises(ValueError, match=f"'lora_adapters'.*{reason}"):
        SchedulerInfo.from_fields(fields)


def test_the_signature_covers_the_adapter_lists():
    fields = json.loads(signed_registration(info(lora_adapters=["sql"], resident_lora_adapters=[]), TOKEN))
    fields["resident_lora_adapters"] = ["sql"]             # a forger claiming residency to attract its requests
    with pytest.raises(ValueError, match="signature does not match"):
        verified_registration(json.dumps(fields), TOKEN)
